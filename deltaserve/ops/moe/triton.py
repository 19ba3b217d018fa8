"""Triton MoE: the routed experts as grouped GEMMs (same signature as reference.fused_moe; routing is
triton_routing.py), all on device with shapes known to the host (no syncs; CUDA-graph capturable).

fused_moe runs, for T tokens routed to top_k of E experts (A = T * top_k assignments):

1. Alignment: the assignments are grouped by expert, each expert's group padded to a multiple of BLOCK_M
   rows, giving `sorted_ids` (assignment index per row; A marks padding) and `block_expert` (expert of each
   BLOCK_M-row block; -1 past the end). Counting is per chunk of assignments (histograms), one program
   turns the counts into padded offsets, and each chunk then scatters its assignments by a local sort on
   (expert, index) -- stable, so the order inside an expert is the token order. A single launch does all
   three when the assignments fit one chunk (decode). The number of blocks is bounded from shapes:
   sum_e ceil(c_e / BM) <= (A + min(E, A) * (BM - 1)) // BM.
2. w13 GEMM: per (block, slice of I) program, gate and up products of the gathered token rows with the
   block's expert, SiLU(gate) * up in the epilogue, one rounding to the activation dtype -> [rows, I].
3. w2 GEMM: per (block, slice of H) program, the expert outputs, rounded to the activation dtype (as the
   reference's per-expert matmul is) and written in assignment order -> [A, H].
4. Combine: y_t = sum_j w[t, j] * out[t * top_k + j], fp32 in a fixed order, rounded once. No atomics.

Experts that get no tokens cost nothing: no block refers to them.

Small batches (T * top_k <= GEMV_MAX_ASSIGNMENTS, the decode case) take a GEMV path instead, two launches
and no alignment: the weights are the whole cost there, and the grouped path's five dependent launches
(and its 16-row tiles holding one real row) left it at a third of the copy rate.

1. w13 GEMV: one program per (assignment, slice of I) reads its expert's gate and up rows once and writes
   SiLU(gate) * up, rounded once -> [A, I]. Programs of one slice are launched next to each other, so
   assignments that share an expert (T > 1) find its rows in L2 rather than DRAM. On Hopper it is
   launched programmatically: the routing kernel lets it start at once, and it waits for the routing's
   output before its first load.
2. w2 GEMV + combine: one program per (token, slice of H) runs the token's top_k experts in order, each
   expert output rounded to the activation dtype (as in the grouped path), weighted and summed in fp32,
   rounded once -> [T, H].
fused_moe_routed (routing + experts, what the layer calls) can do the routing inside the w13 GEMV kernel
(each program takes its slot's choice from the logits itself) instead of a routing kernel before it; not
by default: slower on an H200 (FUSED_ROUTING_MAX_TOKENS).
The shared expert's slots (the last M of every token, experts E .. E+M-1) do not depend on the routing;
fused_moe_routed can start their work before the routing is known (GemvMoeConfig.shared_*, session 6):
shared_first (the w13 kernel's shared-slot programs first, their first tiles loaded before the wait),
shared_in_route (the shared slots' w13 rows computed by extra programs of the routing kernel, weights
loaded before its wait, so they stream during the router GEMV; triton_routing.route_and_shared_w13), and
shared_w2 on top (the shared slots' w2 rows by extra programs at the front of the w13 kernel, into an fp32
partial the w2 kernel adds). Every kernel waits (griddepcontrol.wait) before reading anything a kernel
before it wrote; only constant weights are read before the wait. On Hopper fused_moe_routed's default at
T = 1 is GEMV_T1_SHARED and at T = 2 shared_in_route (H200: 23.3 against 25.8 us per layer at T = 1,
39.7 against 41.6 at T = 2; docs/PERFORMANCE.md).

One-pass path (OnePassMoeConfig; selectable, not a default: on an H200 its main kernel read the ~57 MB of
a decode step's experts at 2.7 TB/s, slower than the GEMV path, see docs/PERFORMANCE.md): w2 split along
I, so that no program waits for another's intermediate and the experts stream as one read, not two
(each with its ramp-up and drain, the second waiting for the first to finish).

1. Main kernel: the A x I intermediate rows (assignment-major) are cut into granules of G rows and the
   granules into NPROG equal contiguous ranges, one per program (a few per SM, all resident: no tail
   wave; they must not run in lockstep, hence the prefetch in the kernel). A program walks its range in
   pieces of at most LP rows (a piece starts at its range's start, at an assignment's start or on the LP
   grid of its assignment): gate and up rows of the piece (over H)
   -> h = SiLU(gate) * up rounded to the activation dtype, then the piece's w2 columns times h -> an
   fp32 partial expert output [H], stored at row (assignment, first granule of the piece).
2. Combine kernel (launched programmatically on Hopper, so it is resident before the main kernel ends):
   per (token, slice of H), each expert's output = the fp32 sum of its pieces' partials (their rows
   follow from the same arithmetic), rounded to the activation dtype, then weighted and summed in fp32 in
   expert order, rounded once. No atomics; fixed order.
With `pdl` the main kernel is launched programmatically too: the routing kernel lets it start, and it
waits (griddepcontrol.wait) before its first load, so only its launch and set-up overlap the routing.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..triton_common import ACTIVATION_DTYPES, check, check_last_contiguous, check_same_device, silu
from . import triton_routing as route_ops

ALIGN_CHUNK = 1024      # assignments per counting / scatter program
GEMV_MAX_ASSIGNMENTS = 96   # T * top_k up to this: the GEMV path (T <= 8 at top-8 or top-10 plus a shared slice)


# ---- alignment: assignments grouped by expert, padded to blocks --------------------------------------

@triton.jit
def _chunk_ids(topk_ids, c, A, E, C: tl.constexpr):
    i = tl.arange(0, C)
    a = c * C + i
    ok = a < A
    e = tl.load(topk_ids + a, mask=ok, other=0).to(tl.int32)
    return tl.where(ok, e, E), i                     # invalid lanes go to bucket E (never an expert)


@triton.jit
def _scatter_chunk(topk_ids, sorted_ids, base, c, A, E, C: tl.constexpr, EB: tl.constexpr):
    """Write chunk c's assignment indices to sorted_ids[base[e] + rank within (chunk, e)], stable."""
    e, i = _chunk_ids(topk_ids, c, A, E, C)
    keys = tl.sort(e * C + i)
    e_s = keys // C
    i_s = keys % C
    counts = tl.histogram(e, EB)
    first = tl.cumsum(counts, 0) - counts                   # first sorted position of each expert
    rank = tl.arange(0, C) - tl.gather(first, e_s, 0)
    dest = tl.gather(base, tl.minimum(e_s, EB - 1), 0) + rank
    tl.store(sorted_ids + dest, c * C + i_s, mask=e_s < E)


@triton.jit(do_not_specialize=["A"])
def _moe_count_kernel(topk_ids, chunk_counts, A, E, C: tl.constexpr, EB: tl.constexpr):
    c = tl.program_id(0)
    e, _ = _chunk_ids(topk_ids, c, A, E, C)
    bins = tl.arange(0, EB)
    tl.store(chunk_counts + c * EB + bins, tl.histogram(e, EB))


