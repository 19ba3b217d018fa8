"""Mixture-of-experts routing and expert compute in plain PyTorch.

  router_logits [T, E] (or [T, E + 1] with the shared expert's gate last); topk_softmax -> weights [T, k]
  (fp32), ids [T, k] (int64), plus the shared-expert slices when asked
  w13 [E, 2I, H] (rows 0..I-1 gate, I..2I-1 up), w2 [E, H, I]
  fused_moe: y_t = sum_j weights[t, j] * w2[e] (silu(gate_e x_t) * up_e x_t), e = ids[t, j]
  fused_moe_routed: fused_moe on topk_softmax's choice (one op, so a kernel can fuse the two)
Weighted expert outputs are accumulated in fp32 and rounded once. Block-FP8 experts (ops/quant/fp8.py
BlockFp8Weight) are dequantised one expert at a time and their products computed in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..quant.fp8 import BlockFp8Weight


def _expert(w, e: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert e's weight, x) ready to multiply: fp32 for an FP8 weight, as they are otherwise."""
    if isinstance(w, BlockFp8Weight):
        return w.expert(e).dequantize(torch.float32), x.float()
    return w[e], x


def topk_softmax(router_logits: torch.Tensor, top_k: int, renormalize: bool, *,
                 shared_slices: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the expert logits, the top_k of them (ties: lowest index first), optionally renormalised.

    With `shared_slices` = m > 0 the last logit column is the shared expert's gate: the m slices of the
    shared expert, stored as experts E .. E+m-1 (layers/moe.py), are appended to every token's choice with
    weight sigmoid(gate logit) computed in fp32. Outputs [T, top_k + m]."""
    E = router_logits.shape[-1] - (1 if shared_slices else 0)
    probs = torch.softmax(router_logits[:, :E], dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if shared_slices:
        T = router_logits.shape[0]
        shared_w = torch.sigmoid(router_logits[:, E:].float()).expand(T, shared_slices)
        shared_ids = torch.arange(E, E + shared_slices, device=ids.device).expand(T, shared_slices)
        weights, ids = torch.cat([weights, shared_w], dim=1), torch.cat([ids, shared_ids], dim=1)
    return weights, ids


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
) -> torch.Tensor:
    if topk_ids.numel() <= _PAIR_LOOP_MAX:
        return _fused_moe_pairs(x, w13, w2, topk_weights, topk_ids)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    inter = w2.shape[-1]
    flat_ids = topk_ids.flatten()
    order = flat_ids.argsort(stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    token_of = order // topk_ids.shape[1]
    start = 0
    for e, cnt in enumerate(counts):
        if cnt == 0:
            continue
        picks = order[start : start + cnt]
        tokens = token_of[start : start + cnt]
        start += cnt
        w, xe = _expert(w13, e, x[tokens])
        h = xe @ w.t()
        h = F.silu(h[:, :inter]) * h[:, inter:]
        w, h = _expert(w2, e, h)
        y = h @ w.t()
        out.index_add_(0, tokens, y.float() * topk_weights.flatten()[picks, None].float())
    return out.to(x.dtype)


def fused_moe_routed(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, router_logits: torch.Tensor, top_k: int,
    renormalize: bool, *, shared_slices: int = 0,
) -> torch.Tensor:
    """topk_softmax, then fused_moe on its choice: the MoE block from the router's logits."""
    weights, ids = topk_softmax(router_logits, top_k, renormalize, shared_slices=shared_slices)
    return fused_moe(x, w13, w2, weights, ids)


# Up to this many (token, expert) pairs, loop over the pairs (few ops each, no sort): the decode case.
_PAIR_LOOP_MAX = 4


def _fused_moe_pairs(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """Same result as the grouped path, pair by pair, in expert-index order within each token."""
    inter = w2.shape[-1]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    weights = topk_weights.float().tolist()
    for t, experts in enumerate(topk_ids.tolist()):
        for j in sorted(range(len(experts)), key=experts.__getitem__):
            e = experts[j]
            w, xe = _expert(w13, e, x[t : t + 1])
            h = F.linear(xe, w)
            w, h = _expert(w2, e, F.silu(h[:, :inter]) * h[:, inter:])
            y = F.linear(h, w)
            out[t : t + 1] += y.float() * weights[t][j]
    return out.to(x.dtype)
