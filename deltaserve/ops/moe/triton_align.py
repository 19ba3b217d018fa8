"""Triton MoE alignment: the T * top_k assignments grouped by expert, each expert's group padded to a
multiple of block_m rows, for the grouped GEMMs (triton_grouped.py).

Outputs: `sorted_ids` (assignment index per row; A = T * top_k marks padding) and `block_expert` (expert
of each block_m-row block; -1 past the end). Counting is per chunk of assignments (histograms), one
program turns the counts into padded offsets, and each chunk then scatters its assignments by a local
sort on (expert, index): stable, so the order inside an expert is the token order. One launch does all
three when the assignments fit one chunk. The number of blocks is bounded from shapes alone
(num_blocks_bound), so there is no host sync (CUDA-graph capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ALIGN_CHUNK = 1024      # assignments per counting / scatter program


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


# The chunk count follows the batch: a runtime loop bound (as a constant, every new count would compile a
# kernel variant in the middle of a serving step).
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
    # padding rows of each expert's last block, one column at a time: an [EB, BM] tile would hold EB * BM
    # values in registers, and its lowering takes minutes to compile at 512 experts x 128 rows
    for j in range(BM):
        pad = start + total + j
        tl.store(sorted_ids + pad, A, mask=is_expert & (pad < end))
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
    """(sorted_ids [NB * block_m] int32, block_expert [NB] int32): module docstring."""
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
