"""Dense SwiGLU MLP: down(silu(gate(x)) * up(x)), gate and up fused into one projection and the
activation fused into one op (kernels.silu_and_mul).

Tensor parallelism splits the intermediate dim (gate and up rows, down columns); the caller sums the
ranks' outputs (`reduce` True: this layer does, with one all-reduce)."""

from __future__ import annotations

import torch
from torch import nn

from ..distributed import comm
from ..distributed.parallel import SINGLE, Parallel, Split, require_divisible
from ..ops import Kernels
from .linear import Linear, fp8_layout
from .weights import WeightMap, rows, sharded


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, kernels: Kernels, *, dtype: torch.dtype,
                 device: torch.device | str, quantization=None, prefix: str = "mlp", parallel: Parallel = SINGLE,
                 reduce: bool = True, field: str = "intermediate_size"):
        """quantization / prefix: the config's QuantizationConfig and this MLP's checkpoint name within a
        decoder layer ("mlp", "mlp.shared_expert"), which decide whether its projections are FP8. parallel:
        the tensor-parallel rank (intermediate dim split); reduce: sum the output over the ranks here (False:
        the caller does, e.g. the MoE block); field: the config field named when the split does not divide."""
        super().__init__()
        self.kernels = kernels
        self.parallel = parallel
        self.reduce = reduce and parallel.sharded
        require_divisible(field, intermediate_size, parallel)
        full = intermediate_size
        intermediate_size = parallel.local(intermediate_size)
        self.intermediate_size = intermediate_size
        gate_up_fp8 = fp8_layout(quantization, (f"{prefix}.gate_proj", f"{prefix}.up_proj"), rows=(intermediate_size,))
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, kernels, dtype=dtype, device=device,
                                   fp8=gate_up_fp8)
        self.down_proj = Linear(intermediate_size, hidden_size, kernels, dtype=dtype, device=device,
                                fp8=fp8_layout(quantization, (f"{prefix}.down_proj",),
                                               cols=(intermediate_size,) if parallel.sharded else ()))
        if parallel.sharded:
            tp = parallel.size
            self.gate_up_proj.param_splits = {"weight": Split(0, ((full, tp), (full, tp)))}
            self.down_proj.param_splits = {"weight": Split(1, ((full, tp),))}

    @property
    def input_proj(self) -> Linear:
        """The projection of the block's input (a pre-norm folds its norm into it: RMSNorm.project)."""
        return self.gate_up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_projected(x, self.gate_up_proj(x))

    def forward_projected(self, x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
        """forward from gate_up_proj(x), computed by the caller (x itself is not needed again)."""
        out = self.down_proj(self.kernels.silu_and_mul(gate_up))
        return comm.all_reduce(out) if self.reduce else out

    def checkpoint_weights(self) -> WeightMap:
        i, par = self.intermediate_size, self.parallel
        ranges = [par.piece(par.size * i)] if par.sharded else None
        return {
            "gate_proj.weight": rows(self.gate_up_proj, 0, par.size * i, ranges),
            "up_proj.weight": rows(self.gate_up_proj, i, par.size * i, ranges),
            "down_proj.weight": sharded(self.down_proj.weight,
                                        getattr(self.down_proj, "param_splits", {}).get("weight"), par),
        }
