"""The hybrid GDN decoder shared by Qwen3-Next, Qwen3.5 dense and Qwen3.5-MoE (model_spec.md §0, §10).

    h = x + Mixer(RMSNorm(x));  y = h + FFN(RMSNorm(h))
(each RMSNorm computed together with its sublayer's input projection, as one op)
Mixer: Gated DeltaNet ("linear_attention") or gated full attention; FFN: sparse MoE or dense SwiGLU,
both per ModelConfig. The families differ only in weight names and layouts, handled here and in
the layers' `checkpoint_weights`.
"""

from __future__ import annotations

import torch
from torch import nn

from ..batch import CacheBuffers, ForwardBatch
from ..config import FULL_ATTENTION, ModelConfig
from ..layers.attention import GatedAttention
from ..layers.gated_deltanet import GatedDeltaNet
from ..layers.linear import Linear, fp8_layout
from ..layers.mlp import MLP
from ..layers.moe import SparseMoeBlock
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding
from ..layers.weights import WeightMap, prefixed, whole
from ..ops import Kernels


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, kernels: Kernels, *, dtype: torch.dtype,
                 device: torch.device | str, layer_type: str | None = None, moe: bool | None = None):
        super().__init__()
        self.layer_type = layer_type or config.layer_types[layer_id]
        self.is_moe = config.moe_layers[layer_id] if moe is None else moe
        kw = dict(dtype=dtype, device=device)
        if self.layer_type == FULL_ATTENTION:
            self.self_attn = GatedAttention(config, kernels, **kw)
        else:
            self.linear_attn = GatedDeltaNet(config, kernels, **kw)
        if self.is_moe:
            self.mlp = SparseMoeBlock(config, kernels, **kw)
        else:
            if config.intermediate_size <= 0:
                raise ValueError(f"layer {layer_id} is dense but intermediate_size is {config.intermediate_size}")
            self.mlp = MLP(config.hidden_size, config.intermediate_size, kernels, quantization=config.quantization,
                           **kw)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels, **kw)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels, **kw)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, state: tuple,
                cos_sin: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (FFN output, residual stream before it); the next layer's norm adds them.

        Each norm runs with its sublayer's input projection as one op (RMSNorm.project; a GDN layer's
        project_input, which may also apply the conv)."""
        if self.layer_type == FULL_ATTENTION:
            projected, _, residual = self.input_layernorm.project(x, residual, self.self_attn.input_proj)
            h = self.self_attn.forward_projected(projected, batch, state[0], cos_sin)
        else:
            projection = self.linear_attn.project_input(x, residual, self.input_layernorm, batch, state[1])
            residual = projection.total
            h = self.linear_attn.forward_projected(projection, batch, state[0], state[1])
        projected, h, residual = self.post_attention_layernorm.project(h, residual, self.mlp.input_proj)
        return self.mlp.forward_projected(h, projected), residual

    def checkpoint_weights(self, fused_experts: bool) -> WeightMap:
        mixer = (("self_attn", self.self_attn) if self.layer_type == FULL_ATTENTION
                 else ("linear_attn", self.linear_attn))
        mlp = self.mlp.checkpoint_weights(fused_experts) if self.is_moe else self.mlp.checkpoint_weights()
        return {
            **prefixed(mixer[0], mixer[1].checkpoint_weights()),
            **prefixed("mlp", mlp),
            "input_layernorm.weight": whole(self.input_layernorm.weight),
            "post_attention_layernorm.weight": whole(self.post_attention_layernorm.weight),
        }


class MTPHead(nn.Module):
    """Multi-token prediction module (model_spec.md §7): predicts token t+2 from the token embedding of
    t+1 and the main model's final hidden state at t, through one full-attention decoder layer. It
    shares embed_tokens and lm_head with the main model and has its own KV cache layer."""

    def __init__(self, config: ModelConfig, num_layers: int, kernels: Kernels, *, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.pre_fc_norm_embedding = RMSNorm(h, eps, kernels, **kw)
        self.pre_fc_norm_hidden = RMSNorm(h, eps, kernels, **kw)
        self.fc = Linear(2 * h, h, kernels, fp8=fp8_layout(config.quantization, ("fc",), cols=(h,)), **kw)
        moe = config.num_experts > 0 and config.family != "qwen3_5"
        self.layers = nn.ModuleList(
            DecoderLayer(config, 0, kernels, layer_type=FULL_ATTENTION, moe=moe, **kw) for _ in range(num_layers))
        self.norm = RMSNorm(h, eps, kernels, **kw)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor,
                rope: RotaryEmbedding, step: int = 0) -> torch.Tensor:
        """embeds: embedding of the next token; hidden: main model's final (normed) hidden state."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        cos_sin = rope.cos_sin(batch.positions, x.dtype)
        layer = self.layers[step % len(self.layers)]
        out, residual = layer(x, None, batch, (kv_cache,), cos_sin)
        return self.norm(out, residual)[0]

    def checkpoint_weights(self, fused_experts: bool) -> WeightMap:
        mapping: WeightMap = {
            "pre_fc_norm_embedding.weight": whole(self.pre_fc_norm_embedding.weight),
            "pre_fc_norm_hidden.weight": whole(self.pre_fc_norm_hidden.weight),
            "fc.weight": whole(self.fc.weight),
            "norm.weight": whole(self.norm.weight),
        }
        for i, layer in enumerate(self.layers):
            mapping.update(prefixed(f"layers.{i}", layer.checkpoint_weights(fused_experts)))
        return mapping


