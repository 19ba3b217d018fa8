"""The UT transform's inverse T = (I + A)^-1 of the chunked prefill's prep (`triton_prep`), A strictly lower
triangular [64, 64], and the prep's lean factors around it.

Recursive doubling joins the inverses of neighbouring diagonal blocks of size s into inverses of blocks of size
2s: with X = diag(X1, X2) and C the block of A below them, (I + [[L1, 0], [C, L2]])^-1 = [[X1, 0], [-X2 C X1, X2]]
= X - X C X. Every product only reads inverse blocks and blocks of A, so nothing grows and cancels (no power
series). Two forms:
- `ut_inverse_blocks` (the "blocks" prep): levels 1-8 on the four 16 x 16 diagonal blocks as one batched
  exact-fp32 problem, then the 32- and 64-wide joins as tensor-core products (tf32, or exact for fp32).
- `ut_inverse_wide` (the "wide" prep): every level on the whole tile (C: A masked to the level's join blocks,
  `join_mask`), spending tensor-core flops on zeros but keeping X in the products' accumulator layout from start
  to end (no block extraction, batched FMA products or reassembly). Level 1 needs no product (X C X = C).

Precision of the wide form's products (UT_PREC), always with fp32 accumulation:
- "fp16": operands rounded to fp16 (11-bit significand, as tf32, at twice its tensor-core rate, and passed from
  one product's accumulator to the next's register operand without shuffles). Range: with unit keys, decays
  e^(G_i - G_j) <= 1 (gates g <= 0) and 0 <= beta <= 2, |T_ij| <= max(1, beta_i) <= 2 for every sub-chunk's X
  (column j of T is x with x_i = delta_ij - beta_i k_i . s_i, s_{i+1} = e^(g_{i+1}) ((I - beta_i k_i k_i^T) s_i
  + delta_ij k_i), s_0 = 0, and I - beta k k^T is a contraction, so |s_i| <= 1); X C then has entries <= 128,
  far from fp16's 65504 (test_ut_inverse_entries_are_bounded). Used only with the in-kernel key norms.
- "tf32": fp32 operands as tf32 (without the in-kernel key norms).
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


@triton.jit
def _sub_mask(n: tl.constexpr, s: tl.constexpr):
    """[n, n] mask of the blocks that join inverse blocks of size s into blocks of size 2s: rows in the
    lower s-half, columns in the upper s-half of each diagonal 2s-block."""
    r = tl.arange(0, n)
    i = r[:, None]
    j = r[None, :]
    return (i // (2 * s) == j // (2 * s)) & ((i // s) % 2 == 1) & ((j // s) % 2 == 0)


@triton.jit
def _join(X, A, s: tl.constexpr, n: tl.constexpr, PREC: tl.constexpr):
    """Inverse blocks of size s -> 2s: X - X C X, C the join blocks of A. X and A are [n, n] or batched
    [B, n, n]."""
    if len(A.shape) == 3:
        C = tl.where(_sub_mask(n, s)[None, :, :], A, 0.0)
    else:
        C = tl.where(_sub_mask(n, s), A, 0.0)
    return X - tl.dot(tl.dot(X, C, input_precision=PREC), X, input_precision=PREC)


@triton.jit
def ut_inverse_blocks(A, BT: tl.constexpr, MERGE_PREC: tl.constexpr):
    """(I + A)^-1 of a strictly lower-triangular fp32 [BT, BT] tile (BT = 64): the four 16 x 16 diagonal blocks
    as one batched [4, 16, 16] problem in exact fp32 (levels 1 -> 16), then the 32- and 64-wide joins on the
    whole tile at MERGE_PREC."""
    SB: tl.constexpr = 16
    NB: tl.constexpr = BT // SB
    b = tl.arange(0, NB)
    same = b[:, None, None, None] == b[None, None, :, None]
    Ad = tl.sum(tl.where(same, tl.reshape(A, (NB, SB, NB, SB)), 0.0), axis=2)   # diagonal blocks [NB, SB, SB]
    rs = tl.arange(0, SB)
    X = tl.zeros([NB, SB, SB], dtype=tl.float32) + tl.where(rs[:, None] == rs[None, :], 1.0, 0.0)[None, :, :]
    X = _join(X, Ad, 1, SB, "ieee")
    X = _join(X, Ad, 2, SB, "ieee")
    X = _join(X, Ad, 4, SB, "ieee")
    X = _join(X, Ad, 8, SB, "ieee")
    Xf = tl.reshape(tl.where(same, tl.expand_dims(X, 2), 0.0), (BT, BT))        # block-diagonal [BT, BT]
    Xf = _join(Xf, A, 16, BT, MERGE_PREC)
    return _join(Xf, A, 32, BT, MERGE_PREC)
