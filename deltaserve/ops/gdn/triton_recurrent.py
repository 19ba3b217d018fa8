"""Triton kernels for the token-by-token forms of the gated delta rule (same signatures as reference.py):
gates, plain decode, the fused decode of a whole GDN layer, speculative verify and its commit.

Layout of the work: one program per (sequence, value head, V-slice of BV columns). The slot's [K, BV]
fp32 state slice lives in registers (rows of BV contiguous floats: coalesced, 16-byte vector loads);
every column of the state is independent, so splitting V costs nothing but the redundant (cheap)
q/k work, and gives enough programs at batch 1. No host sync anywhere: all launches are CUDA-graph
capturable once the batch shape is known; padded rows (slot -1) are masked out on the device.

The fused decode has two forms, picked on the host from the batch size (default_decode_config):
- small batches, one launch (_decode_fused_kernel): per (sequence, value head, V-slice) conv + SiLU +
  gates + L2 norm + delta rule, then the gated RMSNorm and the conv-window update. Both need the programs
  of a key head to cooperate: the q/k window channels are read by all of them, and the norm needs all
  slices of a row. Each program counts itself in on a per-(sequence, key head) counter after its reads
  and writes; the last one to arrive shifts the q/k window and (with V split) normalises the rows, then
  resets the counter to zero. A program's own value channels of the window are read by it alone, so it
  shifts them itself. With whole-row programs (BV = V) the norm needs no other program. For the
  smallest batches on compute capability 9.0+ it is launched as a programmatic dependent (PDL) of the
  kernel before it: it starts while that one drains and waits for it before its first read.
- large batches, two launches: (1) the same per-program math writing the un-normalised output; (2) the
  gated RMSNorm and the conv-window update (after every program of (1) has read the old window).
With gated_norm=False (the layer's batch-1 decode, whose out_proj applies the norm: linear.gated_linear)
the one-launch kernel has no norm tail: each program stores its own slice of o, and the counter only
tells the group's last program that every program has read the q/k window, which it then rewrites from
the conv inputs it holds (stores only); the two launches skip the norm blocks of (2).
With conv_applied=True the input projection has done the conv and the window shift in its GEMV's epilogue
(linear.rms_norm_linear_conv: the program that produces a channel's projection row holds everything the
depthwise conv of that channel needs), and mixed_qkv holds the conv's output: no program reads or writes a
window, and without a norm of split rows nothing is left for the counter (the bare recurrence: gates, q/k
L2 norm, delta rule).
Verify has two forms, picked on the host from the shapes (default_verify_config):
- small batches (at most VERIFY_ONE_LAUNCH_MAX_ROWS (sequence, value head) rows), one launch
  (_verify_fused_kernel, programmatic on 9.0+): per (sequence, value head, V-slice) the conv, norms and
  gates of the sequence's tokens, the T_n delta steps and the stash, the gated norm of split rows by the
  group's last program on a per-(sequence, value head) counter (none with gated_norm=False: each program
  stores its own slice of o). The pools are only read, so nothing else needs coordinating. With
  RecurrentConfig.qk_prepass the q / k half of that prologue runs once per token and key head in a pre-kernel
  launched just before (the pre-pass below, q / k heads only). With
  RecurrentConfig.gram each unrolled chunk of tokens comes from the state it starts with and the tokens' q / k
  dot products (the chunked prefill's algebra), not token after token: independent reductions over the state
  slice, a short scalar substitution, and no state update unless another chunk follows.
- otherwise three: a token-parallel pre-pass (conv + SiLU, q/k L2 norms, gates of every token, once per
  head instead of once per V-slice), the recurrence over the T_n tokens (state math only), and (2) with
  the copy of the inputs into the stash instead of the window update.
Both write the same outputs and stash (bit for bit under the interpreter; fp32 rounding of other
reduction orders on the GPU).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..triton_common import (
    check, check_head_dim, check_index, check_last_contiguous, check_pool, check_same_device,
    next_pow2, prefetch_l2, sigmoid, silu_fast, softplus,
)
from .reference import VerifyStash, num_key_heads


@dataclasses.dataclass(frozen=True)
class RecurrentConfig:
    """Launch shape of the per-token kernels. bv: state columns per program; num_warps per program;
    one_launch (gdn_decode only): the gated norm and the window update in the token kernel.
    One-launch only: pdl (compute capability 9.0+) launches it as a programmatic dependent of the
    previous kernel (it starts while that one drains and waits for it with griddepcontrol.wait before
    reading anything); prefetch (with pdl) asks L2 for the slot's state and window lines before that
    wait; state_after_release stores the new state after the program's arrival on its group counter
    instead of before (so the release's fence does not wait for the state stores).
    qk_prepass (one-launch gdn_verify only): the tokens' q / k conv, SiLU and norms in a token-parallel
    pre-kernel launched just before (programmatically with pdl), once per token and key head, instead of in each
    of the key head's (value head, V-slice) programs (session 9: that prologue is ~25-40 % of a program's
    instructions, and the per-token cost follows the instructions).
    gram (one-launch gdn_verify only): each unrolled chunk of a sequence's tokens from the state it starts with and
    the tokens' q / k dot products (the chunked prefill's algebra on TB tokens) instead of token after token: the
    2 TB reductions over the state slice are independent, only a scalar x vector substitution is sequential, and
    the state is not updated at all unless another chunk follows (the same delta and outputs up to fp32 rounding;
    the commit is unchanged)."""

    bv: int = 32
    num_warps: int = 4
    one_launch: bool = False
    pdl: bool = False
    prefetch: bool = True
    state_after_release: bool = False
    qk_prepass: bool = False
    gram: bool = False


def default_recurrent_config(num_programs_bv32: int, v: int) -> RecurrentConfig:
    """Plain decode (measured on the H200, docs/PERFORMANCE.md): 64-column slices with 4 warps from
    batch ~8 up (3.9-4.07 TB/s at B >= 64); 16-column slices with 2 warps at batch 1-4 (more programs)."""
    if num_programs_bv32 >= 1024:
        return RecurrentConfig(bv=min(64, v), num_warps=4)
    return RecurrentConfig(bv=min(16, v), num_warps=2)


def default_tokens_config(num_programs_bv32: int, v: int) -> RecurrentConfig:
    """Fused decode / verify (conv + gates + norm + delta rule per program), measured on the H200:
    32-column slices with 2 warps from batch ~8 up (gdn_decode B=64 83 us vs 101 with 4 warps; verify
    T=4 B=64 219 us vs 284), one-warp 8-column slices at batch 1-4."""
    if num_programs_bv32 >= 1024:
        return RecurrentConfig(bv=min(32, v), num_warps=2)
    return RecurrentConfig(bv=min(8, v), num_warps=1)


def default_decode_config(n: int, hk: int, hv: int, v: int, pdl: bool = False) -> RecurrentConfig:
    """gdn_decode for n sequences (host-side rule from shapes and the device's PDL support only, so
    graph capture sees one path). Measured on the H200 (benchmarks/gdn_decode_latency.py,
    docs/PERFORMANCE.md): one launch up to ONE_LAUNCH_MAX_ROWS sequences (at 64 two launches win:
    85 vs 99 us); one-warp 16-column slices up to 256 (sequence, value head) rows while a key head has
    at most 16 programs (counted in one by one on its counter: 24 were slower), two-warp 32-column
    slices otherwise. Programmatic launch with the L2 prefetch (where `pdl`: the device has it) up to
    PDL_MAX_ROWS rows: at B = 1 5.67 us against 6.15 without, at B = 16 30.7 against 26.6 (the
    prefetch doubles the L2 requests of a kernel that is by then bandwidth-bound)."""
    if n <= ONE_LAUNCH_MAX_ROWS:
        narrow = n * hv <= 256 and (hv // hk) * (v // 16) <= 16
        bv, warps = (16, 1) if narrow else (32, 2)
        return RecurrentConfig(bv=min(bv, v), num_warps=warps, one_launch=True, pdl=pdl and n * hv <= PDL_MAX_ROWS)
    return default_tokens_config(n * hv * max(v // 32, 1), v)


def default_verify_config(n: int, t: int, hk: int, hv: int, v: int, pdl: bool = False) -> RecurrentConfig:
    """gdn_verify of t tokens over n sequences (host-side rule from shapes and PDL support only, so graph
    capture sees one path): one launch (_verify_fused_kernel) up to VERIFY_ONE_LAUNCH_MAX_ROWS (sequence,
    value head) rows at up to VERIFY_MAX_CHUNK tokens per sequence on average, where the three dependent
    launches of the token-parallel path are the time; programmatic where the device has it. Measured on
    the H200 (docs/PERFORMANCE.md, session 7): B = 1, T = 2 7.26 us vs 8.94 for the three launches, T = 4
    10.39 vs 11.03; the launch shapes tried (8..32 columns, 1..4 warps) within 7 % of each other. From 2
    tokens per sequence on average, one-warp 8-column programs (runs S7-V1 / S8-1 / S8-13 / S8-16, T = 4:
    9.81 / 9.30 / 10.19 / 9.32 us against 10.39 / 10.04 / 10.40 / 10.02 for 16 columns and 2 warps; session 9
    with silu_fast, run S9-H: T = 2 / 3 / 4 / 8 6.61 / 8.12 / 8.76 / 13.05 against 6.82 / 8.63 / 9.34 / 14.46).
    From 3 tokens per sequence, with PDL, the q / k pre-kernel (qk_prepass; session 10, run S10-1, B = 1: T = 3 / 4
    / 8 7.67 / 8.30 / 11.28 us against 8.16 / 8.82 / 13.07; B = 2: T = 4 / 8 9.59 / 13.04 against 10.37 / 14.63;
    below 3 tokens its launch costs more than it saves: B = 1, T = 1 / 2 5.89 / 7.11 against 5.20 / 6.61).
    Where the unrolled chunk is 2 tokens (verify_chunk: more than 1, at most 2 per sequence on average) the gram
    form (session 11, runs S11-2 / 3 / 4, with PDL: B = 1, T = 2 6.02 / 6.07 us against 6.57 / 6.60; B = 2, T = 2
    7.54 us with 16-column two-warp programs against 8.40 for the default and 7.83 for 8 columns); from 3 tokens it
    was slower (T = 3 / 4 / 8: 8.3 / 8.5 / 14.7 us with the pre-kernel
    against 7.6 / 8.2 / 11.2: its TB^2 dot products and registers outgrow what it saves; 4-column programs were
    slower everywhere: T = 4 9.28 us with the pre-kernel)."""
    if n * hv <= VERIFY_ONE_LAUNCH_MAX_ROWS and t <= VERIFY_MAX_CHUNK * n:
        if verify_chunk(t, n) == 2:
            wide = n * hv > 32
            return RecurrentConfig(bv=min(16 if wide else 8, v), num_warps=2 if wide else 1, one_launch=True,
                                   pdl=pdl, gram=True)
        if t >= 2 * n:
            return RecurrentConfig(bv=min(8, v), num_warps=1, one_launch=True, pdl=pdl,
                                   qk_prepass=pdl and t >= 3 * n)
        return RecurrentConfig(bv=min(16, v), num_warps=2, one_launch=True, pdl=pdl)
    return default_tokens_config(n * hv * max(v // 32, 1), v)


def verify_chunk(t: int, n: int) -> int:
    """Tokens per unrolled chunk of the one-launch verify: the mean tokens per sequence (power of two,
    at most VERIFY_MAX_CHUNK); longer sequences take several chunks (any length is correct)."""
    return min(next_pow2(max(1, -(-t // max(n, 1)))), VERIFY_MAX_CHUNK)


def has_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch (griddepcontrol): CUDA devices of compute capability 9.0 and newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


# gdn_decode batches up to this size take the one-launch path.
ONE_LAUNCH_MAX_ROWS = 16
# ... and up to this many (sequence, value head) rows it is launched programmatically (measured at 32
# rows, B = 1, and 512, B = 16; nothing in between).
PDL_MAX_ROWS = 64
# gdn_verify takes the one-launch path up to this many (sequence, value head) rows (B = 2 at 32 value
# heads: where the three launches of the token-parallel path dominate) ...
VERIFY_ONE_LAUNCH_MAX_ROWS = 64
# ... and up to this many tokens per sequence on average (the unrolled chunk of _verify_fused_kernel).
VERIFY_MAX_CHUNK = 8


# ---- shared device pieces -----------------------------------------------------------------------

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
                         SIGMOID: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
                         STATE_AFTER_RELEASE: tl.constexpr, TRIGGER: tl.constexpr = False,
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
        if PREFETCH:
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
    if not counted or not STATE_AFTER_RELEASE:
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
            if STATE_AFTER_RELEASE:  # the release then waits for the small stores only
                tl.store(sp, S, mask=smask)
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
                         TB: tl.constexpr, SIGMOID: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
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
        if PREFETCH:
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
        # may alias stays behind it, which put a DRAM round trip on every token's chain (session 7)
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


def _group_counters(device: torch.device, groups: int) -> torch.Tensor:
    """Zeroed int32 counters, one per (sequence, key head), for _decode_fused_kernel; every launch leaves
    them zero again. Shared by all calls on a device (calls on one device are stream-ordered in the
    engine; two gdn_decode launches must not run concurrently)."""
    return _zeroed_counters(device, next_pow2(max(groups, 4096)))


@functools.cache
def _zeroed_counters(device: torch.device, size: int) -> torch.Tensor:
    # The one cache in the ops: the op's signature has no workspace, and zeroing a fresh buffer on every
    # call would add back the launch that the one-launch path removes.
    return torch.zeros(size, dtype=torch.int32, device=device)


def _check_layer_inputs(op, mixed_qkv, z, a, b, conv_weight, A_log, dt_bias, norm_weight, conv_state, ssm_state):
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


def _norm_activation(op: str, name: str) -> bool:
    check(name in ("silu", "swish", "sigmoid"), op, f"unsupported gate activation {name!r}")
    return name == "sigmoid"


def _layer_tokens(mixed_qkv, z, a, b, conv_weight, A_log, dt_bias, norm_weight, eps, scale, conv_state,
                  ssm_state, state_indices, cu_seqlens, stash, norm_activation, config, op, gated_norm=True,
                  conv_applied=False):
    T, D, HK, HV, K, V, W, z3 = _check_layer_inputs(
        op, mixed_qkv, z, a, b, conv_weight, A_log, dt_bias, norm_weight, conv_state, ssm_state)
    sigmoid_gate = _norm_activation(op, norm_activation)
    verify = cu_seqlens is not None
    N = state_indices.shape[0]
    check_index(op, "state_indices", state_indices, N if verify else T)
    if verify:
        check_index(op, "cu_seqlens", cu_seqlens, N + 1)
        stash.check(T, D, HK, K, HV, V)
    out = torch.empty((T, HV, V), dtype=mixed_qkv.dtype, device=mixed_qkv.device)
    if T == 0 or N == 0:
        return out
    if verify:
        cfg = config or default_verify_config(N, T, HK, HV, V, pdl=has_pdl(mixed_qkv.device))
        check(not cfg.state_after_release, op, "config state_after_release applies to gdn_decode only")
        check(cfg.one_launch or not cfg.qk_prepass, op, "config qk_prepass applies to the one-launch verify only")
        check(cfg.one_launch or not cfg.gram, op, "config gram applies to the one-launch verify only")
    else:
        cfg = config or default_decode_config(N, HK, HV, V, pdl=has_pdl(mixed_qkv.device))
        check(not cfg.qk_prepass, op, "config qk_prepass applies to gdn_verify only")
        check(not cfg.gram, op, "config gram applies to gdn_verify only")
    check(V % cfg.bv == 0, op, f"config bv={cfg.bv} must divide V={V}")
    check(cfg.one_launch or not (cfg.pdl or cfg.state_after_release), op,
          "config pdl / state_after_release apply to the one-launch paths only")
    check(not cfg.pdl or has_pdl(mixed_qkv.device), op,
          "config pdl needs a CUDA device of compute capability 9.0 or newer")
    # without the gated norm the one-launch kernel writes o straight to `out`, the two launches' o_tmp is it
    o_tmp = out if not gated_norm else torch.empty((T, HV, V), dtype=mixed_qkv.dtype, device=mixed_qkv.device)
    if cfg.one_launch and verify:
        qn = o_tmp  # an argument the kernel does not read without the pre-pass
        if cfg.qk_prepass:
            qn = torch.empty((T, HK, K), dtype=torch.float32, device=mixed_qkv.device)
            _verify_prep_kernel[(T, 2 * HK)](
                mixed_qkv, mixed_qkv.stride(0), a, a.stride(0), b, b.stride(0), conv_weight, A_log, dt_bias,
                conv_state, state_indices, cu_seqlens, N, qn, qn, stash.k, stash.g, qn, stash.x, float(scale), HK,
                HV, D, K=K, V=V, W=W, BLOCK_N=max(16, next_pow2(N)), QK_ONLY=True, PDL=cfg.pdl,
                TRIGGER=has_pdl(mixed_qkv.device), num_warps=1, **({"launch_pdl": True} if cfg.pdl else {}))
        _verify_fused_kernel[(V // cfg.bv, N * HV)](
            mixed_qkv, mixed_qkv.stride(0), z3, z3.stride(0), z3.stride(1), a, a.stride(0), b, b.stride(0),
            conv_weight, A_log, dt_bias, norm_weight, conv_state, ssm_state, state_indices, cu_seqlens, o_tmp, out,
            stash.x, stash.k, stash.g, stash.delta, _group_counters(mixed_qkv.device, N * HV), float(scale),
            float(eps), HK, HV, D, ssm_state.shape[0], qn, R=HV // HK, K=K, V=V, BV=cfg.bv, W=W,
            TB=verify_chunk(T, N), SIGMOID=sigmoid_gate, PDL=cfg.pdl, PREFETCH=cfg.prefetch,
            TRIGGER=has_pdl(mixed_qkv.device), QK_IN=cfg.qk_prepass, GRAM=cfg.gram, NORM=gated_norm,
            num_warps=cfg.num_warps,
            **({"launch_pdl": True} if cfg.pdl else {}))
        return out
    if cfg.one_launch:
        _decode_fused_kernel[(V // cfg.bv, N * HV)](
            mixed_qkv, mixed_qkv.stride(0), z3, z3.stride(0), z3.stride(1), a, a.stride(0), b, b.stride(0),
            conv_weight, A_log, dt_bias, norm_weight, conv_state, ssm_state, state_indices, o_tmp, out,
            _group_counters(mixed_qkv.device, N * HK), float(scale), float(eps), HK, HV, D, ssm_state.shape[0],
            R=HV // HK, RP=next_pow2(HV // HK), K=K, V=V, BV=cfg.bv, W=W, WP=next_pow2(W - 1),
            SIGMOID=sigmoid_gate, PDL=cfg.pdl, PREFETCH=cfg.prefetch,
            STATE_AFTER_RELEASE=cfg.state_after_release, TRIGGER=has_pdl(mixed_qkv.device), NORM=gated_norm,
            CONV=not conv_applied, num_warps=cfg.num_warps, **({"launch_pdl": True} if cfg.pdl else {}))
        return out
    dummy = o_tmp  # pointer arguments that the decode variant never touches
    if verify:
        f32 = torch.float32
        qn = torch.empty((T, HK, K), dtype=f32, device=mixed_qkv.device)
        vn = torch.empty((T, HV, V), dtype=mixed_qkv.dtype, device=mixed_qkv.device)
        bn = torch.empty((T, HV), dtype=f32, device=mixed_qkv.device)
        _verify_prep_kernel[(T, 2 * HK + HV)](
            mixed_qkv, mixed_qkv.stride(0), a, a.stride(0), b, b.stride(0), conv_weight, A_log, dt_bias, conv_state,
            state_indices, cu_seqlens, N, qn, vn, stash.k, stash.g, bn, stash.x, float(scale), HK, HV, D, K=K, V=V,
            W=W, BLOCK_N=max(16, next_pow2(N)), num_warps=1)
        _verify_rec_kernel[(V // cfg.bv, N * HV)](
            qn, stash.k, vn, stash.g, bn, ssm_state, state_indices, cu_seqlens, o_tmp, stash.delta, HK, HV,
            R=HV // HK, K=K, V=V, BV=cfg.bv, num_warps=cfg.num_warps)
    else:
        _tokens_kernel[(V // cfg.bv, N * HV)](
            mixed_qkv, mixed_qkv.stride(0), a, a.stride(0), b, b.stride(0), conv_weight, A_log, dt_bias,
            conv_state, ssm_state, state_indices, o_tmp, float(scale), HK, HV, D, R=HV // HK, K=K, V=V,
            BV=cfg.bv, W=W, CONV=not conv_applied, num_warps=cfg.num_warps)
    HB = max(1, min(next_pow2(HV), 4096 // V))
    BD = 1024
    norm_blocks = triton.cdiv(HV, HB) if gated_norm else 0  # without the norm: the window update only
    window_blocks = 0 if conv_applied else triton.cdiv(D, BD)  # conv applied: the window is shifted already
    if norm_blocks + window_blocks:
        _finish_kernel[(T, norm_blocks + window_blocks)](
            o_tmp, z3, z3.stride(0), z3.stride(1), norm_weight, out, mixed_qkv, mixed_qkv.stride(0), conv_state,
            state_indices, stash.x if verify else dummy, float(eps), HV, D, norm_blocks, V=V, HB=HB, BD=BD, W=W,
            WP=next_pow2(W - 1), VERIFY=verify, SIGMOID=sigmoid_gate, num_warps=4)
    return out  # (o_tmp itself without the gated norm)


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
    return _layer_tokens(mixed_qkv, z, a, b, conv_weight, A_log, dt_bias, norm_weight, eps, scale, conv_state,
                         ssm_state, state_indices, None, None, norm_activation, config, "gdn_decode",
                         gated_norm=bool(gated_norm), conv_applied=bool(conv_applied))


def gdn_verify(
    mixed_qkv: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *,
    conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor,
    eps: float, scale: float, cu_seqlens: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
    state_indices: torch.Tensor, stash: VerifyStash, norm_activation: str = "silu", gated_norm: bool = True,
    config: RecurrentConfig | None = None,
) -> torch.Tensor:
    """See reference.gdn_verify. With gated_norm=False the one-launch kernel's programs store their own slices of
    o: no counter, no norm tail (the three launches skip the norm blocks of their last)."""
    return _layer_tokens(mixed_qkv, z, a, b, conv_weight, A_log, dt_bias, norm_weight, eps, scale, conv_state,
                         ssm_state, state_indices, cu_seqlens, stash, norm_activation, config, "gdn_verify",
                         gated_norm=bool(gated_norm))


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
