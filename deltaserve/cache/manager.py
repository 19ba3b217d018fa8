"""Per-sequence coordination of the two pools: KV blocks for the full-attention layers and one GDN state
slot. Keyed by sequence id; the only code that hands out or takes back block and slot ids.

A sequence's blocks cover positions [0, num_tokens) in order: block i holds positions
[i * block_size, (i + 1) * block_size). The GDN state cannot be rolled back, so a sequence either keeps
both its slot and its blocks or gives up both (finish, abort, preemption).

With prefix caching (`prefix`, cache/prefix_index.py) a sequence may start from a cached prefix (`lookup`,
then `admit(..., hit)`): it shares the prefix's full blocks, gets a fresh copy of the partly filled one, and
its slot is restored from the snapshot. `save_state` and `release` index a sequence's cache at a commit
point. The device copies these need (snapshot -> slot, slot -> snapshot, tail block -> fresh block) queue
here in order and leave with the next SchedulerOutput (`take_copies`); the runner applies them before that
step's forward, so a save always sees the state of the steps launched before it. Cached blocks that no
live sequence holds are evicted when an allocation would otherwise fail.
"""

from __future__ import annotations

import dataclasses

from .block_pool import BlockPool
from .prefix_index import MISS, PrefixHit, PrefixIndex
from .state_pool import StatePool


@dataclasses.dataclass
class _Holding:
    slot: int
    blocks: list[int]
    indexed: object = None            # the prefix index's node of its blocks saved so far (resume point)


