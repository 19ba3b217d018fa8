"""Bytes per KV block and per GDN state slot, from the model config. Pure arithmetic: no tensors."""

from __future__ import annotations

import dataclasses

from ..config import ModelConfig


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    block_size: int           # tokens per KV block
    kv_block_bytes: int       # one block across every full-attention layer, K and V
    state_slot_bytes: int     # one slot across every GDN layer: recurrent state + conv window

    @classmethod
    def from_model(cls, config: ModelConfig, *, block_size: int, kv_dtype_bytes: int, conv_dtype_bytes: int,
                   state_dtype_bytes: int = 4, num_attention_layers: int | None = None) -> "CacheSpec":
        """Matches the layout of `CacheBuffers.allocate` (batch.py) element for element."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        n_attn = len(config.attention_layer_ids) if num_attention_layers is None else num_attention_layers
        n_gdn = len(config.gdn_layer_ids)
        kv = n_attn * 2 * block_size * config.num_key_value_heads * config.head_dim * kv_dtype_bytes
        ssm = n_gdn * config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
        conv = n_gdn * (config.linear_conv_kernel_dim - 1) * config.gdn_conv_dim
        return cls(block_size=block_size, kv_block_bytes=kv,
                   state_slot_bytes=ssm * state_dtype_bytes + conv * conv_dtype_bytes)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
