"""RMSNorm modules (zero-centred `x̂·(1+w)` for every Qwen3-Next / 3.5 layer norm)."""

from __future__ import annotations

import torch
from torch import nn

from ..ops import Kernels
from .linear import Linear


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, kernels: Kernels, *, dtype: torch.dtype,
                 device: torch.device | str, zero_centered: bool = True):
        super().__init__()
        self.eps, self.zero_centered, self.kernels = eps, zero_centered, kernels
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Normalise x; with `residual`, normalise x + residual and also return that sum."""
        return self.kernels.rms_norm(x, self.weight, self.eps, zero_centered=self.zero_centered, residual=residual)

    def project(self, x: torch.Tensor, residual: torch.Tensor | None, proj: Linear
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(proj(normed), normed, x + residual) with normed = self(x + residual): the input projection of a
        pre-norm sublayer, one op (kernels.rms_norm_linear). Without `residual` the sum is x."""
        return self.kernels.rms_norm_linear(x, residual, self.weight, self.eps, proj.weight,
                                            zero_centered=self.zero_centered)
