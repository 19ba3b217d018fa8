"""Gating activations in plain PyTorch, rounded as the layers' eager code rounds them.

silu_and_mul: x [..., 2I] (gate columns then up columns) -> silu(gate) * up [..., I] (the SwiGLU middle of
              the dense MLP and the shared expert).
sigmoid_mul:  x * sigmoid(gate), same shapes (the attention output gate, the shared-expert gate).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(gate)
