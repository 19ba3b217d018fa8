"""The hybrid GDN decoder shared by Qwen3-Next, Qwen3.5 dense and Qwen3.5-MoE (model_spec.md §0, §10).

    h = x + Mixer(RMSNorm(x));  y = h + FFN(RMSNorm(h))
(each RMSNorm computed together with its sublayer's input projection, as one op)
Mixer: Gated DeltaNet ("linear_attention") or gated full attention; FFN: sparse MoE or dense SwiGLU,
both per ModelConfig. The families differ only in weight names and layouts, handled here and in
the layers' `checkpoint_weights`.

Under tensor parallelism (`parallel`, distributed/parallel.py) every layer holds its rank's slices and sums
its output over the ranks; the embedding and lm_head are vocabulary-parallel: a rank embeds the ids in its
vocabulary rows (zeros elsewhere, summed over the ranks) and the logits are all-gathered, so every rank
holds the full logits and samples the same token (same seeds, same ops).
"""

from __future__ import annotations

import torch
from torch import nn

from ..batch import CacheBuffers, ForwardBatch
from ..config import FULL_ATTENTION, ModelConfig
from ..distributed import comm
from ..distributed.parallel import SINGLE, Parallel, Split, require_divisible
from ..layers.attention import GatedAttention
from ..layers.gated_deltanet import GatedDeltaNet
from ..layers.linear import Linear, fp8_layout
from ..layers.mlp import MLP
from ..layers.moe import SparseMoeBlock
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding
from ..layers.weights import WeightMap, prefixed, sharded, whole
from ..ops import Kernels


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, kernels: Kernels, *, dtype: torch.dtype,
                 device: torch.device | str, layer_type: str | None = None, moe: bool | None = None,
                 parallel: Parallel = SINGLE):
        super().__init__()
        self.layer_type = layer_type or config.layer_types[layer_id]
        self.is_moe = config.moe_layers[layer_id] if moe is None else moe
        kw = dict(dtype=dtype, device=device)
        if self.layer_type == FULL_ATTENTION:
            self.self_attn = GatedAttention(config, kernels, parallel=parallel, **kw)
        else:
            self.linear_attn = GatedDeltaNet(config, kernels, parallel=parallel, **kw)
        if self.is_moe:
            self.mlp = SparseMoeBlock(config, kernels, parallel=parallel, **kw)
        else:
            if config.intermediate_size <= 0:
                raise ValueError(f"layer {layer_id} is dense but intermediate_size is {config.intermediate_size}")
            self.mlp = MLP(config.hidden_size, config.intermediate_size, kernels, quantization=config.quantization,
                           parallel=parallel, **kw)
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
        return self.ffn(h, residual)

    # ---- the same forward in pieces (runner/prefill_graphs.py): token-wise steps around the mixer's core ----
    def mixer_input(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(input projection of norm(x + residual), x + residual), token-wise. A GDN layer's conv is never folded
        in here: forward does that for decode-only batches only."""
        proj = self.self_attn.qkv_proj if self.layer_type == FULL_ATTENTION else self.linear_attn.in_proj
        projected, _, total = self.input_layernorm.project(x, residual, proj)
        return projected, total

    def mixer_core(self, projected: torch.Tensor, batch: ForwardBatch, state: tuple, cos_sin: tuple,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """The mixer's steps that read the batch's sequence structure: projection -> o (into `out`)."""
        if self.layer_type == FULL_ATTENTION:
            return self.self_attn.core(projected, batch, state[0], cos_sin, out)
        return self.linear_attn.core(projected, batch, state[0], state[1], out)

    def mixer_output(self, o: torch.Tensor, projected: torch.Tensor) -> torch.Tensor:
        """The mixer's output projection of core's o (token-wise)."""
        if self.layer_type == FULL_ATTENTION:
            return self.self_attn.output(o, projected)
        return self.linear_attn.output(o)

    def ffn(self, h: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(FFN output, residual) from the mixer's output h (token-wise; the MoE routes each token alone)."""
        projected, h, residual = self.post_attention_layernorm.project(h, residual, self.mlp.input_proj)
        return self.mlp.forward_projected(h, projected), residual

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn if self.layer_type == FULL_ATTENTION else self.linear_attn

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
                 device: torch.device | str, parallel: Parallel = SINGLE):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.pre_fc_norm_embedding = RMSNorm(h, eps, kernels, **kw)
        self.pre_fc_norm_hidden = RMSNorm(h, eps, kernels, **kw)
        self.fc = Linear(2 * h, h, kernels, fp8=fp8_layout(config.quantization, ("fc",), cols=(h,)), **kw)
        moe = config.num_experts > 0 and config.family != "qwen3_5"
        self.layers = nn.ModuleList(
            DecoderLayer(config, 0, kernels, layer_type=FULL_ATTENTION, moe=moe, parallel=parallel, **kw)
            for _ in range(num_layers))
        self.norm = RMSNorm(h, eps, kernels, **kw)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor,
                rope: RotaryEmbedding, step: int = 0) -> torch.Tensor:
        """embeds: embedding of the next token; hidden: main model's final (normed) hidden state."""
        return self.forward_tables(embeds, hidden, batch, kv_cache, rope.cos_sin(batch.positions, embeds.dtype), step)

    def forward_tables(self, embeds: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor,
                       cos_sin: tuple[torch.Tensor, torch.Tensor], step: int = 0, out_rows: torch.Tensor | None = None,
                       queries: ForwardBatch | None = None) -> torch.Tensor:
        """forward with the RoPE tables of batch.positions given (embed_rope computes them with the embedding).
        Row r: embeds[r] of token t+1, hidden[r] at t = batch.positions[r]; its K/V go to kv_cache at
        batch.slot_mapping[r]. Returns the head's output after its final norm [T, H] (the next step's hidden);
        with out_rows, every row's K/V is stored but only those rows go on past the KV store (attention as
        `queries`: GatedAttention.core_rows): [len(out_rows), H]."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        layer = self.layers[step % len(self.layers)]
        if out_rows is None:
            out, residual = layer(x, None, batch, (kv_cache,), cos_sin)
        else:
            attn = layer.self_attn
            projected, _, residual = layer.input_layernorm.project(x, None, attn.input_proj)
            o = attn.core_rows(projected, batch, kv_cache, cos_sin, out_rows, queries)
            h = attn.output(o, projected.index_select(0, out_rows))
            out, residual = layer.ffn(h, residual.index_select(0, out_rows))
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
                 mtp_layers: int = 0, parallel: Parallel = SINGLE):
        super().__init__()
        self.config, self.kernels, self.parallel = config, kernels, parallel
        kw = dict(dtype=dtype, device=device)
        require_divisible("vocab_size", config.vocab_size, parallel)
        vocab = parallel.local(config.vocab_size)
        self.vocab_start = parallel.rank * vocab
        self.embed_tokens = nn.Parameter(torch.empty(vocab, config.hidden_size, **kw), requires_grad=False)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, kernels, parallel=parallel, **kw) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels, **kw)
        self.lm_head = (None if config.tie_word_embeddings
                        else Linear(config.hidden_size, vocab, kernels, **kw))
        self.rope = RotaryEmbedding(config.rotary_dim, config.rope_theta, device=device)
        self.mtp = MTPHead(config, mtp_layers, kernels, parallel=parallel, **kw) if mtp_layers else None
        if parallel.sharded:
            self._vocab_split = Split(0, ((config.vocab_size, parallel.size),))
            self.param_splits = {"embed_tokens": self._vocab_split}
            if self.lm_head is not None:
                self.lm_head.param_splits = {"weight": self._vocab_split}
        # layer index -> index into the GDN pools or the attention KV layers
        self._state_index = {}
        for kind_ids in (config.gdn_layer_ids, config.attention_layer_ids):
            self._state_index.update({layer_id: j for j, layer_id in enumerate(kind_ids)})

    def forward(self, batch: ForwardBatch, cache: CacheBuffers) -> torch.Tensor:
        """Final normed hidden states [T, H] for every token of the batch."""
        pending = {} if batch.last_tokens is None else {"last_tokens": batch.last_tokens, "slots": batch.state_slots}
        x, cos, sin = self.embed(batch.input_ids, batch.positions, pending)
        cos_sin = (cos, sin)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, batch, self.layer_state(i, cache), cos_sin)
        x, _ = self.norm(x, residual)
        return x

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor, pending: dict | None = None) -> tuple:
        """(token embeddings, RoPE cos, sin) of the ids at these positions (token-wise); pending: forward's
        last_tokens / slots for ids still being sampled."""
        pending = pending or {}
        if self.parallel.sharded:
            return self._embed_vocab_parallel(input_ids, positions, pending)
        return self.kernels.embed_rope(input_ids, self.embed_tokens, positions, self.rope.inv_freq, **pending)

    def layer_state(self, i: int, cache: CacheBuffers) -> tuple:
        """Layer i's pools: (kv,) for full attention, (ssm, conv) for GDN."""
        j = self._state_index[i]
        return (cache.kv[j],) if self.layers[i].layer_type == FULL_ATTENTION else (cache.ssm[j], cache.conv[j])

    def _embed_vocab_parallel(self, ids: torch.Tensor, positions: torch.Tensor, pending: dict) -> tuple:
        """The rank's vocabulary rows embed their ids, other ids give zeros; the sum over the ranks is the
        embedding (ids still being sampled are resolved from last_tokens first)."""
        if pending:
            ids = torch.where(ids < 0, pending["last_tokens"][pending["slots"].long().clamp_min(0)], ids)
        local = ids.long() - self.vocab_start
        mine = (local >= 0) & (local < self.embed_tokens.shape[0])
        x, cos, sin = self.kernels.embed_rope(torch.where(mine, local, 0), self.embed_tokens, positions,
                                              self.rope.inv_freq)
        x = x * mine[:, None].to(x.dtype)
        return comm.all_reduce(x), cos, sin

    def mtp_forward(self, next_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, cache: CacheBuffers,
                    step: int = 0, out_rows: torch.Tensor | None = None,
                    queries: ForwardBatch | None = None) -> torch.Tensor:
        """The MTP head over the rows of `batch` (model_spec.md §7): row r at position t = batch.positions[r]
        takes the embedding of next_ids[r] (token t+1) and hidden[r] (the target's final normed hidden state
        at t, or the head's own output when drafting further); MTP layer step % L writes its K/V into its
        appended KV layer (CacheBuffers.mtp_kv) through the batch's slots. Returns [T, H] after mtp.norm:
        compute_logits of it predicts token t+2. out_rows / queries: only those rows' outputs (MTPHead.forward_tables)."""
        if self.mtp is None:
            raise ValueError("this checkpoint has no MTP head (mtp_num_hidden_layers / num_nextn_predict_layers is 0)")
        embeds, cos, sin = self.embed(next_ids, batch.positions)
        layer = step % len(self.mtp.layers)
        return self.mtp.forward_tables(embeds, hidden, batch, cache.mtp_kv(self.config, layer), (cos, sin), layer,
                                       out_rows, queries)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens if self.lm_head is None else self.lm_head.weight
        logits = self.kernels.linear(hidden, weight)
        return comm.all_gather(logits, dim=-1) if self.parallel.sharded else logits

    def checkpoint_weights(self, fused_experts: bool) -> WeightMap:
        """Expected checkpoint tensors by canonical name (Qwen3.5's `model.language_model.` read as `model.`)."""
        prefix = "model."
        splits = getattr(self, "param_splits", {})
        mapping: WeightMap = {f"{prefix}embed_tokens.weight": sharded(self.embed_tokens, splits.get("embed_tokens"),
                                                                      self.parallel),
                              f"{prefix}norm.weight": whole(self.norm.weight)}
        for i, layer in enumerate(self.layers):
            mapping.update(prefixed(f"{prefix}layers.{i}", layer.checkpoint_weights(fused_experts)))
        if self.lm_head is not None:
            mapping["lm_head.weight"] = sharded(self.lm_head.weight, splits.get("embed_tokens"), self.parallel)
        if self.mtp is not None:
            mapping.update(prefixed("mtp", self.mtp.checkpoint_weights(fused_experts)))
        return mapping
