"""The KV block manager on its own: free list, reference counts, chained prefix hashes, LRU eviction; and a
random-operation test that no block is leaked or owned twice."""

from __future__ import annotations

import random

import pytest

from llmc.errors import InputError
from llmc.runtime.block_manager import BlockManager, BlockTable


def check(bm: BlockManager, tables: list[BlockTable]) -> None:
    """Every block is free, evictable or referenced exactly as often as tables hold it; names are consistent."""
    held = [0] * bm.num_blocks
    for t in tables:
        for b in t.blocks:
            held[b] += 1
    assert held == bm.refs
    free, evictable = set(bm.free), set(bm.evictable)
    assert len(free) == len(bm.free) and not free & evictable
    for b in range(bm.num_blocks):
        state = (b in free) + (b in evictable) + (held[b] > 0)
        assert state == 1, f"block {b}: free {b in free}, evictable {b in evictable}, held {held[b]}"
        if b in free:
            assert bm.block_hash[b] is None
        if b in evictable:
            assert bm.block_hash[b] is not None
    assert {h: b for b, h in enumerate(bm.block_hash) if h is not None} == bm.cached


def test_admit_allocates_ceil_blocks_and_release_frees() -> None:
    bm = BlockManager(8, 4)
    got = bm.admit(list(range(9)))
    assert got is not None
    table, cached = got
    assert cached == 0 and len(table.blocks) == 3 and bm.num_free == 5
    bm.release(table)
    assert bm.num_free == 8 and not table.blocks and bm.refs == [0] * 8


def test_admission_refused_without_room_or_headroom() -> None:
    bm = BlockManager(4, 4)
    assert bm.admit(list(range(17))) is None  # 5 blocks
    assert bm.admit(list(range(12)), headroom=2) is None  # 3 + 2 > 4
    assert bm.admit(list(range(12)), headroom=1) is not None
    assert bm.num_free == 1


def test_grow_adds_a_block_only_when_one_starts() -> None:
    bm = BlockManager(4, 4)
    table, _ = bm.admit([1, 2, 3])  # type: ignore[misc]
    bm.grow(table, 4)
    assert len(table.blocks) == 1
    bm.grow(table, 5)
    assert len(table.blocks) == 2 and bm.num_free == 2
    assert bm.can_grow(table, 16) and not bm.can_grow(table, 17)


def test_prefix_hit_shares_blocks_and_keeps_the_last_token_to_compute() -> None:
    bm = BlockManager(16, 4)
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    a, cached = bm.admit(prompt)  # type: ignore[misc]
    assert cached == 0
    bm.commit(a, prompt)
    assert len(a.hashes) == 2 and all(bm.is_cached(b) for b in a.blocks[:2]) and not bm.is_cached(a.blocks[2])
    b, cached = bm.admit(prompt[:8] + [7, 7, 7])  # type: ignore[misc]
    assert cached == 8 and b.blocks[:2] == a.blocks[:2] and b.blocks[2] != a.blocks[2]
    assert bm.refs[a.blocks[0]] == 2
    c, cached = bm.admit(prompt[:8])  # the whole prompt is cached: its last block is recomputed, privately
    assert cached == 4 and c.blocks[0] == a.blocks[0] and c.blocks[1] not in a.blocks
    check(bm, [a, b, c])
    assert bm.stats().hit_tokens == 12 and bm.stats().queried_tokens == 29


def test_hash_is_chained_so_an_equal_block_after_a_different_prefix_misses() -> None:
    bm = BlockManager(16, 2)
    a, _ = bm.admit([1, 2, 5, 6, 9])  # type: ignore[misc]
    bm.commit(a, [1, 2, 5, 6, 9])
    _, cached = bm.admit([3, 4, 5, 6, 9])  # type: ignore[misc]
    assert cached == 0  # block [5, 6] is cached, but after [1, 2]


def test_released_named_blocks_are_reused_then_evicted_lru() -> None:
    bm = BlockManager(4, 2)
    old, _ = bm.admit([1, 1, 1])  # type: ignore[misc]
    bm.commit(old, [1, 1, 1])
    bm.release(old)
    new, _ = bm.admit([2, 2, 2])  # type: ignore[misc]
    bm.commit(new, [2, 2, 2])
    bm.release(new)
    assert bm.num_free == 4 and len(bm.evictable) == 2
    _, cached = bm.admit([2, 2, 9])  # type: ignore[misc]
    assert cached == 2
    # 1 free + 1 evictable ([1, 1], released first) left; 2 fresh blocks evict it, not the referenced [2, 2]
    big, cached = bm.admit([5, 5, 5])  # type: ignore[misc]
    assert cached == 0 and bm.num_free == 0
    assert bm.match([1, 1, 1]) == [] and len(bm.match([2, 2, 2])) == 1


