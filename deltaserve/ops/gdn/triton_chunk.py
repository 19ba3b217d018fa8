"""Triton chunked prefill of the gated delta rule (same signature as reference.chunk_gated_delta_rule),
in two launches instead of FLA's five (+ fills):

1. `_chunk_prep_kernel`, parallel over (chunk of 64 tokens, key head): computes the q/k inverse norms,
   the gates (optionally from their pre-activations), the chunk-local cumulative log decay G, and for
   each value head sharing the key head the UT transform T = (I + A)^-1 with
   A = strictly_lower(diag(beta) K^ K^T * exp(G_i - G_j)), and the masked, gated score matrix
   P = scale * (Q^ K^T * exp(G_i - G_j)) incl. diagonal. T and P are stored per token row ([T, HV, 64]);
   the L2 norms are never materialised on q and k (the raw bf16 rows are exact dot operands, the norms
   are applied to the products).
2. `_chunk_state_kernel`, one program per (sequence, value head, V-slice): walks the sequence's chunks
   in order with the fp32 state slice in registers:
     V_new = T (beta * (V - exp(G) * (K^ S)));   O = exp(G) * scale * (Q^ S) + P V_new
     S <- exp(G_last) S + K^T (exp(G_last - G) * rstd_k * V_new)
   The initial state is read from the pool slot (or zero) and the final state written back in place.

The inverse, in exact fp32: the chunk is four 16-token sub-blocks; the four 16x16 diagonal blocks of
(I + A) are inverted by forward substitution, the six blocks below them by block back-substitution
(X_ij = -X_ii sum_m A_im X_mj, sixteen 16x16 products). Only 2-D 16x16 tiles are used (the same
constructs FLA's solve kernel relies on).

Exactness: no contribution is truncated; chunks never cross sequence boundaries; padding rows are
masked before any exp so no inf or NaN can arise. Host work is shape-only (grid bounds from T and N),
so the op is CUDA-graph capturable: the chunk -> (sequence, chunk) map is computed inside kernel 1.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ..triton_common import (
    check, check_head_dim, check_index, check_last_contiguous, check_pool, check_same_device, chunk_offsets,
    locate_chunk, next_pow2, sigmoid, softplus,
)

CHUNK = 64


@dataclasses.dataclass(frozen=True)
class ChunkConfig:
    """Launch and precision choices of the chunked prefill.

    bv: state columns per program of kernel 2; prec: operand precision of kernel 2's products with fp32
    accumulation: "tf32" (state and V_new operands rounded to tf32, 10-bit mantissa) or "ieee" (exact
    fp32, slow). The UT-transform inverse is always formed in exact fp32. A bf16-operand variant (FLA's
    choice) produced wrong results on the H200 with Triton 3.6 although it is correct under the
    interpreter; it is not offered until that is understood (docs/PERFORMANCE.md, GDN kernels).
    """

    bv: int = 32
    warps_prep: int = 4
    warps_state: int = 4
    stages_state: int = 2
    prec: str = "tf32"


def default_chunk_config(num_seqs: int, num_v_heads: int, v: int, dtype: torch.dtype) -> ChunkConfig:
    exact = dtype == torch.float32  # fp32 activations: keep every product in fp32
    return ChunkConfig(bv=min(32, v), prec="ieee" if exact else "tf32")


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)


@triton.jit
def _cumsum(g, SB: tl.constexpr):
    """Inclusive prefix sum of a [SB] vector as a masked row sum (no scan)."""
    r = tl.arange(0, SB)
    return tl.sum(tl.where(r[None, :] <= r[:, None], g[None, :], 0.0), axis=1)


@triton.jit
def _block_inverse(A, SB: tl.constexpr):
    """(I + A)^-1 of a strictly lower-triangular fp32 [SB, SB] tile by forward substitution, row by row."""
    r = tl.arange(0, SB)
    X = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    for i in range(1, SB):
        a = tl.sum(tl.where(r[:, None] == i, A, 0.0), axis=0)                 # A[i, :]
        new = -tl.sum(a[:, None] * X, axis=0)                                 # -sum_j A[i, j] X[j, :]
        X = tl.where(r[:, None] == i, new[None, :] + tl.where(r[None, :] == i, 1.0, 0.0), X)
    return X


@triton.jit
def _mm(a, b):
    """Exact fp32 product of two small tiles (the block inverse is kept in fp32 throughout)."""
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _load_rows(ptr, tok, m, s_t, off, K: tl.constexpr):
    ok = tl.arange(0, K)
    return tl.load(ptr + tok[:, None] * s_t + off + ok[None, :], mask=m[:, None], other=0.0)


@triton.jit
def _rstd(x, L2NORM: tl.constexpr):
    if L2NORM:
        xf = x.to(tl.float32)
        return tl.rsqrt(tl.sum(xf * xf, axis=1) + 1e-6)
    else:
        return tl.sum(x.to(tl.float32) * 0.0, axis=1) + 1.0


@triton.jit
def _gram(a, b, ra, rb, PREC: tl.constexpr):
    """ra_i rb_j (a_i . b_j) for raw bf16 rows: exact products, fp32 accumulation, norms applied after."""
    if PREC == "native":
        d = tl.dot(a, tl.trans(b))
    else:
        d = tl.dot(a, tl.trans(b), input_precision=PREC)
    return d * ra[:, None] * rb[None, :]


@triton.jit
def _gates(g, beta, s_g_t, s_b_t, A_log, dt_bias, tok, m, hv, GATES: tl.constexpr):
    if GATES:
        av = tl.load(g + tok * s_g_t + hv, mask=m, other=0.0).to(tl.float32)
        bv = tl.load(beta + tok * s_b_t + hv, mask=m, other=0.0).to(tl.float32)
        gv = -tl.exp(tl.load(A_log + hv).to(tl.float32)) * softplus(av + tl.load(dt_bias + hv).to(tl.float32))
        bv = sigmoid(bv)
    else:
        gv = tl.load(g + tok * s_g_t + hv, mask=m, other=0.0).to(tl.float32)
        bv = tl.load(beta + tok * s_b_t + hv, mask=m, other=0.0).to(tl.float32)
    return tl.where(m, gv, 0.0), tl.where(m, bv, 0.0)


@triton.jit
def _decay(Gi, Gj, DIAG: tl.constexpr, STRICT: tl.constexpr, SB: tl.constexpr):
    """exp(G_i - G_j) for a row block i and column block j; on a diagonal block only below (or on) the
    diagonal, masked before the exp so no exp(+x) can overflow."""
    diff = Gi[:, None] - Gj[None, :]
    if DIAG:
        r = tl.arange(0, SB)
        if STRICT:
            keep = r[:, None] > r[None, :]
        else:
            keep = r[:, None] >= r[None, :]
        diff = tl.where(keep, diff, float("-inf"))
    return tl.exp(diff)


@triton.jit
def _store_block(base, tok, m, hv, HV, col0, X, BT: tl.constexpr, SB: tl.constexpr):
    c = tl.arange(0, SB)
    tl.store(base + (tok[:, None] * HV + hv) * BT + col0 + c[None, :], X.to(base.dtype.element_ty), mask=m[:, None])


@triton.jit
def _chunk_prep_kernel(
    q, k, s_q_t, s_q_h, s_k_t, s_k_h,
    g, beta, s_g_t, s_b_t, A_log, dt_bias,
    coff, cu, N, Tb, Pb, Gb, Bb, rq_b, rk_b, scale, HK, HV,
    R: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BLOCK_N: tl.constexpr, L2NORM: tl.constexpr,
    GATES: tl.constexpr, QK_PREC: tl.constexpr,
):
    """One program per (chunk, key head). The chunk is handled as four 16-token sub-blocks: the ten
    lower-triangular 16x16 blocks of K^ K^T and Q^ K^T, the four diagonal-block inverses by forward
    substitution and the off-diagonal blocks of (I + A)^-1 by block back-substitution in fp32."""
    SB: tl.constexpr = 16
    p = tl.program_id(0)
    hk = tl.program_id(1)
    n, c, bos, eos = locate_chunk(coff, cu, N, p, BLOCK_N)
    t0 = bos + c * BT
    L = eos - t0
    r = tl.arange(0, SB)
    tok0 = (t0 + r).to(tl.int64)
    tok1 = tok0 + SB
    tok2 = tok0 + 2 * SB
    tok3 = tok0 + 3 * SB
    m0 = r < L
    m1 = r + SB < L
    m2 = r + 2 * SB < L
    m3 = r + 3 * SB < L
    koff = hk * s_k_h
    qoff = hk * s_q_h
    k0 = _load_rows(k, tok0, m0, s_k_t, koff, K)
    k1 = _load_rows(k, tok1, m1, s_k_t, koff, K)
    k2 = _load_rows(k, tok2, m2, s_k_t, koff, K)
    k3 = _load_rows(k, tok3, m3, s_k_t, koff, K)
    q0 = _load_rows(q, tok0, m0, s_q_t, qoff, K)
    q1 = _load_rows(q, tok1, m1, s_q_t, qoff, K)
    q2 = _load_rows(q, tok2, m2, s_q_t, qoff, K)
    q3 = _load_rows(q, tok3, m3, s_q_t, qoff, K)
    rk0 = _rstd(k0, L2NORM)
    rk1 = _rstd(k1, L2NORM)
    rk2 = _rstd(k2, L2NORM)
    rk3 = _rstd(k3, L2NORM)
    rq0 = _rstd(q0, L2NORM) * scale
    rq1 = _rstd(q1, L2NORM) * scale
    rq2 = _rstd(q2, L2NORM) * scale
    rq3 = _rstd(q3, L2NORM) * scale
    tl.store(rk_b + tok0 * HK + hk, rk0, mask=m0)
    tl.store(rk_b + tok1 * HK + hk, rk1, mask=m1)
    tl.store(rk_b + tok2 * HK + hk, rk2, mask=m2)
    tl.store(rk_b + tok3 * HK + hk, rk3, mask=m3)
    tl.store(rq_b + tok0 * HK + hk, rq0, mask=m0)
    tl.store(rq_b + tok1 * HK + hk, rq1, mask=m1)
    tl.store(rq_b + tok2 * HK + hk, rq2, mask=m2)
    tl.store(rq_b + tok3 * HK + hk, rq3, mask=m3)
    # normalised Gram blocks (row block i, column block j <= i)
    K00 = _gram(k0, k0, rk0, rk0, QK_PREC)
    K10 = _gram(k1, k0, rk1, rk0, QK_PREC)
    K11 = _gram(k1, k1, rk1, rk1, QK_PREC)
    K20 = _gram(k2, k0, rk2, rk0, QK_PREC)
    K21 = _gram(k2, k1, rk2, rk1, QK_PREC)
    K22 = _gram(k2, k2, rk2, rk2, QK_PREC)
    K30 = _gram(k3, k0, rk3, rk0, QK_PREC)
    K31 = _gram(k3, k1, rk3, rk1, QK_PREC)
    K32 = _gram(k3, k2, rk3, rk2, QK_PREC)
    K33 = _gram(k3, k3, rk3, rk3, QK_PREC)
    Q00 = _gram(q0, k0, rq0, rk0, QK_PREC)
    Q10 = _gram(q1, k0, rq1, rk0, QK_PREC)
    Q11 = _gram(q1, k1, rq1, rk1, QK_PREC)
    Q20 = _gram(q2, k0, rq2, rk0, QK_PREC)
    Q21 = _gram(q2, k1, rq2, rk1, QK_PREC)
    Q22 = _gram(q2, k2, rq2, rk2, QK_PREC)
    Q30 = _gram(q3, k0, rq3, rk0, QK_PREC)
    Q31 = _gram(q3, k1, rq3, rk1, QK_PREC)
    Q32 = _gram(q3, k2, rq3, rk2, QK_PREC)
    Q33 = _gram(q3, k3, rq3, rk3, QK_PREC)
    for jh in range(R):
        hv = hk * R + jh
        g0, b0 = _gates(g, beta, s_g_t, s_b_t, A_log, dt_bias, tok0, m0, hv, GATES)
        g1, b1 = _gates(g, beta, s_g_t, s_b_t, A_log, dt_bias, tok1, m1, hv, GATES)
        g2, b2 = _gates(g, beta, s_g_t, s_b_t, A_log, dt_bias, tok2, m2, hv, GATES)
        g3, b3 = _gates(g, beta, s_g_t, s_b_t, A_log, dt_bias, tok3, m3, hv, GATES)
        G0 = _cumsum(g0, SB)
        G1 = _cumsum(g1, SB) + tl.sum(g0, axis=0)
        G2 = _cumsum(g2, SB) + (tl.sum(g0, axis=0) + tl.sum(g1, axis=0))
        G3 = _cumsum(g3, SB) + (tl.sum(g0, axis=0) + tl.sum(g1, axis=0) + tl.sum(g2, axis=0))
        tl.store(Gb + tok0 * HV + hv, G0, mask=m0)
        tl.store(Gb + tok1 * HV + hv, G1, mask=m1)
        tl.store(Gb + tok2 * HV + hv, G2, mask=m2)
        tl.store(Gb + tok3 * HV + hv, G3, mask=m3)
        tl.store(Bb + tok0 * HV + hv, b0, mask=m0)
        tl.store(Bb + tok1 * HV + hv, b1, mask=m1)
        tl.store(Bb + tok2 * HV + hv, b2, mask=m2)
        tl.store(Bb + tok3 * HV + hv, b3, mask=m3)
        # A = strictly_lower(diag(beta) K^ K^T * exp(G_i - G_j)), block by block
        X0 = _block_inverse(b0[:, None] * K00 * _decay(G0, G0, True, True, SB), SB)
        X1 = _block_inverse(b1[:, None] * K11 * _decay(G1, G1, True, True, SB), SB)
        X2 = _block_inverse(b2[:, None] * K22 * _decay(G2, G2, True, True, SB), SB)
        X3 = _block_inverse(b3[:, None] * K33 * _decay(G3, G3, True, True, SB), SB)
        A10 = b1[:, None] * K10 * _decay(G1, G0, False, False, SB)
        A20 = b2[:, None] * K20 * _decay(G2, G0, False, False, SB)
        A21 = b2[:, None] * K21 * _decay(G2, G1, False, False, SB)
        A30 = b3[:, None] * K30 * _decay(G3, G0, False, False, SB)
        A31 = b3[:, None] * K31 * _decay(G3, G1, False, False, SB)
        A32 = b3[:, None] * K32 * _decay(G3, G2, False, False, SB)
        # (I + A)^-1 below the diagonal: X_ij = -X_ii sum_{j <= m < i} A_im X_mj
        X10 = -_mm(X1, _mm(A10, X0))
        X21 = -_mm(X2, _mm(A21, X1))
        X32 = -_mm(X3, _mm(A32, X2))
        X20 = -_mm(X2, _mm(A20, X0) + _mm(A21, X10))
        X31 = -_mm(X3, _mm(A31, X1) + _mm(A32, X21))
        X30 = -_mm(X3, _mm(A30, X0) + _mm(A31, X10) + _mm(A32, X20))
        _store_block(Tb, tok0, m0, hv, HV, 0, X0, BT, SB)
        _store_block(Tb, tok1, m1, hv, HV, 0, X10, BT, SB)
        _store_block(Tb, tok1, m1, hv, HV, SB, X1, BT, SB)
        _store_block(Tb, tok2, m2, hv, HV, 0, X20, BT, SB)
        _store_block(Tb, tok2, m2, hv, HV, SB, X21, BT, SB)
        _store_block(Tb, tok2, m2, hv, HV, 2 * SB, X2, BT, SB)
        _store_block(Tb, tok3, m3, hv, HV, 0, X30, BT, SB)
        _store_block(Tb, tok3, m3, hv, HV, SB, X31, BT, SB)
        _store_block(Tb, tok3, m3, hv, HV, 2 * SB, X32, BT, SB)
        _store_block(Tb, tok3, m3, hv, HV, 3 * SB, X3, BT, SB)
        # P = scale Q^ K^T * exp(G_i - G_j), on and below the diagonal
        _store_block(Pb, tok0, m0, hv, HV, 0, Q00 * _decay(G0, G0, True, False, SB), BT, SB)
        _store_block(Pb, tok1, m1, hv, HV, 0, Q10 * _decay(G1, G0, False, False, SB), BT, SB)
        _store_block(Pb, tok1, m1, hv, HV, SB, Q11 * _decay(G1, G1, True, False, SB), BT, SB)
        _store_block(Pb, tok2, m2, hv, HV, 0, Q20 * _decay(G2, G0, False, False, SB), BT, SB)
        _store_block(Pb, tok2, m2, hv, HV, SB, Q21 * _decay(G2, G1, False, False, SB), BT, SB)
        _store_block(Pb, tok2, m2, hv, HV, 2 * SB, Q22 * _decay(G2, G2, True, False, SB), BT, SB)
        _store_block(Pb, tok3, m3, hv, HV, 0, Q30 * _decay(G3, G0, False, False, SB), BT, SB)
        _store_block(Pb, tok3, m3, hv, HV, SB, Q31 * _decay(G3, G1, False, False, SB), BT, SB)
        _store_block(Pb, tok3, m3, hv, HV, 2 * SB, Q32 * _decay(G3, G2, False, False, SB), BT, SB)
        _store_block(Pb, tok3, m3, hv, HV, 3 * SB, Q33 * _decay(G3, G3, True, False, SB), BT, SB)


@triton.jit
def _chunk_state_kernel(
    q, k, v, s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h, o,
    Tb, Pb, Gb, Bb, rq_b, rk_b, ssm, cu, idx, has_init, scale, HK, HV,
    R: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    PREC: tl.constexpr, STAGES: tl.constexpr,
):
    j = tl.program_id(0)
    nh = tl.program_id(1)
    n = nh // HV
    hv = nh % HV
    hk = hv // R
    bos = tl.load(cu + n).to(tl.int32)
    L = tl.load(cu + n + 1).to(tl.int32) - bos
    slot = tl.load(idx + n).to(tl.int64)
    live = slot >= 0
    init = tl.load(has_init + n) != 0
    ok = tl.arange(0, K)
    ov = j * BV + tl.arange(0, BV)
    rows = tl.arange(0, BT)
    sp = ssm + slot * (HV * K * V) + hv * (K * V) + ok[:, None] * V + ov[None, :]
    S = tl.load(sp, mask=(ok[:, None] >= 0) & live & init, other=0.0)
    for c in tl.range(0, tl.cdiv(L, BT), num_stages=STAGES):
        left = L - c * BT
        rm = rows < left
        tok = (bos + c * BT + rows).to(tl.int64)
        kk = tl.load(k + tok[:, None] * s_k_t + hk * s_k_h + ok[None, :], mask=rm[:, None], other=0.0)
        # K^T loaded as its own tile (an L1/L2 hit) rather than tl.trans of the tile that feeds K S
        kT = tl.load(k + tok[None, :] * s_k_t + hk * s_k_h + ok[:, None], mask=rm[None, :], other=0.0)
        qq = tl.load(q + tok[:, None] * s_q_t + hk * s_q_h + ok[None, :], mask=rm[:, None], other=0.0)
        vv = tl.load(v + tok[:, None] * s_v_t + hv * s_v_h + ov[None, :], mask=rm[:, None], other=0.0)
        G = tl.load(Gb + tok * HV + hv, mask=rm, other=0.0)
        bt = tl.load(Bb + tok * HV + hv, mask=rm, other=0.0)
        rk = tl.load(rk_b + tok * HK + hk, mask=rm, other=0.0)
        rq = tl.load(rq_b + tok * HK + hk, mask=rm, other=0.0)
        mat = (tok[:, None] * HV + hv) * BT + rows[None, :]
        lower = rm[:, None] & (rows[None, :] <= rows[:, None])   # T and P are lower triangular
        Tm = tl.load(Tb + mat, mask=lower, other=0.0)
        Pm = tl.load(Pb + mat, mask=lower, other=0.0)
        g_last = tl.sum(tl.where(rows == tl.minimum(left, BT) - 1, G, 0.0), axis=0)
        eG = tl.exp(G)
        KS = _dot(kk, S, PREC) * (rk * eG)[:, None]
        Vn = _dot(Tm, bt[:, None] * (vv.to(tl.float32) - KS), PREC)
        O = _dot(qq, S, PREC) * (rq * eG)[:, None] + _dot(Pm, Vn, PREC)
        tl.store(o + tok[:, None] * (HV * V) + hv * V + ov[None, :],
                 tl.where(live, O, 0.0).to(o.dtype.element_ty), mask=rm[:, None])
        d = tl.where(rm, tl.exp(g_last - G) * rk, 0.0)
        S = S * tl.exp(g_last) + _dot(kT, Vn * d[:, None], PREC)
    tl.store(sp, S, mask=(ok[:, None] >= 0) & live & (L > 0))


def _chunk_forward(q, k, v, g, beta, *, gates_in_kernel, A_log, dt_bias, scale, cu_seqlens, ssm_state,
                   state_indices, has_initial_state, use_qk_l2norm_in_kernel, config, op):
    check(q.dim() == 3 and k.shape == q.shape and v.dim() == 3 and v.shape[0] == q.shape[0], op,
          f"q, k must be [T, HK, K] and v [T, HV, V], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    T, HK, K = q.shape
    HV, V = v.shape[1:]
    check(HV % HK == 0 and HV // HK <= 8, op, f"value heads {HV} must be 1..8 x key heads {HK}")
    check_head_dim(op, "K", K)
    check_head_dim(op, "V", V)
    check(q.dtype in (torch.bfloat16, torch.float16, torch.float32) and k.dtype == q.dtype and v.dtype == q.dtype,
          op, f"q, k, v must share a float dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    check(g.shape == (T, HV) and beta.shape == (T, HV), op,
          f"{'a and b' if gates_in_kernel else 'g and beta'} must be [{T}, {HV}], "
          f"got {tuple(g.shape)}, {tuple(beta.shape)}")
    check_last_contiguous(op, q=q, k=k, v=v, g=g, beta=beta)
    check_pool(op, ssm_state, HV, K, V)
    N = state_indices.shape[0]
    check_index(op, "cu_seqlens", cu_seqlens, N + 1)
    check_index(op, "state_indices", state_indices, N)
    check(has_initial_state.dim() == 1 and has_initial_state.shape[0] == N, op,
          f"has_initial_state must be [{N}], got {tuple(has_initial_state.shape)}")
    check_same_device(op, q, k, v, g, beta, cu_seqlens, ssm_state, state_indices, has_initial_state)
    if gates_in_kernel:
        check(A_log.shape == (HV,) and dt_bias.shape == (HV,), op, f"A_log and dt_bias must be [{HV}]")
    cfg = config or default_chunk_config(N, HV, V, q.dtype)
    check(V % cfg.bv == 0, op, f"config bv={cfg.bv} must divide V={V}")
    check(cfg.prec in ("tf32", "ieee"), op, f"config prec={cfg.prec!r} is not one of 'tf32', 'ieee'")
    o = torch.empty((T, HV, V), dtype=v.dtype, device=v.device)
    if T == 0 or N == 0:
        return o
    bufs = _launch_prep(q, k, g, beta, gates_in_kernel, A_log, dt_bias, scale, cu_seqlens, N, HV,
                        use_qk_l2norm_in_kernel, cfg)
    _launch_state(q, k, v, o, bufs, scale, cu_seqlens, ssm_state, state_indices, has_initial_state, cfg)
    return o


def _launch_prep(q, k, g, beta, gates_in_kernel, A_log, dt_bias, scale, cu_seqlens, N, HV, l2norm, cfg):
    """Kernel 1: per (chunk, key head) norms, gates, T and P for every value head of the group."""
    T, HK, K = q.shape
    dev = q.device
    f32 = torch.float32
    mat_dtype = f32  # T and P feed tf32/fp32 products: kept in fp32
    bufs = dict(
        Tb=torch.empty((T, HV, CHUNK), dtype=mat_dtype, device=dev),
        Pb=torch.empty((T, HV, CHUNK), dtype=mat_dtype, device=dev),
        Gb=torch.empty((T, HV), dtype=f32, device=dev),
        Bb=torch.empty((T, HV), dtype=f32, device=dev),
        rq=torch.empty((T, HK), dtype=f32, device=dev),
        rk=torch.empty((T, HK), dtype=f32, device=dev),
    )
    dummy = bufs["Gb"]
    _chunk_prep_kernel[(triton.cdiv(T, CHUNK) + N, HK)](
        q, k, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        g, beta, g.stride(0), beta.stride(0), A_log if gates_in_kernel else dummy,
        dt_bias if gates_in_kernel else dummy, chunk_offsets(cu_seqlens, CHUNK), cu_seqlens, N,
        bufs["Tb"], bufs["Pb"], bufs["Gb"], bufs["Bb"],
        bufs["rq"], bufs["rk"], float(scale), HK, HV,
        R=HV // HK, K=K, BT=CHUNK, BLOCK_N=max(16, next_pow2(N)), L2NORM=bool(l2norm),
        GATES=bool(gates_in_kernel), QK_PREC="ieee" if q.dtype == torch.float32 else "native",
        num_warps=cfg.warps_prep)
    return bufs


def _launch_state(q, k, v, o, bufs, scale, cu_seqlens, ssm_state, state_indices, has_initial_state, cfg):
    """Kernel 2: per (sequence, value head, V-slice) the chunk recurrence, outputs and final state."""
    HK, K = q.shape[1:]
    HV, V = v.shape[1:]
    N = state_indices.shape[0]
    has_init = has_initial_state if has_initial_state.dtype != torch.bool else has_initial_state.view(torch.uint8)
    _chunk_state_kernel[(V // cfg.bv, N * HV)](
        q, k, v, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o,
        bufs["Tb"], bufs["Pb"], bufs["Gb"], bufs["Bb"], bufs["rq"], bufs["rk"], ssm_state, cu_seqlens,
        state_indices, has_init, float(scale), HK, HV,
        R=HV // HK, K=K, V=V, BV=cfg.bv, BT=CHUNK, PREC=cfg.prec, STAGES=cfg.stages_state,
        num_warps=cfg.warps_state)


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    *, scale: float, cu_seqlens: torch.Tensor, ssm_state: torch.Tensor,
    state_indices: torch.Tensor, has_initial_state: torch.Tensor,
    use_qk_l2norm_in_kernel: bool = True, chunk_size: int = CHUNK, config: ChunkConfig | None = None,
) -> torch.Tensor:
    check(chunk_size == CHUNK, "chunk_gated_delta_rule", f"only chunk_size={CHUNK} is implemented, got {chunk_size}")
    return _chunk_forward(q, k, v, g, beta, gates_in_kernel=False, A_log=None, dt_bias=None, scale=scale,
                          cu_seqlens=cu_seqlens, ssm_state=ssm_state, state_indices=state_indices,
                          has_initial_state=has_initial_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                          config=config, op="chunk_gated_delta_rule")


def gdn_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    *, A_log: torch.Tensor, dt_bias: torch.Tensor, scale: float, cu_seqlens: torch.Tensor,
    ssm_state: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor,
    config: ChunkConfig | None = None,
) -> torch.Tensor:
    return _chunk_forward(q, k, v, a, b, gates_in_kernel=True, A_log=A_log, dt_bias=dt_bias, scale=scale,
                          cu_seqlens=cu_seqlens, ssm_state=ssm_state, state_indices=state_indices,
                          has_initial_state=has_initial_state, use_qk_l2norm_in_kernel=True, config=config,
                          op="gdn_prefill")
