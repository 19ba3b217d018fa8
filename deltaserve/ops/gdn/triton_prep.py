"""The chunked prefill's prep (FLA's chunk_local_cumsum + the kkt / solve_tril / wy_fast stages in one launch),
one program per (chunk of 64 tokens, value head), on whole-chunk tiles:

    the q / k inverse norms rq (times scale), rk; the gates (optionally from their pre-activations);
    G = the chunk-local cumulative log decay; E_ij = exp(G_i - G_j) on and below the diagonal;
    P = (Q^ K^T) * E (zeros above the diagonal);  A = strictly_lower(diag(beta) K^ K^T * E);
    T = (I + A)^-1 (never stored, `triton_ut`);  W = T diag(beta e^G rk) K;  U = T diag(beta) V.

The norms are never applied to q and k: the raw bf16 rows are exact dot operands and the norms scale the
products; the diagonal factors scale T's columns for the same reason. W and U take T as two bf16 limbs (~16
mantissa bits) against the exact bf16 rows ("bf16x2"; FLA rounds T, W and U to bf16). ChunkConfig.prep picks
`_prep_blocks_kernel` (any head dims) or `_prep_wide_kernel` (bf16 at head dims 128); on sm_90 with a Gluon chain
`gluon_prep` computes the same buffers bit for bit. ChunkConfig.layout stores the products per token ("token")
or per chunk, zero-padded to 64 rows with the chain's decay factors ("chunk", read by TMA in `triton_chain`).

Padding rows load as zeros and are masked before any exp, so no inf or NaN can arise from them; chunks never
cross sequence boundaries. Host work is shape-only (the grid is bounded by cdiv(T, 64) + N; the chunk -> sequence
map is computed on the device), so the launch is CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..triton_common import given_chunk_offsets, locate_chunk, next_pow2, sigmoid, softplus
from . import gluon_prep
from .dispatch import CHUNK, ChunkConfig
from .triton_ut import LOG2E, decay_tile, load_chunk_rows, rstd_from_gram, ut_inverse_blocks, ut_inverse_wide

# The wide prep's register cap: three programs per SM instead of two (spills of a few scalars held across the
# inverse cost less than the third program gains).
WIDE_PREP_MAXNREG = 168


def operand_dtype(prec: str) -> torch.dtype:
    """dtype of the W and P buffers: the A operand of the chain's products."""
    return torch.bfloat16 if prec.startswith("bf16") else torch.float32


@triton.jit
def _cumsum(g, SB: tl.constexpr):
    """Inclusive prefix sum of a [SB] vector as a masked row sum (no scan)."""
    r = tl.arange(0, SB)
    return tl.sum(tl.where(r[None, :] <= r[:, None], g[None, :], 0.0), axis=1)


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
def _gram(a, b, PREC: tl.constexpr):
    """a_i . b_j of raw rows: exact products (bf16 operands), fp32 accumulation; norms applied after."""
    if PREC == "native":
        return tl.dot(a, tl.trans(b))
    else:
        return tl.dot(a, tl.trans(b), input_precision=PREC)


@triton.jit
def _gates(g, beta, s_g_t, s_b_t, A_log, dt_bias, tok, m, hv, GATES: tl.constexpr):
    """g and beta of the rows `tok` (zero where not m); GATES: from the pre-activations a, b (gdn_prefill)."""
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
def _dot_raw(a, b, PREC: tl.constexpr):
    """a @ b for an fp32 tile a and raw activation rows b. "bf16x2": a as two bf16 limbs (hi + lo, ~16
    mantissa bits) against the exact bf16 b, two bf16 tensor-core passes with bf16-sized shared-memory
    operands; otherwise b is widened to fp32 and PREC is the dot's input precision."""
    if PREC == "bf16x2":
        hi = a.to(tl.bfloat16)
        lo = (a - hi.to(tl.float32)).to(tl.bfloat16)
        return tl.dot(hi, b, tl.dot(lo, b))
    else:
        return tl.dot(a, b.to(tl.float32), input_precision=PREC)


