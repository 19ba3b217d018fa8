"""Triton KV store and attention prologue (same signatures as reference.store_kv / attention_prologue):
the step between the QKV projection and attention. One launch does the q / k RMSNorm, the partial RoPE and
the store of the rotated key and its value into the paged cache (instead of two norms, two rotations and
the store). On Hopper it is a programmatic dependent launch (waits before any load, releases the next)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..quant.fp8 import FP8_DTYPE, FP8_MAX, Fp8KvCache
from ..triton_common import (ACTIVATION_DTYPES, check, check_head_dim, check_last_contiguous, check_same_device,
                             pdl_launch_args)


_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def cache_value(x, mul, cache, KV8: tl.constexpr):
    """x (the key / value rounded to the activation dtype) as the cache stores it: for an FP8 cache the e4m3
    bits of clamp(x / multiplier) (Fp8KvCache.quantize: fp32 division, round to nearest even), else x in
    the cache dtype."""
    if KV8:
        qv = tl.math.div_rn(x.to(tl.float32), mul)
        qv = tl.minimum(tl.maximum(qv, -_MAX), _MAX).to(tl.float8e4nv)
        return qv.to(tl.uint8, bitcast=True)
    else:
        return x.to(cache.dtype.element_ty)


@triton.jit
def _store_kv_kernel(k, v, cache, slots, s_k_t, s_k_h, s_v_t, s_v_h, s_c_kv,
                     NKV: tl.constexpr, D: tl.constexpr, BH: tl.constexpr,
                     kv_scale=None, s_sc_kv=0, s_sc_h=0, KV8: tl.constexpr = False):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots + t).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, BH)[:, None]
        d = tl.arange(0, D)[None, :]
        m = (h < NKV) & (d < D)
        dst = cache + slot * (NKV * D) + h * D + d
        if KV8:
            k_mul = tl.load(kv_scale + h * s_sc_h, mask=h < NKV, other=1.0)
            v_mul = tl.load(kv_scale + s_sc_kv + h * s_sc_h, mask=h < NKV, other=1.0)
        else:
            k_mul = 1.0
            v_mul = 1.0
        tl.store(dst, cache_value(tl.load(k + t * s_k_t + h * s_k_h + d, mask=m), k_mul, cache, KV8), mask=m)
        tl.store(dst + s_c_kv, cache_value(tl.load(v + t * s_v_t + h * s_v_h + d, mask=m), v_mul, cache, KV8),
                 mask=m)


def split_cache(op: str, kv_cache: torch.Tensor | Fp8KvCache) -> tuple[torch.Tensor, Fp8KvCache | None]:
    """(the pool tensor, the Fp8KvCache or None), checked: a pool in an activation dtype, or an e4m3 pool with
    its multipliers [2, 1] (per tensor) or [2, kv_heads] fp32."""
    fp8 = kv_cache if isinstance(kv_cache, Fp8KvCache) else None
    cache = kv_cache.cache if fp8 is not None else kv_cache
    check(cache.dim() == 5 and cache.shape[0] == 2, op,
          f"kv_cache must be [2, blocks, block_size, kv_heads, head_dim], got {tuple(cache.shape)}")
    check(cache.is_contiguous(), op, "kv_cache must be contiguous (one layer's slice of the cache)")
    if fp8 is None:
        check(cache.dtype in ACTIVATION_DTYPES, op, f"unsupported kv_cache dtype {cache.dtype} (an FP8 pool comes "
              "as an Fp8KvCache with its multipliers)")
    else:
        nkv = cache.shape[-2]
        check(cache.dtype == FP8_DTYPE, op, f"an Fp8KvCache pool must be {FP8_DTYPE}, got {cache.dtype}")
        sc = fp8.scale
        check(sc.dim() == 2 and sc.shape[0] == 2 and sc.shape[1] in (1, nkv) and sc.dtype == torch.float32, op,
              f"Fp8KvCache scale must be fp32 [2, 1] or [2, {nkv}], got {sc.dtype} {tuple(sc.shape)}")
        check(sc.stride(1) == 1 or sc.shape[1] == 1, op, "Fp8KvCache scale rows must be contiguous")
        check_same_device(op, cache, sc)
    check_head_dim(op, "head_dim", cache.shape[-1])
    return cache, fp8


def kv8_args(fp8: Fp8KvCache | None) -> dict:
    """The FP8-cache launch arguments of the kernels that read or write the pool (none for a plain pool)."""
    if fp8 is None:
        return {}
    sc = fp8.scale
    return {"kv_scale": sc, "s_sc_kv": sc.stride(0), "s_sc_h": 0 if sc.shape[1] == 1 else 1, "KV8": True}


def pool(cache: torch.Tensor) -> torch.Tensor:
    """The pool as the kernels address it: e4m3 as its bits (uint8)."""
    return cache.view(torch.uint8) if cache.dtype == FP8_DTYPE else cache


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor | Fp8KvCache,
             slot_mapping: torch.Tensor) -> None:
    op = "store_kv"
    kv_cache, fp8 = split_cache(op, kv_cache)
    nkv, d = kv_cache.shape[-2], kv_cache.shape[-1]
    check(k.dim() == 3 and k.shape[1:] == (nkv, d) and v.shape == k.shape, op,
          f"k and v must be [T, {nkv}, {d}], got {tuple(k.shape)}, {tuple(v.shape)}")
    T = k.shape[0]
    check(slot_mapping.dim() == 1 and slot_mapping.shape[0] == T, op,
          f"slot_mapping must be [{T}], got {tuple(slot_mapping.shape)}")
    check(slot_mapping.dtype in (torch.int32, torch.int64), op,
          f"slot_mapping must be int32/int64, got {slot_mapping.dtype}")
    check(slot_mapping.is_contiguous(), op, "slot_mapping must be contiguous")
    check(k.dtype in ACTIVATION_DTYPES and v.dtype in ACTIVATION_DTYPES, op, f"unsupported dtypes {k.dtype}, {v.dtype}")
    check_last_contiguous(op, k=k, v=v)
    check_same_device(op, k, v, kv_cache, slot_mapping)
    if T == 0:
        return
    _store_kv_kernel[(T,)](k, v, pool(kv_cache), slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                           kv_cache.stride(0), NKV=nkv, D=d, BH=triton.next_power_of_2(nkv),
                           num_warps=4 if nkv * d >= 1024 else 2, **kv8_args(fp8))


@triton.jit
def _attn_prologue_kernel(q, k, v, q_w, k_w, cos, sin, q_out, cache, slots, eps,
                          s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h, s_cos, s_sin, s_c_kv,
                          NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, RD: tl.constexpr,
                          PDL: tl.constexpr = False, kv_scale=None, s_sc_kv=0, s_sc_h=0, KV8: tl.constexpr = False):
    """One (token, head) per program: heads 0..NH-1 are query heads (written to q_out), NH.. key heads
    (written with their value head to the token's cache slot; padding rows, slot < 0, store nothing)."""
    if PDL:                          # launched as a programmatic dependent: wait, then release the next
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    dims = tl.arange(0, D)
    HALF: tl.constexpr = RD // 2
    # rotate-half pairing: out[i] = y[i] cos[i] + sign[i] y[partner[i]] sin[i] on the first RD dims
    partner = tl.where(dims < HALF, dims + HALF, tl.where(dims < RD, dims - HALF, dims))
    sign = tl.where(dims < HALF, -1.0, 1.0)
    in_rd = dims < RD
    if h < NH:
        src = q + t * s_q_t + h * s_q_h
        w = q_w
        slot = t                                       # unused for query heads
    else:
        src = k + t * s_k_t + (h - NH) * s_k_h
        w = k_w
        slot = tl.load(slots + t).to(tl.int64)
    if slot >= 0:
        x = tl.load(src + dims).to(tl.float32)
        xp = tl.load(src + partner).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
        # the norm's output is rounded to the activation dtype first, as the reference's rms_norm is
        y = (x * rstd * (tl.load(w + dims).to(tl.float32) + 1.0)).to(q_out.dtype.element_ty).to(tl.float32)
        yp = (xp * rstd * (tl.load(w + partner).to(tl.float32) + 1.0)).to(q_out.dtype.element_ty).to(tl.float32)
        c = tl.load(cos + t * s_cos + dims, mask=in_rd, other=1.0).to(tl.float32)
        sn = tl.load(sin + t * s_sin + dims, mask=in_rd, other=0.0).to(tl.float32)
        out = y * c + sign * yp * sn
        if h < NH:
            tl.store(q_out + (t * NH + h) * D + dims, out.to(q_out.dtype.element_ty))
        else:
            kvh = h - NH
            if KV8:
                k_mul = tl.load(kv_scale + kvh * s_sc_h)
                v_mul = tl.load(kv_scale + s_sc_kv + kvh * s_sc_h)
            else:
                k_mul = 1.0
                v_mul = 1.0
            dst = cache + slot * (NKV * D) + kvh * D + dims
            tl.store(dst, cache_value(out.to(q_out.dtype.element_ty), k_mul, cache, KV8))
            vv = tl.load(v + t * s_v_t + kvh * s_v_h + dims)
            tl.store(dst + s_c_kv, cache_value(vv, v_mul, cache, KV8))


def check_prologue(op, q, k, v, q_norm_weight, k_norm_weight, cos, sin, kv_cache, slot_mapping) -> None:
    kv_cache, _ = split_cache(op, kv_cache)
    nkv, d = kv_cache.shape[-2], kv_cache.shape[-1]
    check(q.dim() == 3 and q.shape[-1] == d, op, f"q must be [T, heads, {d}], got {tuple(q.shape)}")
    T = q.shape[0]
    check(k.shape == (T, nkv, d) and v.shape == k.shape, op,
          f"k and v must be [{T}, {nkv}, {d}], got {tuple(k.shape)}, {tuple(v.shape)}")
    check(q_norm_weight.shape == (d,) and k_norm_weight.shape == (d,), op,
          f"norm weights must be [{d}], got {tuple(q_norm_weight.shape)}, {tuple(k_norm_weight.shape)}")
    rd = cos.shape[-1] if cos.dim() == 2 else -1
    check(cos.dim() == 2 and cos.shape[0] == T and sin.shape == cos.shape and rd % 2 == 0 and 0 < rd <= d, op,
          f"cos and sin must be [{T}, rotary_dim] with an even rotary_dim <= {d}, got {tuple(cos.shape)}, "
          f"{tuple(sin.shape)}")
    check(slot_mapping.dim() == 1 and slot_mapping.shape[0] == T, op,
          f"slot_mapping must be [{T}], got {tuple(slot_mapping.shape)}")
    check(slot_mapping.dtype in (torch.int32, torch.int64), op,
          f"slot_mapping must be int32/int64, got {slot_mapping.dtype}")
    check(slot_mapping.is_contiguous(), op, "slot_mapping must be contiguous")
    check(q.dtype in ACTIVATION_DTYPES and k.dtype == q.dtype and v.dtype == q.dtype, op,
          f"q, k, v must share a float dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    check_last_contiguous(op, q=q, k=k, v=v, cos=cos, sin=sin, q_norm_weight=q_norm_weight,
                          k_norm_weight=k_norm_weight)
    check_same_device(op, q, k, v, cos, sin, kv_cache, slot_mapping, q_norm_weight, k_norm_weight)


def attention_prologue(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
    eps: float, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor | Fp8KvCache, slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """See reference.attention_prologue: one launch instead of two norms, two rotations (a dozen
    elementwise kernels) and the store. fp32 math; the normed values are rounded to the activation dtype
    as the reference's rms_norm output is, and the rotation is rounded once (the reference rounds each
    of its bf16 multiplies and the add: at most an ulp apart)."""
    op = "attention_prologue"
    check_prologue(op, q, k, v, q_norm_weight, k_norm_weight, cos, sin, kv_cache, slot_mapping)
    kv_cache, fp8 = split_cache(op, kv_cache)
    T, nh, nkv, d, rd = q.shape[0], q.shape[1], kv_cache.shape[-2], kv_cache.shape[-1], cos.shape[-1]
    q_out = torch.empty((T, nh, d), dtype=q.dtype, device=q.device)
    if T == 0:
        return q_out
    _attn_prologue_kernel[(T, nh + nkv)](
        q, k, v, q_norm_weight, k_norm_weight, cos, sin, q_out, pool(kv_cache), slot_mapping, float(eps),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        kv_cache.stride(0), NH=nh, NKV=nkv, D=d, RD=rd, num_warps=2 if d <= 256 else 4, **pdl_launch_args(q.device),
        **kv8_args(fp8))
    return q_out
