"""Per-sequence coordination of the two pools: KV blocks for the full-attention layers and one GDN state
slot. Keyed by sequence id; the only code that hands out or takes back block and slot ids.

A sequence's blocks cover positions [0, num_tokens) in order: block i holds positions
[i * block_size, (i + 1) * block_size). The GDN state cannot be rolled back, so a sequence either keeps
both its slot and its blocks or gives up both (finish, abort, preemption).
"""

from __future__ import annotations

import dataclasses

from .block_pool import BlockPool
from .state_pool import StatePool


@dataclasses.dataclass
class _Holding:
    slot: int
    blocks: list[int]


class HybridCacheManager:
    def __init__(self, *, num_blocks: int, block_size: int, num_slots: int):
        self.block_size = block_size
        self.blocks = BlockPool(num_blocks)
        self.slots = StatePool(num_slots)
        self._held: dict[int, _Holding] = {}

    # ---- capacity ----------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of num_tokens fits the whole pool with nobody else in it."""
        return self.blocks_for(num_tokens) <= self.blocks.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free

    @property
    def num_free_slots(self) -> int:
        return self.slots.num_free

    # ---- per sequence ------------------------------------------------------------------------
    def admit(self, seq_id: int, num_tokens: int) -> tuple[int, list[int]] | None:
        """A slot plus blocks covering num_tokens for a new sequence, or None (nothing taken)."""
        if seq_id in self._held:
            raise ValueError(f"sequence {seq_id} already holds cache resources")
        if self.slots.num_free == 0:
            return None
        blocks = self.blocks.allocate(self.blocks_for(num_tokens))
        if blocks is None:
            return None
        slot = self.slots.allocate()
        self._held[seq_id] = _Holding(slot, blocks)
        return slot, list(blocks)

    def grow(self, seq_id: int, num_tokens: int) -> list[int] | None:
        """The new blocks needed so the sequence covers num_tokens ([] when it already does), or None
        when the pool is short (nothing taken)."""
        held = self._held[seq_id]
        missing = self.blocks_for(num_tokens) - len(held.blocks)
        if missing <= 0:
            return []
        new = self.blocks.allocate(missing)
        if new is None:
            return None
        held.blocks.extend(new)
        return new

    def free(self, seq_id: int) -> None:
        """Give back everything the sequence holds (no-op when it holds nothing)."""
        held = self._held.pop(seq_id, None)
        if held is not None:
            self.blocks.free(held.blocks)
            self.slots.free(held.slot)

    def holds(self, seq_id: int) -> bool:
        return seq_id in self._held

    def slot_of(self, seq_id: int) -> int:
        return self._held[seq_id].slot

    def block_ids(self, seq_id: int) -> list[int]:
        return list(self._held[seq_id].blocks)

    def check_integrity(self) -> None:
        """Pools consistent, and exactly the blocks / slots held by live sequences are in use."""
        self.blocks.check_integrity()
        self.slots.check_integrity()
        held_blocks = [b for h in self._held.values() for b in h.blocks]
        if len(set(held_blocks)) != len(held_blocks):
            raise AssertionError("a KV block is held by two sequences")
        if len(held_blocks) != self.blocks.num_used:
            raise AssertionError(f"{self.blocks.num_used} blocks in use but sequences hold {len(held_blocks)}")
        if len(self._held) != self.slots.num_used:
            raise AssertionError(f"{self.slots.num_used} slots in use but {len(self._held)} sequences hold one")