@triton.jit(do_not_specialize=["N"])
def _prep_blocks_kernel(
    q, k, v, s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h,
    g, beta, s_g_t, s_b_t, A_log, dt_bias,
    coff, cu, N, Wb, Ub, Pb, Gb, rq_b, rk_b, scale, HK, HV,
    R: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BLOCK_N: tl.constexpr,
    L2NORM: tl.constexpr, GATES: tl.constexpr, QK_PREC: tl.constexpr, MERGE_PREC: tl.constexpr,
    WU_PREC: tl.constexpr,
):
    """The "blocks" prep on the token layout: W, U, P per token row ([T, HV, ...]), G per token and value head,
    the norms per token and key head; the inverse by `ut_inverse_blocks`."""
    p = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // R
    n, c, bos, eos = locate_chunk(coff, cu, N, p, BLOCK_N)
    t0 = bos + c * BT
    rows = tl.arange(0, BT)
    m = rows < eos - t0
    tok = (t0 + rows).to(tl.int64)
    srow = tok * HV + hv
    kraw = _load_rows(k, tok, m, s_k_t, hk * s_k_h, K)
    rk = _rstd(kraw, L2NORM)
    gv, bt = _gates(g, beta, s_g_t, s_b_t, A_log, dt_bias, tok, m, hv, GATES)
    G = _cumsum(gv, BT)
    tl.store(Gb + tok * HV + hv, G, mask=m)
    # exp(G_i - G_j) on and below the diagonal, masked before the exp (no exp(+x) overflow)
    E = tl.exp(tl.where(rows[:, None] >= rows[None, :], G[:, None] - G[None, :], float("-inf")))
    qraw = _load_rows(q, tok, m, s_q_t, hk * s_q_h, K)
    rq = _rstd(qraw, L2NORM) * scale
    if hv % R == 0:  # the norms are per key head: one of its value heads stores them
        tl.store(rq_b + tok * HK + hk, rq, mask=m)
        tl.store(rk_b + tok * HK + hk, rk, mask=m)
    Pm = _gram(qraw, kraw, QK_PREC) * (rq[:, None] * rk[None, :]) * E
    tl.store(Pb + srow[:, None] * BT + rows[None, :], Pm.to(Pb.dtype.element_ty), mask=m[:, None])
    KK = _gram(kraw, kraw, QK_PREC)
    A = tl.where(rows[:, None] > rows[None, :], KK * ((bt * rk)[:, None] * rk[None, :]) * E, 0.0)
    T = ut_inverse_blocks(A, BT, MERGE_PREC)
    Tw = T * (bt * tl.exp(G) * rk)[None, :]
    ok = tl.arange(0, K)
    W = _dot_raw(Tw, kraw, WU_PREC)
    tl.store(Wb + srow[:, None] * K + ok[None, :], W.to(Wb.dtype.element_ty), mask=m[:, None])
    Tu = T * bt[None, :]
    ov = tl.arange(0, V)
    vc = tl.load(v + tok[:, None] * s_v_t + hv * s_v_h + ov[None, :], mask=m[:, None], other=0.0)
    tl.store(Ub + srow[:, None] * V + ov[None, :], _dot_raw(Tu, vc, WU_PREC), mask=m[:, None])