# The chunk count follows the batch: a runtime loop bound (as a constant, each new count built a variant in
# the middle of a step: H200 e2e at concurrency 256, 5.6-8.5 s).
@triton.jit(do_not_specialize=["A", "NB", "nchunk"])
def _moe_offsets_kernel(topk_ids, chunk_counts, chunk_base, sorted_ids, block_expert, A, E, NB, nchunk,
                        C: tl.constexpr, EB: tl.constexpr, BM: tl.constexpr,
                        BB: tl.constexpr, FUSED: tl.constexpr):
    bins = tl.arange(0, EB)
    is_expert = bins < E
    if FUSED:  # one chunk: count here, scatter here
        e, _ = _chunk_ids(topk_ids, 0, A, E, C)
        total = tl.histogram(e, EB)
    else:
        total = tl.zeros([EB], dtype=tl.int32)
        for c in range(nchunk):
            total += tl.load(chunk_counts + c * EB + bins)
    total = tl.where(is_expert, total, 0)
    padded = (total + BM - 1) // BM * BM
    end = tl.cumsum(padded, 0)
    start = end - padded
    if FUSED:
        _scatter_chunk(topk_ids, sorted_ids, start, 0, A, E, C, EB)
    else:
        running = start
        for c in range(nchunk):
            tl.store(chunk_base + c * EB + bins, running)
            running += tl.load(chunk_counts + c * EB + bins)
    # padding rows of each expert's last block
    pad = start[:, None] + total[:, None] + tl.arange(0, BM)[None, :]
    tl.store(sorted_ids + pad, A, mask=is_expert[:, None] & (pad < end[:, None]))
    # expert of every block: the number of experts whose padded range ends at or before the block start
    end_e = tl.where(is_expert, end, 2147483647)
    used = tl.sum(padded, 0)
    for b0 in range(0, NB, BB):
        b = b0 + tl.arange(0, BB)
        first_row = b * BM
        owner = tl.sum((end_e[None, :] <= first_row[:, None]).to(tl.int32), 1)
        tl.store(block_expert + b, tl.where(first_row < used, owner, -1), mask=b < NB)


@triton.jit(do_not_specialize=["A"])
def _moe_scatter_kernel(topk_ids, chunk_base, sorted_ids, A, E, C: tl.constexpr, EB: tl.constexpr):
    c = tl.program_id(0)
    base = tl.load(chunk_base + c * EB + tl.arange(0, EB))
    _scatter_chunk(topk_ids, sorted_ids, base, c, A, E, C, EB)


def num_blocks_bound(A: int, E: int, block_m: int) -> int:
    """Blocks of block_m rows that any routing of A assignments over E experts can need."""
    return (A + min(E, A) * (block_m - 1)) // block_m


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_ids [NB * block_m] int32, block_expert [NB] int32), see the module docstring."""
    A = topk_ids.numel()
    E = num_experts
    ids = topk_ids.reshape(-1)
    nb = num_blocks_bound(A, E, block_m)
    dev = topk_ids.device
    sorted_ids = torch.empty(nb * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(nb, dtype=torch.int32, device=dev)
    eb = triton.next_power_of_2(E + 1)                     # one spare bucket for masked lanes
    C = min(ALIGN_CHUNK, max(16, triton.next_power_of_2(A)))
    nchunk = triton.cdiv(A, C)
    fused = nchunk == 1
    counts = torch.empty((nchunk, eb), dtype=torch.int32, device=dev) if not fused else sorted_ids
    base = torch.empty((nchunk, eb), dtype=torch.int32, device=dev) if not fused else sorted_ids
    if not fused:
        _moe_count_kernel[(nchunk,)](ids, counts, A, E, C=C, EB=eb, num_warps=4)
    _moe_offsets_kernel[(1,)](ids, counts, base, sorted_ids, block_expert, A, E, nb, nchunk, C=C, EB=eb,
                              BM=block_m, BB=max(16, min(256, 8192 // eb)), FUSED=fused, num_warps=4)
    if not fused:
        _moe_scatter_kernel[(nchunk,)](ids, base, sorted_ids, A, E, C=C, EB=eb, num_warps=4)
    return sorted_ids, block_expert


# ---- grouped GEMMs --------------------------------------------------------------------------------

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
    reduction step of each of the two kernels. The defaults are the fastest at T = 8 of a sweep on an H200
    at the Qwen3.5-35B-A3B shape (benchmarks/linear_gemv.py: 102 us, 85 % of copy; the first choice,
    16/256/16/256 with 4 warps, took 117.5 us): many small programs with long rows keep more loads in
    flight. T = 1 has its own choice (GEMV_T1)."""

    block_n1: int = 8        # rows of I per w13 program (gate and up each)
    block_k1: int = 512      # reduction step over H
    block_n2: int = 4        # rows of H per w2 program
    block_k2: int = 512      # reduction step over I
    warps1: int = 2
    warps2: int = 2
    stages: int = 3
    # all_experts: the w2 kernel loads all top_k experts' tiles of a step in one [top_k, block_n2, block_k2]
    # gather instead of one expert after the other; with `pdl` (Hopper programmatic dependent launch, needs
    # all_experts) its first weight tiles are read while the w13 kernel is still running, and it waits for
    # w13's output only after them. Faster at T = 1, slower at T = 8 (the gather pads top_k to a power of 2).
    all_experts: bool = False
    pdl: bool = False
    # pdl_w13: the w13 kernel is launched programmatically as well (the routing kernel lets it start; it
    # waits before its first load, so only its launch and set-up overlap the routing kernel). Needs
    # compute capability 9.0; after a kernel that does not release it early it gains nothing.
    pdl_w13: bool = False
    # The shared expert's slots (fused_moe_routed with shared_slices M: experts E .. E+M-1 in every token's
    # last M slots) do not depend on the routing; session 6 variants that start them before it is known:
    # shared_first: the w13 kernel's programs of the shared slots are launched first and load their first
    # weight tiles before the wait (overlapping the routing kernel); same arithmetic, bit for bit.
    shared_first: bool = False
    # shared_in_route: the shared slots' w13 rows are computed by extra programs of the routing kernel
    # (shared_rows weight rows each, loaded before its wait: they stream during the router GEMV), and the
    # w13 kernel runs the routed slots only (8 of 9 slots at top-8).
    shared_in_route: bool = False
    shared_rows: int = 1
    # shared_w2 (needs shared_in_route and all_experts): the shared slots' w2 rows are computed by extra
    # programs at the front of the w13 kernel (shared_w2_rows rows each, loaded before its wait) into a
    # weighted fp32 partial; the w2 kernel runs the routed slots only (KP = 8 instead of 16 at top-8) and
    # adds the partial last.
    shared_w2: bool = False
    shared_w2_rows: int = 32


# T = 1 (H200 sweep at the 35B-A3B shape, top-8 + the shared slot: 23.2 us against 27.1 for the T = 8 tiles):
# w2 one weight row per program with every expert's row gathered at once, launched programmatically
# (needs compute capability 9.0; GEMV_T1_NO_PDL elsewhere: 26.0 us); w13 launched programmatically after
# the routing kernel (session 4: ~1 us per call less than without, see docs/PERFORMANCE.md).
GEMV_T1 = GemvMoeConfig(block_n1=8, block_k1=1024, block_n2=1, block_k2=512, warps1=4, warps2=4, stages=3,
                        all_experts=True, pdl=True, pdl_w13=True)
GEMV_T1_NO_PDL = dataclasses.replace(GEMV_T1, block_n1=4, pdl=False, pdl_w13=False)
# With the shared expert folded in (fused_moe_routed, shared_slices >= 1) on Hopper, session 6 (H200, the block
# as the layer runs it, docs/PERFORMANCE.md): T = 1 runs the shared slots' w13 in the routing kernel and their
# w2 at the front of the w13 kernel, the w2 kernel 2 rows per program (23.3 us against 25.8 / 25.9 for
# GEMV_T1); T = 2 up to SHARED_IN_ROUTE_MAX_TOKENS the shared slots' w13 in the routing kernel (39.7 against
# 41.5 / 41.6 us; T = 4 even at 67.4 against 67.6 / 67.8, T = 8 slower at 111.3 against 108.7 / 109.0).
GEMV_T1_SHARED = dataclasses.replace(GEMV_T1, shared_in_route=True, shared_w2=True, block_n2=2)
SHARED_IN_ROUTE_MAX_TOKENS = 2