class HybridCacheManager:
    def __init__(self, *, num_blocks: int, block_size: int, num_slots: int, num_snapshot_slots: int = 0,
                 enable_prefix_caching: bool = False):
        """num_slots live state slots (ids 0 ..); the prefix cache's snapshot slots follow them."""
        self.block_size = block_size
        self.blocks = BlockPool(num_blocks)
        self.slots = StatePool(num_slots)
        self._held: dict[int, _Holding] = {}
        self.prefix = (PrefixIndex(self.blocks, block_size=block_size, first_slot=num_slots,
                                   num_slots=num_snapshot_slots) if enable_prefix_caching else None)
        self._state_copies: list[tuple[int, int]] = []
        self._block_copies: list[tuple[int, int]] = []

    @property
    def prefix_caching(self) -> bool:
        return self.prefix is not None

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

    @property
    def num_live_blocks(self) -> int:
        """Blocks live sequences hold (the rest of the used ones only the prefix cache holds: evictable)."""
        if self.prefix is None:
            return self.blocks.num_used
        return len({b for h in list(self._held.values()) for b in h.blocks})   # list(): stats from another thread

    @property
    def num_cached_blocks(self) -> int:
        """Blocks the prefix cache holds (some may also be held by live sequences)."""
        return 0 if self.prefix is None else self.prefix.num_blocks

    def _allocate(self, n: int) -> list[int] | None:
        if self.prefix is not None and self.blocks.num_free < n:
            self.prefix.evict_blocks(n)
        return self.blocks.allocate(n)

    # ---- prefix cache --------------------------------------------------------------------------
    def lookup(self, tokens: list[int], max_len: int) -> PrefixHit:
        """The longest cached prefix of tokens of at most max_len tokens (MISS without prefix caching)."""
        if self.prefix is None:
            return MISS
        return self.prefix.lookup(tokens, max_len)

    def save_state(self, seq_id: int, tokens: list[int], length: int) -> None:
        """Index the sequence's cache after `length` computed tokens (a commit point): the device copy of its
        state into a snapshot slot is queued for the next step."""
        if self.prefix is None or not 0 < length <= len(tokens):
            return
        held = self._held[seq_id]
        snap = self.prefix.save(tokens, length, held.blocks, held.indexed)
        held.indexed = self.prefix.last_node
        if snap is not None:
            self._state_copies.append((held.slot, snap))

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The queued (state, block) copies, in order; the caller hands them to the runner."""
        out = self._state_copies, self._block_copies
        self._state_copies, self._block_copies = [], []
        return out

    def reset_prefix_cache(self) -> None:
        """Drop the index; queued saves into its snapshot slots go too (restores only queue within a step)."""
        if self.prefix is not None:
            self.prefix.reset()
            self._state_copies = [(a, b) for a, b in self._state_copies if b < self.prefix.first_slot]

    # ---- per sequence ------------------------------------------------------------------------
    def admit(self, seq_id: int, num_tokens: int, hit: PrefixHit = MISS) -> tuple[int, list[int]] | None:
        """A slot plus blocks covering num_tokens for a new sequence, or None (nothing taken). With a hit
        its first blocks are the prefix's (shared), the next a copy of the prefix's partly filled block, and
        the slot is restored from the snapshot (both copies queued)."""
        if seq_id in self._held:
            raise ValueError(f"sequence {seq_id} already holds cache resources")
        if self.slots.num_free == 0:
            return None
        shared = list(hit.blocks)
        pinned = shared + ([hit.tail_block] if hit.tail_block is not None else [])
        self.blocks.share(pinned)                    # not evicted while fresh blocks are found
        fresh = self._allocate(self.blocks_for(num_tokens) - len(shared))
        if hit.tail_block is not None:
            self.blocks.free([hit.tail_block])       # its content is read by this step's copy, before any write
            self.prefix.released([hit.tail_block])
        if fresh is None:
            self.blocks.free(shared)
            if self.prefix is not None:
                self.prefix.released(shared)
            return None
        slot = self.slots.allocate()
        if hit.slot is not None:
            self._state_copies.append((hit.slot, slot))
        if hit.tail_block is not None:
            self._block_copies.append((hit.tail_block, fresh[0]))
        blocks = shared + fresh
        self._held[seq_id] = _Holding(slot, blocks)
        return slot, list(blocks)

    def grow(self, seq_id: int, num_tokens: int) -> list[int] | None:
        """The new blocks needed so the sequence covers num_tokens ([] when it already does), or None
        when the pool is short (nothing taken)."""
        held = self._held[seq_id]
        missing = self.blocks_for(num_tokens) - len(held.blocks)
        if missing <= 0:
            return []
        new = self._allocate(missing)
        if new is None:
            return None
        held.blocks.extend(new)
        return new

    def release(self, seq_id: int, tokens: list[int], num_computed: int) -> None:
        """free(), after indexing the sequence's cache at num_computed tokens (prefix caching; the state
        covers exactly them, so nothing is saved when they are not all known yet)."""
        if self.prefix is not None and seq_id in self._held:
            self.save_state(seq_id, tokens, num_computed)
        self.free(seq_id)

    def free(self, seq_id: int) -> None:
        """Give back everything the sequence holds (no-op when it holds nothing)."""
        held = self._held.pop(seq_id, None)
        if held is not None:
            self.blocks.free(held.blocks)
            self.slots.free(held.slot)
            if self.prefix is not None:
                self.prefix.released(held.blocks)

    def holds(self, seq_id: int) -> bool:
        return seq_id in self._held

    def slot_of(self, seq_id: int) -> int:
        return self._held[seq_id].slot

    def block_ids(self, seq_id: int) -> list[int]:
        return list(self._held[seq_id].blocks)

    def check_integrity(self) -> None:
        """Pools consistent; every block's reference count is what live sequences and the prefix cache
        hold; exactly the live sequences' slots are in use; every snapshot slot is free or cached once."""
        self.blocks.check_integrity()
        self.slots.check_integrity()
        refs: dict[int, int] = {} if self.prefix is None else self.prefix.block_refs()
        for h in self._held.values():
            if len(set(h.blocks)) != len(h.blocks):
                raise AssertionError("a sequence holds a KV block twice")
            for b in h.blocks:
                refs[b] = refs.get(b, 0) + 1
        if self.prefix is None and any(r > 1 for r in refs.values()):
            raise AssertionError("a KV block is held by two sequences")
        for b in range(self.blocks.num_blocks):
            if self.blocks.ref_count(b) != refs.get(b, 0):
                raise AssertionError(f"block {b}: refcount {self.blocks.ref_count(b)} but {refs.get(b, 0)} holders")
        if self.prefix is not None:
            self.prefix.check_integrity()
        if len(self._held) != self.slots.num_used:
            raise AssertionError(f"{self.slots.num_used} slots in use but {len(self._held)} sequences hold one")
