"""The chunked prefill's chain (FLA's chunk_fwd_h and chunk_fwd_o in one kernel): one program per (sequence,
value head, slice of bv state columns) walks the sequence's chunks in order with its fp32 [K, bv] state slice S in
registers. Two dependent products per chunk, and the output off that chain:

    V_new = U - W S;   O = e^G rq (Q S) + P V_new;   S <- e^(G_last) S + K^T (e^(G_last - G) rk V_new)

from the prep's buffers (`triton_prep`). The initial state is read from the pool slot (zero without one) and
the final state written back in place; padded sequences (slot < 0) write zeros and no state.

Operand precision (ChunkConfig.prec, always fp32 accumulation): "bf16x2" splits the fp32 operand of the chain's
products (S in W S, V_new in K^T V_new) into two bf16 limbs against the bf16 W / K (twice the MMA count at bf16
rate); the output products (Q S, P V_new) use one limb (the output is bf16). "ieee" (fp32 activations) is exact.

Loads that feed products carry only row masks (constant along the contiguous dimension): P is stored with
explicit zeros above the diagonal instead of being masked element-wise (a triangle-masked load computed wrong
values on the H200 while exact under the interpreter). On sm_90 the chunk layout's chain is the Gluon kernel
(`gluon_chain`, `gluon_chain_t`; dispatch.ChunkConfig.chain).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import gluon_chain, gluon_chain_t
from .dispatch import CHUNK, ChunkConfig


@triton.jit
def _mmx(a, b, PREC: tl.constexpr):
    """a @ b with fp32 accumulation; a is W, K^T, Q or P (already in its operand dtype), b is fp32."""
    if PREC == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif PREC == "bf16x2":
        hi = b.to(tl.bfloat16)
        lo = (b - hi.to(tl.float32)).to(tl.bfloat16)
        a16 = a.to(tl.bfloat16)
        return tl.dot(a16, lo, tl.dot(a16, hi))
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)


@triton.jit
def _state_slice(cu, idx, has_init, ssm, HV, R: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    """A chain program's (sequence n, value head hv, key head hk) from its grid position, the sequence's bounds,
    whether its slot is live, and its [K, BV] state slice (pointers and the initial values: zero without an
    initial state or for a padded row)."""
    j = tl.program_id(0)
    nh = tl.program_id(1)
    n = nh // HV
    hv = nh % HV
    bos = tl.load(cu + n).to(tl.int32)
    L = tl.load(cu + n + 1).to(tl.int32) - bos
    slot = tl.load(idx + n).to(tl.int64)
    live = slot >= 0
    init = tl.load(has_init + n) != 0
    ok = tl.arange(0, K)
    ov = j * BV + tl.arange(0, BV)
    sp = ssm + slot * (HV * K * V) + hv * (K * V) + ok[:, None] * V + ov[None, :]
    S = tl.load(sp, mask=(ok[:, None] >= 0) & live & init, other=0.0)
    return n, hv, hv // R, bos, L, live, ok, ov, sp, S


@triton.jit
def _chain_kernel(
    q, k, s_q_t, s_q_h, s_k_t, s_k_h, o,
    Wb, Ub, Pb, Gb, rq_b, rk_b, ssm, cu, idx, has_init, HK, HV,
    R: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    PREC: tl.constexpr, STAGES: tl.constexpr,
):
    """The chain on the token layout: W, U, P, G and the norms per token row, read with row masks."""
    OUT_PREC: tl.constexpr = "bf16" if PREC == "bf16x2" else PREC
    n, hv, hk, bos, L, live, ok, ov, sp, S = _state_slice(cu, idx, has_init, ssm, HV, R, K, V, BV)
    rows = tl.arange(0, BT)
    for c in tl.range(0, tl.cdiv(L, BT), num_stages=STAGES):
        left = L - c * BT
        rm = rows < left
        tok = (bos + c * BT + rows).to(tl.int64)
        w = tl.load(Wb + (tok[:, None] * HV + hv) * K + ok[None, :], mask=rm[:, None], other=0.0)
        u = tl.load(Ub + (tok[:, None] * HV + hv) * V + ov[None, :], mask=rm[:, None], other=0.0)
        # K^T loaded as its own tile (an L1/L2 hit) rather than tl.trans of a loaded tile
        kT = tl.load(k + tok[None, :] * s_k_t + hk * s_k_h + ok[:, None], mask=rm[None, :], other=0.0)
        qq = tl.load(q + tok[:, None] * s_q_t + hk * s_q_h + ok[None, :], mask=rm[:, None], other=0.0)
        pm = tl.load(Pb + (tok[:, None] * HV + hv) * BT + rows[None, :], mask=rm[:, None], other=0.0)
        G = tl.load(Gb + tok * HV + hv, mask=rm, other=0.0)
        rk = tl.load(rk_b + tok * HK + hk, mask=rm, other=0.0)
        rq = tl.load(rq_b + tok * HK + hk, mask=rm, other=0.0)
        g_last = tl.load(Gb + (bos + c * BT + tl.minimum(left, BT) - 1).to(tl.int64) * HV + hv)
        Vn = u - _mmx(w, S, PREC)
        # the output products leave the recurrence: one bf16 limb is enough for a bf16 output
        O = _mmx(qq, S, OUT_PREC) * (rq * tl.exp(G))[:, None] + _mmx(pm, Vn, OUT_PREC)
        tl.store(o + tok[:, None] * (HV * V) + hv * V + ov[None, :],
                 tl.where(live, O, 0.0).to(o.dtype.element_ty), mask=rm[:, None])
        d = tl.where(rm, tl.exp(g_last - G) * rk, 0.0)
        S = S * tl.exp(g_last) + _mmx(kT, Vn * d[:, None], PREC)
    tl.store(sp, S, mask=(ok[:, None] >= 0) & live & (L > 0))


@triton.jit
def _chain_tma_kernel(
    w_desc, u_desc, k_desc, q_desc, p_desc, Cb, Lb, o, ssm, cu, coff, idx, has_init, HK, HV,
    R: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    PREC: tl.constexpr, STAGES: tl.constexpr,
):
    """`_chain_kernel` on the chunk layout: W, U, K, P arrive as whole zero-padded chunk tiles and Q as the
    chunk's rows of q, all through TMA descriptors (one async copy per tile, no masks, no per-element addresses),
    and the decay factors come precomputed. Q rows past the sequence belong to the next one (or are TMA's zero
    fill past T); they only reach output rows that are not stored."""
    OUT_PREC: tl.constexpr = "bf16" if PREC == "bf16x2" else PREC
    n, hv, hk, bos, L, live, ok, ov, sp, S = _state_slice(cu, idx, has_init, ssm, HV, R, K, V, BV)
    c0 = tl.load(coff + n).to(tl.int32)
    rows = tl.arange(0, BT)
    for c in tl.range(0, tl.cdiv(L, BT), num_stages=STAGES):
        ch = c0 + c
        row = (ch * HV + hv) * BT
        w = w_desc.load([row, 0])
        u = u_desc.load([row, tl.program_id(0) * BV])
        kk = k_desc.load([(ch * HK + hk) * BT, 0])
        qq = q_desc.load([bos + c * BT, hk * K])
        pm = p_desc.load([row, 0])
        f = Cb + (ch * HV + hv).to(tl.int64) * (2 * BT) + rows
        d = tl.load(f)
        eq = tl.load(f + BT)
        decay = tl.load(Lb + (ch * HV + hv))
        Vn = u - _mmx(w, S, PREC)
        O = _mmx(qq, S, OUT_PREC) * eq[:, None] + _mmx(pm, Vn, OUT_PREC)
        tok = (bos + c * BT + rows).to(tl.int64)
        tl.store(o + tok[:, None] * (HV * V) + hv * V + ov[None, :],
                 tl.where(live, O, 0.0).to(o.dtype.element_ty), mask=(rows < L - c * BT)[:, None])
        S = S * decay + _mmx(tl.trans(kk), Vn * d[:, None], PREC)
    tl.store(sp, S, mask=(ok[:, None] >= 0) & live & (L > 0))


def launch_chain(q, k, v, o, bufs, cu_seqlens, ssm_state, state_indices, has_initial_state, cfg: ChunkConfig) -> None:
    """The chain for cfg on the prep's buffers `bufs` (`triton_prep.launch_prep`), writing o and the pool."""
    HK, K = q.shape[1:]
    HV, V = v.shape[1:]
    N = state_indices.shape[0]
    has_init = has_initial_state if has_initial_state.dtype != torch.bool else has_initial_state.view(torch.uint8)
    if cfg.chain == "gluon_t":
        gluon_chain_t.launch_chain_t(q, o, bufs, cu_seqlens, ssm_state, state_indices, has_init,
                                     consumers=cfg.bv // gluon_chain_t.COLS)
    elif cfg.chain == "gluon":
        gluon_chain.launch_chain(q, o, bufs, cu_seqlens, ssm_state, state_indices, has_init, cfg.bv)
    elif cfg.layout == "chunk":
        T = q.shape[0]
        aligned = q.data_ptr() % 16 == 0 and q.stride(0) * q.element_size() % 16 == 0
        # TMA reads a row's heads as one [HK * K] row: they must be contiguous, the rows 16-byte aligned
        q2 = q if aligned and q.stride(1) == K and q.stride(2) == 1 else q.contiguous()
        _chain_tma_kernel[(V // cfg.bv, N * HV)](
            TensorDescriptor.from_tensor(bufs["Wb"], [CHUNK, K]),
            TensorDescriptor.from_tensor(bufs["Ub"], [CHUNK, cfg.bv]),
            TensorDescriptor.from_tensor(bufs["Kb"], [CHUNK, K]),
            TensorDescriptor(q2, [T, HK * K], [q2.stride(0), 1], [CHUNK, K]),
            TensorDescriptor.from_tensor(bufs["Pb"], [CHUNK, CHUNK]),
            bufs["Cb"], bufs["Lb"], o, ssm_state, cu_seqlens, bufs["coff"], state_indices, has_init, HK, HV,
            R=HV // HK, K=K, V=V, BV=cfg.bv, BT=CHUNK, PREC=cfg.prec, STAGES=cfg.state_stages(), num_warps=4)
    else:
        _chain_kernel[(V // cfg.bv, N * HV)](
            q, k, q.stride(0), q.stride(1), k.stride(0), k.stride(1), o,
            bufs["Wb"], bufs["Ub"], bufs["Pb"], bufs["Gb"], bufs["rq"], bufs["rk"], ssm_state, cu_seqlens,
            state_indices, has_init, HK, HV,
            R=HV // HK, K=K, V=V, BV=cfg.bv, BT=CHUNK, PREC=cfg.prec, STAGES=cfg.state_stages(), num_warps=4)