@triton.jit(do_not_specialize=["N"])
def _prep_wide_kernel(
    q, k, v, s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h,
    g, beta, s_g_t, s_b_t, A_log, dt_bias,
    coff, cu, N, Wb, Ub, Pb, Gb, rq_b, rk_b, Kb, Cb, Lb, scale, HK, HV,
    k_desc, q_desc, v_desc, w_desc, u_desc, p_desc,
    R: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BLOCK_N: tl.constexpr,
    L2NORM: tl.constexpr, GATES: tl.constexpr, QK_PREC: tl.constexpr, WU_PREC: tl.constexpr,
    CHUNKED: tl.constexpr, UT_PREC: tl.constexpr, HEADS_FIRST: tl.constexpr, TMA_LOAD: tl.constexpr = False,
    TMA_STORE: tl.constexpr = False, U_FACTOR: tl.constexpr = False, K_FROM_INPUT: tl.constexpr = False,
):
    """The "wide" prep (`_prep_wide_program`). HEADS_FIRST: the grid is (HV, chunks), so the value heads of a chunk
    run side by side and share their q / k rows and gate lines in L2. TMA_LOAD: k / q / v by TMA, only for a chunk
    whose 64 rows all belong to its sequence (a partial last chunk's tile would bring in the next sequence's rows,
    whose inf / NaN no zero weight removes: 0 x inf), so such a chunk takes the pointer loads; two whole program
    bodies, no tile crossing the branch, so the TMA tiles stay in shared memory."""
    p = tl.program_id(1 if HEADS_FIRST else 0)
    hv = tl.program_id(0 if HEADS_FIRST else 1)
    n, c, bos, eos = locate_chunk(coff, cu, N, p, BLOCK_N)
    t0 = bos + c * BT
    if TMA_LOAD:
        if eos - t0 >= BT:
            _prep_wide_program(q, k, v, s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h, g, beta, s_g_t, s_b_t, A_log,
                               dt_bias, t0, eos, Wb, Ub, Pb, Gb, rq_b, rk_b, Kb, Cb, Lb, scale, HK, HV, p, hv,
                               k_desc, q_desc, v_desc, w_desc, u_desc, p_desc, R, K, V, BT, L2NORM, GATES, QK_PREC,
                               WU_PREC, CHUNKED, UT_PREC, True, TMA_STORE, U_FACTOR, K_FROM_INPUT)
        else:
            _prep_wide_program(q, k, v, s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h, g, beta, s_g_t, s_b_t, A_log,
                               dt_bias, t0, eos, Wb, Ub, Pb, Gb, rq_b, rk_b, Kb, Cb, Lb, scale, HK, HV, p, hv,
                               k_desc, q_desc, v_desc, w_desc, u_desc, p_desc, R, K, V, BT, L2NORM, GATES, QK_PREC,
                               WU_PREC, CHUNKED, UT_PREC, False, TMA_STORE, U_FACTOR, K_FROM_INPUT)
    else:
        _prep_wide_program(q, k, v, s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h, g, beta, s_g_t, s_b_t, A_log, dt_bias,
                           t0, eos, Wb, Ub, Pb, Gb, rq_b, rk_b, Kb, Cb, Lb, scale, HK, HV, p, hv,
                           k_desc, q_desc, v_desc, w_desc, u_desc, p_desc, R, K, V, BT, L2NORM, GATES, QK_PREC,
                           WU_PREC, CHUNKED, UT_PREC, False, TMA_STORE, U_FACTOR, K_FROM_INPUT)


