"""KV bookkeeping in integers only: how many slots are taken (each running sequence records its own `slot`).

Running sequences are kept in slots 0..n-1 (a freed slot in the middle is refilled by moving the last one),
so a backend whose batch is a contiguous range of cache rows can bind them without gathering.
"""

from __future__ import annotations


class SlotAllocator:
    def __init__(self, num_slots: int, max_len: int) -> None:
        self.num_slots = num_slots
        self.max_len = max_len
        self.used = 0  # slots 0..used-1 are taken: the invariant this class keeps

    @property
    def free(self) -> int:
        return self.num_slots - self.used

    def allocate(self) -> int:
        if self.used >= self.num_slots:
            raise RuntimeError("no free KV slot (the scheduler admits only when one is free)")
        self.used += 1
        return self.used - 1

    def release(self, slot: int) -> tuple[int, int] | None:
        """Free `slot`; returns (src, dst) when the last used slot must move into it to stay compact."""
        assert 0 <= slot < self.used, f"slot {slot} is not taken ({self.used} are)"
        self.used -= 1
        return None if slot == self.used else (self.used, slot)
