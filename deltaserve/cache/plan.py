"""Memory planning, in one place and in plain integers (no tensors, no device): the pools' layout, the
bytes one KV block and one GDN state slot take, the cache budget left by what the device measured, and
that budget turned into pool sizes (how many slots and blocks, and what concurrency and context length
they allow). Measuring and allocating are the runner's (runner/memory.py); `CacheBuffers.allocate`
and the runner's allocation both take their shapes from `pool_shapes`.

Policy: the KV pool is first guaranteed room for one sequence of max_model_len tokens (so the longest
request allowed can always run, alone if need be); state slots then take what max_num_seqs (+ spares)
needs of the rest; KV blocks get everything left. When the budget cannot hold max_num_seqs slots the
concurrency is clamped with a warning instead of refusing to start; when it cannot hold even one
max_model_len sequence, max_model_len is clamped with a warning.
"""

from __future__ import annotations

import dataclasses
import logging
import math

from ..config import ModelConfig

logger = logging.getLogger(__name__)

MiB = 1 << 20
DEFAULT_CPU_CACHE_BYTES = 1 << 30     # the CPU cache budget when none is given (pages are touched lazily)
STATE_DTYPE_BYTES = 4                 # the GDN recurrent state is fp32 whatever the activation dtype


@dataclasses.dataclass(frozen=True)
class PoolShapes:
    """The three pools' shapes (see batch.CacheBuffers):
      ssm  [L_gdn, S, HV, K, V]            recurrent state (fp32)
      conv [L_gdn, S, W-1, D]              conv window (activation dtype)
      kv   [L_attn + L_mtp, 2, B, BS, NKV, HD]  paged K/V (activation dtype); the last L_mtp layers are the MTP
                                             head's, addressed by the same block ids (speculation with mtp only)"""

    ssm: tuple[int, ...]
    conv: tuple[int, ...]
    kv: tuple[int, ...]