@triton.jit
def _prep_wide_program(q, k, v, s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h, g, beta, s_g_t, s_b_t, A_log, dt_bias,
                       t0, eos, Wb, Ub, Pb, Gb, rq_b, rk_b, Kb, Cb, Lb, scale, HK, HV, p, hv,
                       k_desc, q_desc, v_desc, w_desc, u_desc, p_desc, R: tl.constexpr,
                       K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, L2NORM: tl.constexpr,
                       GATES: tl.constexpr, QK_PREC: tl.constexpr, WU_PREC: tl.constexpr, CHUNKED: tl.constexpr,
                       UT_PREC: tl.constexpr, TMA_LOAD: tl.constexpr, TMA_STORE: tl.constexpr,
                       U_FACTOR: tl.constexpr, K_FROM_INPUT: tl.constexpr):
    """One (chunk, value head) of the wide prep: every global load (k, q, the gates, v) issued before the first
    product (one memory round trip, not four), the norms from the Gram products' diagonals, the key norms folded
    into the decay tile's exponent, the inverse by `ut_inverse_wide`. The chunk starts at token t0 of a sequence
    ending at eos.
    TMA_STORE (chunk layout): W, U and P leave by TMA stores of whole tiles.
    U_FACTOR (a Gluon chain, chunk layout): instead of U, its factor T diag(beta) as two bf16 limbs (hi in columns
    0..63, lo in 64..127 of Ub's row); the chain forms U = hi V + lo V itself, so v is not read here.
    K_FROM_INPUT (a Gluon chain): the chain reads a whole chunk's K rows from k, so the TMA body stores no K copy
    (the pointer body, a sequence's partial last chunk, still does: its padded rows are what the chain reads)."""
    hk = hv // R
    rows = tl.arange(0, BT)
    m = rows < eos - t0
    tok = (t0 + rows).to(tl.int64)
    if TMA_LOAD:  # each TMA load waits for its data where it stands: the gates' loads first, in flight meanwhile
        gv, bt = _gates(g, beta, s_g_t, s_b_t, A_log, dt_bias, tok, m, hv, GATES)
        kraw = k_desc.load([t0, hk * K])
        qraw = q_desc.load([t0, hk * K])
        if not U_FACTOR:
            vraw = v_desc.load([t0, hv * V])
    else:
        kraw = load_chunk_rows(k, t0, m, s_k_t, hk * s_k_h, 0, K, BT)
        qraw = load_chunk_rows(q, t0, m, s_q_t, hk * s_q_h, 0, K, BT)
        gv, bt = _gates(g, beta, s_g_t, s_b_t, A_log, dt_bias, tok, m, hv, GATES)
        if not U_FACTOR:
            vraw = load_chunk_rows(v, t0, m, s_v_t, hv * s_v_h, 0, V, BT)
    KK = _gram(kraw, kraw, QK_PREC)
    rk = rstd_from_gram(KK, L2NORM, BT)
    rq = rstd_from_gram(_gram(qraw, qraw, QK_PREC), L2NORM, BT) * scale
    if CHUNKED:
        srow = (p.to(tl.int64) * HV + hv) * BT + rows
        sm = rows >= 0
    else:
        srow = tok * HV + hv
        sm = m
    G = tl.cumsum(gv, 0)
    if not CHUNKED:
        tl.store(Gb + tok * HV + hv, G, mask=m)
    E = decay_tile(G, tl.log2(rk), BT)
    if CHUNKED:
        _store_chunk_factors(Kb, Cb, Lb, kraw, G, rk, rq, m, p, hv, hk, HK, HV, R, K, BT, not TMA_LOAD)
        if TMA_LOAD and hv % R == 0 and not K_FROM_INPUT:  # the padded K copy from k's rows in L2 (kraw: smem)
            _store_k_rows(Kb, load_chunk_rows(k, t0, m, s_k_t, hk * s_k_h, 0, K, BT), p, hk, HK, K, BT)
    elif hv % R == 0:
        tl.store(rq_b + tok * HK + hk, rq, mask=m)
        tl.store(rk_b + tok * HK + hk, rk, mask=m)
    Pm = _gram(qraw, kraw, QK_PREC) * rq[:, None] * E
    if TMA_STORE and CHUNKED:
        p_desc.store([((p * HV + hv) * BT).to(tl.int32), 0], Pm.to(p_desc.dtype))
    else:
        tl.store(Pb + srow[:, None] * BT + rows[None, :], Pm.to(Pb.dtype.element_ty), mask=sm[:, None])
    A = tl.where(rows[:, None] > rows[None, :], KK * (bt * rk)[:, None] * E, 0.0)
    T = ut_inverse_wide(A, BT, UT_PREC)
    Tw = T * (bt * tl.exp2(G * LOG2E) * rk)[None, :]
    ok = tl.arange(0, K)
    W = _dot_raw(Tw, kraw, WU_PREC)
    if TMA_STORE and CHUNKED:
        w_desc.store([((p * HV + hv) * BT).to(tl.int32), 0], W.to(w_desc.dtype))
    else:
        tl.store(Wb + srow[:, None] * K + ok[None, :], W.to(Wb.dtype.element_ty), mask=sm[:, None])
    Tu = T * bt[None, :]
    if U_FACTOR:  # the limbs _dot_raw("bf16x2") would multiply v by
        hi = Tu.to(tl.bfloat16)
        lo = (Tu - hi.to(tl.float32)).to(tl.bfloat16)
        if TMA_STORE:
            u_desc.store([((p * HV + hv) * BT).to(tl.int32), 0], hi)
            u_desc.store([((p * HV + hv) * BT).to(tl.int32), BT], lo)
        else:
            tl.store(Ub + srow[:, None] * (2 * BT) + rows[None, :], hi)
            tl.store(Ub + srow[:, None] * (2 * BT) + BT + rows[None, :], lo)
    else:
        ov = tl.arange(0, V)
        U = _dot_raw(Tu, vraw, WU_PREC)
        if TMA_STORE and CHUNKED:
            u_desc.store([((p * HV + hv) * BT).to(tl.int32), 0], U)
        else:
            tl.store(Ub + srow[:, None] * V + ov[None, :], U, mask=sm[:, None])


