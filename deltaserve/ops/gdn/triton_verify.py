"""Triton kernels of speculative verify and its commit (same signatures as reference.gdn_verify / gdn_commit,
plus an optional `config`). Verify runs a GDN layer over each sequence's draft tokens without touching the pools
and fills the stash (per token: the conv inputs, k, g and the delta rule's delta); commit then applies the first
num_accepted tokens of each sequence from the stash: one state write, no re-run of anything.

Verify has two forms, picked from the shapes (`dispatch.default_verify_config`):
- small batches, one launch (`_verify_fused_kernel`, programmatic on 9.0+): per (sequence, value head, V-slice)
  the conv, norms and gates of the sequence's tokens, the T_n delta steps and the stash, the gated norm of split
  rows by the group's last program on a per-(sequence, value head) counter (none with gated_norm=False). The
  pools are only read, so nothing else needs coordinating. RecurrentConfig.qk_prepass moves the q / k half of
  the prologue into a pre-kernel (`_verify_prep_kernel`, q / k heads only); RecurrentConfig.gram computes each
  unrolled chunk of tokens from the state it starts with and the tokens' q / k dot products (the chunked
  prefill's algebra): independent reductions over the state slice and a short scalar substitution.
- otherwise three launches: a token-parallel pre-pass (conv + SiLU, q/k L2 norms, gates of every token, once per
  head instead of once per V-slice), the recurrence over the T_n tokens, and the finish (`triton_steps`) with the
  copy of the inputs into the stash instead of the window update.
Both write the same outputs and stash (bit for bit under the interpreter; fp32 rounding of other reduction orders
on the GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..triton_common import (
    check,
    check_index,
    check_pool,
    check_same_device,
    next_pow2,
    prefetch_l2,
    sigmoid,
    silu_fast,
    softplus,
)
from .dispatch import RecurrentConfig, default_verify_config, has_pdl, verify_chunk
from .reference import VerifyStash
from .triton_steps import (
    _conv_token,
    _delta_step,
    _gated_rms,
    _l2norm,
    check_layer_inputs,
    group_counters,
    launch_finish,
    norm_activation_is_sigmoid,
)


@triton.jit(do_not_specialize=["N"])
def _verify_prep_kernel(x, s_x_t, a, s_a_t, b, s_b_t, conv_w, A_log, dt_bias, conv_state, idx, cu, N,
                        qn, vn, st_k, st_g, bn, st_x, scale, HK, HV, D,
                        K: tl.constexpr, V: tl.constexpr, W: tl.constexpr, BLOCK_N: tl.constexpr,
                        QK_ONLY: tl.constexpr = False, PDL: tl.constexpr = False, TRIGGER: tl.constexpr = False):
    """Verify, launch 1 (token-parallel pre-pass), one program per (token, head group): the conv + SiLU of
    the group's channels, then for a q / k head its L2 norm (q scaled), for a v head the values and the
    gates. grp < HK: q head, < 2 HK: k head, else v head grp - 2 HK.
    QK_ONLY (RecurrentConfig.qk_prepass, grid (T, 2 HK)): the q / k heads only, ahead of _verify_fused_kernel
    (QK_IN), which computes the rest; these programs also copy their channels of x into stash.x. Waits for
    the previous kernel (PDL), then lets the fused kernel launch (TRIGGER): it may read what was written before
    this kernel, and waits for this one before it reads qn / stash.k."""
    if PDL:
        gdc_wait()
    if TRIGGER:
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    grp = tl.program_id(1)
    offs = tl.arange(0, BLOCK_N)
    ends = tl.load(cu + 1 + offs, mask=offs < N, other=2147483647)
    n = tl.sum((ends <= t).to(tl.int32), 0)  # the sequence holding token t
    slot = tl.load(idx + n).to(tl.int64)
    live = slot >= 0
    bos = tl.load(cu + n).to(tl.int32)
    win = conv_state + slot * ((W - 1) * D)
    if grp < 2 * HK:
        ok = tl.arange(0, K)
        xh = _l2norm(_conv_token(x, s_x_t, win, D, conv_w, grp * K + ok, t, bos, live, K, W))
        if grp < HK:  # q heads then k heads, contiguous in the conv channels
            tl.store(qn + (t * HK + grp) * K + ok, xh * scale)
        else:
            tl.store(st_k + (t * HK + grp - HK) * K + ok, xh)  # zeros for a padded row (no inputs)
        if QK_ONLY:
            tl.store(st_x + t * D + grp * K + ok, tl.load(x + t * s_x_t + grp * K + ok))
    else:
        hv = grp - 2 * HK
        ov = tl.arange(0, V)
        row = t * HV + hv
        vv = _conv_token(x, s_x_t, win, D, conv_w, 2 * HK * K + hv * V + ov, t, bos, live, V, W)
        tl.store(vn + row * V + ov, vv.to(vn.dtype.element_ty))
        gt = -tl.exp(tl.load(A_log + hv).to(tl.float32)) * softplus(
            tl.load(a + t * s_a_t + hv).to(tl.float32) + tl.load(dt_bias + hv).to(tl.float32))
        tl.store(st_g + row, gt)
        tl.store(bn + row, sigmoid(tl.load(b + t * s_b_t + hv).to(tl.float32)))


@triton.jit
def _verify_rec_kernel(qn, st_k, vn, st_g, bn, ssm, idx, cu, o_tmp, st_d, HK, HV,
                       R: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    """Verify, launch 2: per (sequence, value head, V-slice) only the state math of the T_n tokens (every
    per-token input was prepared by the pre-pass, so the loads are off the dependency chain)."""
    j = tl.program_id(0)
    nh = tl.program_id(1)
    n = nh // HV
    hv = nh % HV
    hk = hv // R
    slot = tl.load(idx + n).to(tl.int64)
    live = slot >= 0
    bos = tl.load(cu + n).to(tl.int32)
    eos = tl.load(cu + n + 1).to(tl.int32)
    ok = tl.arange(0, K)
    ov = j * BV + tl.arange(0, BV)
    sp = ssm + slot * (HV * K * V) + hv * (K * V) + ok[:, None] * V + ov[None, :]
    S = tl.load(sp, mask=(ok[:, None] >= 0) & live, other=0.0)
    bos64 = bos.to(tl.int64)
    for i in range(0, eos - bos):
        t = bos64 + i
        row = t * HV + hv
        kh = tl.load(st_k + (t * HK + hk) * K + ok)
        qh = tl.load(qn + (t * HK + hk) * K + ok)
        vv = tl.load(vn + row * V + ov).to(tl.float32)
        S, out, delta = _delta_step(S, kh, qh, vv, tl.load(st_g + row), tl.load(bn + row))
        tl.store(o_tmp + row * V + ov, tl.where(live, out, 0.0).to(o_tmp.dtype.element_ty))
        tl.store(st_d + row * V + ov, delta, mask=(ov >= 0) & live)



@triton.jit
def _store_o_delta(o, delta, row, live, ov, z_c, w, eps, out, o_tmp, st_d, r: tl.constexpr, V: tl.constexpr,
                   BV: tl.constexpr, SIGMOID: tl.constexpr, NORM: tl.constexpr):
    """A verify token's read-out (normed here for whole rows, else its slice to o_tmp, which is the output
    itself without the norm) and its stash delta."""
    o = tl.where(live, o, 0.0).to(out.dtype.element_ty)  # rounded to the activation dtype, as o_tmp
    if NORM and BV == V:
        y = _gated_rms(o.to(tl.float32)[None, :], z_c[r][None, :], w, eps, V, SIGMOID)
        tl.store(out + row * V + ov[None, :], y.to(out.dtype.element_ty))
    else:
        tl.store(o_tmp + row * V + ov, o)
    tl.store(st_d + row * V + ov, delta, mask=(ov >= 0) & live)


@triton.jit
def _stash_inputs(st_x, st_g, st_k, t, row, D, cv, cq, ck, ok, v_in, gt, kh, q_x, k_x, live, hk, HK, first_slice,
                  lead_k, K: tl.constexpr, xr: tl.constexpr, QK_IN: tl.constexpr):
    """A verify token's stash entries that do not depend on the state: its value channels of x, the gate (first
    V-slice) and, for the key head's lead program without the pre-pass, k and the q / k channels of x."""
    tl.store(st_x + t * D + cv, v_in.to(st_x.dtype.element_ty))
    if first_slice:
        tl.store(st_g + row, gt)
    if lead_k and not QK_IN:  # (with the pre-pass it wrote these)
        tl.store(st_k + (t * HK + hk) * K + ok, tl.where(live, kh, 0.0))
        tl.store(st_x + t * D + cq, q_x[xr].to(st_x.dtype.element_ty))
        tl.store(st_x + t * D + ck, k_x[xr].to(st_x.dtype.element_ty))