def pool_shapes(config: ModelConfig, *, num_slots: int, num_blocks: int, block_size: int,
                num_attention_layers: int | None = None, mtp_kv_layers: int = 0, tp_size: int = 1) -> PoolShapes:
    """num_attention_layers: the KV pool's layer count when it is not the model's (a separate cache).
    mtp_kv_layers: KV layers appended for the MTP head (one per MTP layer when speculating with mtp, else 0).
    tp_size: one tensor-parallel rank's pools (its GDN heads; its KV heads, one when the ranks outnumber them)."""
    if mtp_kv_layers < 0:
        raise ValueError(f"mtp_kv_layers must be >= 0, got {mtp_kv_layers}")
    n_gdn = len(config.gdn_layer_ids)
    n_attn = len(config.attention_layer_ids) if num_attention_layers is None else num_attention_layers
    n_attn += mtp_kv_layers
    kv_heads = max(1, config.num_key_value_heads // tp_size)
    return PoolShapes(
        ssm=(n_gdn, num_slots, config.linear_num_value_heads // tp_size, config.linear_key_head_dim,
             config.linear_value_head_dim),
        conv=(n_gdn, num_slots, config.linear_conv_kernel_dim - 1, config.gdn_conv_dim // tp_size),
        kv=(n_attn, 2, num_blocks, block_size, kv_heads, config.head_dim))


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    block_size: int           # tokens per KV block
    kv_block_bytes: int       # one block across every full-attention layer (the MTP head's included), K and V
    state_slot_bytes: int     # one slot across every GDN layer: recurrent state + conv window

    @classmethod
    def from_model(cls, config: ModelConfig, *, block_size: int, kv_dtype_bytes: int, conv_dtype_bytes: int,
                   state_dtype_bytes: int = STATE_DTYPE_BYTES,
                   num_attention_layers: int | None = None, mtp_kv_layers: int = 0,
                   tp_size: int = 1) -> "CacheSpec":
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        one = pool_shapes(config, num_slots=1, num_blocks=1, block_size=block_size,
                          num_attention_layers=num_attention_layers, mtp_kv_layers=mtp_kv_layers, tp_size=tp_size)
        return cls(block_size=block_size, kv_block_bytes=math.prod(one.kv) * kv_dtype_bytes,
                   state_slot_bytes=math.prod(one.ssm) * state_dtype_bytes + math.prod(one.conv) * conv_dtype_bytes)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


def gpu_cache_budget(*, total_bytes: int, utilization: float, peak_bytes: int, outside_torch_bytes: int,
                     graph_bytes: int) -> int:
    """What the pools may take on a GPU: total x utilization, less the process's measured needs besides
    them (weights + activation peak, memory outside torch's allocator, the CUDA graphs' pool)."""
    budget = int(total_bytes * utilization - peak_bytes - max(outside_torch_bytes, 0) - graph_bytes)
    logger.debug("GPU memory: total %.0f MiB x %.2f, weights + activation peak %.0f MiB, outside torch %.0f MiB, "
                 "CUDA graphs ~%.0f MiB -> %.0f MiB for the cache", total_bytes / MiB, utilization,
                 peak_bytes / MiB, outside_torch_bytes / MiB, graph_bytes / MiB, budget / MiB)
    if budget <= 0:
        needed = peak_bytes + outside_torch_bytes + graph_bytes
        raise ValueError(f"no GPU memory left for the cache: {total_bytes / MiB:.0f} MiB x {utilization} is less "
                         f"than the {needed / MiB:.0f} MiB the model needs (raise gpu_memory_utilization, "
                         "lower max_num_batched_tokens, or free the GPU)")
    return budget


@dataclasses.dataclass(frozen=True)
class CachePlan:
    num_slots: int            # GDN state slots allocated (running sequences + spares)
    num_blocks: int           # KV blocks allocated
    max_num_seqs: int         # concurrency after reconciling with the slots
    max_model_len: int        # context limit after reconciling with the KV pool
    budget_bytes: int
    used_bytes: int
    num_snapshot_slots: int = 0   # of num_slots, the prefix cache's state snapshots (the last ids)


DEFAULT_PREFIX_CACHE_STATE_FRACTION = 0.1   # of the cache budget, for prefix-cache state snapshots
MAX_SNAPSHOT_SLOTS = 4096   # bounds the host tables indexed by slot (block table rows, last tokens)


def plan_cache(spec: CacheSpec, *, budget_bytes: int, max_num_seqs: int, max_model_len: int,
               spare_slots: int = 0, num_blocks: int | None = None, snapshot_fraction: float = 0.0) -> CachePlan:
    """num_blocks, when given, fixes the KV pool size (the budget then only sizes the slots).
    snapshot_fraction: this share of the budget becomes prefix-cache snapshot slots, taken first (the rest
    is planned as without them); they come last in num_slots."""
    snapshots = 0
    if snapshot_fraction > 0:
        snapshots = (int(budget_bytes * snapshot_fraction) // spec.state_slot_bytes if spec.state_slot_bytes
                     else 4 * max_num_seqs)
        snapshots = min(snapshots, MAX_SNAPSHOT_SLOTS)
        budget_bytes -= snapshots * spec.state_slot_bytes
    plan = _plan_live(spec, budget_bytes=budget_bytes, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                      spare_slots=spare_slots, num_blocks=num_blocks)
    if not snapshots:
        return plan
    extra = snapshots * spec.state_slot_bytes
    logger.debug("prefix cache: %d state snapshots x %.2f MiB (%.1f MiB)", snapshots,
                 spec.state_slot_bytes / MiB, extra / MiB)
    return dataclasses.replace(plan, num_slots=plan.num_slots + snapshots, num_snapshot_slots=snapshots,
                               budget_bytes=plan.budget_bytes + extra, used_bytes=plan.used_bytes + extra)


def _plan_live(spec: CacheSpec, *, budget_bytes: int, max_num_seqs: int, max_model_len: int,
               spare_slots: int, num_blocks: int | None) -> CachePlan:
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
    logger.debug("cache: %d KV blocks x %d tokens (%.1f MiB, %d tokens), %d GDN state slots x %.2f MiB "
                 "(%.1f MiB); budget %.1f MiB; max_num_seqs %d, max_model_len %d",
                 num_blocks, bs, num_blocks * block_b / MiB, num_blocks * bs, num_slots, slot_b / MiB,
                 num_slots * slot_b / MiB, budget_bytes / MiB, seqs, model_len)
    return CachePlan(num_slots=num_slots, num_blocks=num_blocks, max_num_seqs=seqs, max_model_len=model_len,
                     budget_bytes=budget_bytes, used_bytes=used)
