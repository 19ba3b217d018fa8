"""Gated full attention (model_spec.md §4): q/k RMSNorm, partial RoPE, GQA, sigmoid output gate.

q_proj rows are grouped per query head, [query head h | gate head h] each head_dim rows. We keep q_proj,
k_proj and v_proj as one fused projection with the query and gate rows regrouped on load:
rows [all query heads | all gate heads | k_proj | v_proj], so the gate is a plain [T, NH * D] slice that
the fused output gate (kernels.sigmoid_mul) reads in place.

With an FP8 KV cache (kv_cache_dtype "fp8") the layer hands the ops its pool with `kv_scale` [2, 1], the K and
V dequantisation multipliers: the checkpoint's k_scale / v_scale when it has them, else calibrated at start-up
(runner/kv_calibration.py). They start as NaN, so an uncalibrated FP8 cache cannot pass for a working one.

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
from ..ops.quant.fp8 import FP8_DTYPE, Fp8KvCache
from .linear import Linear, fp8_layout
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
        quant = config.quantization
        qkv_fp8 = fp8_layout(quant, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                             rows=(self.head_dim, self.kv_size))
        self.qkv_proj = Linear(h, self.q_size + 2 * self.kv_size, kernels, dtype=dtype, device=device, fp8=qkv_fp8)
        self.o_proj = Linear(self.num_heads * self.head_dim, h, kernels, dtype=dtype, device=device,
                             fp8=fp8_layout(quant, ("self_attn.o_proj",), cols=(self.o_size,) if parallel.sharded else ()))
        eps = config.rms_norm_eps
        self.q_norm = RMSNorm(self.head_dim, eps, kernels, dtype=dtype, device=device)
        self.k_norm = RMSNorm(self.head_dim, eps, kernels, dtype=dtype, device=device)
        self.scale = self.head_dim ** -0.5
        self.register_buffer("kv_scale", torch.full((2, 1), float("nan"), device=device), persistent=False)
        self.kv_scale_source = ""                                 # "checkpoint" | "calibration" once set
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
        return self.output(self.core(projected, batch, kv_cache, cos_sin), projected)

    def core(self, projected: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor,
             cos_sin: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        """The part that reads the batch's sequence structure (KV slots, context lengths, block tables): q/k
        norms, RoPE, the KV store and attention -> o [T, o_size] (into `out` when given)."""
        T = projected.shape[0]
        if kv_cache.dtype == FP8_DTYPE:
            kv_cache = Fp8KvCache(kv_cache, self.kv_scale)
        q, _, k, v = projected.split([self.o_size, self.o_size, self.kv_size, self.kv_size], dim=-1)
        # q/k norms, RoPE, the KV store and attention in one op (the norms here are zero-centred, as the op's
        # are); max_query_len tells it when every sequence has one query token
        o = self.kernels.fused_paged_attention(
            q.view(T, self.num_heads, self.head_dim), k.view(T, self.num_kv_heads, self.head_dim),
            v.view(T, self.num_kv_heads, self.head_dim), self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
            *cos_sin, kv_cache, batch.slot_mapping, cu_seqlens=batch.cu_seqlens, seq_lens=batch.seq_lens,
            block_tables=batch.block_tables, scale=self.scale, max_query_len=1 if batch.num_prefills == 0 else None)
        o = o.view(T, self.o_size)
        return o if out is None else out.copy_(o)

    def core_rows(self, projected: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor,
                  cos_sin: tuple[torch.Tensor, torch.Tensor], rows: torch.Tensor, queries: ForwardBatch) -> torch.Tensor:
        """core with every row's K/V stored but the attention of `rows` only -> o [len(rows), o_size]: `queries`
        holds them as one-token sequences (cu_seqlens, seq_lens = position + 1, block_tables)."""
        T = projected.shape[0]
        if kv_cache.dtype == FP8_DTYPE:
            kv_cache = Fp8KvCache(kv_cache, self.kv_scale)
        q, _, k, v = projected.split([self.o_size, self.o_size, self.kv_size, self.kv_size], dim=-1)
        q = self.kernels.attention_prologue(
            q.view(T, self.num_heads, self.head_dim), k.view(T, self.num_kv_heads, self.head_dim),
            v.view(T, self.num_kv_heads, self.head_dim), self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
            *cos_sin, kv_cache, batch.slot_mapping)
        o = self.kernels.paged_attention(q.index_select(0, rows), kv_cache, cu_seqlens=queries.cu_seqlens,
                                         seq_lens=queries.seq_lens, block_tables=queries.block_tables, scale=self.scale)
        return o.reshape(rows.shape[0], self.o_size)

    def output(self, o: torch.Tensor, projected: torch.Tensor) -> torch.Tensor:
        """The token-wise rest: the sigmoid output gate (read from the projection) and o_proj."""
        gate = projected[:, self.o_size : 2 * self.o_size]
        out = self.kernels.gated_linear(o, gate, self.o_proj.weight, activation="sigmoid")
        return comm.all_reduce(out) if self.parallel.sharded else out

    @property
    def projection_width(self) -> int:
        return self.q_size + 2 * self.kv_size

    def checkpoint_weights(self) -> WeightMap:
        par = self.parallel
        common = {
            "q_norm.weight": whole(self.q_norm.weight),
            "k_norm.weight": whole(self.k_norm.weight),
            # FP8 KV-cache multipliers (optional: the loader does not require them)
            "k_scale": Target((), lambda t: self._load_kv_scale(0, t)),
            "v_scale": Target((), lambda t: self._load_kv_scale(1, t)),
        }
        if not par.sharded:
            return {
                "q_proj.weight": Target((self.q_size, self.qkv_proj.in_features), self._load_q_proj,
                                        fp8=self.qkv_proj.is_fp8),
                "k_proj.weight": rows(self.qkv_proj, self.q_size, self.kv_size),
                "v_proj.weight": rows(self.qkv_proj, self.q_size + self.kv_size, self.kv_size),
                "o_proj.weight": whole(self.o_proj.weight),
                **common,
            }
        # q_proj rows are per head [q_h | gate_h]: a rank's heads are one contiguous range
        full_q, full_kv = par.size * self.q_size, self.kv_parts * self.kv_size
        kv_rows = [par.piece(full_kv, self.kv_parts)]
        return {
            "q_proj.weight": Target((full_q, self.qkv_proj.in_features), self._load_q_proj,
                                    read_ranges([par.piece(full_q)]), fp8=self.qkv_proj.is_fp8),
            "k_proj.weight": rows(self.qkv_proj, self.q_size, full_kv, kv_rows),
            "v_proj.weight": rows(self.qkv_proj, self.q_size + self.kv_size, full_kv, kv_rows),
            "o_proj.weight": sharded(self.o_proj.weight, self.o_proj.param_splits["weight"], par),
            **common,
        }

    def _load_kv_scale(self, which: int, t: torch.Tensor) -> None:
        self.kv_scale[which].copy_(t.float().reshape(1))
        self.kv_scale_source = "checkpoint"

    def _load_q_proj(self, t: torch.Tensor) -> None:
        """Checkpoint rows [q_0 | gate_0 | q_1 | gate_1 | ...] -> [q_0 | q_1 | ... | gate_0 | gate_1 | ...]."""
        q, gate = t.reshape(self.num_heads, 2, self.head_dim, -1).unbind(1)
        self.qkv_proj.load_rows(0, q.reshape(self.o_size, -1))
        self.qkv_proj.load_rows(self.o_size, gate.reshape(self.o_size, -1))
