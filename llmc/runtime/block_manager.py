"""KV bookkeeping in blocks, integers only: a free list, reference counts, per-sequence block tables, and the
prefix cache (full blocks named by a hash of their tokens chained with the previous block's hash).

A block is in exactly one of three states:
  - free: in `free` (the last freed on top), no hash, reference count 0;
  - referenced: reference count >= 1 (held by that many block tables); it may carry a hash (then it is full and
    immutable: only its owner's last, partial block is ever written);
  - cached: reference count 0 with a hash, in `evictable` (least recently released first); a request whose prefix
    matches takes it back, and `_take` evicts the oldest when the free list is empty.
KV memory (buffers, bindings) and scheduling live elsewhere; this class never touches a tensor.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from llmc.errors import InputError


@dataclass
class BlockTable:
    """One sequence's blocks, in order: token t sits in blocks[t // block_size] at t % block_size."""

    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # chained hashes of blocks[0 .. len(hashes)-1], all full


@dataclass(frozen=True)
class BlockStats:
    num_blocks: int
    used: int  # referenced by a running sequence
    cached: int  # unreferenced, kept for prefix reuse
    queried_tokens: int  # prompt tokens looked up in the prefix cache
    hit_tokens: int  # of those, found cached

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


def chain_hash(prev: int, tokens: list[int] | tuple[int, ...]) -> int:
    return hash((prev, *tokens))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise InputError(f"KV blocks: {num_blocks} blocks of {block_size} tokens; need at least 1 of 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        # a stack: the block freed last is handed out first, and blocks never used (0 first) only when none freed
        # is left, so KV memory is written (its pages mapped) no further than the most ever held at once; a queue
        # cycled through the whole pool, and each step's first writes into fresh pages paid their mapping (s42)
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.refs = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...]] = [()] * num_blocks  # a hashed block's tokens: a hit is exact
        self.cached: dict[int, int] = {}  # hash -> block
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks with no reference, oldest first
        self.queried_tokens = 0
        self.hit_tokens = 0

    # -- state ---------------------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free or evictable)."""
        return len(self.free) + len(self.evictable)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def is_cached(self, block: int) -> bool:
        """A block with a hash: full and shared by name; never written again until it is evicted."""
        return self.block_hash[block] is not None

    def stats(self) -> BlockStats:
        return BlockStats(self.num_blocks, self.num_blocks - self.num_free, len(self.evictable),
                          self.queried_tokens, self.hit_tokens)

    # -- prefix cache --------------------------------------------------------------------------------------------
    def match(self, tokens: list[int]) -> list[int]:
        """The cached blocks holding the longest prefix of `tokens`, leaving at least the last token to compute
        (its logits are needed), so a matched block is never the one a new token is written into."""
        if not self.prefix_caching:
            return []
        out: list[int] = []
        prev = 0
        bs = self.block_size
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            prev = chain_hash(prev, chunk)
            block = self.cached.get(prev)
            if block is None or self.block_tokens[block] != chunk:
                break
            out.append(block)
        return out

    # -- allocation ----------------------------------------------------------------------------------------------
    def can_admit(self, tokens: list[int], headroom: int = 0) -> bool:
        matched = self.match(tokens)
        reusable = sum(1 for b in matched if self.refs[b] == 0)  # evictable now, taken back rather than handed out
        return self.num_free - reusable >= self.blocks_for(len(tokens)) - len(matched) + headroom

    def admit(self, tokens: list[int], headroom: int = 0) -> tuple[BlockTable, int] | None:
        """Blocks for a sequence about to compute `tokens`: its cached prefix (shared) and fresh blocks for the rest.
        None when fewer than the fresh blocks + `headroom` are free. Returns (table, cached tokens)."""
        if not self.can_admit(tokens, headroom):
            return None
        matched = self.match(tokens)
        for block in matched:
            self._ref(block)
        table = BlockTable(list(matched), [self.block_hash[b] for b in matched])  # type: ignore[misc]
        table.blocks += [self._take() for _ in range(self.blocks_for(len(tokens)) - len(matched))]
        cached = len(matched) * self.block_size
        self.queried_tokens += len(tokens)
        self.hit_tokens += cached
        return table, cached

    def can_grow(self, table: BlockTable, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(table.blocks) <= self.num_free

    def grow(self, table: BlockTable, num_tokens: int) -> None:
        """Extend the table to hold `num_tokens` (the caller checked can_grow)."""
        need = self.blocks_for(num_tokens) - len(table.blocks)
        assert need <= self.num_free, f"{need} blocks needed, {self.num_free} free"
        table.blocks += [self._take() for _ in range(need)]

    def commit(self, table: BlockTable, tokens: list[int]) -> None:
        """Name the full blocks among `tokens` (the sequence's tokens now in KV memory) for later prefix reuse.
        A block whose hash another block already has (the same prefix computed twice at once) stays private."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        for i in range(len(table.hashes), len(tokens) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = chain_hash(table.hashes[-1] if table.hashes else 0, chunk)
            table.hashes.append(h)
            block = table.blocks[i]
            if h not in self.cached and self.block_hash[block] is None:
                self.cached[h] = block
                self.block_hash[block] = h
                self.block_tokens[block] = chunk

    def release(self, table: BlockTable) -> None:
        """Drop a table's references: unnamed blocks go back to the free list, named ones become evictable (the
        table's last blocks first, so a long prefix is cut from its end)."""
        for block in reversed(table.blocks):
            assert self.refs[block] > 0, f"block {block} released with no reference"
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if self.block_hash[block] is None:
                    self.free.append(block)
                else:
                    self.evictable[block] = None
        table.blocks.clear()
        table.hashes.clear()

    def _ref(self, block: int) -> None:
        if self.refs[block] == 0:
            self.evictable.pop(block)
        self.refs[block] += 1

    def _take(self) -> int:
        if self.free:
            block = self.free.pop()
        else:
            block, _ = self.evictable.popitem(last=False)  # the least recently released cached block
            del self.cached[self.block_hash[block]]  # type: ignore[arg-type]
            self.block_hash[block] = None
            self.block_tokens[block] = ()
        assert self.refs[block] == 0, f"block {block} handed out while referenced"
        self.refs[block] = 1
        return block
