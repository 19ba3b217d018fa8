"""Triton attention ops (same signatures and masking as reference.py), by stage:

  triton_prologue.py  store_kv; attention_prologue (q / k RMSNorm, partial RoPE, KV store in one launch)
  triton_paged.py     paged_attention: varlen batches mixing prefill chunks and decodes, optional split-K
  triton_merge.py     the split-K merge
  triton_decode.py    the one-launch decode (prologue + attention) of fused_paged_attention
  config.py           the launch choices, from shapes and device

fused_paged_attention (here) picks its path from the batch: decode batches (one token per sequence) the
one-launch decode, others attention_prologue then paged_attention.

Every op takes an FP8 pool (kv_cache an ops.quant Fp8KvCache: e4m3 values + per-tensor / per-KV-head
multipliers) as the reference does: keys and values quantised on the store (clamp(x / multiplier), round to
nearest even) and dequantised on the load (value * multiplier rounded to q's dtype), in the kernels.
"""

from __future__ import annotations

import torch

from ..quant.fp8 import Fp8KvCache
from ..triton_common import check
from .config import AttentionConfig, DecodeAttentionConfig, default_attention_config, default_decode_config
from .triton_decode import decode_attention
from .triton_paged import check_attention, paged_attention
from .triton_prologue import attention_prologue, check_prologue, store_kv

__all__ = ["AttentionConfig", "DecodeAttentionConfig", "attention_prologue", "default_attention_config",
           "default_decode_config", "fused_paged_attention", "paged_attention", "store_kv"]


def fused_paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
    eps: float, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor | Fp8KvCache, slot_mapping: torch.Tensor, *,
    cu_seqlens: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
    max_query_len: int | None = None, config: DecodeAttentionConfig | None = None,
) -> torch.Tensor:
    """See reference.fused_paged_attention. With max_query_len == 1 (the caller promises one token per
    sequence; the reference checks it, this op cannot without a host sync) the one-launch decode
    (triton_decode.py) with `config` or default_decode_config; otherwise attention_prologue then
    paged_attention."""
    op = "fused_paged_attention"
    T, N = q.shape[0], seq_lens.shape[0]
    check(max_query_len is None or max_query_len >= 1, op, f"max_query_len must be >= 1, got {max_query_len}")
    decode = max_query_len == 1 and T == N
    check(config is None or decode, op, "config applies to the one-launch decode path only "
          "(max_query_len=1, one token per sequence)")
    if not decode:
        qr = attention_prologue(q, k, v, q_norm_weight, k_norm_weight, eps, cos, sin, kv_cache, slot_mapping)
        return paged_attention(qr, kv_cache, cu_seqlens=cu_seqlens, seq_lens=seq_lens, block_tables=block_tables,
                               scale=scale, max_query_len=max_query_len)
    check_prologue(op, q, k, v, q_norm_weight, k_norm_weight, cos, sin, kv_cache, slot_mapping)
    check_attention(op, q, kv_cache, cu_seqlens, seq_lens, block_tables, scale)
    return decode_attention(q, k, v, q_norm_weight, k_norm_weight, eps, cos, sin, kv_cache, slot_mapping,
                            seq_lens=seq_lens, block_tables=block_tables, scale=scale, config=config)
