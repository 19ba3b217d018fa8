"""Paged causal attention in plain PyTorch: the reference for the full-attention layers.

Layouts:
  q            [T, NH, D]        packed query tokens of N sequences (cu_seqlens [N + 1])
  k, v         [T, NKV, D]       the new tokens' keys/values, stored by store_kv before attention
  kv_cache     [2, B, BS, NKV, D] one layer's paged cache: B blocks of BS token slots, [0] keys, [1] values
  slot_mapping [T]               flat cache slot (block * BS + offset) of each new token; -1 = padding
  block_tables [N, max_blocks]   the blocks of each sequence, in order
  seq_lens     [N]               context length of each sequence after this step (cached + new)

Query token i of a sequence sits at position seq_len - q_len + i and attends to cached positions
<= its own (causal). GQA: query head j uses KV head j // (NH / NKV). Scores and softmax as in
transformers' eager path: scores in the activation dtype, softmax in fp32 cast back, then @ v.

An FP8 KV cache (kv_cache an ops.quant Fp8KvCache: e4m3 values + per-tensor / per-head multipliers) is
quantised on store and dequantised to the activation dtype on read; every op here takes either.
"""

from __future__ import annotations

import torch

from ..norm.reference import rms_norm
from ..quant.fp8 import Fp8KvCache


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half ("NeoX") partial RoPE on the first rd = cos.shape[-1] dims of x [T, heads, D], pairing
    (i, i + rd/2), in x's dtype; the other dims pass through. cos, sin: [T, rd]."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    rot = rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat((rot, rest), dim=-1)


def attention_prologue(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
    eps: float, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Everything between the QKV projection and attention: zero-centred RMSNorm of each q and k head,
    partial RoPE of both, k and v stored into the paged cache. q [T, NH, D], k and v [T, NKV, D] (may be
    strided views of the projection output). Returns the rotated q, contiguous [T, NH, D]."""
    q = apply_rope(rms_norm(q, q_norm_weight, eps), cos, sin)
    k = apply_rope(rms_norm(k, k_norm_weight, eps), cos, sin)
    store_kv(k, v, kv_cache, slot_mapping)
    return q.contiguous()


def fused_paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
    eps: float, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
    cu_seqlens: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """attention_prologue then paged_attention: the whole attention core of a layer between the QKV
    projection and the output gate. `max_query_len` (optional): the longest query chunk of the batch, a
    promise the fused decode kernel relies on (1: every sequence has exactly one token); checked here."""
    if max_query_len is not None:
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0
        if max_query_len < 1 or longest > max_query_len:
            raise ValueError(f"fused_paged_attention: max_query_len={max_query_len} but a sequence has "
                             f"{longest} query tokens")
    q = attention_prologue(q, k, v, q_norm_weight, k_norm_weight, eps, cos, sin, kv_cache, slot_mapping)
    return paged_attention(q, kv_cache, cu_seqlens=cu_seqlens, seq_lens=seq_lens, block_tables=block_tables,
                           scale=scale)


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor | Fp8KvCache,
             slot_mapping: torch.Tensor) -> None:
    live = slot_mapping >= 0
    slots = slot_mapping[live].long()
    if isinstance(kv_cache, Fp8KvCache):
        cache = kv_cache.cache
        flat = cache.view(2, -1, cache.shape[-2], cache.shape[-1])
        flat[0, slots] = kv_cache.quantize(k[live], 0)
        flat[1, slots] = kv_cache.quantize(v[live], 1)
        return
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    flat[0, slots] = k[live].to(kv_cache.dtype)
    flat[1, slots] = v[live].to(kv_cache.dtype)


def paged_attention(
    q: torch.Tensor, kv_cache: torch.Tensor | Fp8KvCache, *, cu_seqlens: torch.Tensor, seq_lens: torch.Tensor,
    block_tables: torch.Tensor, scale: float,
) -> torch.Tensor:
    fp8 = kv_cache if isinstance(kv_cache, Fp8KvCache) else None
    if fp8 is not None:
        kv_cache = fp8.cache
    nh, d = q.shape[1], q.shape[2]
    nkv, block_size = kv_cache.shape[-2], kv_cache.shape[2]
    group = nh // nkv                        # query heads h*group .. h*group+group-1 share KV head h
    out = torch.zeros_like(q)
    bounds = cu_seqlens.tolist()
    for n, ctx in enumerate(seq_lens.tolist()):
        s, e = bounds[n], bounds[n + 1]
        L = e - s
        if L == 0 or ctx <= 0:
            continue
        blocks = block_tables[n, : -(-ctx // block_size)].long()
        kv = kv_cache[:, blocks].reshape(2, -1, nkv, d)[:, :ctx]
        kv = (kv.to(q.dtype) if fp8 is None else fp8.dequantize(kv, q.dtype)).transpose(1, 2)  # [2, NKV, ctx, D]
        qs = q[s:e].transpose(0, 1).reshape(nkv, group * L, d)     # [NKV, group*L, D]
        scores = (qs @ kv[0].transpose(1, 2) * scale).reshape(nkv, group, L, ctx)
        if L > 1:  # causal within the new tokens (a single decode token sees every cached position)
            q_pos = torch.arange(ctx - L, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] > q_pos[:, None]
            scores = scores.masked_fill(mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype).reshape(nkv, group * L, ctx)
        out[s:e] = (probs @ kv[1]).reshape(nh, L, d).transpose(0, 1)
    return out
