"""Triton temperature sampling (same signature as reference.temperature_sample): two launches instead of
the ~25 small torch kernels of the reference at a 248k vocabulary.

1. `_block_mass_kernel`, one program per (row, chunk of CHUNK_BLOCKS x 128 tokens): the chunk's max of
   logits / T and each 128-token block's sum of exp(x - chunk max), fp32.
2. `_pick_kernel`, one program per row: the row max M over the chunk maxima, block masses rescaled by
   exp(chunk max - M) into float64, their cumulative sum, the block holding u x total, then that block's
   128 probabilities exp(x - M) summed in float64 to find the token: the reference's two-level inverse
   CDF. The block masses differ from the reference's (sums of exp(x - M)) by fp32 rounding (~1e-7 of a
   block), so a uniform within that distance of a block boundary may pick the neighbouring token.
No host sync; CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_common import check, check_same_device

BLOCK = 128
CHUNK_BLOCKS = 16            # 2048 tokens per program of the first kernel


@triton.jit
def _block_mass_kernel(logits, temp, cmax, mass, V, s_l, NC, s_m,
                       NB: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t = tl.load(temp + r).to(tl.float32)
    offs = c * (NB * BLOCK) + tl.arange(0, NB * BLOCK)
    x = tl.load(logits + r * s_l + offs, mask=offs < V, other=float("-inf")).to(tl.float32) / t
    m = tl.max(x, 0)
    p = tl.exp(x - tl.where(m == float("-inf"), 0.0, m))          # an all -inf chunk has no mass
    tl.store(cmax + r * NC + c, m)
    tl.store(mass + r * s_m + c * NB + tl.arange(0, NB), tl.sum(tl.reshape(p, (NB, BLOCK)), 1))


@triton.jit
def _pick_kernel(logits, temp, u, cmax, mass, out, last, slots, V, s_l, NC, NBT, s_m,
                 NCP: tl.constexpr, NB: tl.constexpr, NBP: tl.constexpr, BLOCK: tl.constexpr, RECORD: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    t = tl.load(temp + r).to(tl.float32)
    cs = tl.arange(0, NCP)
    M = tl.max(tl.load(cmax + r * NC + cs, mask=cs < NC, other=float("-inf")), 0)
    bs = tl.arange(0, NBP)
    valid = bs < NBT
    cm = tl.load(cmax + r * NC + bs // NB, mask=valid, other=float("-inf"))
    scale = tl.where(cm == float("-inf"), 0.0, tl.exp(cm - M))
    w = tl.load(mass + r * s_m + bs, mask=valid, other=0.0).to(tl.float64) * scale.to(tl.float64)
    cdf = tl.cumsum(w, 0)
    x = tl.load(u + r) * tl.sum(w, 0)
    b = tl.minimum(tl.sum(((cdf <= x) & valid).to(tl.int32), 0), NBT - 1)     # block holding x
    before = tl.sum(tl.where(bs == b - 1, cdf, 0.0), 0)
    frac = (x - before) / tl.sum(tl.where(bs == b, w, 0.0), 0)
    frac = tl.minimum(tl.maximum(frac, 0.0), 1.0 - 2.0 ** -52)
    tok = b * BLOCK + tl.arange(0, BLOCK)
    xl = tl.load(logits + r * s_l + tok, mask=tok < V, other=float("-inf")).to(tl.float32) / t
    p = tl.exp(xl - M).to(tl.float64)
    inner = tl.cumsum(p, 0)
    j = tl.minimum(tl.sum((inner <= frac * tl.sum(p, 0)).to(tl.int32), 0), BLOCK - 1)
    tl.store(out + r, (b * BLOCK + j).to(tl.int64))
    if RECORD:
        tl.store(last + tl.load(slots + r), (b * BLOCK + j).to(tl.int64))


def temperature_sample(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor, *,
                       record: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """See reference.temperature_sample (record: the pick kernel writes the tokens there too)."""
    op = "temperature_sample"
    check(logits.dim() == 2 and logits.stride(-1) == 1, op,
          f"logits must be [N, V] with contiguous rows, got {tuple(logits.shape)} strides {tuple(logits.stride())}")
    N, V = logits.shape
    check(temperature.shape == (N,) and u.shape == (N,), op,
          f"temperature and u must be [{N}], got {tuple(temperature.shape)} and {tuple(u.shape)}")
    check(temperature.dtype in (torch.float32, torch.float64) and u.dtype == torch.float64, op,
          f"temperature must be float32 / float64 and u float64, got {temperature.dtype} and {u.dtype}")
    check_same_device(op, logits, temperature, u)
    last, slots = record if record is not None else (u, u)
    if record is not None:
        check(last.dim() == 1 and last.dtype == torch.long and slots.shape == (N,)
              and slots.dtype in (torch.int32, torch.int64), op,
              "record must be (last_tokens 1-D int64, slots [N] int32 / int64)")
        check_same_device(op, logits, last, slots)
    out = torch.empty(N, dtype=torch.long, device=logits.device)
    if N == 0:
        return out
    check(V >= 1, op, "the vocabulary must not be empty")
    nc = triton.cdiv(V, CHUNK_BLOCKS * BLOCK)
    nbt = triton.cdiv(V, BLOCK)
    cmax = torch.empty((N, nc), dtype=torch.float32, device=logits.device)
    mass = torch.empty((N, nc * CHUNK_BLOCKS), dtype=torch.float32, device=logits.device)
    _block_mass_kernel[(N, nc)](logits, temperature, cmax, mass, V, logits.stride(0), nc, mass.stride(0),
                                NB=CHUNK_BLOCKS, BLOCK=BLOCK, num_warps=4)
    _pick_kernel[(N,)](logits, temperature, u, cmax, mass, out, last, slots, V, logits.stride(0), nc, nbt,
                       mass.stride(0), NCP=triton.next_power_of_2(nc), NB=CHUNK_BLOCKS,
                       NBP=triton.next_power_of_2(nc * CHUNK_BLOCKS), BLOCK=BLOCK, RECORD=record is not None,
                       num_warps=8)
    return out
