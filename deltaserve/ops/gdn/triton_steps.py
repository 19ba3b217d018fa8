"""Device pieces shared by the token-by-token GDN kernels (`triton_recurrent`, `triton_verify`): the delta rule
on a register state slice, the causal conv of one token from the slot's window, window updates, the gated
RMSNorm, the finishing launch of the multi-launch paths, and the input checks of the whole-layer ops.

Work layout of those kernels: one program per (sequence, value head, V-slice of BV columns). The slot's [K, BV]
fp32 state slice lives in registers (rows of BV contiguous floats: coalesced, 16-byte vector loads); every column
of the state is independent, so splitting V costs nothing but the redundant (cheap) q / k work and gives enough
programs at batch 1. No host sync anywhere: every launch is CUDA-graph capturable once the batch shape is known;
padded rows (slot -1) are masked out on the device.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..triton_common import (
    check,
    check_head_dim,
    check_last_contiguous,
    check_pool,
    check_same_device,
    next_pow2,
    sigmoid,
    silu_fast,
)
from .reference import num_key_heads


@triton.jit
def _delta_step(S, kh, qh, v, g, beta):
    """One token on a [K, BV] fp32 state slice: decay, delta write, read-out (reference order)."""
    S = S * tl.exp(g)
    u = tl.sum(S * kh[:, None], axis=0)
    delta = beta * (v - u)
    S = S + kh[:, None] * delta[None, :]
    o = tl.sum(S * qh[:, None], axis=0)
    return S, o, delta


@triton.jit
def _l2norm(x):
    return x * tl.rsqrt(tl.sum(x * x, axis=0) + 1e-6)


@triton.jit
def _conv_token(x, s_x_t, win, D, conv_w, ch, t, bos, live, C: tl.constexpr, W: tl.constexpr):
    """SiLU(depthwise causal conv) of token t on channels ch ([C]); inputs before the sequence start
    (token bos) come from the slot's window `win` ([W-1, D], oldest first). Rounded to x's dtype."""
    acc = tl.zeros([C], dtype=tl.float32)
    for i in tl.static_range(W):
        p = t - (W - 1) + i
        in_x = (ch >= 0) & live & (p >= bos)
        in_w = (ch >= 0) & live & (p < bos)
        xv = tl.load(x + p * s_x_t + ch, mask=in_x, other=0.0).to(tl.float32)
        wv = tl.load(win + (W - 1 + p - bos) * D + ch, mask=in_w, other=0.0).to(tl.float32)
        acc += (xv + wv) * tl.load(conv_w + ch * W + i).to(tl.float32)
    return silu_fast(acc).to(x.dtype.element_ty).to(tl.float32)


@triton.jit
def _conv_inputs(xrow, win, D, conv_w, ch, live, W: tl.constexpr):
    """Loads of the one-token conv of channels ch ([C]): a tuple of W inputs (window rows oldest first,
    then x_t; zeros where not live) and a tuple of the W taps. Split from the math (_conv_of) so that a
    kernel can issue every load of a phase before it waits on one."""
    cm = ch >= 0
    inputs = ()
    taps = ()
    for i in tl.static_range(W):
        if i < W - 1:
            inputs = inputs + (tl.load(win + i * D + ch, mask=cm & live, other=0.0),)
        else:
            inputs = inputs + (tl.load(xrow + ch, mask=cm & live, other=0.0),)
        taps = taps + (tl.load(conv_w + ch * W + i),)
    return inputs, taps


@triton.jit
def _conv_of(inputs, taps, dtype: tl.constexpr, W: tl.constexpr):
    """SiLU(conv) from _conv_inputs in _conv_token's order (bit-identical to it), rounded to dtype."""
    acc = tl.zeros(inputs[0].shape, dtype=tl.float32)
    for i in tl.static_range(W):
        acc += inputs[i].to(tl.float32) * taps[i].to(tl.float32)
    return silu_fast(acc).to(dtype).to(tl.float32)


@triton.jit
def _shifted_window(win, D, ch, cm, xrow, live, W: tl.constexpr, WP: tl.constexpr):
    """The next window rows of channels ch (mask cm): [rows 1.., x_t], [WP, C] fp32."""
    r = tl.arange(0, WP)
    shifted = tl.load(win + (r[:, None] + 1) * D + ch[None, :], mask=(r[:, None] + 1 < W - 1) & cm[None, :] & live,
                      other=0.0)
    xt = tl.load(xrow + ch, mask=cm & live, other=0.0)
    return tl.where(r[:, None] == W - 2, xt[None, :].to(tl.float32), shifted.to(tl.float32))


