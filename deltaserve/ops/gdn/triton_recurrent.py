"""Triton kernels of the one-token GDN ops (same signatures as reference.py, plus an optional `config`): the
gates, the plain decode (FLA's fused_recurrent contract, pooled) and the fused decode of a whole GDN layer.
Work layout and shared pieces: `triton_steps`; launch shapes: `dispatch.default_decode_config`.

The fused decode has two forms, picked from the batch size:
- small batches, one launch (`_decode_fused_kernel`): per (sequence, value head, V-slice) conv + SiLU + gates +
  L2 norm + delta rule, then the gated RMSNorm and the conv-window update. Both need the programs of a key head
  to cooperate: the q/k window channels are read by all of them, and the norm needs all slices of a row. Each
  program counts itself in on a per-(sequence, key head) counter after its reads and writes; the last one to
  arrive shifts the q/k window and (with V split) normalises the rows, then resets the counter to zero. A
  program's own value channels of the window are read by it alone, so it shifts them itself. With whole-row
  programs (BV = V) the norm needs no other program. For the smallest batches on compute capability 9.0+ it is
  launched as a programmatic dependent (PDL) of the kernel before it.
- large batches, two launches: (1) `_tokens_kernel`, the same per-program math writing the un-normalised output;
  (2) the gated RMSNorm and the conv-window update (`triton_steps._finish_kernel`).
With gated_norm=False (the output projection applies the norm: linear.gated_linear) the one-launch kernel has no
norm tail: each program stores its own slice of o, and the counter only tells the group's last program that
every program has read the q/k window, which it then rewrites from the conv inputs it holds. With
conv_applied=True the input projection has done the conv and the window shift in its epilogue
(linear.rms_norm_linear_conv) and mixed_qkv holds the conv's output: no program reads or writes a window.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..triton_common import (
    check,
    check_head_dim,
    check_index,
    check_last_contiguous,
    check_pool,
    check_same_device,
    next_pow2,
    prefetch_l2,
    sigmoid,
    softplus,
)
from .dispatch import (
    RecurrentConfig,
    default_decode_config,
    default_recurrent_config,
    has_pdl,
)
from .triton_steps import (
    _conv_inputs,
    _conv_of,
    _conv_token,
    _delta_step,
    _gated_rms,
    _l2norm,
    _shift_window,
    _shifted_window,
    _store_qk_window,
    _store_window,
    check_layer_inputs,
    group_counters,
    launch_finish,
    norm_activation_is_sigmoid,
)

# ---- gates --------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["T"])
def _gating_kernel(A_log, a, dt_bias, b, g, beta, T, HV, s_a_t, s_b_t,
                   BH: tl.constexpr, BT: tl.constexpr):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    h = tl.arange(0, BH)
    m = (rows[:, None] < T) & (h[None, :] < HV)
    av = tl.load(a + rows[:, None].to(tl.int64) * s_a_t + h[None, :], mask=m, other=0.0).to(tl.float32)
    bv = tl.load(b + rows[:, None].to(tl.int64) * s_b_t + h[None, :], mask=m, other=0.0).to(tl.float32)
    A = tl.load(A_log + h, mask=h < HV, other=0.0).to(tl.float32)
    dtb = tl.load(dt_bias + h, mask=h < HV, other=0.0).to(tl.float32)
    gv = -tl.exp(A)[None, :] * softplus(av + dtb[None, :])
    out = rows[:, None] * HV + h[None, :]
    tl.store(g + out, gv, mask=m)
    tl.store(beta + out, sigmoid(bv), mask=m)


def gdn_gating(A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor):
    op = "gdn_gating"
    check(a.dim() == 2 and a.shape == b.shape, op, f"a and b must be [T, HV], got {tuple(a.shape)}, {tuple(b.shape)}")
    T, HV = a.shape
    check(A_log.shape == (HV,) and dt_bias.shape == (HV,), op, f"A_log and dt_bias must be [{HV}]")
    check_last_contiguous(op, a=a, b=b)
    check_same_device(op, A_log, a, dt_bias, b)
    g = torch.empty((T, HV), dtype=torch.float32, device=a.device)
    beta = torch.empty_like(g)
    if T == 0:
        return g, beta
    BT = 32
    _gating_kernel[(triton.cdiv(T, BT),)](A_log, a, dt_bias, b, g, beta, T, HV, a.stride(0), b.stride(0),
                                          BH=next_pow2(HV), BT=BT)
    return g, beta


# ---- plain decode (FLA's fused_recurrent contract, pooled) --------------------------------------

@triton.jit
def _recurrent_kernel(q, k, v, g, beta, o, ssm, idx, scale,
                      s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h, s_g_t, s_b_t, HV,
                      R: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                      L2NORM: tl.constexpr):
    j = tl.program_id(0)
    nh = tl.program_id(1)
    n = nh // HV
    hv = nh % HV
    hk = hv // R
    slot = tl.load(idx + n).to(tl.int64)
    live = slot >= 0
    ok = tl.arange(0, K)
    ov = j * BV + tl.arange(0, BV)
    qv = tl.load(q + n * s_q_t + hk * s_q_h + ok).to(tl.float32)
    kv = tl.load(k + n * s_k_t + hk * s_k_h + ok).to(tl.float32)
    if L2NORM:
        qv = _l2norm(qv)
        kv = _l2norm(kv)
    qv = qv * scale
    vv = tl.load(v + n * s_v_t + hv * s_v_h + ov).to(tl.float32)
    gv = tl.load(g + n * s_g_t + hv).to(tl.float32)
    bv = tl.load(beta + n * s_b_t + hv).to(tl.float32)
    sp = ssm + slot * (HV * K * V) + hv * (K * V) + ok[:, None] * V + ov[None, :]
    smask = (ok[:, None] >= 0) & live
    S = tl.load(sp, mask=smask, other=0.0)
    S, out, _ = _delta_step(S, kv, qv, vv, gv, bv)
    tl.store(o + (n * HV + hv) * V + ov, tl.where(live, out, 0.0).to(o.dtype.element_ty))
    tl.store(sp, S, mask=smask)


def _check_token_inputs(op, q, k, v, g, beta, ssm_state):
    check(q.dim() == 3 and k.shape == q.shape and v.dim() == 3, op,
          f"q, k must be [N, HK, K] and v [N, HV, V], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    N, HK, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    check(v.shape[0] == N and HV % HK == 0, op, f"v heads {HV} must be a multiple of key heads {HK}")
    check(g.shape == (N, HV) and beta.shape == (N, HV), op, f"g and beta must be [{N}, {HV}]")
    check_head_dim(op, "K", K)
    check_head_dim(op, "V", V)
    check(q.dtype in (torch.bfloat16, torch.float16, torch.float32) and k.dtype == q.dtype and v.dtype == q.dtype,
          op, f"q, k, v must share a float dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    check_last_contiguous(op, q=q, k=k, v=v, g=g, beta=beta)
    check_pool(op, ssm_state, HV, K, V)
    check_same_device(op, q, k, v, g, beta, ssm_state)
    return N, HK, K, HV, V


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    *, scale: float, ssm_state: torch.Tensor, state_indices: torch.Tensor,
    use_qk_l2norm_in_kernel: bool = True, config: RecurrentConfig | None = None,
) -> torch.Tensor:
    op = "fused_recurrent_gated_delta_rule"
    N, HK, K, HV, V = _check_token_inputs(op, q, k, v, g, beta, ssm_state)
    check_index(op, "state_indices", state_indices, N)
    cfg = config or default_recurrent_config(N * HV * max(V // 32, 1), V)
    check(V % cfg.bv == 0, op, f"config bv={cfg.bv} must divide V={V}")
    o = torch.empty((N, HV, V), dtype=v.dtype, device=v.device)
    if N == 0:
        return o
    _recurrent_kernel[(V // cfg.bv, N * HV)](
        q, k, v, g, beta, o, ssm_state, state_indices, float(scale),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
        beta.stride(0), HV, R=HV // HK, K=K, V=V, BV=cfg.bv, L2NORM=bool(use_qk_l2norm_in_kernel),
        num_warps=cfg.num_warps)
    return o


# ---- fused decode / verify: launch 1 (conv + gates + norm + delta rule) -------------------------

@triton.jit
def _tokens_kernel(x, s_x_t, a, s_a_t, b, s_b_t, conv_w, A_log, dt_bias, conv_state, ssm, idx,
                   o_tmp, scale, HK, HV, D,
                   R: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, W: tl.constexpr,
                   CONV: tl.constexpr = True):
    """Fused decode, launch 1: one token per sequence, conv + norms + gates + delta rule per program
    (without CONV x holds the conv's output already: norms + gates + delta rule)."""
    j = tl.program_id(0)
    nh = tl.program_id(1)
    n = nh // HV
    hv = nh % HV
    hk = hv // R
    slot = tl.load(idx + n).to(tl.int64)
    live = slot >= 0
    ok = tl.arange(0, K)
    ov = j * BV + tl.arange(0, BV)
    cq = hk * K + ok
    ck = HK * K + hk * K + ok
    cv = 2 * HK * K + hv * V + ov
    win = conv_state + slot * ((W - 1) * D)
    sp = ssm + slot * (HV * K * V) + hv * (K * V) + ok[:, None] * V + ov[None, :]
    smask = (ok[:, None] >= 0) & live
    S = tl.load(sp, mask=smask, other=0.0)
    t = n.to(tl.int64)
    if CONV:
        qh = _l2norm(_conv_token(x, s_x_t, win, D, conv_w, cq, t, n, live, K, W)) * scale
        kh = _l2norm(_conv_token(x, s_x_t, win, D, conv_w, ck, t, n, live, K, W))
        vv = _conv_token(x, s_x_t, win, D, conv_w, cv, t, n, live, BV, W)
    else:
        qh = _l2norm(tl.load(x + t * s_x_t + cq).to(tl.float32)) * scale
        kh = _l2norm(tl.load(x + t * s_x_t + ck).to(tl.float32))
        vv = tl.load(x + t * s_x_t + cv).to(tl.float32)
    gt = -tl.exp(tl.load(A_log + hv).to(tl.float32)) * softplus(
        tl.load(a + t * s_a_t + hv).to(tl.float32) + tl.load(dt_bias + hv).to(tl.float32))
    bt = sigmoid(tl.load(b + t * s_b_t + hv).to(tl.float32))
    S, out, delta = _delta_step(S, kh, qh, vv, gt, bt)
    tl.store(o_tmp + (t * HV + hv) * V + ov, tl.where(live, out, 0.0).to(o_tmp.dtype.element_ty))
    tl.store(sp, S, mask=smask)


@triton.jit(do_not_specialize=["SLOTS"])
def _decode_fused_kernel(x, s_x_t, z, s_z_t, s_z_h, a, s_a_t, b, s_b_t, conv_w, A_log, dt_bias, norm_w,
                         conv_state, ssm, idx, o_tmp, out, counters, scale, eps, HK, HV, D, SLOTS,
                         R: tl.constexpr, RP: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                         BV: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
                         SIGMOID: tl.constexpr, PDL: tl.constexpr, TRIGGER: tl.constexpr = False,
                         NORM: tl.constexpr = True, CONV: tl.constexpr = True):
    """Fused decode in one launch (small batches): _tokens_kernel's math, then the gated norm and the
    window update, coordinated per (sequence, key head) by a counter (module docstring).

    Without CONV (conv_applied: the input projection's epilogue did the conv and the window shift) x holds
    the post-conv q|k|v: no window is read or written, and the counter remains only for the gated norm of
    rows split over several programs (NORM with BV < V); the layer's batch-1 decode (no NORM) has none.

    Without NORM (gated_norm=False: the output projection applies the norm) each program stores its
    slice of the un-normalised o itself, and the group's last program only writes the q/k window rows,
    from the conv inputs it holds in registers (no reload, no o_tmp).

    At batch 1 the time is latency, so the chain of dependent memory round trips is kept short: the
    slot index, then the state (issued first: a CTA barrier after its loads keeps the compiler from
    sinking them behind conv math that waits on the window loads, as it did), then the window, inputs
    and weights in one batch; the value-channel window rows this program writes back are loaded in that
    batch too, not again after the math. With PDL the kernel starts while the previous one drains and
    reads nothing before griddepcontrol.wait (the kernel before it may write the pools, the slot list,
    the inputs); it may only ask L2 for the lines of the slot it finds before the wait (a hint: a stale
    slot costs bandwidth, never a wrong value)."""
    j = tl.program_id(0)
    nh = tl.program_id(1)
    n = nh // HV
    hv = nh % HV
    hk = hv // R
    ok = tl.arange(0, K)
    ov = j * BV + tl.arange(0, BV)
    if PDL:
        # ask L2 for the slot's state and window lines before the wait (a hint: a stale slot costs only bandwidth)
        guess = tl.load(idx + n, cache_modifier=".cg").to(tl.int64)  # L2 only: no stale L1 line later
        gslot = tl.minimum(tl.maximum(guess, 0), SLOTS - 1)  # in bounds whatever the guess holds
        pm = guess >= 0
        for c in tl.static_range(0, BV, 8):  # one pointer per 32-byte sector of each row of the slice
            prefetch_l2(ssm + gslot * (HV * K * V) + hv * (K * V) + ok * V + j * BV + c, (ok >= 0) & pm)
        if CONV:
            gwin = conv_state + gslot * ((W - 1) * D)
            for r in tl.static_range(W - 1):
                prefetch_l2(gwin + r * D + hk * K + ok, (ok >= 0) & pm)
                prefetch_l2(gwin + r * D + HK * K + hk * K + ok, (ok >= 0) & pm)
                prefetch_l2(gwin + r * D + 2 * HK * K + hv * V + ov, (ov >= 0) & pm)
        gdc_wait()
    if TRIGGER:
        gdc_launch_dependents()      # the output projection may become resident; it waits for us itself
    slot = tl.load(idx + n, cache_modifier=".cg").to(tl.int64)
    live = slot >= 0
    sp = ssm + slot * (HV * K * V) + hv * (K * V) + ok[:, None] * V + ov[None, :]
    smask = (ok[:, None] >= 0) & live
    S = tl.load(sp, mask=smask, other=0.0, cache_modifier=".cg")
    # The compiler may hoist math above a barrier but not loads: without this one it issued the state
    # loads after conv math that waited on the window loads (one more memory round trip).
    tl.debug_barrier()
    cq = hk * K + ok
    ck = HK * K + hk * K + ok
    cv = 2 * HK * K + hv * V + ov
    win = conv_state + slot * ((W - 1) * D)
    t = n.to(tl.int64)
    xrow = x + t * s_x_t
    if CONV:
        q_in, q_taps = _conv_inputs(xrow, win, D, conv_w, cq, live, W)
        k_in, k_taps = _conv_inputs(xrow, win, D, conv_w, ck, live, W)
        v_in, v_taps = _conv_inputs(xrow, win, D, conv_w, cv, live, W)
        new_v = _shifted_window(win, D, cv, ov >= 0, xrow, live, W, WP)  # written back after the math
    else:  # the conv's output, as _conv_of returns it (rounded to x's dtype)
        q_c = tl.load(xrow + cq)
        k_c = tl.load(xrow + ck)
        v_c = tl.load(xrow + cv)
    av = tl.load(a + t * s_a_t + hv).to(tl.float32)
    bv = tl.load(b + t * s_b_t + hv).to(tl.float32)
    A = tl.load(A_log + hv).to(tl.float32)
    dtb = tl.load(dt_bias + hv).to(tl.float32)
    of = tl.arange(0, V)
    if NORM:
        w = tl.load(norm_w + of).to(tl.float32)  # a weight: likely a DRAM miss, unlike z (just written)
    # ---- phase 2: the math ----
    if CONV:
        qh = _l2norm(_conv_of(q_in, q_taps, x.dtype.element_ty, W)) * scale
        kh = _l2norm(_conv_of(k_in, k_taps, x.dtype.element_ty, W))
        vv = _conv_of(v_in, v_taps, x.dtype.element_ty, W)
    else:
        qh = _l2norm(q_c.to(tl.float32)) * scale
        kh = _l2norm(k_c.to(tl.float32))
        vv = v_c.to(tl.float32)
    gt = -tl.exp(A) * softplus(av + dtb)
    bt = sigmoid(bv)
    S, o, _ = _delta_step(S, kh, qh, vv, gt, bt)
    group_of_one: tl.constexpr = R * (V // BV) == 1
    # the group's programs meet on the counter for the q/k window (CONV) or a norm of split rows
    counted: tl.constexpr = (not group_of_one) and (CONV or (NORM and BV < V))
    tl.store(sp, S, mask=smask)
    o = tl.where(live, o, 0.0).to(out.dtype.element_ty)  # rounded to the activation dtype, as unfused
    if not NORM:
        tl.store(out + (t * HV + hv) * V + ov, o)
    elif BV == V:  # whole rows: the norm is local (dead rows: zeros in, zeros out)
        zt = tl.load(z + t * s_z_t + hv * s_z_h + of).to(tl.float32)
        y = _gated_rms(o.to(tl.float32)[None, :], zt[None, :], w, eps, V, SIGMOID)
        tl.store(out + (t * HV + hv) * V + ov[None, :], y.to(out.dtype.element_ty))
    else:
        tl.store(o_tmp + (t * HV + hv) * V + ov, o)
        tl.store(out + (t * HV + hv) * V + ov, tl.zeros([BV], dtype=out.dtype.element_ty), mask=(ov >= 0) & (slot < 0))
    i2 = tl.arange(0, 2 * K)
    cqk = tl.where(i2 < K, hk * K + i2, HK * K + hk * K + i2 - K)  # the key head's q and k channels
    if CONV:
        # the value channels of this slice are read by this program alone
        _store_window(win, D, cv, ov >= 0, new_v, live, W, WP)
        if group_of_one:  # the only program of its (sequence, key head)
            if NORM:
                _shift_window(win, D, cqk, i2 >= 0, xrow, live, W, WP)
            else:
                _store_qk_window(win, D, cq, ck, q_in, k_in, live, W)
    if counted:
        if live:
            tl.debug_barrier()  # every thread's o_tmp stores and window reads precede the release below
            cnt = counters + n * HK + hk
            arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
            if arrived == R * (V // BV) - 1:  # the last of the group: the q/k window is free, o_tmp complete
                tl.store(cnt, 0)
                if not NORM:
                    _store_qk_window(win, D, cq, ck, q_in, k_in, live, W)
                else:
                    # all loads of this tail in flight together (L2 hits: o_tmp, z and x were just written)
                    if CONV:
                        new_qk = _shifted_window(win, D, cqk, i2 >= 0, xrow, live, W, WP)
                    if BV < V:
                        hr = tl.arange(0, RP)
                        heads = hk * R + hr
                        hm = (hr[:, None] < R) & (of[None, :] >= 0)
                        ot = tl.load(o_tmp + (t * HV + heads[:, None]) * V + of[None, :], mask=hm, other=0.0,
                                     cache_modifier=".cg").to(tl.float32)
                        zt = tl.load(z + t * s_z_t + heads[:, None] * s_z_h + of[None, :], mask=hm,
                                     other=0.0).to(tl.float32)
                        y = _gated_rms(ot, zt, w, eps, V, SIGMOID)
                        tl.store(out + (t * HV + heads[:, None]) * V + of[None, :], y.to(out.dtype.element_ty),
                                 mask=hm)
                    if CONV:
                        _store_window(win, D, cqk, i2 >= 0, new_qk, live, W, WP)



def gdn_decode(
    mixed_qkv: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *,
    conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor,
    eps: float, scale: float, conv_state: torch.Tensor, ssm_state: torch.Tensor,
    state_indices: torch.Tensor, norm_activation: str = "silu", gated_norm: bool = True,
    conv_applied: bool = False, config: RecurrentConfig | None = None,
) -> torch.Tensor:
    """See reference.gdn_decode. With gated_norm=False the one-launch kernel's programs store their own
    slices of o and the group counter only orders the q/k window update (no o_tmp, no norm tail). With
    conv_applied=True (mixed_qkv from linear.rms_norm_linear_conv) no window is read or written: with
    gated_norm=False, or rows whole in one program, the one-launch kernel is the bare recurrence with no
    counter; the two launches skip the window blocks of the second (no second launch without the norm)."""
    op = "gdn_decode"
    gated_norm, conv_applied = bool(gated_norm), bool(conv_applied)
    T, D, HK, HV, K, V, W, z3 = check_layer_inputs(
        op, mixed_qkv, z, a, b, conv_weight, A_log, dt_bias, norm_weight, conv_state, ssm_state)
    sigmoid_gate = norm_activation_is_sigmoid(op, norm_activation)
    N = state_indices.shape[0]
    check_index(op, "state_indices", state_indices, T)
    out = torch.empty((T, HV, V), dtype=mixed_qkv.dtype, device=mixed_qkv.device)
    if T == 0 or N == 0:
        return out
    cfg = config or default_decode_config(N, HK, HV, V, pdl=has_pdl(mixed_qkv.device))
    check(not cfg.qk_prepass, op, "config qk_prepass applies to gdn_verify only")
    check(not cfg.gram, op, "config gram applies to gdn_verify only")
    check(V % cfg.bv == 0, op, f"config bv={cfg.bv} must divide V={V}")
    check(cfg.one_launch or not cfg.pdl, op, "config pdl applies to the one-launch path only")
    check(not cfg.pdl or has_pdl(mixed_qkv.device), op,
          "config pdl needs a CUDA device of compute capability 9.0 or newer")
    # without the gated norm the one-launch kernel writes o straight to `out`, the two launches' o_tmp is it
    o_tmp = out if not gated_norm else torch.empty((T, HV, V), dtype=mixed_qkv.dtype, device=mixed_qkv.device)
    if cfg.one_launch:
        _decode_fused_kernel[(V // cfg.bv, N * HV)](
            mixed_qkv, mixed_qkv.stride(0), z3, z3.stride(0), z3.stride(1), a, a.stride(0), b, b.stride(0),
            conv_weight, A_log, dt_bias, norm_weight, conv_state, ssm_state, state_indices, o_tmp, out,
            group_counters(mixed_qkv.device, N * HK), float(scale), float(eps), HK, HV, D, ssm_state.shape[0],
            R=HV // HK, RP=next_pow2(HV // HK), K=K, V=V, BV=cfg.bv, W=W, WP=next_pow2(W - 1),
            SIGMOID=sigmoid_gate, PDL=cfg.pdl, TRIGGER=has_pdl(mixed_qkv.device), NORM=gated_norm,
            CONV=not conv_applied, num_warps=cfg.num_warps, **({"launch_pdl": True} if cfg.pdl else {}))
        return out
    _tokens_kernel[(V // cfg.bv, N * HV)](
        mixed_qkv, mixed_qkv.stride(0), a, a.stride(0), b, b.stride(0), conv_weight, A_log, dt_bias,
        conv_state, ssm_state, state_indices, o_tmp, float(scale), HK, HV, D, R=HV // HK, K=K, V=V,
        BV=cfg.bv, W=W, CONV=not conv_applied, num_warps=cfg.num_warps)
    launch_finish(o_tmp, z3, norm_weight, out, mixed_qkv, conv_state, state_indices, None, eps, HV, D, V, W,
                  sigmoid_gate, gated_norm, conv_applied)
    return out  # (o_tmp itself without the gated norm)