@triton.jit(do_not_specialize=["SLOTS"])
def _verify_fused_kernel(x, s_x_t, z, s_z_t, s_z_h, a, s_a_t, b, s_b_t, conv_w, A_log, dt_bias, norm_w,
                         conv_state, ssm, idx, cu, o_tmp, out, st_x, st_k, st_g, st_d, counters, scale, eps,
                         HK, HV, D, SLOTS, qn,
                         R: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, W: tl.constexpr,
                         TB: tl.constexpr, SIGMOID: tl.constexpr, PDL: tl.constexpr,
                         TRIGGER: tl.constexpr = False, QK_IN: tl.constexpr = False, GRAM: tl.constexpr = False,
                         NORM: tl.constexpr = True):
    """Verify in one launch (small batches), per (sequence, value head, V-slice): the pre-pass, the
    recurrence and the finish of the three-launch path in one program, the same math in the same order.

    Tokens go in chunks of TB: the TB + W - 1 conv input rows of a chunk (old window rows for positions
    before the sequence start, then x) are loaded once, every token's conv + SiLU, L2 norms and gates
    come from them, then the TB delta steps run unrolled (each guarded by the token count). The pools are
    only read (no window to coordinate), so the programs of a row meet only for the gated norm of rows
    split over V-slices: each stores its rounded o slice in o_tmp and counts itself in on a per-(sequence,
    value head) counter; the last one normalises the head's rows of every token and resets the counter.
    With whole rows (BV = V) the norm is local. The stash is shared out: each program copies its own value
    channels of x and writes its delta slice; the first V-slice writes g; the first V-slice of a key
    head's first value head writes k and the key head's q/k channels of x. PDL and the L2 prefetch as in
    _decode_fused_kernel (nothing is read before griddepcontrol.wait but the prefetch's hint).
    QK_IN (RecurrentConfig.qk_prepass): the tokens' normalised q (qn, scaled) and k (stash.k) come from the
    pre-pass launched just before (_verify_prep_kernel, QK_ONLY: once per token and key head instead of in each
    of a key head's programs), which also wrote k and the q / k channels of stash.x. Everything else is read
    before griddepcontrol.wait: the pre-pass let this kernel launch only after its own wait (what was written
    before it is complete), so only qn / stash.k wait for it."""
    j = tl.program_id(0)
    nh = tl.program_id(1)
    n = nh // HV
    hv = nh % HV
    hk = hv // R
    ok = tl.arange(0, K)
    ov = j * BV + tl.arange(0, BV)
    if PDL and not QK_IN:
        # ask L2 for the slot's state lines before the wait (a hint: a stale slot costs only bandwidth)
        guess = tl.load(idx + n, cache_modifier=".cg").to(tl.int64)
        gslot = tl.minimum(tl.maximum(guess, 0), SLOTS - 1)
        pm = guess >= 0
        for c8 in tl.static_range(0, BV, 8):
            prefetch_l2(ssm + gslot * (HV * K * V) + hv * (K * V) + ok * V + j * BV + c8, (ok >= 0) & pm)
        gdc_wait()
    if TRIGGER:
        gdc_launch_dependents()
    slot = tl.load(idx + n, cache_modifier=".cg").to(tl.int64)
    bos = tl.load(cu + n).to(tl.int32)
    eos = tl.load(cu + n + 1).to(tl.int32)
    live = slot >= 0
    sp = ssm + slot * (HV * K * V) + hv * (K * V) + ok[:, None] * V + ov[None, :]
    S = tl.load(sp, mask=(ok[:, None] >= 0) & live, other=0.0, cache_modifier=".cg")
    tl.debug_barrier()  # keep the state loads ahead of the conv math (as in _decode_fused_kernel)
    cq = hk * K + ok
    ck = HK * K + hk * K + ok
    cv = 2 * HK * K + hv * V + ov
    win = conv_state + slot * ((W - 1) * D)
    A = tl.load(A_log + hv).to(tl.float32)
    dtb = tl.load(dt_bias + hv).to(tl.float32)
    of = tl.arange(0, V)
    w = tl.load(norm_w + of).to(tl.float32)
    q_taps = ()
    k_taps = ()
    v_taps = ()
    for i in tl.static_range(W):
        if not QK_IN:
            q_taps = q_taps + (tl.load(conv_w + cq * W + i).to(tl.float32),)
            k_taps = k_taps + (tl.load(conv_w + ck * W + i).to(tl.float32),)
        v_taps = v_taps + (tl.load(conv_w + cv * W + i).to(tl.float32),)
    lead_k = (j == 0) & (hv % R == 0)  # writes stash.k and the q/k channels of stash.x
    Tn = eos - bos
    bos64 = bos.to(tl.int64)
    for c in range(0, Tn, TB):
        # conv input rows: position p = c - (W - 1) + rr from the sequence start (old window when p < 0)
        q_x = ()  # x rows (TB + W - 1), then the old window rows (W - 1), as loaded; zero where not in range
        k_x = ()
        v_x = ()
        q_w = ()
        k_w = ()
        v_w = ()
        for rr in tl.static_range(TB + W - 1):
            p = c - (W - 1) + rr
            in_x = (p >= 0) & (p < Tn)
            xr = x + (bos64 + p) * s_x_t
            if not QK_IN:
                q_x = q_x + (tl.load(xr + cq, mask=(ok >= 0) & in_x, other=0.0),)
                k_x = k_x + (tl.load(xr + ck, mask=(ok >= 0) & in_x, other=0.0),)
            v_x = v_x + (tl.load(xr + cv, mask=(ov >= 0) & in_x, other=0.0),)
            if rr < W - 1:  # only these rows can lie before the sequence start
                in_w = (p < 0) & live
                wr = win + (W - 1 + p) * D
                if not QK_IN:
                    q_w = q_w + (tl.load(wr + cq, mask=(ok >= 0) & in_w, other=0.0),)
                    k_w = k_w + (tl.load(wr + ck, mask=(ok >= 0) & in_w, other=0.0),)
                v_w = v_w + (tl.load(wr + cv, mask=(ov >= 0) & in_w, other=0.0),)
        # every per-token input of the chunk is loaded before the first store: a load after a store it
        # may alias stays behind it, which put a DRAM round trip on every token's chain
        a_c = ()
        b_c = ()
        z_c = ()
        for r in tl.static_range(TB):
            t = bos64 + c + r
            valid = c + r < Tn
            a_c = a_c + (tl.load(a + t * s_a_t + hv, mask=valid, other=0.0).to(tl.float32),)
            b_c = b_c + (tl.load(b + t * s_b_t + hv, mask=valid, other=0.0).to(tl.float32),)
            if NORM and BV == V:
                z_c = z_c + (tl.load(z + t * s_z_t + hv * s_z_h + of, mask=(of >= 0) & valid, other=0.0)
                             .to(tl.float32),)
        if QK_IN:  # the pre-pass's rows (after it completed: the only reads that wait for it)
            if PDL:
                gdc_wait()
            for r in tl.static_range(TB):
                qk_row = ((bos64 + c + r) * HK + hk) * K + ok
                qk_m = (ok >= 0) & (c + r < Tn)
                q_x = q_x + (tl.load(qn + qk_row, mask=qk_m, other=0.0),)
                k_x = k_x + (tl.load(st_k + qk_row, mask=qk_m, other=0.0),)
        if GRAM:
            kS = ()  # k_r . S, q_r . S per token; the tokens' k, q, v, beta, and cumulative gates
            qS = ()
            k_r = ()
            q_r = ()
            v_r = ()
            b_r = ()
            cg_r = ()
            cg = 0.0
        for r in tl.static_range(TB):
            t = bos64 + c + r
            valid = c + r < Tn
            av = a_c[r]
            bv = b_c[r]
            acc_q = tl.zeros([K], dtype=tl.float32)
            acc_k = tl.zeros([K], dtype=tl.float32)
            acc_v = tl.zeros([BV], dtype=tl.float32)
            for i in tl.static_range(W):
                if r + i < W - 1:  # (x + window) as _conv_token adds them: one of the two is zero
                    if not QK_IN:
                        acc_q += (q_x[r + i].to(tl.float32) + q_w[r + i].to(tl.float32)) * q_taps[i]
                        acc_k += (k_x[r + i].to(tl.float32) + k_w[r + i].to(tl.float32)) * k_taps[i]
                    acc_v += (v_x[r + i].to(tl.float32) + v_w[r + i].to(tl.float32)) * v_taps[i]
                else:
                    if not QK_IN:
                        acc_q += q_x[r + i].to(tl.float32) * q_taps[i]
                        acc_k += k_x[r + i].to(tl.float32) * k_taps[i]
                    acc_v += v_x[r + i].to(tl.float32) * v_taps[i]
            if QK_IN:
                qh = q_x[r]
                kh = k_x[r]
            else:
                qh = _l2norm(silu_fast(acc_q).to(x.dtype.element_ty).to(tl.float32)) * scale
                kh = _l2norm(silu_fast(acc_k).to(x.dtype.element_ty).to(tl.float32))
            vv = silu_fast(acc_v).to(x.dtype.element_ty).to(tl.float32)
            gt = -tl.exp(A) * softplus(av + dtb)
            bt = sigmoid(bv)
            if GRAM:  # everything but the recurrence now; the chunk's tokens below
                kS = kS + (tl.sum(S * kh[:, None], axis=0),)
                qS = qS + (tl.sum(S * qh[:, None], axis=0),)
                cg = cg + gt
                k_r = k_r + (kh,)
                q_r = q_r + (qh,)
                v_r = v_r + (vv,)
                b_r = b_r + (bt,)
                cg_r = cg_r + (cg,)
                if valid:
                    _stash_inputs(st_x, st_g, st_k, t, t * HV + hv, D, cv, cq, ck, ok, v_x[W - 1 + r], gt, kh,
                                  q_x, k_x, live, hk, HK, j == 0, lead_k, K, W - 1 + r, QK_IN)
            elif valid:
                S, o, delta = _delta_step(S, kh, qh, vv, gt, bt)
                _store_o_delta(o, delta, t * HV + hv, live, ov, z_c, w, eps, out, o_tmp, st_d, r, V, BV, SIGMOID, NORM)
                _stash_inputs(st_x, st_g, st_k, t, t * HV + hv, D, cv, cq, ck, ok, v_x[W - 1 + r], gt, kh,
                              q_x, k_x, live, hk, HK, j == 0, lead_k, K, W - 1 + r, QK_IN)
        if GRAM:
            # token r from the chunk's start state S and the tokens before it (G_r = e^{cg_r}, f = e^{cg_r - cg_i}):
            #   u_r = G_r k_r.S + sum_{i<r} f (k_r.k_i) delta_i,  delta_r = beta_r (v_r - u_r),
            #   o_r = G_r q_r.S + sum_{i<=r} f (q_r.k_i) delta_i
            # the 2 TB reductions over S above are independent of each other; only this small scalar x vector
            # substitution is sequential (the token-by-token form has two dependent reductions per token)
            d_r = ()
            for r in tl.static_range(TB):
                in_seq = c + r < Tn
                eg = tl.exp(cg_r[r])
                u = eg * kS[r]
                o = eg * qS[r]
                for i in tl.static_range(r):
                    f = tl.exp(cg_r[r] - cg_r[i])
                    u += (f * tl.sum(k_r[r] * k_r[i], axis=0)) * d_r[i]
                    o += (f * tl.sum(q_r[r] * k_r[i], axis=0)) * d_r[i]
                delta = b_r[r] * (v_r[r] - u)
                o += tl.sum(q_r[r] * k_r[r], axis=0) * delta
                d_r = d_r + (delta,)
                if in_seq:
                    _store_o_delta(o, delta, (bos64 + c + r) * HV + hv, live, ov, z_c, w, eps, out, o_tmp, st_d, r,
                                   V, BV, SIGMOID, NORM)
            if c + TB < Tn:  # another chunk follows: the state after this one (every token of it valid)
                S = S * tl.exp(cg_r[TB - 1])
                for i in tl.static_range(TB):
                    S += k_r[i][:, None] * (tl.exp(cg_r[TB - 1] - cg_r[i]) * d_r[i])[None, :]
    if NORM and BV < V:  # (without the norm every program stored its own slice of the output: nothing to meet for)
        tr_ = tl.arange(0, TB)
        if live:
            tl.debug_barrier()  # every thread's o_tmp stores precede the release below
            cnt = counters + n * HV + hv
            arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
            if arrived == V // BV - 1:  # the last slice of the head: its o_tmp rows are complete
                tl.store(cnt, 0)
                for c in range(0, Tn, TB):
                    tt = bos64 + c + tr_
                    m = ((c + tr_)[:, None] < Tn) & (of[None, :] >= 0)
                    ot = tl.load(o_tmp + (tt[:, None] * HV + hv) * V + of[None, :], mask=m, other=0.0,
                                 cache_modifier=".cg").to(tl.float32)
                    zt = tl.load(z + tt[:, None] * s_z_t + hv * s_z_h + of[None, :], mask=m, other=0.0).to(tl.float32)
                    y = _gated_rms(ot, zt, w, eps, V, SIGMOID)
                    tl.store(out + (tt[:, None] * HV + hv) * V + of[None, :], y.to(out.dtype.element_ty), mask=m)
        else:  # a padded row: zeros, no counter
            for c in range(0, Tn, TB):
                tt = bos64 + c + tr_
                m = ((c + tr_)[:, None] < Tn) & (ov[None, :] >= 0)
                tl.store(out + (tt[:, None] * HV + hv) * V + ov[None, :],
                         tl.zeros([TB, BV], dtype=out.dtype.element_ty), mask=m)