@triton.jit
def _store_window(win, D, ch, cm, new, live, W: tl.constexpr, WP: tl.constexpr):
    """Write rows from _shifted_window after every thread of the program has read the old ones (the
    barrier); other programs must be done reading them."""
    r = tl.arange(0, WP)
    tl.debug_barrier()
    tl.store(win + r[:, None] * D + ch[None, :], new.to(win.dtype.element_ty),
             mask=(r[:, None] < W - 1) & cm[None, :] & live)


@triton.jit
def _shift_window(win, D, ch, cm, xrow, live, W: tl.constexpr, WP: tl.constexpr):
    """Window rows of channels ch (mask cm) <- [rows 1.., x_t]."""
    _store_window(win, D, ch, cm, _shifted_window(win, D, ch, cm, xrow, live, W, WP), live, W, WP)


@triton.jit
def _store_qk_window(win, D, cq, ck, q_in, k_in, live, W: tl.constexpr):
    """Window rows of the q and k channels cq, ck <- [rows 1.., x_t], from the _conv_inputs tuples that
    hold them (the old rows and x_t): stores only. Other programs must be done reading the old rows."""
    tl.debug_barrier()
    for r in tl.static_range(W - 1):
        tl.store(win + r * D + cq, q_in[r + 1].to(win.dtype.element_ty), mask=(cq >= 0) & live)
        tl.store(win + r * D + ck, k_in[r + 1].to(win.dtype.element_ty), mask=(ck >= 0) & live)


@triton.jit
def _gated_rms(ot, zt, w, eps, V: tl.constexpr, SIGMOID: tl.constexpr):
    """Gated RMSNorm of fp32 rows ot [H, V] with gate inputs zt [H, V] and weight w [V] (fp32)."""
    y = ot * tl.rsqrt(tl.sum(ot * ot, axis=1) / V + eps)[:, None] * w[None, :]
    if SIGMOID:
        gate = sigmoid(zt)
    else:
        gate = silu_fast(zt)
    return y * gate



# ---- fused decode / verify: launch 2 (gated RMSNorm + conv window / stash) ----------------------