@dataclasses.dataclass(frozen=True)
class OnePassMoeConfig:
    """Tiles of the one-pass small-batch path (module docstring): `rows` (LP) intermediate rows per piece,
    pieces starting on `granule` (G) rows (w2 column runs of 2G bytes), reduction step `block_k` over H
    for gate / up, `block_n` rows of w2 per step, `programs_per_sm` resident programs per SM (the grid is
    that times the SM count, at most one program per granule); the combine kernel's `combine_cols`
    columns of H per program. `pdl`: programmatic dependent launch of both kernels (compute capability
    >= 9.0)."""

    rows: int = 16
    granule: int = 16
    block_k: int = 256
    block_n: int = 256
    warps: int = 4
    stages: int = 3
    programs_per_sm: int = 3
    combine_cols: int = 32
    combine_warps: int = 2
    pdl: bool = False


# The one-pass tiles timed last (H200 session 4, run 2: main kernel 20.7 us at T = 1; not a default).
ONE_PASS_T1 = OnePassMoeConfig(pdl=True)


MoeConfigs = MoeConfig | GemvMoeConfig | OnePassMoeConfig


def default_moe_config(T: int, top_k: int, E: int, H: int, inter: int, *, pdl: bool = False,
                       shared_slices: int = 0) -> MoeConfigs:
    """Small batches (up to GEMV_MAX_ASSIGNMENTS assignments): GEMV tiles (T = 1: GEMV_T1 where `pdl` says
    the device has programmatic dependent launch, else GEMV_T1_NO_PDL; T >= 2: the w13 kernel launched
    programmatically where it can be). With `shared_slices` (fused_moe_routed with the shared expert folded
    in; top_k counts its slots) and `pdl`: the shared slots set apart from the routing up to
    SHARED_IN_ROUTE_MAX_TOKENS tokens (T = 1: GEMV_T1_SHARED; T = 2: shared_in_route). The one-pass path is
    not a default: it was slower on an H200 (docs/PERFORMANCE.md). Larger batches: grouped-GEMM tiles by the
    mean rows per expert; the small and large grouped choices were measured on an H200 at the
    Qwen3.5-35B-A3B shape (benchmarks/attention_moe_ops.py --sweep), the middle one was not."""
    shared = pdl and shared_slices >= 1 and T <= SHARED_IN_ROUTE_MAX_TOKENS
    if T == 1 and top_k <= GEMV_MAX_ASSIGNMENTS:
        return GEMV_T1_SHARED if shared else GEMV_T1 if pdl else GEMV_T1_NO_PDL
    if T * top_k <= GEMV_MAX_ASSIGNMENTS:
        return GemvMoeConfig(pdl_w13=pdl, shared_in_route=shared)
    rows_per_expert = T * top_k / E
    if rows_per_expert <= 16:      # decode: weight-bandwidth bound, small row blocks
        return MoeConfig(block_m=16, block_n1=32, block_k1=256, block_n2=64, block_k2=256, warps1=4, warps2=4,
                         stages=3)
    if rows_per_expert <= 64:
        return MoeConfig(block_m=32, block_n1=64, block_k1=128, block_n2=64, block_k2=128, warps1=4, warps2=4,
                         stages=3)
    return MoeConfig(block_m=128, block_n1=64, block_k1=64, block_n2=128, block_k2=64, warps1=8, warps2=8,
                     stages=3)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit(do_not_specialize=["A"])
