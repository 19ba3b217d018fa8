"""GDN state slot ids. A slot indexes `CacheBuffers.ssm[:, slot]` and `.conv[:, slot]` (every GDN layer at
once); a sequence holds one for its whole life. Spare slots (prefix-cache snapshots, speculation
stashes) come from the same pool."""

from __future__ import annotations


class StatePool:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"a state pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._used = [False] * num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self._used[slot] = True
        return slot

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or not self._used[slot]:
            raise ValueError(f"state slot {slot} is not allocated")
        self._used[slot] = False
        self._free.append(slot)

    def check_integrity(self) -> None:
        if len(set(self._free)) != len(self._free):
            raise AssertionError("a state slot is on the free list twice")
        for slot, used in enumerate(self._used):
            if used == (slot in self._free):
                raise AssertionError(f"state slot {slot}: used={used} disagrees with the free list")
