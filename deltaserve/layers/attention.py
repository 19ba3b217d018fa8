"""Gated full attention (model_spec.md §4): q/k RMSNorm, partial RoPE, GQA, sigmoid output gate.

q_proj rows are grouped per query head, [query head h | gate head h] each head_dim rows. We keep q_proj,
k_proj and v_proj as one fused projection with the query and gate rows regrouped on load:
rows [all query heads | all gate heads | k_proj | v_proj], so the gate is a plain [T, NH * D] slice that
the fused output gate (kernels.sigmoid_mul) reads in place.

Tensor parallelism splits the query heads (with their gates); KV heads are split too, or, when the ranks
outnumber them, each rank holds the one KV head its query heads use (replicated). o_proj is row-parallel,
its output summed over the ranks.
"""

from __future__ import annotations

import torch
from torch import nn

from ..batch import ForwardBatch
from ..config import ModelConfig
from ..distributed import comm
from ..distributed.parallel import SINGLE, Parallel, Split, kv_parts, require_divisible
from ..ops import Kernels
from .linear import Linear
from .norm import RMSNorm
from .weights import Target, WeightMap, read_ranges, rows, sharded, whole


class GatedAttention(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels, *, dtype: torch.dtype, device: torch.device | str,
                 parallel: Parallel = SINGLE):
        super().__init__()
        self.kernels = kernels
        self.parallel = parallel
        require_divisible("num_attention_heads", config.num_attention_heads, parallel)
        self.kv_parts = kv_parts(config.num_key_value_heads, parallel)
        self.num_heads, self.num_kv_heads, self.head_dim = (
            parallel.local(config.num_attention_heads), config.num_key_value_heads // self.kv_parts, config.head_dim)
        self.o_size = self.num_heads * self.head_dim              # queries; as many gate rows
        self.q_size = 2 * self.o_size                             # queries and gates
        self.kv_size = self.num_kv_heads * self.head_dim
        h = config.hidden_size
        self.qkv_proj = Linear(h, self.q_size + 2 * self.kv_size, kernels, dtype=dtype, device=device)
        self.o_proj = Linear(self.num_heads * self.head_dim, h, kernels, dtype=dtype, device=device)
        eps = config.rms_norm_eps
        self.q_norm = RMSNorm(self.head_dim, eps, kernels, dtype=dtype, device=device)
        self.k_norm = RMSNorm(self.head_dim, eps, kernels, dtype=dtype, device=device)
        self.scale = self.head_dim ** -0.5
        if parallel.sharded:
            tp, kvp = parallel.size, self.kv_parts
            o, kv = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
            self.qkv_proj.param_splits = {"weight": Split(0, ((o, tp), (o, tp), (kv, kvp), (kv, kvp)))}
            self.o_proj.param_splits = {"weight": Split(1, ((o, tp),))}

    @property
    def input_proj(self) -> Linear:
        """The projection of the layer's input (a pre-norm folds its norm into it: RMSNorm.project)."""
        return self.qkv_proj

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor,
                cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [T, H] -> [T, H]; cos_sin: the step's RoPE tables [T, rotary_dim] (RotaryEmbedding.cos_sin)."""
        return self.forward_projected(self.qkv_proj(x), batch, kv_cache, cos_sin)

    def forward_projected(self, projected: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor,
                          cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """forward from qkv_proj(x) [T, q_size + 2 kv_size], computed by the caller."""
        T = projected.shape[0]
        q, gate, k, v = projected.split([self.o_size, self.o_size, self.kv_size, self.kv_size], dim=-1)
        # q/k norms, RoPE, the KV store and attention in one op (the norms here are zero-centred, as the op's
        # are); max_query_len tells it when every sequence has one query token
        o = self.kernels.fused_paged_attention(
            q.view(T, self.num_heads, self.head_dim), k.view(T, self.num_kv_heads, self.head_dim),
            v.view(T, self.num_kv_heads, self.head_dim), self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
            *cos_sin, kv_cache, batch.slot_mapping, cu_seqlens=batch.cu_seqlens, seq_lens=batch.seq_lens,
            block_tables=batch.block_tables, scale=self.scale, max_query_len=1 if batch.num_prefills == 0 else None)
        out = self.kernels.gated_linear(o.view(T, self.o_size), gate, self.o_proj.weight, activation="sigmoid")
        return comm.all_reduce(out) if self.parallel.sharded else out

    def checkpoint_weights(self) -> WeightMap:
        par = self.parallel
        if not par.sharded:
            return {
                "q_proj.weight": Target((self.q_size, self.qkv_proj.in_features), self._load_q_proj),
                "k_proj.weight": rows(self.qkv_proj, self.q_size, self.kv_size),
                "v_proj.weight": rows(self.qkv_proj, self.q_size + self.kv_size, self.kv_size),
                "o_proj.weight": whole(self.o_proj.weight),
                "q_norm.weight": whole(self.q_norm.weight),
                "k_norm.weight": whole(self.k_norm.weight),
            }
        # q_proj rows are per head [q_h | gate_h]: a rank's heads are one contiguous range
        full_q, full_kv = par.size * self.q_size, self.kv_parts * self.kv_size
        kv_rows = [par.piece(full_kv, self.kv_parts)]
        return {
            "q_proj.weight": Target((full_q, self.qkv_proj.in_features), self._load_q_proj,
                                    read_ranges([par.piece(full_q)])),
            "k_proj.weight": rows(self.qkv_proj, self.q_size, full_kv, kv_rows),
            "v_proj.weight": rows(self.qkv_proj, self.q_size + self.kv_size, full_kv, kv_rows),
            "o_proj.weight": sharded(self.o_proj.weight, self.o_proj.param_splits["weight"], par),
            "q_norm.weight": whole(self.q_norm.weight),
            "k_norm.weight": whole(self.k_norm.weight),
        }

    def _load_q_proj(self, t: torch.Tensor) -> None:
        """Checkpoint rows [q_0 | gate_0 | q_1 | gate_1 | ...] -> [q_0 | q_1 | ... | gate_0 | gate_1 | ...]."""
        q, gate = t.reshape(self.num_heads, 2, self.head_dim, -1).unbind(1)
        self.qkv_proj.load_rows(0, q.reshape(self.o_size, -1))
        self.qkv_proj.load_rows(self.o_size, gate.reshape(self.o_size, -1))