def gdn_verify(
    mixed_qkv: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *,
    conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor,
    eps: float, scale: float, cu_seqlens: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
    state_indices: torch.Tensor, stash: VerifyStash, norm_activation: str = "silu", gated_norm: bool = True,
    config: RecurrentConfig | None = None,
) -> torch.Tensor:
    """See reference.gdn_verify. With gated_norm=False the one-launch kernel's programs store their own slices of
    o: no counter, no norm tail (the three launches skip the norm blocks of their last)."""
    op = "gdn_verify"
    gated_norm = bool(gated_norm)
    T, D, HK, HV, K, V, W, z3 = check_layer_inputs(
        op, mixed_qkv, z, a, b, conv_weight, A_log, dt_bias, norm_weight, conv_state, ssm_state)
    sigmoid_gate = norm_activation_is_sigmoid(op, norm_activation)
    N = state_indices.shape[0]
    check_index(op, "state_indices", state_indices, N)
    check_index(op, "cu_seqlens", cu_seqlens, N + 1)
    stash.check(T, D, HK, K, HV, V)
    out = torch.empty((T, HV, V), dtype=mixed_qkv.dtype, device=mixed_qkv.device)
    if T == 0 or N == 0:
        return out
    dev = mixed_qkv.device
    cfg = config or default_verify_config(N, T, HK, HV, V, pdl=has_pdl(dev))
    check(cfg.one_launch or not cfg.qk_prepass, op, "config qk_prepass applies to the one-launch verify only")
    check(cfg.one_launch or not cfg.gram, op, "config gram applies to the one-launch verify only")
    check(V % cfg.bv == 0, op, f"config bv={cfg.bv} must divide V={V}")
    check(cfg.one_launch or not cfg.pdl, op, "config pdl applies to the one-launch path only")
    check(not cfg.pdl or has_pdl(dev), op, "config pdl needs a CUDA device of compute capability 9.0 or newer")
    # without the gated norm the one-launch kernel writes o straight to `out`, the three launches' o_tmp is it
    o_tmp = out if not gated_norm else torch.empty((T, HV, V), dtype=mixed_qkv.dtype, device=dev)
    if cfg.one_launch:
        qn = o_tmp  # an argument the kernel does not read without the pre-pass
        if cfg.qk_prepass:
            qn = torch.empty((T, HK, K), dtype=torch.float32, device=dev)
            _verify_prep_kernel[(T, 2 * HK)](
                mixed_qkv, mixed_qkv.stride(0), a, a.stride(0), b, b.stride(0), conv_weight, A_log, dt_bias,
                conv_state, state_indices, cu_seqlens, N, qn, qn, stash.k, stash.g, qn, stash.x, float(scale), HK,
                HV, D, K=K, V=V, W=W, BLOCK_N=max(16, next_pow2(N)), QK_ONLY=True, PDL=cfg.pdl,
                TRIGGER=has_pdl(dev), num_warps=1, **({"launch_pdl": True} if cfg.pdl else {}))
        _verify_fused_kernel[(V // cfg.bv, N * HV)](
            mixed_qkv, mixed_qkv.stride(0), z3, z3.stride(0), z3.stride(1), a, a.stride(0), b, b.stride(0),
            conv_weight, A_log, dt_bias, norm_weight, conv_state, ssm_state, state_indices, cu_seqlens, o_tmp, out,
            stash.x, stash.k, stash.g, stash.delta, group_counters(dev, N * HV), float(scale),
            float(eps), HK, HV, D, ssm_state.shape[0], qn, R=HV // HK, K=K, V=V, BV=cfg.bv, W=W,
            TB=verify_chunk(T, N), SIGMOID=sigmoid_gate, PDL=cfg.pdl, TRIGGER=has_pdl(dev), QK_IN=cfg.qk_prepass,
            GRAM=cfg.gram, NORM=gated_norm, num_warps=cfg.num_warps, **({"launch_pdl": True} if cfg.pdl else {}))
        return out
    f32 = torch.float32
    qn = torch.empty((T, HK, K), dtype=f32, device=dev)
    vn = torch.empty((T, HV, V), dtype=mixed_qkv.dtype, device=dev)
    bn = torch.empty((T, HV), dtype=f32, device=dev)
    _verify_prep_kernel[(T, 2 * HK + HV)](
        mixed_qkv, mixed_qkv.stride(0), a, a.stride(0), b, b.stride(0), conv_weight, A_log, dt_bias, conv_state,
        state_indices, cu_seqlens, N, qn, vn, stash.k, stash.g, bn, stash.x, float(scale), HK, HV, D, K=K, V=V,
        W=W, BLOCK_N=max(16, next_pow2(N)), num_warps=1)
    _verify_rec_kernel[(V // cfg.bv, N * HV)](
        qn, stash.k, vn, stash.g, bn, ssm_state, state_indices, cu_seqlens, o_tmp, stash.delta, HK, HV,
        R=HV // HK, K=K, V=V, BV=cfg.bv, num_warps=cfg.num_warps)
    launch_finish(o_tmp, z3, norm_weight, out, mixed_qkv, conv_state, state_indices, stash.x, eps, HV, D, V, W,
                  sigmoid_gate, gated_norm, False)
    return out  # (o_tmp itself without the gated norm)


# ---- commit -------------------------------------------------------------------------------------

@triton.jit
def _commit_kernel(num_acc, cu, idx, conv_state, ssm, st_x, st_k, st_g, st_d, HK, HV, D, STATE_BLOCKS,
                   R: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, W: tl.constexpr,
                   WP: tl.constexpr, BD: tl.constexpr):
    n = tl.program_id(0)
    p = tl.program_id(1)
    slot = tl.load(idx + n).to(tl.int64)
    bos = tl.load(cu + n).to(tl.int32)
    eos = tl.load(cu + n + 1).to(tl.int32)
    acc = tl.minimum(tl.maximum(tl.load(num_acc + n).to(tl.int32), 0), eos - bos)
    go = (slot >= 0) & (acc > 0)
    if p < STATE_BLOCKS:
        nsl = V // BV
        hv = p // nsl
        j = p % nsl
        hk = hv // R
        ok = tl.arange(0, K)
        ov = j * BV + tl.arange(0, BV)
        sp = ssm + slot * (HV * K * V) + hv * (K * V) + ok[:, None] * V + ov[None, :]
        smask = (ok[:, None] >= 0) & go
        S = tl.load(sp, mask=smask, other=0.0)
        bos64 = bos.to(tl.int64)
        for i in range(0, tl.where(go, acc, 0)):
            t = bos64 + i
            row = t * HV + hv
            kh = tl.load(st_k + (t * HK + hk) * K + ok)
            dl = tl.load(st_d + row * V + ov)
            S = S * tl.exp(tl.load(st_g + row)) + kh[:, None] * dl[None, :]
        tl.store(sp, S, mask=smask)
    else:
        ch = (p - STATE_BLOCKS) * BD + tl.arange(0, BD)
        cm = ch < D
        r = tl.arange(0, WP)
        src = acc + r  # row of [old window (W-1 rows), accepted inputs]
        rm = (r[:, None] < W - 1) & cm[None, :] & go
        win = conv_state + slot * ((W - 1) * D)
        from_old = tl.load(win + src[:, None] * D + ch[None, :], mask=rm & (src[:, None] < W - 1), other=0.0)
        from_x = tl.load(st_x + (bos + src[:, None] - (W - 1)).to(tl.int64) * D + ch[None, :],
                         mask=rm & (src[:, None] >= W - 1), other=0.0)
        new = from_old.to(tl.float32) + from_x.to(tl.float32)
        tl.debug_barrier()
        tl.store(win + r[:, None] * D + ch[None, :], new.to(conv_state.dtype.element_ty), mask=rm)


def gdn_commit(
    num_accepted: torch.Tensor, *, cu_seqlens: torch.Tensor, state_indices: torch.Tensor,
    conv_state: torch.Tensor, ssm_state: torch.Tensor, stash: VerifyStash, config: RecurrentConfig | None = None,
) -> None:
    """Triton commit. num_accepted is clamped to 0..T_n on the device (no host sync: graph capturable);
    the reference raises on out-of-range counts instead."""
    op = "gdn_commit"
    N = state_indices.shape[0]
    check_index(op, "state_indices", state_indices, N)
    check_index(op, "cu_seqlens", cu_seqlens, N + 1)
    check_index(op, "num_accepted", num_accepted, N)
    HV, K, V = ssm_state.shape[1:]
    HK = stash.k.shape[1]
    check_pool(op, ssm_state, HV, K, V)
    D = conv_state.shape[2]
    W = conv_state.shape[1] + 1
    check(conv_state.is_contiguous(), op, "conv_state must be contiguous")
    stash.check(0, D, HK, K, HV, V)
    check(HV % HK == 0, op, f"stash key heads {HK} must divide value heads {HV}")
    check_same_device(op, num_accepted, cu_seqlens, state_indices, conv_state, ssm_state, stash.x)
    if N == 0:
        return
    cfg = config or RecurrentConfig(bv=min(32, V), num_warps=4)
    state_blocks = HV * (V // cfg.bv)
    BD = 1024
    _commit_kernel[(N, state_blocks + triton.cdiv(D, BD))](
        num_accepted, cu_seqlens, state_indices, conv_state, ssm_state, stash.x, stash.k, stash.g, stash.delta,
        HK, HV, D, state_blocks, R=HV // HK, K=K, V=V, BV=cfg.bv, W=W, WP=next_pow2(W - 1), BD=BD,
        num_warps=cfg.num_warps)