@triton.jit
def _store_chunk_factors(Kb, Cb, Lb, kraw, G, rk, rq, m, p, hv, hk, HK, HV, R: tl.constexpr, K: tl.constexpr,
                         BT: tl.constexpr, STORE_K: tl.constexpr = True):
    """The chunk layout's per-chunk factors: d = e^(G_last - G) rk (zero past the sequence) and e^G rq (Cb,
    [chunks, HV, 2, 64]), e^G_last (Lb, [chunks, HV]); G_last is G's last row (the gates past the sequence are
    zero, so the cumulative sum stays at the last token's value); with STORE_K the zero-padded K rows too (one
    value head of each key head stores them)."""
    rows = tl.arange(0, BT)
    ch = p.to(tl.int64) * HV + hv
    g_last = tl.sum(tl.where(rows == BT - 1, G, 0.0), 0)
    tl.store(Cb + ch * (2 * BT) + rows, tl.where(m, tl.exp(g_last - G) * rk, 0.0))
    tl.store(Cb + ch * (2 * BT) + BT + rows, tl.exp(G) * rq)
    tl.store(Lb + ch, tl.exp(g_last))
    if STORE_K and hv % R == 0:  # K is per key head: one of its value heads stores the padded rows
        _store_k_rows(Kb, kraw, p, hk, HK, K, BT)


@triton.jit
def _store_k_rows(Kb, kraw, p, hk, HK, K: tl.constexpr, BT: tl.constexpr):
    """The chunk's zero-padded K rows (the chunk layout's Kb, per key head)."""
    rows = tl.arange(0, BT)
    ok = tl.arange(0, K)
    tl.store(Kb + ((p.to(tl.int64) * HK + hk) * BT + rows)[:, None] * K + ok[None, :], kraw)


def tma_rows(x: torch.Tensor) -> bool:
    """Whether TMA can read x [T, H, D] as one [T, H * D] row per token: heads contiguous, the base and the row
    stride 16-byte aligned."""
    e = x.element_size()
    return (x.stride(2) == 1 and x.stride(1) == x.shape[2] and x.data_ptr() % 16 == 0
            and (x.stride(0) * e) % 16 == 0)


def _wide_descriptors(q, k, v, bufs, cfg: ChunkConfig, dummy) -> tuple:
    """The wide prep's TMA descriptors (k, q, v where TMA can read all three; W, U, P in the chunk layout; `dummy`
    for the others). Host-built, addresses and shapes only (CUDA-graph safe)."""
    out = [dummy] * 6
    if all(tma_rows(x) for x in (q, k, v)):
        out[:3] = [TensorDescriptor(x, [x.shape[0], x.shape[1] * x.shape[2]], [x.stride(0), 1], [CHUNK, x.shape[2]])
                   for x in (k, q, v)]
    if cfg.layout == "chunk":  # U's factor leaves as two [64, 64] limb tiles
        out[3:] = [TensorDescriptor.from_tensor(bufs[b], [CHUNK, CHUNK if b == "Ub" and cfg.gluon
                                                          else bufs[b].shape[1]]) for b in ("Wb", "Ub", "Pb")]
    return tuple(out)


