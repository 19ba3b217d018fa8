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
    if topk_ids.numel() <= _FEW_PAIRS_MAX:
        return _fused_moe_few_tokens(x, w13, w2, topk_weights, topk_ids)
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


# Up to this many (token, expert) pairs (decode and verify steps), group on the host (no sort, no bincount):
# the per-op overhead, not the weight reads, is what those few rows would otherwise pay for.
_FEW_PAIRS_MAX = 24


def _fused_moe_few_tokens(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """Same result as the grouped path: every expert any token picked runs once, on the tokens that picked it,
    in expert-index order; a contiguous run of tokens (one token, or every token: the shared expert's slices)
    is a slice, not a gather."""
    inter = w2.shape[-1]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    weights = topk_weights.float().tolist()
    picked: dict[int, list[int]] = {}                 # expert -> the tokens that picked it, in token order
    pick_weight: dict[int, list[float]] = {}
    for t, experts in enumerate(topk_ids.tolist()):
        for j, e in enumerate(experts):
            if weights[t][j] == 0.0:    # adds nothing (expert parallelism gives other ranks' pairs weight 0):
                continue                # kept out, each expert's product has the same rows on every layout
            picked.setdefault(e, []).append(t)
            pick_weight.setdefault(e, []).append(weights[t][j])
    for e in sorted(picked):
        tokens = picked[e]
        run = tokens[-1] - tokens[0] + 1 == len(tokens)
        index = None if run else torch.tensor(tokens, device=x.device)
        xs = x[tokens[0] : tokens[-1] + 1] if run else x[index]
        w, xe = _expert(w13, e, xs)
        h = F.linear(xe, w)
        w, h = _expert(w2, e, F.silu(h[:, :inter]) * h[:, inter:])
        y = F.linear(h, w).float() * torch.tensor(pick_weight[e], device=x.device)[:, None]
        if run:
            out[tokens[0] : tokens[-1] + 1] += y
        else:
            out.index_add_(0, index, y)
    return out.to(x.dtype)