@triton.jit
def _finish_kernel(o_tmp, z, s_z_t, s_z_h, norm_w, out, x, s_x_t, conv_state, idx, st_x, eps, HV, D,
                   NORM_BLOCKS, V: tl.constexpr, HB: tl.constexpr, BD: tl.constexpr, W: tl.constexpr,
                   WP: tl.constexpr, VERIFY: tl.constexpr, SIGMOID: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    if p < NORM_BLOCKS:
        heads = p * HB + tl.arange(0, HB)
        ov = tl.arange(0, V)
        hm = (heads[:, None] < HV) & (ov[None, :] >= 0)
        ot = tl.load(o_tmp + (t * HV + heads[:, None]) * V + ov[None, :], mask=hm, other=0.0).to(tl.float32)
        zt = tl.load(z + t * s_z_t + heads[:, None] * s_z_h + ov[None, :], mask=hm, other=0.0).to(tl.float32)
        w = tl.load(norm_w + ov).to(tl.float32)
        y = _gated_rms(ot, zt, w, eps, V, SIGMOID)
        tl.store(out + (t * HV + heads[:, None]) * V + ov[None, :], y.to(out.dtype.element_ty), mask=hm)
    else:
        ch = (p - NORM_BLOCKS) * BD + tl.arange(0, BD)
        cm = ch < D
        if VERIFY:
            xt = tl.load(x + t * s_x_t + ch, mask=cm, other=0.0)
            tl.store(st_x + t * D + ch, xt.to(st_x.dtype.element_ty), mask=cm)
        else:  # window <- [window[1:], x_t]
            slot = tl.load(idx + t).to(tl.int64)
            _shift_window(conv_state + slot * ((W - 1) * D), D, ch, cm, x + t * s_x_t, slot >= 0, W, WP)


def group_counters(device: torch.device, groups: int) -> torch.Tensor:
    """Zeroed int32 counters, one per (sequence, key head), for _decode_fused_kernel; every launch leaves
    them zero again. Shared by all calls on a device (calls on one device are stream-ordered in the
    engine; two gdn_decode launches must not run concurrently)."""
    return _zeroed_counters(device, next_pow2(max(groups, 4096)))


@functools.cache
def _zeroed_counters(device: torch.device, size: int) -> torch.Tensor:
    # The one cache in the ops: the op's signature has no workspace, and zeroing a fresh buffer on every
    # call would add back the launch that the one-launch path removes.
    return torch.zeros(size, dtype=torch.int32, device=device)


def check_layer_inputs(op, mixed_qkv, z, a, b, conv_weight, A_log, dt_bias, norm_weight, conv_state, ssm_state):
    check(mixed_qkv.dim() == 2, op, f"mixed_qkv must be [T, D], got {tuple(mixed_qkv.shape)}")
    T, D = mixed_qkv.shape
    check(ssm_state.dim() == 4, op, f"ssm_state must be [S, HV, K, V], got {tuple(ssm_state.shape)}")
    HV, K, V = ssm_state.shape[1:]
    check_head_dim(op, "K", K)
    check_head_dim(op, "V", V)
    try:
        HK = num_key_heads(D, HV, K, V)
    except ValueError as exc:
        raise ValueError(f"{op} (triton): {exc}") from None
    check(z.shape in ((T, HV, V), (T, HV * V)), op, f"z must be [{T}, {HV}, {V}], got {tuple(z.shape)}")
    check(a.shape == (T, HV) and b.shape == (T, HV), op, f"a and b must be [{T}, {HV}]")
    check(conv_weight.dim() == 2 and conv_weight.shape[0] == D and conv_weight.is_contiguous(), op,
          f"conv_weight must be contiguous [{D}, W], got {tuple(conv_weight.shape)}")
    W = conv_weight.shape[1]
    check(2 <= W <= 8, op, f"conv width {W} outside 2..8")
    check(tuple(conv_state.shape[1:]) == (W - 1, D) and conv_state.is_contiguous(), op,
          f"conv_state must be contiguous [S, {W - 1}, {D}], got {tuple(conv_state.shape)}")
    check(A_log.shape == (HV,) and dt_bias.shape == (HV,) and norm_weight.shape == (V,), op,
          f"A_log, dt_bias must be [{HV}] and norm_weight [{V}]")
    check(mixed_qkv.dtype in (torch.bfloat16, torch.float16, torch.float32), op,
          f"unsupported activation dtype {mixed_qkv.dtype}")
    check_last_contiguous(op, mixed_qkv=mixed_qkv, z=z, a=a, b=b)
    check_pool(op, ssm_state, HV, K, V)
    check_same_device(op, mixed_qkv, z, a, b, conv_weight, A_log, dt_bias, norm_weight, conv_state, ssm_state)
    z3 = z.view(T, HV, V) if z.dim() == 2 else z
    return T, D, HK, HV, K, V, W, z3


def norm_activation_is_sigmoid(op: str, name: str) -> bool:
    check(name in ("silu", "swish", "sigmoid"), op, f"unsupported gate activation {name!r}")
    return name == "sigmoid"




def launch_finish(o_tmp, z3, norm_weight, out, mixed_qkv, conv_state, state_indices, stash_x, eps, HV, D, V, W,
                  sigmoid_gate, gated_norm, conv_applied) -> None:
    """The multi-launch paths' last launch (`_finish_kernel`): the gated norm of o_tmp into out (if gated_norm)
    and the window update (decode: stash_x None, unless the conv was applied already) or the copy of the inputs
    into the stash (verify)."""
    T = mixed_qkv.shape[0]
    HB = max(1, min(next_pow2(HV), 4096 // V))
    BD = 1024
    norm_blocks = triton.cdiv(HV, HB) if gated_norm else 0  # without the norm: the window update only
    window_blocks = 0 if conv_applied else triton.cdiv(D, BD)  # conv applied: the window is shifted already
    if norm_blocks + window_blocks:
        verify = stash_x is not None
        _finish_kernel[(T, norm_blocks + window_blocks)](
            o_tmp, z3, z3.stride(0), z3.stride(1), norm_weight, out, mixed_qkv, mixed_qkv.stride(0), conv_state,
            state_indices, stash_x if verify else o_tmp, float(eps), HV, D, norm_blocks, V=V, HB=HB, BD=BD, W=W,
            WP=next_pow2(W - 1), VERIFY=verify, SIGMOID=sigmoid_gate, num_warps=4)
