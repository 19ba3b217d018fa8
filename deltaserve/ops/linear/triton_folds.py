"""Triton helpers of the GEMV kernels' folds (triton_gemv.py): the pre-norm's residual sum, norm multiplier
and store of the normed rows, and rms_norm_linear_conv's conv epilogue (its L2 prefetch, its loads, the conv
and window shift)."""

from __future__ import annotations

import triton
import triton.language as tl

from ..triton_common import prefetch_l2, silu


@triton.jit
def residual_sum(x, r, x_off, r_off, mask, HAS_RES: tl.constexpr):
    """x (+ r, the sum rounded to x's dtype as the reference's `x + residual` is) at the given offsets."""
    v = tl.load(x + x_off, mask=mask, other=0.0)
    if HAS_RES:
        v = (v.to(tl.float32) + tl.load(r + r_off, mask=mask, other=0.0).to(tl.float32)).to(x.dtype.element_ty)
    return v


@triton.jit
def norm_multiplier(nw, k_idx, k_ok, ZC: tl.constexpr):
    """The norm's multiplier w' (1 + w zero-centred, else w) at k_idx, fp32."""
    w = tl.load(nw + k_idx, mask=k_ok, other=0.0).to(tl.float32)
    if ZC:
        w = w + 1.0
    return w


@triton.jit
def prenorm_store(x, r, nw, h, s, rstd, M, K, s_xm, s_rm, BM: tl.constexpr, PK: tl.constexpr,
                   HAS_RES: tl.constexpr, ZC: tl.constexpr):
    """Write the normed rows h = (x + r) * rstd * w' (rounded once, as the reference's) and the sum s
    (both [M, K] contiguous): the other readers of the normed input, and the next residual."""
    ms = tl.arange(0, BM)
    m_ok = ms < M
    kk = tl.arange(0, PK)
    for k0 in range(0, K, PK):
        ks = k0 + kk
        ok = m_ok[:, None] & (ks < K)[None, :]
        v = residual_sum(x, r, ms[:, None].to(tl.int64) * s_xm + ks[None, :],
                          ms[:, None].to(tl.int64) * s_rm + ks[None, :], ok, HAS_RES)
        if HAS_RES:
            tl.store(s + ms[:, None].to(tl.int64) * K + ks[None, :], v, mask=ok)
        hv = v.to(tl.float32) * rstd[:, None] * norm_multiplier(nw, ks, ks < K, ZC)[None, :]
        tl.store(h + ms[:, None].to(tl.int64) * K + ks[None, :], hv.to(v.dtype), mask=ok)



@triton.jit
def conv_prefetch(cst, cw, cidx, ch, tok, ok, CD, SLOTS, W: tl.constexpr):
    """Ask L2 for the window rows and taps the conv epilogue will load (a hint, no registers kept): issued
    before griddepcontrol.wait, from the slots found then (read at L2, clamped to the pool: a stale slot
    costs bandwidth, never a wrong value; the real slots are read after the wait)."""
    guess = tl.load(cidx + tok, mask=ok, other=-1, cache_modifier=".cg").to(tl.int64)
    cm = ok & (ch < CD)
    live = cm & (guess >= 0)
    win = cst + tl.minimum(tl.maximum(guess, 0), SLOTS - 1) * ((W - 1) * CD) + ch
    for i in tl.static_range(W - 1):
        prefetch_l2(win + i * CD, live)
    prefetch_l2(cw + ch * W, cm)


@triton.jit
def conv_loads(cst, cw, slot, ch, ok, CD, W: tl.constexpr):
    """Loads of the conv epilogue (rms_norm_linear_conv) for output channels ch of tokens whose slots are
    `slot` (tensors that broadcast to the output tile; ok: the tile's valid entries): the conv-channel mask
    (ch < CD), the live mask (a conv channel of a token whose slot is not -1), the window pointers of row 0,
    the slot window's W-1 rows oldest first (zeros where not live) and the W taps (conv weight [CD, W])."""
    cm = ok & (ch < CD)
    slot = slot.to(tl.int64)
    live = cm & (slot >= 0)
    win = cst + slot * ((W - 1) * CD) + ch
    olds = ()
    for i in tl.static_range(W - 1):
        olds = olds + (tl.load(win + i * CD, mask=live, other=0.0),)
    taps = ()
    for i in tl.static_range(W):
        taps = taps + (tl.load(cw + ch * W + i, mask=cm, other=0.0),)
    return cm, live, win, olds, taps


@triton.jit
def conv_epilogue(out, cm, live, win, olds, taps, CD, dtype: tl.constexpr, W: tl.constexpr):
    """The projection tile out (fp32) with its conv channels replaced by SiLU(depthwise causal conv) over
    [window rows, the projection rounded to dtype], and the window shifted to [rows 1.., that projection].
    The conv is gdn_decode's (triton_steps._conv_of): fp32 products of the inputs and taps added in tap
    order from zero, SiLU, one rounding to dtype, so its bits are the ones gdn_decode computes from the
    stored projection. Conv channels of padded tokens (slot -1) give zeros and leave the pool alone; the
    other channels (z, b, a) keep the projection."""
    xt = out.to(dtype)           # the stored projection: the conv's newest input and the window's new row
    acc = tl.zeros(out.shape, dtype=tl.float32)
    for i in tl.static_range(W):
        if i < W - 1:
            acc += olds[i].to(tl.float32) * taps[i].to(tl.float32)
        else:
            acc += xt.to(tl.float32) * taps[i].to(tl.float32)
    conv = silu(acc).to(dtype).to(tl.float32)
    tl.debug_barrier()           # every thread has read the old rows before any is overwritten
    for i in tl.static_range(W - 1):
        if i < W - 2:
            tl.store(win + i * CD, olds[i + 1], mask=live)
        else:
            tl.store(win + i * CD, xt.to(win.dtype.element_ty), mask=live)
    return tl.where(live, conv, tl.where(cm, 0.0, out))
