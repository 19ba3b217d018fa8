"""Sparse MoE block with a sigmoid-gated shared expert (model_spec.md §6).

Experts are stored fused, w13 [E, 2I, H] (gate rows then up rows) and w2 [E, H, I], whatever the
checkpoint layout: per-expert `experts.{e}.{gate,up,down}_proj.weight` (Qwen3-Next, re-saved models)
or fused `experts.gate_up_proj` / `experts.down_proj` (official Qwen3.5-MoE).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..ops import Kernels
from .linear import Linear
from .mlp import MLP
from .weights import Target, WeightMap, prefixed, whole


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels, *, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.kernels = kernels
        h, e, i = config.hidden_size, config.num_experts, config.moe_intermediate_size
        self.num_experts, self.top_k, self.renormalize = e, config.num_experts_per_tok, config.norm_topk_prob
        self.intermediate_size = i
        self.gate = Linear(h, e, dtype=dtype, device=device)
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype, device=device), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, h, i, dtype=dtype, device=device), requires_grad=False)
        self.shared_expert = MLP(h, config.shared_expert_intermediate_size, dtype=dtype, device=device) \
            if config.shared_expert_intermediate_size > 0 else None
        self.shared_expert_gate = Linear(h, 1, dtype=dtype, device=device) if self.shared_expert else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.kernels.topk_softmax(self.gate(x), self.top_k, self.renormalize)
        out = self.kernels.fused_moe(x, self.w13, self.w2, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def checkpoint_weights(self, fused_experts: bool) -> WeightMap:
        h, i = self.w13.shape[-1], self.intermediate_size
        mapping: WeightMap = {"gate.weight": whole(self.gate.weight)}
        if self.shared_expert is not None:
            mapping.update(prefixed("shared_expert", self.shared_expert.checkpoint_weights()))
            mapping["shared_expert_gate.weight"] = whole(self.shared_expert_gate.weight)
        if fused_experts:
            mapping["experts.gate_up_proj"] = whole(self.w13)
            mapping["experts.down_proj"] = whole(self.w2)
            return mapping
        for e in range(self.num_experts):
            mapping[f"experts.{e}.gate_proj.weight"] = Target((i, h), self.w13.data[e, :i].copy_)
            mapping[f"experts.{e}.up_proj.weight"] = Target((i, h), self.w13.data[e, i:].copy_)
            mapping[f"experts.{e}.down_proj.weight"] = Target((h, i), self.w2.data[e].copy_)
        return mapping
