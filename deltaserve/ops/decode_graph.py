"""The decode-graph backend: forms of the reference ops for decode-only batches (one token per sequence, no
padded rows) written without host reads, so that a whole decode step traces into one torch.compile graph
(the compiled CPU decode step, runner/cpu_compile.py). Same math as the references (checked against them in
tests); the other ops keep their reference.

Two changes make the step cheaper without changing its numbers beyond fp32 rounding:
  - a projection weight stored narrower than its input (bf16 copies of exact fp32 weights) is widened
    inside the product loop: the same products and fp32 accumulation, half the weight bytes, which is what
    bounds a single-token step once dispatch is gone;
  - pool writes index the pool itself (blocks, offsets), so they stay in place in a compiled graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .activation import reference as activation_ref
from .attention import reference as attention_ref
from .gdn import reference as gdn_ref
from .moe import reference as moe_ref
from .norm import reference as norm_ref

BACKEND = "decode-graph"


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T; a weight of a narrower dtype than x (bf16 under fp32) is widened in the
    loop (inductor fuses the cast into the reduction), F.linear otherwise."""
    if weight.dtype == x.dtype:
        return F.linear(x, weight)
    return (x[..., None, :] * weight.to(x.dtype)).sum(-1)


def rms_norm_linear(x, residual, norm_weight, eps, weight, *, zero_centered=True):
    """reference rms_norm_linear with this backend's `linear`."""
    if residual is None:
        normed, total = norm_ref.rms_norm(x, norm_weight, eps, zero_centered=zero_centered), x
    else:
        normed, total = norm_ref.rms_norm(x, norm_weight, eps, zero_centered=zero_centered, residual=residual)
    return linear(normed, weight), normed, total


def gated_linear(x, gate, weight, *, norm_weight=None, eps=1e-6, activation="sigmoid"):
    """reference gated_linear with this backend's `linear`."""
    if norm_weight is None:
        h = activation_ref.sigmoid_mul(x, gate) if activation == "sigmoid" else x * F.silu(gate)
    else:
        D, K = norm_weight.numel(), x.shape[-1]
        hd = (*x.shape[:-1], K // D, D)
        h = norm_ref.rms_norm_gated(x.reshape(hd), gate.reshape(hd), norm_weight, eps,
                                    activation=activation).reshape(x.shape)
    return linear(h, weight)


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """store_kv for tokens without padding (slot >= 0), indexing the pool itself (blocks, offsets) so the
    write stays in place in a compiled graph."""
    bs = kv_cache.shape[2]
    which = torch.arange(2, device=k.device)[:, None]
    kv_cache.index_put_((which, (slot_mapping // bs)[None], (slot_mapping % bs)[None]),
                        torch.stack([k, v]).to(kv_cache.dtype))


def attention_prologue(q, k, v, q_norm_weight, k_norm_weight, eps, cos, sin, kv_cache, slot_mapping):
    """reference attention_prologue with this backend's in-place store."""
    q = attention_ref.apply_rope(norm_ref.rms_norm(q, q_norm_weight, eps), cos, sin)
    store_kv(attention_ref.apply_rope(norm_ref.rms_norm(k, k_norm_weight, eps), cos, sin), v, kv_cache, slot_mapping)
    return q.contiguous()


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, *, cu_seqlens: torch.Tensor, seq_lens: torch.Tensor,
                    block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """paged_attention when every sequence has exactly one query token (cu_seqlens is then 0..N): all
    sequences at once over the block table's width, positions past each context masked out (their keys
    get -inf, their values zero: unwritten cache memory may hold anything)."""
    N, nh, d = q.shape
    nkv = kv_cache.shape[-2]
    kv = kv_cache[:, block_tables.long()].reshape(2, N, -1, nkv, d).to(q.dtype).transpose(2, 3)  # [2,N,NKV,C,D]
    valid = torch.arange(kv.shape[3], device=q.device)[None, :] < seq_lens[:, None]             # [N, C]
    scores = q.view(N, nkv, nh // nkv, d) @ kv[0].transpose(-1, -2) * scale                    # [N,NKV,G,C]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return (probs @ torch.where(valid[:, None, :, None], kv[1], 0.0)).reshape(N, nh, d)


def fused_paged_attention(q, k, v, q_norm_weight, k_norm_weight, eps, cos, sin, kv_cache, slot_mapping, *,
                          cu_seqlens, seq_lens, block_tables, scale, max_query_len=None):
    """attention_prologue + paged_attention of this backend."""
    q = attention_prologue(q, k, v, q_norm_weight, k_norm_weight, eps, cos, sin, kv_cache, slot_mapping)
    return paged_attention(q, kv_cache, cu_seqlens=cu_seqlens, seq_lens=seq_lens, block_tables=block_tables,
                           scale=scale)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """fused_moe as a gather + multiply-reduce per (token, expert) pair: inductor fuses the gather and the
    widening of bf16-stored experts into the reduction loop, so only the chosen experts are read."""
    inter = w2.shape[-1]
    h = (x[:, None, None, :].float() * w13[topk_ids].float()).sum(-1)          # [N, k, 2I]
    act = (F.silu(h[..., :inter]) * h[..., inter:]).to(x.dtype)
    y = (act[:, :, None, :].float() * w2[topk_ids].float()).sum(-1).to(x.dtype)  # [N, k, H]
    return (y.float() * topk_weights.float()[..., None]).sum(1).to(x.dtype)


def fused_moe_routed(x, w13, w2, router_logits, top_k, renormalize, *, shared_slices=0):
    """The reference routing, then this backend's fused_moe."""
    weights, ids = moe_ref.topk_softmax(router_logits, top_k, renormalize, shared_slices=shared_slices)
    return fused_moe(x, w13, w2, weights, ids)


# op name -> this backend's form (every other op keeps its reference)
OPS = {
    "linear": linear, "rms_norm_linear": rms_norm_linear, "gated_linear": gated_linear, "store_kv": store_kv,
    "attention_prologue": attention_prologue, "paged_attention": paged_attention,
    "fused_paged_attention": fused_paged_attention, "fused_moe": fused_moe, "fused_moe_routed": fused_moe_routed,
    "gdn_decode": gdn_ref.gdn_decode_unpadded,
}