def launch_prep(q, k, v, g, beta, gates_in_kernel, A_log, dt_bias, scale, cu_seqlens, N, l2norm,
                cfg: ChunkConfig, chunk_offsets: torch.Tensor | None = None) -> dict:
    """Allocate the prep's buffers for cfg.layout and fill them (module docstring); returns them by name (plus
    coff, the chunk offsets: the caller's chunk_offsets, computed once per step, or computed here; with a Gluon
    chain "v" and, where whole chunks' K rows come from k, "k")."""
    T, HK, K = q.shape
    HV, V = v.shape[1:]
    dev = q.device
    f32 = torch.float32
    op_dtype = operand_dtype(cfg.prec)
    if cfg.layout == "chunk":  # per chunk, zero-padded to CHUNK rows; cdiv(T, CHUNK) + N bounds the chunk count
        C = triton.cdiv(T, CHUNK) + N
        bufs = dict(
            Wb=torch.empty((C * HV * CHUNK, K), dtype=op_dtype, device=dev),
            # a Gluon chain: the two bf16 limbs of U's factor T diag(beta) side by side
            Ub=(torch.empty((C * HV * CHUNK, 2 * CHUNK), dtype=torch.bfloat16, device=dev) if cfg.gluon
                else torch.empty((C * HV * CHUNK, V), dtype=f32, device=dev)),
            Pb=torch.empty((C * HV * CHUNK, CHUNK), dtype=op_dtype, device=dev),
            Kb=torch.empty((C * HK * CHUNK, K), dtype=k.dtype, device=dev),
            Cb=torch.empty((C, HV, 2, CHUNK), dtype=f32, device=dev),
            Lb=torch.empty((C, HV), dtype=f32, device=dev),
        )
        dummy = bufs["Lb"]
        bufs.update(Gb=dummy, rq=dummy, rk=dummy)
        if cfg.gluon:  # the chain reads the chunk's rows of v by TMA: one [HV * V] row per token
            bufs["v"] = v if tma_rows(v) else v.contiguous()
    else:
        bufs = dict(
            Wb=torch.empty((T, HV, K), dtype=op_dtype, device=dev),
            Ub=torch.empty((T, HV, V), dtype=f32, device=dev),
            Pb=torch.empty((T, HV, CHUNK), dtype=op_dtype, device=dev),
            Gb=torch.empty((T, HV), dtype=f32, device=dev),
            rq=torch.empty((T, HK), dtype=f32, device=dev),
            rk=torch.empty((T, HK), dtype=f32, device=dev),
        )
        dummy = bufs["Gb"]
        bufs.update(Kb=dummy, Cb=dummy, Lb=dummy)
    exact = q.dtype == torch.float32
    wu_prec = "bf16x2" if q.dtype == torch.bfloat16 else "ieee" if exact else "tf32"
    qk_prec = "ieee" if exact else "native"
    coff = given_chunk_offsets("chunk_gated_delta_rule", chunk_offsets, cu_seqlens, CHUNK)
    bufs["coff"] = coff
    grid = (triton.cdiv(T, CHUNK) + N, HV)
    block_n = max(16, next_pow2(N))
    if cfg.prep == "blocks":
        _prep_blocks_kernel[grid](
            q, k, v, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            g, beta, g.stride(0), beta.stride(0), A_log if gates_in_kernel else dummy,
            dt_bias if gates_in_kernel else dummy, coff, cu_seqlens, N,
            bufs["Wb"], bufs["Ub"], bufs["Pb"], bufs["Gb"], bufs["rq"], bufs["rk"], float(scale), HK, HV,
            R=HV // HK, K=K, V=V, BT=CHUNK, BLOCK_N=block_n, L2NORM=bool(l2norm), GATES=bool(gates_in_kernel),
            QK_PREC=qk_prec, MERGE_PREC="ieee" if exact else "tf32", WU_PREC=wu_prec, num_warps=4)
        return bufs
    heads_first = grid[0] <= 65535  # the grid's second dimension
    if cfg.gluon and gluon_prep.covers(q, k, v, l2norm, tma_rows):
        bufs["k"] = k  # whole chunks' K rows come from k (the prep reads every whole chunk by TMA)
        gluon_prep.launch_prep(q, k, g, beta, gates_in_kernel, A_log, dt_bias, scale, cu_seqlens, N, bufs,
                               True, heads_first, WIDE_PREP_MAXNREG)
        return bufs
    descs = _wide_descriptors(q, k, v, bufs, cfg, dummy)
    tma_load = not isinstance(descs[0], torch.Tensor)
    if cfg.gluon and tma_load:  # the prep reads whole chunks by TMA: the chain reads their K rows from k
        bufs["k"] = k
    _prep_wide_kernel[grid[::-1] if heads_first else grid](
        q, k, v, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g, beta, g.stride(0), beta.stride(0), A_log if gates_in_kernel else dummy,
        dt_bias if gates_in_kernel else dummy, coff, cu_seqlens, N,
        bufs["Wb"], bufs["Ub"], bufs["Pb"], bufs["Gb"], bufs["rq"], bufs["rk"], bufs["Kb"], bufs["Cb"],
        bufs["Lb"], float(scale), HK, HV, *descs,
        R=HV // HK, K=K, V=V, BT=CHUNK, BLOCK_N=block_n, L2NORM=bool(l2norm), GATES=bool(gates_in_kernel),
        QK_PREC=qk_prec, WU_PREC=wu_prec, CHUNKED=cfg.layout == "chunk",
        UT_PREC="ieee" if exact else "fp16" if l2norm else "tf32", HEADS_FIRST=heads_first, TMA_LOAD=tma_load,
        TMA_STORE=not isinstance(descs[3], torch.Tensor), U_FACTOR=cfg.gluon, K_FROM_INPUT="k" in bufs,
        num_warps=4, maxnreg=WIDE_PREP_MAXNREG)
    return bufs