def _w13_kernel(x, w13, inter, sorted_ids, block_expert, A, H, I, s_x, s_we, s_wn,
                TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    blk = tl.program_id(0)
    e = tl.load(block_expert + blk).to(tl.int64)
    if e >= 0:
        rows = blk * BM + tl.arange(0, BM)
        a_idx = tl.load(sorted_ids + rows)
        row_ok = a_idx < A
        tok = (a_idx // TOP_K).to(tl.int64)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        col_ok = cols < I
        kk = tl.arange(0, BK)
        xp = x + tok[:, None] * s_x + kk[None, :]
        wg = w13 + e * s_we + cols[None, :].to(tl.int64) * s_wn + kk[:, None]
        wu = wg + I * s_wn
        acc_g = tl.zeros([BM, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, H, BK):
            k_ok = kk + k0 < H
            xa = tl.load(xp + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            bg = tl.load(wg + k0, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            bu = tl.load(wu + k0, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc_g += _dot(xa, bg, IEEE)
            acc_u += _dot(xa, bu, IEEE)
        h = silu(acc_g) * acc_u
        tl.store(inter + rows[:, None].to(tl.int64) * I + cols[None, :], h.to(inter.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["A"])
def _w2_kernel(inter, w2, y, sorted_ids, block_expert, A, H, I, s_we, s_wn,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    blk = tl.program_id(0)
    e = tl.load(block_expert + blk).to(tl.int64)
    if e >= 0:
        rows = blk * BM + tl.arange(0, BM)
        a_idx = tl.load(sorted_ids + rows)
        row_ok = a_idx < A
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        col_ok = cols < H
        kk = tl.arange(0, BK)
        hp = inter + rows[:, None].to(tl.int64) * I + kk[None, :]
        wp = w2 + e * s_we + cols[None, :].to(tl.int64) * s_wn + kk[:, None]
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, I, BK):
            k_ok = kk + k0 < I
            ha = tl.load(hp + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(wp + k0, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc += _dot(ha, b, IEEE)
        tl.store(y + a_idx[:, None].to(tl.int64) * H + cols[None, :], acc.to(y.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _combine_kernel(y, weights, out, H, s_w, s_o, TOP_K: tl.constexpr, BH: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    ok = cols < H
    acc = tl.zeros([BH], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        w = tl.load(weights + t * s_w + j).to(tl.float32)
        acc += w * tl.load(y + (t * TOP_K + j) * H + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out + t * s_o + cols, acc.to(out.dtype.element_ty), mask=ok)


@triton.jit
def _gemv_w13_kernel(x, w13, ids, inter, H, I, s_x, s_we, s_wn,
                     TOP_K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr,
                     WAIT: tl.constexpr):
    if WAIT:
        gdc_wait()                   # ids / x come from the kernels before us
    if PDL:
        gdc_launch_dependents()      # the w2 kernel may start now; it waits for our output itself
    a = tl.program_id(0)
    e = tl.load(ids + a).to(tl.int64)
    t = (a // TOP_K).to(tl.int64)
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    row_ok = rows < I
    kk = tl.arange(0, BK)
    wg = w13 + e * s_we + rows[:, None].to(tl.int64) * s_wn + kk[None, :]
    wu = wg + I * s_wn
    xp = x + t * s_x + kk
    acc_g = tl.zeros([BN, BK], dtype=tl.float32)
    acc_u = tl.zeros([BN, BK], dtype=tl.float32)
    for k0 in range(0, H, BK):
        k_ok = kk + k0 < H
        xv = tl.load(xp + k0, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        m = row_ok[:, None] & k_ok[None, :]
        acc_g += tl.load(wg + k0, mask=m, other=0.0).to(tl.float32) * xv
        acc_u += tl.load(wu + k0, mask=m, other=0.0).to(tl.float32) * xv
    h = silu(tl.sum(acc_g, 1)) * tl.sum(acc_u, 1)
    tl.store(inter + a.to(tl.int64) * I + rows, h.to(inter.dtype.element_ty), mask=row_ok)


@triton.jit
def _shared_w2_rows(inter, w2, weights, part, q, T, H, I, E0, s_w2e, s_w2n, s_w, SLOTS: tl.constexpr,
                    K: tl.constexpr, M: tl.constexpr, R2: tl.constexpr, IB: tl.constexpr, WAIT: tl.constexpr,
                    PDL: tl.constexpr):
    """Rows q*R2 .. of the shared slices' stacked w2 rows (M*H rows: slice s = row // H, expert E0 + s) for
    every token: part[t, s, row % H] = weight[t, K + s] * round(w2 row . inter[t * SLOTS + K + s]) in fp32.
    The weights are constant: loaded before the wait (the intermediate comes from the kernel before us)."""
    rr = q * R2 + tl.arange(0, R2)
    r_ok = rr < M * H
    s = rr // H
    r = rr - s * H
    kk = tl.arange(0, IB)
    k_ok = kk < I
    m = r_ok[:, None] & k_ok[None, :]
    w = tl.load(w2 + (E0 + s).to(tl.int64)[:, None] * s_w2e + r.to(tl.int64)[:, None] * s_w2n + kk[None, :],
                mask=m, other=0.0)
    if WAIT:
        gdc_wait()
    if PDL:
        gdc_launch_dependents()
    for t in range(T):
        slot = t * SLOTS + K + s
        hv = tl.load(inter + slot.to(tl.int64)[:, None] * I + kk[None, :], mask=m, other=0.0).to(tl.float32)
        y = tl.sum(w.to(tl.float32) * hv, 1).to(inter.dtype.element_ty).to(tl.float32)   # rounded
        wt = tl.load(weights + t * s_w + K + s, mask=r_ok, other=0.0).to(tl.float32)
        tl.store(part + (t * M + s).to(tl.int64) * H + r, wt * y, mask=r_ok)


@triton.jit(do_not_specialize=["T", "NW2", "NSH"])
def _gemv_w13_split_kernel(x, w13, ids, inter, w2, weights, part, T, H, I, E0, NW2, NSH, s_x, s_we, s_wn,
                           s_w2e, s_w2n, s_w, SLOTS: tl.constexpr, K: tl.constexpr, M: tl.constexpr,
                           BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr, WAIT: tl.constexpr,
                           PRE: tl.constexpr, W2S: tl.constexpr, R2: tl.constexpr, IB: tl.constexpr):
    """_gemv_w13_kernel with the shared slots (the last M of SLOTS per token, experts E0 .. E0+M-1) set apart,
    over a 1-D grid in this order: NW2 programs of the shared slots' w2 (W2S, _shared_w2_rows), NSH w13
    programs of the shared slots (PRE: they load their first tiles before the wait), then the routed slots'
    w13 programs (K per token; program order (slot, row block) as _gemv_w13_kernel's grid). Each w13 program
    runs _gemv_w13_kernel's arithmetic, operation for operation."""
    pid = tl.program_id(0)
    if pid < NW2:
        if W2S:
            _shared_w2_rows(inter, w2, weights, part, pid, T, H, I, E0, s_w2e, s_w2n, s_w, SLOTS, K, M, R2, IB,
                            WAIT, PDL)
    else:
        p = pid - NW2
        shared = p < NSH
        routed = p >= NSH
        sa = p % (T * M)                       # shared programs: (token, slice), then row block
        ra = (p - NSH) % (T * K)               # routed programs: (token, slot), then row block
        n = tl.where(shared, p // (T * M), (p - NSH) // (T * K))
        t = tl.where(shared, sa // M, ra // K).to(tl.int64)
        a = tl.where(shared, t * SLOTS + K + sa % M, t * SLOTS + ra % K)
        rows = n * BN + tl.arange(0, BN)
        row_ok = rows < I
        kk = tl.arange(0, BK)
        off = rows[:, None].to(tl.int64) * s_wn + kk[None, :]
        m0 = row_ok[:, None] & (kk < H)[None, :]
        if PRE:
            ws = w13 + (E0 + sa % M).to(tl.int64) * s_we + off          # read only where shared
            g0 = tl.load(ws, mask=m0 & shared, other=0.0)
            u0 = tl.load(ws + I * s_wn, mask=m0 & shared, other=0.0)
        if WAIT:
            gdc_wait()                   # ids / x come from the kernels before us
        if PDL:
            gdc_launch_dependents()      # the w2 kernel may start now; it waits for our output itself
        e = tl.where(shared, E0 + sa % M, tl.load(ids + a, mask=routed, other=0)).to(tl.int64)
        wg = w13 + e * s_we + off
        wu = wg + I * s_wn
        xp = x + t * s_x + kk
        acc_g = tl.zeros([BN, BK], dtype=tl.float32)
        acc_u = tl.zeros([BN, BK], dtype=tl.float32)
        xv = tl.load(xp, mask=kk < H, other=0.0).to(tl.float32)[None, :]
        if PRE:
            gt = tl.where(shared, g0, tl.load(wg, mask=m0 & routed, other=0.0))
            ut = tl.where(shared, u0, tl.load(wu, mask=m0 & routed, other=0.0))
        else:
            gt = tl.load(wg, mask=m0, other=0.0)
            ut = tl.load(wu, mask=m0, other=0.0)
        acc_g += gt.to(tl.float32) * xv
        acc_u += ut.to(tl.float32) * xv
        for k0 in range(BK, H, BK):
            k_ok = kk + k0 < H
            xv = tl.load(xp + k0, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            m = row_ok[:, None] & k_ok[None, :]
            acc_g += tl.load(wg + k0, mask=m, other=0.0).to(tl.float32) * xv
            acc_u += tl.load(wu + k0, mask=m, other=0.0).to(tl.float32) * xv
        h = silu(tl.sum(acc_g, 1)) * tl.sum(acc_u, 1)
        tl.store(inter + a.to(tl.int64) * I + rows, h.to(inter.dtype.element_ty), mask=row_ok)


@triton.jit(do_not_specialize=["E"])
def _gemv_w13_routed_kernel(x, logits, w13, ids, weights, inter, H, I, E, s_x, s_l, s_we, s_wn,
                            K: tl.constexpr, M: tl.constexpr, EP: tl.constexpr, RENORM: tl.constexpr,
                            BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr, WAIT: tl.constexpr):
    """_gemv_w13_kernel with the routing inside (fused_moe_routed): program (a, n) takes slot j = a % (K + M)
    of token t = a // (K + M). A routed slot finds its expert from the token's logits (the choice j of
    triton_routing's math: exponentials exp(x - max), one max-reduction per choice over int64 keys
    (exponential bits | EP-1-index: the largest value, the lowest index among equal ones)); a shared slot
    knows its expert (E + j - K) and loads its first weight tiles before the wait (constant data). The
    programs with n = 0 write the slot's id and weight for the w2 kernel (they run all K choices, for the
    renormalisation sum in choice order; the others stop at choice j). The GEMV is _gemv_w13_kernel's,
    operation for operation."""
    a = tl.program_id(0)
    t = (a // (K + M)).to(tl.int64)
    j = a % (K + M)
    writer = tl.program_id(1) == 0
    shared = j >= K
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    row_ok = rows < I
    kk = tl.arange(0, BK)
    off = rows[:, None].to(tl.int64) * s_wn + kk[None, :]
    m0 = row_ok[:, None] & (kk < H)[None, :]
    ws = w13 + (E + j - K).to(tl.int64) * s_we + off            # read only where shared
    g0 = tl.load(ws, mask=m0 & shared, other=0.0)
    u0 = tl.load(ws + I * s_wn, mask=m0 & shared, other=0.0)
    if WAIT:
        gdc_wait()                   # logits / x come from the kernel before us
    if PDL:
        gdc_launch_dependents()      # the w2 kernel may start now; it waits for our output itself
    lrow = logits + t * s_l
    if shared:
        e = (E + j - K).to(tl.int64)
        gate = tl.load(lrow + E).to(tl.float32)
        w = 1.0 / (1.0 + tl.exp(-gate))
    else:
        cols = tl.arange(0, EP)
        lg = tl.load(lrow + cols, mask=cols < E, other=float("-inf")).to(tl.float32)
        ex = tl.exp(lg - tl.max(lg, 0))
        key = (ex.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (EP - 1 - cols).to(tl.int64)
        key = tl.where(cols < E, key, -1)
        total = tl.full([], 0.0, tl.float32)
        pick = tl.full([], 0, tl.int64)
        for r in tl.static_range(K):
            if writer | (r <= j):
                best = tl.max(key, 0)
                key = tl.where(key == best, -1, key)             # keys are distinct: one taken
                total += (best >> 32).to(tl.int32).to(tl.float32, bitcast=True)
                pick = tl.where(r == j, best, pick)
        hi = pick >> 32
        e = (EP - 1 - (pick - (hi << 32))).to(tl.int64)
        w = hi.to(tl.int32).to(tl.float32, bitcast=True)
        if RENORM:
            w = w / total
        else:
            w = w / tl.sum(ex, 0)
    if writer:
        tl.store(ids + a, e.to(ids.dtype.element_ty))
        tl.store(weights + a, w)
    wg = w13 + e * s_we + off
    wu = wg + I * s_wn
    xp = x + t * s_x + kk
    routed = j < K
    acc_g = tl.zeros([BN, BK], dtype=tl.float32)
    acc_u = tl.zeros([BN, BK], dtype=tl.float32)
    xv = tl.load(xp, mask=kk < H, other=0.0).to(tl.float32)[None, :]
    gt = tl.where(shared, g0, tl.load(wg, mask=m0 & routed, other=0.0))
    ut = tl.where(shared, u0, tl.load(wu, mask=m0 & routed, other=0.0))
    acc_g += gt.to(tl.float32) * xv
    acc_u += ut.to(tl.float32) * xv
    for k0 in range(BK, H, BK):
        k_ok = kk + k0 < H
        xv = tl.load(xp + k0, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        m = row_ok[:, None] & k_ok[None, :]
        acc_g += tl.load(wg + k0, mask=m, other=0.0).to(tl.float32) * xv
        acc_u += tl.load(wu + k0, mask=m, other=0.0).to(tl.float32) * xv
    h = silu(tl.sum(acc_g, 1)) * tl.sum(acc_u, 1)
    tl.store(inter + a.to(tl.int64) * I + rows, h.to(inter.dtype.element_ty), mask=row_ok)


@triton.jit
def _gemv_w2_combine_kernel(inter, w2, ids, weights, out, H, I, s_we, s_wn, s_w, s_o,
                            TOP_K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ONE_STEP: tl.constexpr,
                            TRIGGER: tl.constexpr = False):
    """ONE_STEP (BK >= I): no loop over I, so the unrolled experts are straight-line code and their
    weight loads can all be in flight at once instead of one DRAM round trip per expert. TRIGGER: let the
    next kernel launch at once (Hopper; it waits for our output itself)."""
    if TRIGGER:
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    row_ok = rows < H
    kk = tl.arange(0, BK)
    total = tl.zeros([BN], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        a = t * TOP_K + j
        e = tl.load(ids + a).to(tl.int64)
        wp = w2 + e * s_we + rows[:, None].to(tl.int64) * s_wn + kk[None, :]
        hp = inter + a * I + kk
        if ONE_STEP:
            k_ok = kk < I
            hv = tl.load(hp, mask=k_ok, other=0.0).to(tl.float32)
            acc = tl.load(wp, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32) * hv[None, :]
        else:
            acc = tl.zeros([BN, BK], dtype=tl.float32)
            for k0 in range(0, I, BK):
                k_ok = kk + k0 < I
                hv = tl.load(hp + k0, mask=k_ok, other=0.0).to(tl.float32)
                acc += tl.load(wp + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32) * hv[None, :]
        y = tl.sum(acc, 1).to(out.dtype.element_ty).to(tl.float32)    # the expert's output, rounded
        total += tl.load(weights + t * s_w + j).to(tl.float32) * y
    tl.store(out + t * s_o + rows, total.to(out.dtype.element_ty), mask=row_ok)


@triton.jit
def _gemv_w2_all_kernel(inter, w2, ids, weights, out, H, I, s_we, s_wn, s_w, s_o, TOP_K: tl.constexpr,
                        KP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr,
                        SLOTS: tl.constexpr, part=None, MP: tl.constexpr = 0):
    """As _gemv_w2_combine_kernel, the token's experts gathered into one [KP, BN, BK] tile per step.
    SLOTS: slots per token in ids / weights / inter, of which the first TOP_K run here; MP: the
    fp32 partials part[t, 0 .. MP-1, :] (the other slots' weighted outputs, GemvMoeConfig.shared_w2) are
    added after them, in order."""
    t = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    j = tl.arange(0, KP)
    j_ok = j < TOP_K
    e = tl.load(ids + t * SLOTS + j, mask=j_ok, other=0).to(tl.int64)
    wt = tl.load(weights + t * s_w + j, mask=j_ok, other=0.0).to(tl.float32)
    kk = tl.arange(0, BK)
    wp = w2 + e[:, None, None] * s_we + rows[None, :, None].to(tl.int64) * s_wn + kk[None, None, :]
    hp = inter + (t * SLOTS + j)[:, None] * I + kk[None, :]
    m_w = j_ok[:, None, None] & (rows < H)[None, :, None]
    w_first = tl.load(wp, mask=m_w & (kk < I)[None, None, :], other=0.0)
    if PDL:
        gdc_wait()                   # inter is written by the w13 kernel
        gdc_launch_dependents()      # the next layer's projection may become resident; it waits for us
    h = tl.load(hp, mask=j_ok[:, None] & (kk < I)[None, :], other=0.0).to(tl.float32)
    acc = tl.sum(w_first.to(tl.float32) * h[:, None, :], 2)
    for k0 in range(BK, I, BK):
        k_ok = kk + k0 < I
        w = tl.load(wp + k0, mask=m_w & k_ok[None, None, :], other=0.0).to(tl.float32)
        h = tl.load(hp + k0, mask=j_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * h[:, None, :], 2)
    y = acc.to(out.dtype.element_ty).to(tl.float32)                 # each expert's output, rounded
    total = tl.sum(wt[:, None] * y, 0)
    for s in tl.static_range(MP):
        total += tl.load(part + (t * MP + s) * H + rows, mask=rows < H, other=0.0)
    tl.store(out + t * s_o + rows, total.to(out.dtype.element_ty), mask=rows < H)


@triton.jit
def _piece_of(g, g_hi, CPA, LPG):
    """The piece that starts at granule g of a range ending at g_hi: (assignment, first granule inside the
    assignment, end granule inside the assignment)."""
    a = g // CPA
    q = g - a * CPA
    q_end = tl.minimum(tl.minimum((q // LPG + 1) * LPG, CPA), q + (g_hi - g))
    return a, q, q_end


@triton.jit(do_not_specialize=["NG", "NPROG"])
def _one_pass_kernel(x, w13, w2, ids, part, H, I, NG, NPROG, s_x, s_we, s_wn, s_w2e, s_w2n,
                     TOP_K: tl.constexpr, CPA: tl.constexpr, G: tl.constexpr, LP: tl.constexpr,
                     BK: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()                   # ids / x come from the kernels before us
        gdc_launch_dependents()      # the combine kernel may become resident; it waits for us itself
    p = tl.program_id(0)
    g = p * NG // NPROG
    g_hi = (p + 1) * NG // NPROG
    kk = tl.arange(0, BK)
    nn = tl.arange(0, BN)
    while g < g_hi:
        a, q, q_end = _piece_of(g, g_hi, CPA, LP // G)
        e = tl.load(ids + a).to(tl.int64)
        t = (a // TOP_K).to(tl.int64)
        r = q * G + tl.arange(0, LP)
        r_ok = (r < q_end * G) & (r < I)
        # gate and up rows of the piece, over H (int32 offsets inside the expert: half the registers of
        # 64-bit pointer tiles). Every step loads the next step's tiles before summing its own, and the
        # first w2 tile is loaded before the gate / up steps: each program always has a load in flight.
        # (Without it, the programs, all resident and alike, ran in lockstep: the memory system idled while
        # all of them summed, and a step cost its transfer plus a round trip; 20.8 us for 57 MB.)
        wg = w13 + e * s_we
        wu = wg + I * s_wn
        off = r[:, None] * s_wn + kk[None, :]
        wp = w2 + e * s_w2e
        off2 = nn[:, None] * s_w2n + r[None, :]
        m = r_ok[:, None] & (kk < H)[None, :]
        g_nx = tl.load(wg + off, mask=m, other=0.0, eviction_policy="evict_first")
        u_nx = tl.load(wu + off, mask=m, other=0.0, eviction_policy="evict_first")
        w_nx = tl.load(wp + off2, mask=(nn < H)[:, None] & r_ok[None, :], other=0.0, eviction_policy="evict_first")
        xp = x + t * s_x
        acc_g = tl.zeros([LP], dtype=tl.float32)
        acc_u = tl.zeros([LP], dtype=tl.float32)
        for k0 in range(0, H, BK):
            gt = g_nx
            ut = u_nx
            m = r_ok[:, None] & (kk + k0 + BK < H)[None, :]
            g_nx = tl.load(wg + (off + k0 + BK), mask=m, other=0.0, eviction_policy="evict_first")
            u_nx = tl.load(wu + (off + k0 + BK), mask=m, other=0.0, eviction_policy="evict_first")
            xv = tl.load(xp + (kk + k0), mask=kk + k0 < H, other=0.0).to(tl.float32)[None, :]
            acc_g += tl.sum(gt.to(tl.float32) * xv, 1)
            acc_u += tl.sum(ut.to(tl.float32) * xv, 1)
        h = silu(acc_g) * acc_u
        h = tl.where(r_ok, h.to(x.dtype.element_ty).to(tl.float32), 0.0)     # rounded as the reference's
        # the piece's w2 columns: its share of the expert's output, fp32
        pp = part + (a * CPA + q).to(tl.int64) * H
        for n0 in range(0, H, BN):
            w = w_nx
            w_nx = tl.load(wp + (off2 + (n0 + BN) * s_w2n), mask=(nn + n0 + BN < H)[:, None] & r_ok[None, :],
                           other=0.0, eviction_policy="evict_first")
            tl.store(pp + (nn + n0), tl.sum(w.to(tl.float32) * h[None, :], 1), mask=nn + n0 < H)
        g = a * CPA + q_end


@triton.jit(do_not_specialize=["NG", "NPROG"])
def _one_pass_combine_kernel(part, weights, out, H, NG, NPROG, s_w, s_o, TOP_K: tl.constexpr,
                             CPA: tl.constexpr, CPAP: tl.constexpr, LPG: tl.constexpr, BH: tl.constexpr,
                             PDL: tl.constexpr):
    if PDL:
        gdc_wait()                   # the partials are written by the main kernel
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    c_ok = cols < H
    q = tl.arange(0, CPAP)
    total = tl.zeros([BH], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        gq = (t * TOP_K + j) * CPA + q
        # granule q of this assignment starts a piece: on the LP grid, or where a program's range starts
        # (the program owning granule c is ((c + 1) * NPROG - 1) // NG; q = 0 is on the grid)
        own = ((gq + 1) * NPROG - 1) // NG
        own_prev = tl.maximum(gq * NPROG - 1, 0) // NG
        start = (q < CPA) & ((q % LPG == 0) | (own != own_prev))
        pv = tl.load(part + gq[:, None] * H + cols[None, :], mask=start[:, None] & c_ok[None, :], other=0.0)
        y = tl.sum(pv, 0).to(out.dtype.element_ty).to(tl.float32)     # the expert's output, rounded
        total += tl.load(weights + t * s_w + j).to(tl.float32) * y
    tl.store(out + t * s_o + cols, total.to(out.dtype.element_ty), mask=c_ok)


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _partials(rows: int, H: int, device: torch.device) -> torch.Tensor:
    """The one-pass path's fp32 partial expert outputs (only the rows that start a piece are written)."""
    return torch.empty((rows, H), dtype=torch.float32, device=device)


def _fused_moe_one_pass(x, w13, w2, topk_weights, topk_ids, cfg: OnePassMoeConfig) -> torch.Tensor:
    T, H = x.shape
    inter = w2.shape[-1]
    top_k = topk_ids.shape[1]
    A = T * top_k
    cpa = triton.cdiv(inter, cfg.granule)            # granules per assignment
    ng = A * cpa
    # as many programs as stay resident, with equal granule counts: the fewest granules per program that
    # fit the grid, then the fewest programs at that count (288 granules on 396 slots: 288 programs of 1)
    per_prog = triton.cdiv(ng, cfg.programs_per_sm * _num_sms(x.device))
    nprog = triton.cdiv(ng, per_prog)
    part = _partials(ng, H, x.device)
    pdl = {"launch_pdl": True} if cfg.pdl else {}
    _one_pass_kernel[(nprog,)](
        x, w13, w2, topk_ids, part, H, inter, ng, nprog, x.stride(0), w13.stride(0), w13.stride(1),
        w2.stride(0), w2.stride(1), TOP_K=top_k, CPA=cpa, G=cfg.granule, LP=cfg.rows, BK=cfg.block_k,
        BN=cfg.block_n, PDL=cfg.pdl, num_warps=cfg.warps, num_stages=cfg.stages, **pdl)
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    _one_pass_combine_kernel[(T, triton.cdiv(H, cfg.combine_cols))](
        part, topk_weights, out, H, ng, nprog, topk_weights.stride(0), out.stride(0), TOP_K=top_k, CPA=cpa,
        CPAP=triton.next_power_of_2(cpa), LPG=cfg.rows // cfg.granule, BH=cfg.combine_cols, PDL=cfg.pdl,
        num_warps=cfg.combine_warps, **pdl)
    return out


@dataclasses.dataclass(frozen=True)
class _Routing:
    """fused_moe_routed's routing, done inside the w13 kernel (its outputs go to topk_weights / topk_ids)."""

    logits: torch.Tensor
    experts: int             # routed experts E (the shared gate, if any, is logits' column E)
    top_k: int
    shared_slices: int
    renormalize: bool


def _fused_moe_gemv(x, w13, w2, topk_weights, topk_ids, cfg: GemvMoeConfig, route: _Routing | None = None
                    ) -> torch.Tensor:
    T, H = x.shape
    inter = w2.shape[-1]
    top_k = topk_ids.shape[1]
    A = T * top_k
    h = torch.empty((A, inter), dtype=x.dtype, device=x.device)
    launch = dict(BN=cfg.block_n1, BK=cfg.block_k1, PDL=cfg.pdl, WAIT=cfg.pdl_w13, num_warps=cfg.warps1,
                  num_stages=cfg.stages, **({"launch_pdl": True} if cfg.pdl_w13 else {}))
    if route is None:
        _gemv_w13_kernel[(A, triton.cdiv(inter, cfg.block_n1))](
            x, w13, topk_ids, h, H, inter, x.stride(0), w13.stride(0), w13.stride(1), TOP_K=top_k, **launch)
    else:
        lg = route.logits
        _gemv_w13_routed_kernel[(A, triton.cdiv(inter, cfg.block_n1))](
            x, lg, w13, topk_ids, topk_weights, h, H, inter, route.experts, x.stride(0), lg.stride(0),
            w13.stride(0), w13.stride(1), K=route.top_k, M=route.shared_slices,
            EP=triton.next_power_of_2(route.experts), RENORM=route.renormalize, **launch)
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    if cfg.all_experts:
        _gemv_w2_all_kernel[(T, triton.cdiv(H, cfg.block_n2))](
            h, w2, topk_ids, topk_weights, out, H, inter, w2.stride(0), w2.stride(1), topk_weights.stride(0),
            out.stride(0), TOP_K=top_k, KP=triton.next_power_of_2(top_k), BN=cfg.block_n2, BK=cfg.block_k2,
            PDL=cfg.pdl, SLOTS=top_k, num_warps=cfg.warps2, num_stages=cfg.stages,
            **({"launch_pdl": True} if cfg.pdl else {}))
        return out
    _gemv_w2_combine_kernel[(T, triton.cdiv(H, cfg.block_n2))](
        h, w2, topk_ids, topk_weights, out, H, inter, w2.stride(0), w2.stride(1), topk_weights.stride(0),
        out.stride(0), TOP_K=top_k, BN=cfg.block_n2, BK=cfg.block_k2, ONE_STEP=cfg.block_k2 >= inter,
        TRIGGER=x.is_cuda and _has_pdl(x.device), num_warps=cfg.warps2, num_stages=cfg.stages)
    return out


@dataclasses.dataclass(frozen=True)
class _Shared:
    """fused_moe_routed's routing, done by the routing kernel with the shared slots set apart (the
    GemvMoeConfig.shared_* variants); its outputs go to topk_weights / topk_ids."""

    logits: torch.Tensor
    experts: int             # routed experts E; the shared slices are experts E .. E + slices - 1
    top_k: int
    slices: int
    renormalize: bool


def _shared_variant(cfg: MoeConfigs | None) -> bool:
    return isinstance(cfg, GemvMoeConfig) and (cfg.shared_first or cfg.shared_in_route or cfg.shared_w2)


def _fused_moe_gemv_shared(x, w13, w2, topk_weights, topk_ids, cfg: GemvMoeConfig, sh: _Shared) -> torch.Tensor:
    """The GEMV path with the shared slots set apart (GemvMoeConfig.shared_first / shared_in_route /
    shared_w2): routing with the shared slots' w13 rows where shared_in_route (else the routing has run
    already), one w13 launch whose shared-slot programs come first, the w2 + combine."""
    T, H = x.shape
    inter = w2.shape[-1]
    K, M = sh.top_k, sh.slices
    width = K + M
    h = torch.empty((T * width, inter), dtype=x.dtype, device=x.device)
    if cfg.shared_in_route:
        route_ops.route_and_shared_w13(sh.logits, K, sh.renormalize, M, x, w13, h, rows=cfg.shared_rows,
                                       out=(topk_weights, topk_ids))
    # else: fused_moe_routed has routed into topk_weights / topk_ids already
    nb = triton.cdiv(inter, cfg.block_n1)
    nsh = 0 if cfg.shared_in_route else T * M * nb
    nw2 = triton.cdiv(M * H, cfg.shared_w2_rows) if cfg.shared_w2 else 0
    part = torch.empty((T, M, H), dtype=torch.float32, device=x.device) if cfg.shared_w2 else None
    _gemv_w13_split_kernel[(nw2 + nsh + T * K * nb,)](
        x, w13, topk_ids, h, w2, topk_weights, part if part is not None else h, T, H, inter, sh.experts, nw2, nsh,
        x.stride(0), w13.stride(0), w13.stride(1), w2.stride(0), w2.stride(1), topk_weights.stride(0),
        SLOTS=width, K=K, M=M, BN=cfg.block_n1, BK=cfg.block_k1, PDL=cfg.pdl, WAIT=cfg.pdl_w13,
        PRE=cfg.shared_first, W2S=cfg.shared_w2, R2=cfg.shared_w2_rows, IB=triton.next_power_of_2(inter),
        num_warps=cfg.warps1, num_stages=cfg.stages, **({"launch_pdl": True} if cfg.pdl_w13 else {}))
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    if cfg.all_experts:
        run = K if cfg.shared_w2 else width
        _gemv_w2_all_kernel[(T, triton.cdiv(H, cfg.block_n2))](
            h, w2, topk_ids, topk_weights, out, H, inter, w2.stride(0), w2.stride(1), topk_weights.stride(0),
            out.stride(0), TOP_K=run, KP=triton.next_power_of_2(run), BN=cfg.block_n2, BK=cfg.block_k2,
            PDL=cfg.pdl, SLOTS=width, part=part, MP=M if cfg.shared_w2 else 0, num_warps=cfg.warps2,
            num_stages=cfg.stages, **({"launch_pdl": True} if cfg.pdl else {}))
        return out
    _gemv_w2_combine_kernel[(T, triton.cdiv(H, cfg.block_n2))](
        h, w2, topk_ids, topk_weights, out, H, inter, w2.stride(0), w2.stride(1), topk_weights.stride(0),
        out.stride(0), TOP_K=width, BN=cfg.block_n2, BK=cfg.block_k2, ONE_STEP=cfg.block_k2 >= inter,
        TRIGGER=x.is_cuda and _has_pdl(x.device), num_warps=cfg.warps2, num_stages=cfg.stages)
    return out


def _has_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch (griddepcontrol): compute capability 9.0 and newer."""
    return torch.cuda.get_device_capability(device)[0] >= 9


# fused_moe_routed does the routing inside the w13 GEMV kernel up to this many tokens by default. 0: never.
# H200, session 5, the block as the layer runs it: slower at every T measured (T = 1, 2, 4, 8: 26.3 / 42.2
# / 71.1 / 117.4 us against 25.8 / 41.4 / 67.7 / 109.1 with the routing kernel; docs/PERFORMANCE.md).
FUSED_ROUTING_MAX_TOKENS = 0


def fused_moe_routed(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, router_logits: torch.Tensor, top_k: int,
    renormalize: bool, *, shared_slices: int = 0, config: MoeConfigs | None = None,
    fuse_routing: bool | None = None,
) -> torch.Tensor:
    """See reference.fused_moe_routed: topk_softmax then fused_moe. On the GEMV path (small batches) with
    `fuse_routing` (None: up to FUSED_ROUTING_MAX_TOKENS tokens, now none) the routing runs inside the w13
    kernel: every w13 program computes its own slot's expert from the token's logits (redundant, a few
    reductions over the logits from L2), so the routing kernel's launch, drain and the round trip for its
    output leave the chain (router GEMV -> w13 -> w2 instead of -> route -> w13 -> w2). The choice and the
    weights are triton_routing's (same math, module docstring there), bit for bit with renormalisation.
    Elsewhere: triton_routing.topk_softmax, then fused_moe. (Measured slower on an H200 at T = 1..8: each
    wave of w13 programs pays the routing before its first weight load, see FUSED_ROUTING_MAX_TOKENS.)
    With shared_slices the default config (default_moe_config) may set the shared slots apart from the
    routing (GemvMoeConfig.shared_*, module docstring): the routing kernel then also computes their w13
    rows."""
    op = "fused_moe_routed"
    E = route_ops.check_routing(op, router_logits, top_k, shared_slices)
    check(x.dim() == 2 and router_logits.shape[0] == x.shape[0], op,
          f"router_logits {tuple(router_logits.shape)} and x {tuple(x.shape)} must have the same tokens")
    check(w13.dim() == 3 and w13.shape[0] >= E + shared_slices, op,
          f"w13 holds {w13.shape[0] if w13.dim() == 3 else '?'} experts, the routing needs {E + shared_slices}")
    check_same_device(op, x, router_logits)
    T, width = x.shape[0], top_k + shared_slices
    if config is None and T >= 1 and T * width <= GEMV_MAX_ASSIGNMENTS:
        # the shared-slot defaults route in their own kernel: not where the routing is asked inside w13
        config = default_moe_config(T, width, w13.shape[0], x.shape[1], w2.shape[-1],
                                    pdl=x.is_cuda and _has_pdl(x.device),
                                    shared_slices=0 if fuse_routing else shared_slices)
    gemv = isinstance(config, GemvMoeConfig)
    split = _shared_variant(config)
    if fuse_routing is None:
        fuse_routing = gemv and not split and T <= FUSED_ROUTING_MAX_TOKENS
    check(not fuse_routing or gemv, op, f"fuse_routing needs the GEMV path (a GemvMoeConfig), got {config}")
    check(not (fuse_routing and split), op, "fuse_routing excludes the config's shared_first / shared_in_route / "
          "shared_w2 (the routing is its own kernel there)")
    if split:
        check(shared_slices >= 1, op, "the config's shared_first / shared_in_route / shared_w2 need shared_slices >= 1")
        if config.shared_in_route:     # written by the routing kernel
            weights = torch.empty((T, width), dtype=torch.float32, device=x.device)
            ids = torch.empty((T, width), dtype=torch.int64, device=x.device)
        else:
            weights, ids = route_ops.topk_softmax(router_logits, top_k, renormalize, shared_slices=shared_slices)
        return _fused_moe(op, x, w13, w2, weights, ids, config,
                          shared=_Shared(router_logits, E, top_k, shared_slices, bool(renormalize)))
    if not fuse_routing:
        weights, ids = route_ops.topk_softmax(router_logits, top_k, renormalize, shared_slices=shared_slices)
        return fused_moe(x, w13, w2, weights, ids, config=config)
    weights = torch.empty((T, width), dtype=torch.float32, device=x.device)
    ids = torch.empty((T, width), dtype=torch.int64, device=x.device)
    return _fused_moe(op, x, w13, w2, weights, ids, config,
                      _Routing(router_logits, E, top_k, shared_slices, bool(renormalize)))


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    *, config: MoeConfigs | None = None,
) -> torch.Tensor:
    """See reference.fused_moe. `config` (optional) picks the path (OnePassMoeConfig or GemvMoeConfig: small
    batches, MoeConfig: grouped GEMMs) and its tiles; expert ids must lie in [0, E) (they are not checked
    on device)."""
    return _fused_moe("fused_moe", x, w13, w2, topk_weights, topk_ids, config)


def _fused_moe(op: str, x, w13, w2, topk_weights, topk_ids, config: MoeConfigs | None,
               route: _Routing | None = None, shared: _Shared | None = None) -> torch.Tensor:
    """fused_moe; with `route` or `shared`, topk_weights / topk_ids are outputs, written by the w13 kernel
    or the routing kernel."""
    check(x.dim() == 2, op, f"x must be [T, H], got {tuple(x.shape)}")
    T, H = x.shape
    check(w13.dim() == 3 and w13.shape[2] == H and w13.shape[1] % 2 == 0, op,
          f"w13 must be [E, 2I, {H}], got {tuple(w13.shape)}")
    E, inter = w13.shape[0], w13.shape[1] // 2
    check(w2.shape == (E, H, inter), op, f"w2 must be [{E}, {H}, {inter}], got {tuple(w2.shape)}")
    check(topk_ids.dim() == 2 and topk_ids.shape[0] == T and topk_weights.shape == topk_ids.shape, op,
          f"topk_ids and topk_weights must be [{T}, top_k], got {tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}")
    check(topk_ids.dtype in (torch.int32, torch.int64), op, f"topk_ids must be int32/int64, got {topk_ids.dtype}")
    check(topk_weights.dtype.is_floating_point, op, f"topk_weights must be floating point, got {topk_weights.dtype}")
    check(x.dtype in ACTIVATION_DTYPES and w13.dtype == x.dtype and w2.dtype == x.dtype, op,
          f"x, w13, w2 must share a float dtype, got {x.dtype}, {w13.dtype}, {w2.dtype}")
    check(E <= 4096, op, f"{E} experts: at most 4096 supported")
    check(topk_ids.is_contiguous(), op, "topk_ids must be contiguous")
    check_last_contiguous(op, x=x, w13=w13, w2=w2, topk_weights=topk_weights)
    check(w13.stride(1) == H and w2.stride(1) == inter, op, "expert weight rows must be dense ([E, rows, cols] views)")
    check_same_device(op, x, w13, w2, topk_weights, topk_ids)
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    top_k = topk_ids.shape[1]
    A = T * top_k
    if A == 0:
        return out.zero_()
    cfg = config or default_moe_config(T, top_k, E, H, inter, pdl=x.is_cuda and _has_pdl(x.device))
    if isinstance(cfg, OnePassMoeConfig):
        for name in ("rows", "granule", "block_k", "block_n", "combine_cols"):
            v = getattr(cfg, name)
            check(v >= 1 and v & (v - 1) == 0, op, f"config {name}={v} must be a power of two")
        check(cfg.granule <= cfg.rows, op, f"config granule={cfg.granule} must be <= rows={cfg.rows}")
        check(cfg.programs_per_sm >= 1, op, f"config programs_per_sm={cfg.programs_per_sm} must be >= 1")
        check(not cfg.pdl or (x.is_cuda and _has_pdl(x.device)), op,
              "config pdl=True needs a CUDA device of compute capability 9.0 or newer")
        check(2 * inter * H < 2 ** 31, op, "one expert's weights must have < 2^31 elements (int32 offsets)")
        return _fused_moe_one_pass(x, w13, w2, topk_weights, topk_ids, cfg)
    gemv = isinstance(cfg, GemvMoeConfig)
    for name in ("block_n1", "block_k1", "block_n2", "block_k2") + (() if gemv else ("block_m",)):
        v, least = getattr(cfg, name), 1 if gemv else 16
        check(v >= least and v & (v - 1) == 0, op, f"config {name}={v} must be a power of two >= {least}")
    if gemv:
        if _shared_variant(cfg):
            check(shared is not None, op, "config shared_first / shared_in_route / shared_w2 need fused_moe_routed "
                  "with shared_slices >= 1 (the shared slots must be known before the routing)")
            check(not (cfg.shared_first and cfg.shared_in_route), op,
                  "config shared_first and shared_in_route exclude each other (the shared slots' w13 runs in "
                  "one of the two kernels)")
            check(not cfg.shared_w2 or (cfg.shared_in_route and cfg.all_experts), op,
                  "config shared_w2 needs shared_in_route=True and all_experts=True")
            for name in ("shared_rows", "shared_w2_rows"):
                v = getattr(cfg, name)
                check(v >= 1 and v & (v - 1) == 0, op, f"config {name}={v} must be a power of two")
        if cfg.pdl_w13:
            check(x.is_cuda and _has_pdl(x.device), op,
                  "config pdl_w13=True needs a CUDA device of compute capability 9.0 or newer")
        if cfg.pdl:
            check(cfg.all_experts, op, "config pdl=True needs all_experts=True")
            check(x.is_cuda and _has_pdl(x.device), op,
                  "config pdl=True needs a CUDA device of compute capability 9.0 or newer")
        if shared is not None:
            return _fused_moe_gemv_shared(x, w13, w2, topk_weights, topk_ids, cfg, shared)
        return _fused_moe_gemv(x, w13, w2, topk_weights, topk_ids, cfg, route)
    sorted_ids, block_expert = align_by_expert(topk_ids, E, cfg.block_m)
    nb = block_expert.shape[0]
    ieee = x.dtype == torch.float32
    inter_act = torch.empty((nb * cfg.block_m, inter), dtype=x.dtype, device=x.device)
    _w13_kernel[(nb, triton.cdiv(inter, cfg.block_n1))](
        x, w13, inter_act, sorted_ids, block_expert, A, H, inter, x.stride(0), w13.stride(0), w13.stride(1),
        TOP_K=top_k, BM=cfg.block_m, BN=cfg.block_n1, BK=cfg.block_k1, IEEE=ieee,
        num_warps=cfg.warps1, num_stages=cfg.stages)
    y = torch.empty((A, H), dtype=x.dtype, device=x.device)
    _w2_kernel[(nb, triton.cdiv(H, cfg.block_n2))](
        inter_act, w2, y, sorted_ids, block_expert, A, H, inter, w2.stride(0), w2.stride(1),
        BM=cfg.block_m, BN=cfg.block_n2, BK=cfg.block_k2, IEEE=ieee, num_warps=cfg.warps2, num_stages=cfg.stages)
    bh = min(1024, triton.next_power_of_2(H))
    _combine_kernel[(T, triton.cdiv(H, bh))](y, topk_weights, out, H, topk_weights.stride(0), out.stride(0),
                                              TOP_K=top_k, BH=bh, num_warps=4)
    return out
