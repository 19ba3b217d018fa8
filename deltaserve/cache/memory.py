"""Turn a memory budget into pool sizes: how many GDN state slots and KV blocks, and what concurrency and
context length they allow. Pure arithmetic on byte counts; measuring the budget (free GPU memory after a
warm-up) is the runner's business.

Policy: the KV pool is first guaranteed room for one sequence of max_model_len tokens (so the longest
request allowed can always run, alone if need be); state slots then take what max_num_seqs (+ spares)
needs of the rest; KV blocks get everything left. When the budget cannot hold max_num_seqs slots the
concurrency is clamped with a warning instead of refusing to start; when it cannot hold even one
max_model_len sequence, max_model_len is clamped with a warning.
"""

from __future__ import annotations

import dataclasses
import logging

from .spec import CacheSpec

logger = logging.getLogger(__name__)

MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class CachePlan:
    num_slots: int            # GDN state slots allocated (running sequences + spares)
    num_blocks: int           # KV blocks allocated
    max_num_seqs: int         # concurrency after reconciling with the slots
    max_model_len: int        # context limit after reconciling with the KV pool
    budget_bytes: int
    used_bytes: int


def plan_cache(spec: CacheSpec, *, budget_bytes: int, max_num_seqs: int, max_model_len: int,
               spare_slots: int = 0, num_blocks: int | None = None) -> CachePlan:
    """num_blocks, when given, fixes the KV pool size (the budget then only sizes the slots)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    if num_blocks is not None and num_blocks < 1:
        raise ValueError(f"the number of KV blocks must be >= 1, got {num_blocks}")
    bs, slot_b, block_b = spec.block_size, spec.state_slot_bytes, spec.kv_block_bytes
    blocks_per_max_seq = spec.blocks_for(max_model_len)

    if num_blocks is not None:
        kv_reserved = num_blocks * block_b
    else:
        kv_reserved = min(blocks_per_max_seq * block_b, max(budget_bytes - slot_b, block_b))
    want_slots = max_num_seqs + spare_slots
    if slot_b == 0:
        num_slots = want_slots
    else:
        num_slots = min(want_slots, (budget_bytes - kv_reserved) // slot_b)
    if num_slots < 1 + spare_slots:
        raise ValueError(
            f"cache budget of {budget_bytes / MiB:.1f} MiB is too small: one GDN state slot needs "
            f"{slot_b / MiB:.2f} MiB and one KV block of {bs} tokens {block_b / MiB:.3f} MiB "
            "(raise gpu_memory_utilization / cpu_cache_bytes, or lower max_model_len)")
    seqs = min(max_num_seqs, num_slots - spare_slots)
    if seqs < max_num_seqs:
        logger.warning("max_num_seqs %d clamped to %d: the cache budget (%.1f MiB) holds only %d GDN state "
                       "slots of %.2f MiB", max_num_seqs, seqs, budget_bytes / MiB, num_slots, slot_b / MiB)

    if num_blocks is None:
        if block_b == 0:   # no full-attention layers: blocks are free bookkeeping
            num_blocks = max(1, seqs * blocks_per_max_seq)
        else:
            num_blocks = (budget_bytes - num_slots * slot_b) // block_b
        if num_blocks < 1:
            raise ValueError(f"cache budget of {budget_bytes / MiB:.1f} MiB leaves no room for a KV block")
    model_len = max_model_len
    if num_blocks < blocks_per_max_seq:
        model_len = num_blocks * bs
        logger.warning("max_model_len %d clamped to %d: the KV pool holds only %d blocks of %d tokens",
                       max_model_len, model_len, num_blocks, bs)
    used = num_slots * slot_b + num_blocks * block_b
    logger.info("cache: %d KV blocks x %d tokens (%.1f MiB, %d tokens), %d GDN state slots x %.2f MiB "
                "(%.1f MiB); budget %.1f MiB; max_num_seqs %d, max_model_len %d",
                num_blocks, bs, num_blocks * block_b / MiB, num_blocks * bs, num_slots, slot_b / MiB,
                num_slots * slot_b / MiB, budget_bytes / MiB, seqs, model_len)
    return CachePlan(num_slots=num_slots, num_blocks=num_blocks, max_num_seqs=seqs, max_model_len=model_len,
                     budget_bytes=budget_bytes, used_bytes=used)
