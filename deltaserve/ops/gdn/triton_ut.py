"""Arithmetic of the chunked prefill's prep (`triton_chunk._chunk_prep_tc_kernel`) in one register layout:
the UT transform's inverse T = (I + A)^-1 with every doubling level on the whole [BT, BT] tile
(ChunkConfig.ut = "wide"), and the lean forms of the factors around it (ChunkConfig.lean: the q and k norms
from the diagonals of Gram products, the key norms folded into the decay tile's exponent, exp2, int32 row
offsets).

A is strictly lower triangular. Recursive doubling joins the inverses of neighbouring diagonal blocks of size
s into inverses of blocks of size 2s: with X = diag(X1, X2) and C the block of A below them,
(I + [[L1, 0], [C, L2]])^-1 = [[X1, 0], [-X2 C X1, X2]] = X - X C X. Doing every level on the whole tile
(C: A masked to the level's join blocks, `join_mask`) spends tensor-core flops on zeros but keeps X in the
products' accumulator layout from start to end: no extraction of 16 x 16 diagonal blocks, no batched fp32
FMA products, no reassembly (the layout changes and FMA work that were half of the prep's instructions).
Level 1 needs no product (X = I, so X C X = C), and every product only reads inverse blocks and blocks of A,
so nothing grows and cancels (no power series).

Precision of the products (UT_PREC), always with fp32 accumulation:
- "fp16": operands rounded to fp16 (11-bit significand, round to nearest; tf32 keeps 11 bits too, truncated
  by the tensor cores). 16-bit operands pass from one product's accumulator to the next product's register
  operand without shuffles, at twice tf32's tensor-core rate. Range: with unit keys, decays e^(G_i - G_j) <= 1
  (gates g <= 0) and 0 <= beta <= 2, |T_ij| <= max(1, beta_i) <= 2, and so for every X (each is the T of a
  sub-chunk): column j of T is x with x_i = delta_ij - beta_i k_i . s_i, where s_{i+1} = e^(g_{i+1})
  ((I - beta_i k_i k_i^T) s_i + delta_ij k_i), s_0 = 0, and (I - beta k k^T) is a contraction, so |s_i| <= 1.
  Then X C has entries <= 4 s <= 128, far from fp16's 65504 (test_ut_inverse_entries_are_bounded). The
  launcher uses fp16 only with the in-kernel key norms (otherwise "tf32").
- "tf32": fp32 operands as tf32 (the 32- and 64-wide joins' precision in the "blocks" inverse); the register
  operand of each product is re-laid out by warp shuffles.
- "ieee": exact fp32 products (fp32 activations).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def join_mask(n: tl.constexpr, s: tl.constexpr):
    """[n, n] mask of the blocks that join inverse blocks of size s into blocks of size 2s: rows in the
    lower s-half, columns in the upper s-half of each diagonal 2s-block."""
    r = tl.arange(0, n)
    i = r[:, None]
    j = r[None, :]
    return ((i ^ j) < 2 * s) & ((i & s) != 0) & ((j & s) == 0)


@triton.jit
def _mm(a, b, PREC: tl.constexpr):
    """a @ b of two fp32 tiles of the inverse at PREC (module docstring), fp32 accumulation."""
    if PREC == "fp16":
        return tl.dot(a.to(tl.float16), b.to(tl.float16))
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _level(X, A, s: tl.constexpr, n: tl.constexpr, PREC: tl.constexpr):
    """One doubling level on the whole tile: X <- X - (X C) X, C the level's join blocks of A."""
    C = tl.where(join_mask(n, s), A, 0.0)
    return X - _mm(_mm(X, C, PREC), X, PREC)


@triton.jit
def ut_inverse_wide(A, BT: tl.constexpr, PREC: tl.constexpr):
    """(I + A)^-1 of a strictly lower-triangular fp32 [BT, BT] tile (BT in 16, 32, 64), every level on the
    whole tile (module docstring): level 1 as I - C, then log2(BT) - 1 levels of two products each."""
    r = tl.arange(0, BT)
    X = tl.where(r[:, None] == r[None, :], 1.0, -tl.where(join_mask(BT, 1), A, 0.0))
    X = _level(X, A, 2, BT, PREC)
    X = _level(X, A, 4, BT, PREC)
    X = _level(X, A, 8, BT, PREC)
    if BT > 16:
        X = _level(X, A, 16, BT, PREC)
    if BT > 32:
        X = _level(X, A, 32, BT, PREC)
    return X


@triton.jit
def rstd_from_gram(KK, L2NORM: tl.constexpr, BT: tl.constexpr):
    """1 / sqrt(|k_i|^2 + eps) from the diagonal of the Gram product K K^T of the raw rows (exact bf16
    products, fp32 accumulation, as the row sums they replace), in the products' row layout, so the norms
    scale the products without a layout change or a reduction over the 128-wide rows."""
    if L2NORM:
        r = tl.arange(0, BT)
        return tl.rsqrt(tl.sum(tl.where(r[:, None] == r[None, :], KK, 0.0), axis=1) + 1e-6)
    else:
        return tl.zeros([BT], dtype=tl.float32) + 1.0


@triton.jit
def decay_tile(G, lcol, BT: tl.constexpr):
    """exp(G_i - G_j) * 2^lcol_j on and below the diagonal, zeros above: a column scale (the key norms,
    lcol = log2 rk) folded into the exponent, as exp2 of log2-scaled differences; masked before the
    exponential, so no exp(+x) can overflow (lcol is at most log2(1e3), the norms' epsilon)."""
    r = tl.arange(0, BT)
    G2 = G * LOG2E
    return tl.exp2(tl.where(r[:, None] >= r[None, :], G2[:, None] - (G2 - lcol)[None, :], float("-inf")))


@triton.jit
def load_chunk_rows(ptr, t0, m, s_t, off, col0, COLS: tl.constexpr, BT: tl.constexpr):
    """Rows t0 .. t0 + BT of columns col0 .. col0 + COLS (row mask m, zeros elsewhere), addressed from the
    chunk's int64 base with int32 offsets inside it (BT rows of one projection row stride fit int32)."""
    rows = tl.arange(0, BT)
    cols = col0 + tl.arange(0, COLS)
    base = ptr + t0.to(tl.int64) * s_t + off
    return tl.load(base + rows[:, None] * s_t + cols[None, :], mask=m[:, None], other=0.0)
