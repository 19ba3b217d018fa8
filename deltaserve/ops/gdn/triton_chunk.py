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

The inverse: the four 16x16 diagonal blocks D of (I + A) are inverted by forward substitution (15
steps on a [4, 16, 16] tile), and with M = D^-1 N (N the strictly block-lower part, M^4 = 0),
(I + A)^-1 = (I - M + M^2 - M^3) D^-1 -- four 64^3 products on the tensor cores.

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
    L2NORM_EPS, check, check_head_dim, check_index, check_last_contiguous, check_pool, check_same_device,
    locate_chunk, next_pow2, sigmoid, softplus,
)

CHUNK = 64


@dataclasses.dataclass(frozen=True)
class ChunkConfig:
    """Launch and precision choices of the chunked prefill.

    bv: state columns per program of kernel 2; prec: operand precision of kernel 2's products
    ("bf16": operands rounded to bf16, fp32 accumulate -- FLA's choice; "tf32"; "ieee" exact fp32);
    solve_prec: precision of the 64^3 products forming the inverse (fp32 operands).
    """

    bv: int = 32
    warps_prep: int = 4
    warps_state: int = 4
    stages_state: int = 1
    prec: str = "bf16"
    solve_prec: str = "tf32"


def default_chunk_config(num_seqs: int, num_v_heads: int, v: int, dtype: torch.dtype) -> ChunkConfig:
    exact = dtype == torch.float32  # fp32 activations: keep every product in fp32
    # enough (sequence, head, slice) programs to fill the GPU, wide slices when batched
    bv = 64 if num_seqs * num_v_heads >= 256 else 32
    return ChunkConfig(bv=min(bv, v), prec="ieee" if exact else "bf16", solve_prec="ieee" if exact else "tf32")


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    if PREC == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)


