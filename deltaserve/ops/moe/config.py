"""fused_moe's launch choice: which path (GEMV or grouped GEMMs) and which tiles, from the batch shape and
whether the device has programmatic dependent launch (PDL, compute capability >= 9.0). Chosen per call from
host-side shapes only (no device data: CUDA-graph capturable).

The numbers below were measured on an H200 at the Qwen3.5-35B-A3B shape (E 256 + 1 shared, top-8,
H 2048, I 512, bf16) with `PYTHONPATH=. python benchmarks/attention_moe_ops.py --out DIR --moe-decode`
(GEMV path, the block as the layer runs it, T = 1..8) and `... --sweep` (grouped tiles).
"""

from __future__ import annotations

import dataclasses

# T * top_k up to this: the GEMV path (T <= 8 at top-8 plus a shared slot).
GEMV_MAX_ASSIGNMENTS = 96
# With the shared expert folded in and PDL, up to this many tokens the shared slots' w13 runs in the routing
# kernel (GemvMoeConfig.shared_in_route): T = 2 39.7 against 41.6 us; T = 8 111.3 against 108.7.
SHARED_IN_ROUTE_MAX_TOKENS = 2


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """Tile shapes of the two grouped GEMMs (block_m rows of one expert per program)."""

    block_m: int = 16
    block_n1: int = 64       # columns of I per w13 program (gate and up each)
    block_k1: int = 128      # reduction step over H
    block_n2: int = 64       # columns of H per w2 program
    block_k2: int = 128      # reduction step over I
    warps1: int = 4
    warps2: int = 4
    stages: int = 3


@dataclasses.dataclass(frozen=True)
class GemvMoeConfig:
    """Tiles of the small-batch GEMV path (no alignment, no tensor cores): weight rows per program and the
    reduction step of each of its two kernels, and how the kernels overlap (triton_gemv.py). Many small
    programs with long rows keep the most loads in flight: the defaults are the T = 8 choice (102 us, 85 %
    of copy rate: `PYTHONPATH=. python benchmarks/linear_gemv.py`)."""

    block_n1: int = 8        # rows of I per w13 program (gate and up each)
    block_k1: int = 512      # reduction step over H
    block_n2: int = 4        # rows of H per w2 program
    block_k2: int = 512      # reduction step over I
    warps1: int = 2
    warps2: int = 2
    stages: int = 3
    # w2 loads all top_k experts' tiles of a step in one [top_k, block_n2, block_k2] gather instead of one
    # expert after the other (faster at T = 1; the gather pads top_k to a power of two)
    all_experts: bool = False
    # w2 launched programmatically (needs all_experts and PDL): its first weight tiles load while w13 runs
    pdl: bool = False
    # w13 launched programmatically after the routing kernel (needs PDL)
    pdl_w13: bool = False
    # fused_moe_routed with shared slots: their w13 rows computed by extra programs of the routing kernel
    # (constant weights, loaded before its wait, so they stream during the router GEMV); w13 runs the
    # routed slots only
    shared_in_route: bool = False
    # with shared_in_route and all_experts: the shared slots' w2 rows computed by extra programs at the
    # front of the w13 kernel into an fp32 partial that w2 adds last
    shared_w2: bool = False


# T = 1 on a PDL device: w2 one weight row per program, every expert's row gathered at once, both GEMV
# kernels launched programmatically (23.2 against 27.1 us with the T = 8 tiles; 26.0 without PDL).
GEMV_T1 = GemvMoeConfig(block_n1=8, block_k1=1024, block_n2=1, block_k2=512, warps1=4, warps2=4, stages=3,
                        all_experts=True, pdl=True, pdl_w13=True)
GEMV_T1_NO_PDL = dataclasses.replace(GEMV_T1, block_n1=4, pdl=False, pdl_w13=False)
# T = 1 with the shared expert folded in, on a PDL device: the shared slots' w13 in the routing kernel and
# their w2 at the front of the w13 kernel (23.3 against 25.8 us with GEMV_T1).
GEMV_T1_SHARED = dataclasses.replace(GEMV_T1, shared_in_route=True, shared_w2=True, block_n2=2)

MoeConfigs = MoeConfig | GemvMoeConfig


def default_moe_config(T: int, top_k: int, E: int, H: int, inter: int, *, pdl: bool = False,
                       shared_slices: int = 0) -> MoeConfigs:
    """The launch choice for T tokens routed to top_k slots each (shared slots included) over E stored
    experts. `pdl`: the device has programmatic dependent launch; `shared_slices`: fused_moe_routed's shared
    slots, set apart from the routing up to SHARED_IN_ROUTE_MAX_TOKENS tokens with PDL. Larger batches take
    grouped-GEMM tiles by the mean rows per expert."""
    shared = pdl and shared_slices >= 1 and T <= SHARED_IN_ROUTE_MAX_TOKENS
    if T == 1 and top_k <= GEMV_MAX_ASSIGNMENTS:
        return GEMV_T1_SHARED if shared else GEMV_T1 if pdl else GEMV_T1_NO_PDL
    if T * top_k <= GEMV_MAX_ASSIGNMENTS:
        return GemvMoeConfig(pdl_w13=pdl, shared_in_route=shared)
    rows_per_expert = T * top_k / E
    if rows_per_expert <= 16:      # decode: weight-bandwidth bound, small row blocks
        return MoeConfig(block_m=16, block_n1=32, block_k1=256, block_n2=64, block_k2=256, warps1=4, warps2=4,
                         stages=3)
    if rows_per_expert <= 64:      # between the two measured choices (not measured itself)
        return MoeConfig(block_m=32, block_n1=64, block_k1=128, block_n2=64, block_k2=128, warps1=4, warps2=4,
                         stages=3)
    return MoeConfig(block_m=128, block_n1=64, block_k1=64, block_n2=128, block_k2=64, warps1=8, warps2=8,
                     stages=3)
