"""Dense SwiGLU MLP: down(silu(gate(x)) * up(x)), gate and up fused into one projection and the
activation fused into one op (kernels.silu_and_mul)."""

from __future__ import annotations

import torch
from torch import nn

from ..ops import Kernels
from .linear import Linear, fp8_layout
from .weights import WeightMap, rows, whole


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, kernels: Kernels, *, dtype: torch.dtype,
                 device: torch.device | str, quantization=None, prefix: str = "mlp"):
        """quantization / prefix: the config's QuantizationConfig and this MLP's checkpoint name within a
        decoder layer ("mlp", "mlp.shared_expert"), which decide whether its projections are FP8."""
        super().__init__()
        self.kernels = kernels
        self.intermediate_size = intermediate_size
        gate_up_fp8 = fp8_layout(quantization, (f"{prefix}.gate_proj", f"{prefix}.up_proj"), rows=(intermediate_size,))
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, kernels, dtype=dtype, device=device,
                                   fp8=gate_up_fp8)
        self.down_proj = Linear(intermediate_size, hidden_size, kernels, dtype=dtype, device=device,
                                fp8=fp8_layout(quantization, (f"{prefix}.down_proj",)))

    @property
    def input_proj(self) -> Linear:
        """The projection of the block's input (a pre-norm folds its norm into it: RMSNorm.project)."""
        return self.gate_up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_projected(x, self.gate_up_proj(x))

    def forward_projected(self, x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
        """forward from gate_up_proj(x), computed by the caller (x itself is not needed again)."""
        return self.down_proj(self.kernels.silu_and_mul(gate_up))

    def checkpoint_weights(self) -> WeightMap:
        i = self.intermediate_size
        return {
            "gate_proj.weight": rows(self.gate_up_proj, 0, i),
            "up_proj.weight": rows(self.gate_up_proj, i, i),
            "down_proj.weight": whole(self.down_proj.weight),
        }