class HybridForCausalLM(nn.Module):
    """Embedding -> decoder layers -> final norm -> lm_head, over a packed ForwardBatch."""

    def __init__(self, config: ModelConfig, kernels: Kernels, *, dtype: torch.dtype, device: torch.device | str,
                 mtp_layers: int = 0):
        super().__init__()
        self.config, self.kernels = config, kernels
        kw = dict(dtype=dtype, device=device)
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, **kw), requires_grad=False)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, kernels, **kw) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels, **kw)
        self.lm_head = (None if config.tie_word_embeddings
                        else Linear(config.hidden_size, config.vocab_size, kernels, **kw))
        self.rope = RotaryEmbedding(config.rotary_dim, config.rope_theta, device=device)
        self.mtp = MTPHead(config, mtp_layers, kernels, **kw) if mtp_layers else None
        # layer index -> index into the GDN pools or the attention KV layers
        self._state_index = {}
        for kind_ids in (config.gdn_layer_ids, config.attention_layer_ids):
            self._state_index.update({layer_id: j for j, layer_id in enumerate(kind_ids)})

    def forward(self, batch: ForwardBatch, cache: CacheBuffers) -> torch.Tensor:
        """Final normed hidden states [T, H] for every token of the batch."""
        pending = {} if batch.last_tokens is None else {"last_tokens": batch.last_tokens, "slots": batch.state_slots}
        x, cos, sin = self.kernels.embed_rope(batch.input_ids, self.embed_tokens, batch.positions, self.rope.inv_freq,
                                              **pending)
        cos_sin = (cos, sin)
        residual = None
        for i, layer in enumerate(self.layers):
            j = self._state_index[i]
            state = (cache.kv[j],) if layer.layer_type == FULL_ATTENTION else (cache.ssm[j], cache.conv[j])
            x, residual = layer(x, residual, batch, state, cos_sin)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens if self.lm_head is None else self.lm_head.weight
        return self.kernels.linear(hidden, weight)

    def checkpoint_weights(self, fused_experts: bool) -> WeightMap:
        """Expected checkpoint tensors by canonical name (Qwen3.5's `model.language_model.` read as `model.`)."""
        prefix = "model."
        mapping: WeightMap = {f"{prefix}embed_tokens.weight": whole(self.embed_tokens),
                              f"{prefix}norm.weight": whole(self.norm.weight)}
        for i, layer in enumerate(self.layers):
            mapping.update(prefixed(f"{prefix}layers.{i}", layer.checkpoint_weights(fused_experts)))
        if self.lm_head is not None:
            mapping["lm_head.weight"] = whole(self.lm_head.weight)
        if self.mtp is not None:
            mapping.update(prefixed("mtp", self.mtp.checkpoint_weights(fused_experts)))
        return mapping
