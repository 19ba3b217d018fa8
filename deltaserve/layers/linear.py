"""Linear layers whose weights may be assembled from several checkpoint tensors (row shards).

Each layer owns how a checkpoint tensor lands in it (`load_rows`), so a quantized variant can replace
the storage and the loading without the model or the loader changing.

`gated_projection` is a gated sublayer's output projection (attention's sigmoid gate, GDN's gated norm):
one op for a dense Linear (kernels.gated_linear: the GDN norm folded into the GEMV at one token, the gate
op then the GEMV elsewhere), the gate op then the module's forward for a projection of another kind.
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


# Rows of x up to which the GDN layer hands its gated norm to the projection (asking gdn_decode for the
# un-normalised output): gated_linear folds the norm into the GEMV at one row only (default_gated_config).
GATE_FOLD_MAX_ROWS = 1


def folds_gate(proj: nn.Module, rows: int) -> bool:
    """Whether gated_projection(proj, ...) of `rows` rows runs the gate inside the projection's kernel."""
    return type(proj) is Linear and rows <= GATE_FOLD_MAX_ROWS


def gated_projection(proj: nn.Module, kernels: Kernels, x: torch.Tensor, gate: torch.Tensor, *, activation: str,
                     norm_weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """proj(h), h = x * act(gate) or, with norm_weight [D], the gated RMSNorm over heads of D (see
    ops.linear.reference.gated_linear). A dense `Linear`: kernels.gated_linear (one launch at one row);
    another module (the CPU decode twin's): the gate op, then its forward."""
    if type(proj) is Linear:
        return kernels.gated_linear(x, gate, proj.weight, norm_weight=norm_weight, eps=eps, activation=activation)
    if norm_weight is None:
        if activation != "sigmoid":
            raise ValueError(f"gated_projection: a gate without norm is sigmoid here, got {activation!r}")
        return proj(kernels.sigmoid_mul(x, gate))
    D, K = norm_weight.numel(), x.shape[-1]
    hd = (*x.shape[:-1], K // D, D)
    return proj(kernels.rms_norm_gated(x.reshape(hd), gate.reshape(hd), norm_weight, eps,
                                       activation=activation).reshape(x.shape))
