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
"""

from __future__ import annotations

import torch


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    live = slot_mapping >= 0
    slots = slot_mapping[live].long()
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    flat[0, slots] = k[live].to(kv_cache.dtype)
    flat[1, slots] = v[live].to(kv_cache.dtype)


def paged_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, *, cu_seqlens: torch.Tensor, seq_lens: torch.Tensor,
    block_tables: torch.Tensor, scale: float,
) -> torch.Tensor:
    nh, nkv = q.shape[1], kv_cache.shape[-2]
    block_size = kv_cache.shape[2]
    out = torch.zeros_like(q)
    bounds = cu_seqlens.tolist()
    for n, ctx in enumerate(seq_lens.tolist()):
        s, e = bounds[n], bounds[n + 1]
        if e == s or ctx <= 0:
            continue
        nblocks = -(-ctx // block_size)
        blocks = block_tables[n, :nblocks].long()
        keys = kv_cache[0, blocks].reshape(-1, nkv, q.shape[-1])[:ctx]
        values = kv_cache[1, blocks].reshape(-1, nkv, q.shape[-1])[:ctx]
        if nh != nkv:
            keys = keys.repeat_interleave(nh // nkv, dim=1)
            values = values.repeat_interleave(nh // nkv, dim=1)
        qs = q[s:e].transpose(0, 1)                                  # [NH, L, D]
        scores = qs @ keys.to(q.dtype).permute(1, 2, 0) * scale     # [NH, L, ctx]
        q_pos = torch.arange(ctx - (e - s), ctx, device=q.device)
        k_pos = torch.arange(ctx, device=q.device)
        scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[s:e] = (probs @ values.to(q.dtype).transpose(0, 1)).transpose(0, 1)
    return out
