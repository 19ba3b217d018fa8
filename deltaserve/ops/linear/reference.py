"""Dense projection y = x W^T (no bias) and the pre-norm projection (RMSNorm folded in front of it): the
references, and the ops every Linear layer, the pre-norm sublayers and the logits call."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..norm.reference import rms_norm


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T -> [..., N] in x's dtype (torch's matmul, fp32 accumulation on GPU)."""
    return F.linear(x, weight)


def rms_norm_linear(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
    *, zero_centered: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pre-norm sublayer's input projection: (y, normed, sum) with sum = x + residual (x itself when
    residual is None), normed = rms_norm(sum, norm_weight, eps) and y = linear(normed, weight). The normed
    rows are returned for the sublayer's other readers (the MoE experts), the sum as the next residual."""
    if residual is None:
        normed, total = rms_norm(x, norm_weight, eps, zero_centered=zero_centered), x
    else:
        normed, total = rms_norm(x, norm_weight, eps, zero_centered=zero_centered, residual=residual)
    return linear(normed, weight), normed, total
