"""Dense projection y = x W^T (no bias): the reference, and the op every Linear layer and the logits call."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T -> [..., N] in x's dtype (torch's matmul, fp32 accumulation on GPU)."""
    return F.linear(x, weight)