@triton.jit
def _unit_lower_inverse(A, BT: tl.constexpr, PREC: tl.constexpr):
    """(I + A)^-1 for a strictly lower-triangular fp32 [BT, BT] tile (BT = 64, 16x16 diagonal blocks)."""
    SB: tl.constexpr = 16
    NB: tl.constexpr = BT // SB
    A4 = tl.reshape(A, (NB, SB, NB, SB))
    b1 = tl.arange(0, NB)[:, None, None, None]
    b2 = tl.arange(0, NB)[None, None, :, None]
    Ad = tl.sum(tl.where(b1 == b2, A4, 0.0), axis=2)                       # [NB, SB, SB] diagonal blocks
    ii = tl.arange(0, SB)[None, :, None]
    jj = tl.arange(0, SB)[None, None, :]
    Td = tl.where(ii == jj, 1.0, 0.0) + tl.zeros([NB, SB, SB], dtype=tl.float32)
    for i in range(1, SB):
        a = tl.sum(tl.where(ii == i, Ad, 0.0), axis=1)                     # row i of each block: [NB, SB]
        new = -tl.sum(a[:, :, None] * Td, axis=1)                          # -sum_j A[i, j] Tinv[j, :]
        Td = tl.where(ii == i, new[:, None, :] + tl.where(jj == i, 1.0, 0.0), Td)
    Dinv = tl.reshape(tl.where(b1 == b2, Td[:, :, None, :], 0.0), (BT, BT))
    r = tl.arange(0, BT)
    same_block = (r[:, None] // SB) == (r[None, :] // SB)
    M = tl.dot(Dinv, tl.where(same_block, 0.0, A), input_precision=PREC)
    M2 = tl.dot(M, M, input_precision=PREC)
    M3 = tl.dot(M2, M, input_precision=PREC)
    Y = tl.where(r[:, None] == r[None, :], 1.0, 0.0) - M + M2 - M3
    return tl.dot(Y, Dinv, input_precision=PREC)


@triton.jit
def _chunk_prep_kernel(
    q, k, s_q_t, s_q_h, s_k_t, s_k_h,
    g, beta, s_g_t, s_b_t, A_log, dt_bias,
    cu, N, Tb, Pb, Gb, Bb, rq_b, rk_b, scale, HK, HV,
    R: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BLOCK_N: tl.constexpr, L2NORM: tl.constexpr,
    GATES: tl.constexpr, QK_PREC: tl.constexpr, SOLVE_PREC: tl.constexpr,
):
    p = tl.program_id(0)
    hk = tl.program_id(1)
    n, c, bos, eos = locate_chunk(cu, N, p, BT, BLOCK_N)
    t0 = bos + c * BT
    rows = tl.arange(0, BT)
    rm = rows < eos - t0
    tok = (t0 + rows).to(tl.int64)
    ok = tl.arange(0, K)
    kk = tl.load(k + tok[:, None] * s_k_t + hk * s_k_h + ok[None, :], mask=rm[:, None], other=0.0)
    qq = tl.load(q + tok[:, None] * s_q_t + hk * s_q_h + ok[None, :], mask=rm[:, None], other=0.0)
    if L2NORM:
        kf = kk.to(tl.float32)
        qf = qq.to(tl.float32)
        rk = tl.rsqrt(tl.sum(kf * kf, axis=1) + 1e-6)
        rq = tl.rsqrt(tl.sum(qf * qf, axis=1) + 1e-6)
    else:
        rk = tl.full([BT], 1.0, tl.float32)
        rq = tl.full([BT], 1.0, tl.float32)
    tl.store(rk_b + tok * HK + hk, rk, mask=rm)
    tl.store(rq_b + tok * HK + hk, rq, mask=rm)
    if QK_PREC == "native":
        KK = tl.dot(kk, tl.trans(kk))
        QK = tl.dot(qq, tl.trans(kk))
    else:
        KK = tl.dot(kk, tl.trans(kk), input_precision=QK_PREC)
        QK = tl.dot(qq, tl.trans(kk), input_precision=QK_PREC)
    KK = KK * rk[:, None] * rk[None, :]
    QK = QK * (rq * scale)[:, None] * rk[None, :]
    ri = rows[:, None]
    ci = rows[None, :]
    for jh in range(R):
        hv = hk * R + jh
        if GATES:
            av = tl.load(g + tok * s_g_t + hv, mask=rm, other=0.0).to(tl.float32)
            bv = tl.load(beta + tok * s_b_t + hv, mask=rm, other=0.0).to(tl.float32)
            gv = -tl.exp(tl.load(A_log + hv).to(tl.float32)) * softplus(av + tl.load(dt_bias + hv).to(tl.float32))
            bv = sigmoid(bv)
        else:
            gv = tl.load(g + tok * s_g_t + hv, mask=rm, other=0.0).to(tl.float32)
            bv = tl.load(beta + tok * s_b_t + hv, mask=rm, other=0.0).to(tl.float32)
        gv = tl.where(rm, gv, 0.0)
        bv = tl.where(rm, bv, 0.0)
        G = tl.cumsum(gv, axis=0)
        tl.store(Gb + tok * HV + hv, G, mask=rm)
        tl.store(Bb + tok * HV + hv, bv, mask=rm)
        # exp(G_i - G_j) on and below the diagonal only: the difference is taken before the exp and
        # masked first, so no exp(+large) -> inf (and no 0 * inf) can appear
        E = tl.exp(tl.where(ri >= ci, G[:, None] - G[None, :], float("-inf")))
        A = tl.where(ri > ci, bv[:, None] * KK * E, 0.0)
        Tm = _unit_lower_inverse(A, BT, SOLVE_PREC)
        out = (tok[:, None] * HV + hv) * BT + ci
        tl.store(Tb + out, Tm.to(Tb.dtype.element_ty), mask=rm[:, None])
        tl.store(Pb + out, (QK * E).to(Pb.dtype.element_ty), mask=rm[:, None])


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
        qq = tl.load(q + tok[:, None] * s_q_t + hk * s_q_h + ok[None, :], mask=rm[:, None], other=0.0)
        vv = tl.load(v + tok[:, None] * s_v_t + hv * s_v_h + ov[None, :], mask=rm[:, None], other=0.0)
        G = tl.load(Gb + tok * HV + hv, mask=rm, other=0.0)
        bt = tl.load(Bb + tok * HV + hv, mask=rm, other=0.0)
        rk = tl.load(rk_b + tok * HK + hk, mask=rm, other=0.0)
        rq = tl.load(rq_b + tok * HK + hk, mask=rm, other=0.0)
        mat = (tok[:, None] * HV + hv) * BT + rows[None, :]
        Tm = tl.load(Tb + mat, mask=rm[:, None], other=0.0)
        Pm = tl.load(Pb + mat, mask=rm[:, None], other=0.0)
        g_last = tl.sum(tl.where(rows == tl.minimum(left, BT) - 1, G, 0.0), axis=0)
        eG = tl.exp(G)
        KS = _dot(kk, S, PREC) * (rk * eG)[:, None]
        Vn = _dot(Tm, bt[:, None] * (vv.to(tl.float32) - KS), PREC)
        O = _dot(qq, S, PREC) * (rq * eG * scale)[:, None] + _dot(Pm, Vn, PREC)
        tl.store(o + tok[:, None] * (HV * V) + hv * V + ov[None, :],
                 tl.where(live, O, 0.0).to(o.dtype.element_ty), mask=rm[:, None])
        d = tl.where(rm, tl.exp(g_last - G) * rk, 0.0)
        S = S * tl.exp(g_last) + _dot(tl.trans(kk), Vn * d[:, None], PREC)
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
          f"{'a and b' if gates_in_kernel else 'g and beta'} must be [{T}, {HV}], got {tuple(g.shape)}, {tuple(beta.shape)}")
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
    mat_dtype = f32 if cfg.prec != "bf16" else torch.bfloat16
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
        dt_bias if gates_in_kernel else dummy, cu_seqlens, N, bufs["Tb"], bufs["Pb"], bufs["Gb"], bufs["Bb"],
        bufs["rq"], bufs["rk"], float(scale), HK, HV,
        R=HV // HK, K=K, BT=CHUNK, BLOCK_N=max(16, next_pow2(N)), L2NORM=bool(l2norm),
        GATES=bool(gates_in_kernel), QK_PREC="ieee" if q.dtype == torch.float32 else "native",
        SOLVE_PREC=cfg.solve_prec, num_warps=cfg.warps_prep)
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
