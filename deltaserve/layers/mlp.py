"""Dense SwiGLU MLP: down(silu(gate(x)) * up(x)), gate and up fused into one projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import Linear
from .weights import WeightMap, rows, whole


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, *, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, dtype=dtype, device=device)
        self.down_proj = Linear(intermediate_size, hidden_size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def checkpoint_weights(self) -> WeightMap:
        i = self.intermediate_size
        return {
            "gate_proj.weight": rows(self.gate_up_proj, 0, i),
            "up_proj.weight": rows(self.gate_up_proj, i, i),
            "down_proj.weight": whole(self.down_proj.weight),
        }
