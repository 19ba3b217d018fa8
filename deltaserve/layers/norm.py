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

    def project(self, x: torch.Tensor, residual: torch.Tensor | None, proj: nn.Module, *, conv: dict | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(proj(normed), normed, x + residual) with normed = self(x + residual): the input projection of a
        pre-norm sublayer. A dense `Linear` runs it as one op (kernels.rms_norm_linear: at one token the
        norm is folded into the GEMV, no launch of its own); a projection module of another kind (another
        weight storage, such as the CPU decode twin's bf16 reads) gets the norm, then its own forward.
        Without `residual` the sum is x. `conv` (a GDN layer's decode step: GatedDeltaNet.conv_fold's
        conv_weight, conv_state, state_indices; a dense Linear only): kernels.rms_norm_linear_conv, the
        one-token conv of the projection's first columns done in the GEMV's epilogue."""
        if conv is not None:
            if type(proj) is not Linear:
                raise ValueError(f"RMSNorm.project: the conv epilogue needs a dense Linear, got {type(proj).__name__}")
            return self.kernels.rms_norm_linear_conv(x, residual, self.weight, self.eps, proj.weight,
                                                     zero_centered=self.zero_centered, **conv)
        if type(proj) is Linear:
            return self.kernels.rms_norm_linear(x, residual, self.weight, self.eps, proj.weight,
                                                zero_centered=self.zero_centered)
        normed, total = (self(x), x) if residual is None else self(x, residual)
        return proj(normed), normed, total
