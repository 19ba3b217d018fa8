"""Linear layers whose weights may be assembled from several checkpoint tensors (row shards).

Each layer owns how a checkpoint tensor lands in it (`load_rows`). The sublayers pass its `weight` to the
projection ops (kernels.linear, rms_norm_linear, gated_linear, ...), which decide how it is read.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops import Kernels


class Linear(nn.Module):
    """y = x W^T, no bias. W is [out_features, in_features], possibly filled from several row shards."""

    def __init__(self, in_features: int, out_features: int, kernels: Kernels, *, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.kernels = kernels
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear(x, self.weight)

    def load_rows(self, offset: int, tensor: torch.Tensor) -> None:
        """Copy a [rows, in_features] checkpoint tensor into rows offset..offset+rows."""
        self.weight.data[offset : offset + tensor.shape[0]].copy_(tensor)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}"
