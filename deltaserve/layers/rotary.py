"""Partial rotary position embedding, rotate-half ("NeoX") pairing (i, i + rd/2) on the first rd dims.

For Qwen3.5's interleaved mRoPE the three position rows are equal for text, which reduces exactly to
this 1-D form (model_spec.md §4).
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.attention.reference import apply_rope


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, theta: float, *, device: torch.device | str):
        super().__init__()
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float().to(device) / rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin tables [T, rd] for the given positions, computed in fp32 and cast to `dtype`."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate the first rd dims of x [T, heads, D]; the rest pass through."""
        return apply_rope(x, cos, sin)
