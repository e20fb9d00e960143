"""KV bookkeeping in integers only: which slot each running sequence owns.

Running sequences are kept in slots 0..n-1 (a freed slot in the middle is refilled by moving the last one),
so a backend whose batch is a contiguous range of cache rows can bind them without gathering.
"""

from __future__ import annotations


class SlotAllocator:
    def __init__(self, num_slots: int, max_len: int) -> None:
        self.num_slots = num_slots
        self.max_len = max_len
        self.owner: list[str | None] = [None] * num_slots

    @property
    def used(self) -> int:
        return sum(o is not None for o in self.owner)

    @property
    def free(self) -> int:
        return self.num_slots - self.used

    def allocate(self, seq_id: str) -> int:
        slot = self.used  # slots 0..used-1 are taken: the invariant this class keeps
        if slot >= self.num_slots:
            raise RuntimeError("no free KV slot (the scheduler admits only when one is free)")
        self.owner[slot] = seq_id
        return slot

    def release(self, slot: int) -> tuple[int, int] | None:
        """Free `slot`; returns (src, dst) when the last used slot must move into it to stay compact."""
        last = self.used - 1
        assert self.owner[slot] is not None, f"slot {slot} released twice"
        self.owner[slot] = None
        if slot == last:
            return None
        self.owner[slot], self.owner[last] = self.owner[last], None
        return last, slot