def test_release_order_evicts_a_prefix_from_its_end() -> None:
    bm = BlockManager(3, 1)
    t, _ = bm.admit([4, 5, 6])  # type: ignore[misc]
    bm.commit(t, [4, 5, 6])
    bm.release(t)
    assert list(bm.evictable) == [2, 1, 0]
    bm.admit([9])  # takes one block: the last of the prefix goes first
    assert len(bm.match([4, 5, 6, 0])) == 2


def test_a_duplicate_computed_block_stays_private() -> None:
    bm = BlockManager(8, 2)
    a, _ = bm.admit([1, 2, 3])  # type: ignore[misc]
    b, _ = bm.admit([1, 2, 3])  # type: ignore[misc]  (admitted before a computed anything: no hit)
    bm.commit(a, [1, 2, 3])
    bm.commit(b, [1, 2, 3])
    assert bm.is_cached(a.blocks[0]) and not bm.is_cached(b.blocks[0])
    bm.release(b)
    assert b.blocks == [] and bm.num_free == 6 and len(bm.evictable) == 0
    check(bm, [a])


def test_prefix_caching_off_never_matches() -> None:
    bm = BlockManager(8, 2, prefix_caching=False)
    a, _ = bm.admit([1, 2, 3])  # type: ignore[misc]
    bm.commit(a, [1, 2, 3])
    assert bm.admit([1, 2, 3])[1] == 0  # type: ignore[index]
    assert not any(bm.is_cached(b) for b in range(8))


def test_bad_geometry_is_one_line() -> None:
    with pytest.raises(InputError, match="0 blocks of 16 tokens"):
        BlockManager(0, 16)


def test_random_operations_keep_every_block_accounted_for() -> None:
    rng = random.Random(7)
    for _ in range(30):
        bm = BlockManager(rng.randint(1, 24), rng.choice([1, 2, 4]))
        tables: list[tuple[BlockTable, list[int]]] = []
        for _ in range(200):
            op = rng.random()
            if op < 0.35:
                prompt = [rng.randint(0, 2) for _ in range(rng.randint(1, 12))]  # few tokens: many prefix hits
                got = bm.admit(prompt, headroom=rng.randint(0, 2))
                if got is not None:
                    table, cached = got
                    assert cached % bm.block_size == 0 and cached < len(prompt)
                    for i, block in enumerate(table.blocks[: cached // bm.block_size]):
                        assert bm.block_tokens[block] == tuple(prompt[i * bm.block_size:(i + 1) * bm.block_size])
                    assert all(bm.refs[b] == 1 for b in table.blocks[cached // bm.block_size:])
                    tables.append((table, prompt))
            elif op < 0.6 and tables:
                table, tokens = rng.choice(tables)
                tokens.append(rng.randint(0, 2))
                if bm.can_grow(table, len(tokens)):
                    bm.grow(table, len(tokens))
                    bm.commit(table, tokens[:-1])  # what is in KV: all but the newest token
                else:
                    tokens.pop()
            elif tables:
                table, _ = tables.pop(rng.randrange(len(tables)))
                bm.release(table)
            check(bm, [t for t, _ in tables])
        for table, _ in tables:
            bm.release(table)
        assert bm.num_free == bm.num_blocks and not any(bm.refs)


@pytest.mark.parametrize("size", [0, 24, 512])
def test_a_block_size_the_operator_cannot_page_is_refused_naming_it(size: int) -> None:
    from llmc.runtime.config import RuntimeConfig

    with pytest.raises(InputError, match=f"--kv-block-size must be a power of 2 from 1 to 256, got {size}"):
        RuntimeConfig(kv_block_size=size)


def test_the_block_freed_last_is_handed_out_first_and_unused_blocks_only_after() -> None:
    """KV memory is written no further than the most blocks ever held at once (the pages of the rest stay unmapped);
    a queue cycled through the whole pool, mapping a fresh page inside some step until every one had been."""
    bm = BlockManager(num_blocks=8, block_size=4, prefix_caching=False)
    a, _ = bm.admit(list(range(10)))  # 3 blocks
    b, _ = bm.admit(list(range(6)))  # 2 blocks
    assert a.blocks == [0, 1, 2] and b.blocks == [3, 4]
    bm.release(a)
    c, _ = bm.admit(list(range(14)))  # 4 blocks: a's three (its first on top), then the lowest never used
    assert c.blocks == [0, 1, 2, 5]
    bm.release(b), bm.release(c)
    for _ in range(20):  # request after request of up to 6 blocks: nothing past the 6 ever held at once
        t, _ = bm.admit(list(range(21)))
        assert max(t.blocks) <= 5, t.blocks
        bm.release(t)
    check(bm, [])
