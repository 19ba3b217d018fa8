"""Sparse MoE block with a sigmoid-gated shared expert (model_spec.md §6).

Experts are stored fused, w13 [E', 2I, H] (gate rows then up rows) and w2 [E', H, I], whatever the
checkpoint layout: per-expert `experts.{e}.{gate,up,down}_proj.weight` (Qwen3-Next, re-saved models)
or fused `experts.gate_up_proj` / `experts.down_proj` (official Qwen3.5-MoE).

The shared expert runs inside the same fused_moe call when its width S is a multiple m of the routed
width I (Qwen3-Next and Qwen3.5-MoE: S = I): it is stored as m more experts E .. E+m-1, slice j holding
its intermediate columns jI .. (j+1)I - 1, and every token is routed to all m with weight
sigmoid(shared_expert_gate(x)). silu(gate) * up is per column and the down projection sums over columns,
so the slices' outputs add up to the shared expert's output: the same function, one op, one fp32
combine. The shared gate's row is the router's last row, and topk_softmax appends the slices with weight
sigmoid(gate logit). A decode step's MoE block is four launches: router GEMV, route, w13, w2 + combine
(at T <= 2 on Hopper the routing kernel also runs the shared slots' w13 rows: ops/moe/config.py).
Other widths keep the shared expert as a separate MLP.

Block-FP8 experts (every expert and the folded shared expert converted): w13 / w2 are float8_e4m3fn with
w13_scale_inv / w2_scale_inv (fp32 per scale group, ops/quant/fp8.py), and `self.w13` / `self.w2` read as
BlockFp8Weight operands; checkpoint pieces arrive as packed FP8 rows. Under tensor parallelism the scale
groups divide the rank's intermediate width, so a shard narrower than a 128-block (Qwen3-Next's experts at
TP8) is exact; w2's column shards travel with one multiplier per column group (layers/weights.py).

Tensor parallelism (distributed/parallel.py), default: every expert's intermediate dim is split (w13 rows,
w2 columns; the shared expert and its slices too), the router is replicated, and the block's output is
summed over the ranks (one all-reduce). Expert parallelism (`Parallel.expert_parallel`): each rank holds
E / tp whole experts; every rank has every token (the hidden state is replicated), routes them all with the
replicated router, keeps the (token, expert) pairs of its own experts (the others get weight 0) and the sum
over the ranks combines them. The shared-expert slices are then held by every rank and weighted on rank 0
only (a separate shared MLP stays tensor-parallel).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..distributed import comm
from ..distributed.parallel import SINGLE, Parallel, Split, require_divisible
from ..ops import Kernels
from ..ops.quant.fp8 import BLOCK, FP8_DTYPE, BlockFp8Weight
from .linear import Fp8Layout, Linear, fp8_layout, fp8_scale_shape, load_fp8_rows
from .mlp import MLP
from .weights import Slices, Target, WeightMap, prefixed, read_ranges, rows, whole

_NOT_THIS_RANK = (lambda t: None, lambda sl: None)   # (load, read) of an expert another rank holds


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels, *, dtype: torch.dtype, device: torch.device | str,
                 parallel: Parallel = SINGLE):
        super().__init__()
        self.kernels = kernels
        self.parallel = parallel
        h, e, i = config.hidden_size, config.num_experts, config.moe_intermediate_size
        s = config.shared_expert_intermediate_size
        self.num_experts, self.top_k, self.renormalize = e, config.num_experts_per_tok, config.norm_topk_prob
        self.intermediate_size, self.shared_size = i, s
        # shared-expert slices stored as experts E.. (0: no shared expert, or kept separate)
        self.shared_slices = s // i if s > 0 and s % i == 0 else 0
        m = self.shared_slices
        self.expert_parallel = parallel.sharded and parallel.expert_parallel
        tp = parallel.size
        if self.expert_parallel:
            require_divisible("num_experts", e, parallel)
        else:
            require_divisible("moe_intermediate_size", i, parallel)
        # this rank's experts [expert_start, expert_start + local_experts) and intermediate width
        self.local_experts = parallel.local(e) if self.expert_parallel else e
        self.expert_start = parallel.rank * self.local_experts if self.expert_parallel else 0
        self.local_intermediate = i if self.expert_parallel else parallel.local(i)
        i_full, i = i, self.local_intermediate
        stored = self.local_experts + m
        quant = config.quantization
        # the router; with folded slices its last row is the shared expert's gate (one GEMV for both)
        router_names = ("mlp.gate", "mlp.shared_expert_gate") if self.shared_slices else ("mlp.gate",)
        self.gate = Linear(h, e + (1 if self.shared_slices else 0), kernels, dtype=dtype, device=device,
                           fp8=fp8_layout(quant, router_names, rows=(e, 1) if self.shared_slices else ()))
        expert_names = ("mlp.experts",) + (("mlp.shared_expert",) if self.shared_slices else ())
        self.w13_fp8 = fp8_layout(quant, expert_names, rows=(i,))
        self.w2_fp8 = None if self.w13_fp8 is None else Fp8Layout(col_group=fp8_layout(quant, expert_names,
                                                                                          cols=(i,)).col_group)
        self._expert_param("w13", (stored, 2 * i, h), self.w13_fp8, dtype, device)
        self._expert_param("w2", (stored, h, i), self.w2_fp8, dtype, device)
        self.shared_expert = MLP(h, s, kernels, dtype=dtype, device=device, quantization=quant,
                                 prefix="mlp.shared_expert", parallel=parallel, reduce=False,
                                 field="shared_expert_intermediate_size") if s > 0 and not self.shared_slices else None
        self.shared_expert_gate = Linear(h, 1, kernels, dtype=dtype, device=device,
                                         fp8=fp8_layout(quant, ("mlp.shared_expert_gate",))) \
            if self.shared_expert is not None else None
        if parallel.sharded:
            experts = Split(0, ((e, tp), (m, 1)))
            self.param_splits = ({"w13": experts, "w2": experts} if self.expert_parallel else
                                 {"w13": Split(1, ((i_full, tp), (i_full, tp))), "w2": Split(2, ((i_full, tp),))})

    def _expert_param(self, name: str, shape: tuple[int, ...], fp8: Fp8Layout | None, dtype, device) -> None:
        if fp8 is None:
            setattr(self, name, nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False))
            return
        setattr(self, name, nn.Parameter(torch.empty(shape, dtype=FP8_DTYPE, device=device), requires_grad=False))
        setattr(self, f"{name}_scale_inv", nn.Parameter(
            torch.ones(fp8_scale_shape(shape, fp8), dtype=torch.float32, device=device), requires_grad=False))

    def __getattr__(self, name: str):
        # FP8 experts read as BlockFp8Weight operands (the Parameters stay w13 / w13_scale_inv, w2 / ...)
        p = self.__dict__.get("_parameters", {})
        if name in ("w13", "w2") and self.__dict__.get(f"{name}_fp8") is not None and f"{name}_scale_inv" in p:
            layout = self.__dict__[f"{name}_fp8"]
            return BlockFp8Weight(p[name], p[f"{name}_scale_inv"], layout.row_group, layout.col_group)
        return super().__getattr__(name)

    @property
    def experts_fp8(self) -> bool:
        return self.w13_fp8 is not None

    @property
    def input_proj(self) -> Linear:
        """The projection of the block's input, the router (a pre-norm folds its norm into it:
        RMSNorm.project)."""
        return self.gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_projected(x, self.gate(x))

    def forward_projected(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """forward from x and gate(x), computed by the caller."""
        # routing (the shared slices' sigmoid weights included) and the experts in one op (the op picks
        # whether the routing is its own kernel or done inside the w13 kernel)
        if self.expert_parallel:
            out = self._local_experts(x, router_logits)
        else:
            out = self.kernels.fused_moe_routed(x, self.w13, self.w2, router_logits, self.top_k, self.renormalize,
                                                shared_slices=self.shared_slices)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return comm.all_reduce(out) if self.parallel.sharded else out

    def _local_experts(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """Expert parallelism: the routed pairs of this rank's experts (others weighted 0, so the sum over the
        ranks is the full block); the shared slices (ids E..) count on rank 0 only."""
        weights, ids = self.kernels.topk_softmax(router_logits, self.top_k, self.renormalize,
                                                 shared_slices=self.shared_slices)
        e, start = self.num_experts, self.expert_start
        mine = (ids >= start) & (ids < start + self.local_experts)
        local = ids - start
        if self.shared_slices:
            shared = ids >= e
            local = torch.where(shared, ids - e + self.local_experts, local)
            mine = mine | (shared & (self.parallel.rank == 0))
        weights = torch.where(mine, weights, torch.zeros_like(weights))
        return self.kernels.fused_moe(x, self.w13, self.w2, weights, torch.where(mine, local, torch.zeros_like(local)))

    def checkpoint_weights(self, fused_experts: bool) -> WeightMap:
        h, e, par = self.w13.shape[-1], self.num_experts, self.parallel
        i_full, i = self.intermediate_size, self.local_intermediate
        fp8 = self.experts_fp8
        mapping: WeightMap = {"gate.weight": rows(self.gate, 0, e)}
        if self.shared_expert_gate is not None:
            mapping["shared_expert_gate.weight"] = whole(self.shared_expert_gate.weight)
        if self.shared_expert is not None:
            mapping.update(prefixed("shared_expert", self.shared_expert.checkpoint_weights()))
        elif self.shared_slices:
            s = self.shared_size
            # each slice's intermediate columns this rank holds (all of them under expert parallelism)
            a, b = (0, i) if self.expert_parallel else par.piece(i_full)
            ranges = [(j * i_full + a, j * i_full + b) for j in range(self.shared_slices)]
            read_rows, read_cols = (None, None) if not par.sharded else (read_ranges(ranges), read_ranges(ranges, 1))
            mapping["shared_expert_gate.weight"] = rows(self.gate, e, 1)
            mapping["shared_expert.gate_proj.weight"] = self._target(
                (s, h), lambda t: self._load_shared(t, 0, rows=True), read_rows)
            mapping["shared_expert.up_proj.weight"] = self._target(
                (s, h), lambda t: self._load_shared(t, i, rows=True), read_rows)
            mapping["shared_expert.down_proj.weight"] = self._target(
                (h, s), lambda t: self._load_shared(t, 0, rows=False), read_cols, w2=par.sharded)
        n, start = self.local_experts, self.expert_start
        if not par.sharded:
            if fused_experts:
                mapping["experts.gate_up_proj"] = Target((e, 2 * i, h),
                                                         lambda t: self._load("w13", slice(0, e), 0, t), fp8=fp8)
                mapping["experts.down_proj"] = Target((e, h, i), lambda t: self._load("w2", slice(0, e), 0, t),
                                                      fp8=fp8)
                return mapping
            for j in range(e):
                mapping[f"experts.{j}.gate_proj.weight"] = Target((i, h), lambda t, j=j: self._load("w13", j, 0, t),
                                                                  fp8=fp8)
                mapping[f"experts.{j}.up_proj.weight"] = Target((i, h), lambda t, j=j: self._load("w13", j, i, t),
                                                                fp8=fp8)
                mapping[f"experts.{j}.down_proj.weight"] = Target((h, i), lambda t, j=j: self._load("w2", j, 0, t),
                                                                  fp8=fp8)
            return mapping
        # tensor parallel: rows a..b of w13's gate and up halves, columns a..b of w2; expert parallel: experts
        # start..start+n whole (Slices reads, so FP8 shards carry their block multipliers)
        if self.expert_parallel:
            reads = {"gate": None, "up": None, "down": None, "fused13": Slices(0, ((start, start + n),)),
                     "fused2": Slices(0, ((start, start + n),))}
        else:
            a, b = par.piece(i_full)
            reads = {"gate": Slices(0, ((a, b),)), "up": Slices(0, ((a, b),)), "down": Slices(1, ((a, b),)),
                     "fused13": Slices(1, ((a, b), (i_full + a, i_full + b))), "fused2": Slices(2, ((a, b),))}
        w2_cols = not self.expert_parallel     # w2's shard is a column range
        if fused_experts:
            mapping["experts.gate_up_proj"] = self._target(
                (e, 2 * i_full, h), lambda t: self._load("w13", slice(0, n), 0, t), reads["fused13"])
            mapping["experts.down_proj"] = self._target(
                (e, h, i_full), lambda t: self._load("w2", slice(0, n), 0, t, block_k=self._w2_block(w2_cols)),
                reads["fused2"], w2=w2_cols)
            return mapping
        for j in range(e):
            if not start <= j < start + n:
                for name, shape in (("gate_proj", (i_full, h)), ("up_proj", (i_full, h)), ("down_proj", (h, i_full))):
                    mapping[f"experts.{j}.{name}.weight"] = Target(shape, *_NOT_THIS_RANK)
                continue
            k = j - start
            mapping[f"experts.{j}.gate_proj.weight"] = self._target(
                (i_full, h), lambda t, k=k: self._load("w13", k, 0, t), reads["gate"])
            mapping[f"experts.{j}.up_proj.weight"] = self._target(
                (i_full, h), lambda t, k=k: self._load("w13", k, i, t), reads["up"])
            mapping[f"experts.{j}.down_proj.weight"] = self._target(
                (h, i_full), lambda t, k=k: self._load("w2", k, 0, t, block_k=self._w2_block(w2_cols)),
                reads["down"], w2=w2_cols)
        return mapping

    def _w2_block(self, column_shard: bool) -> int:
        """Columns per multiplier of the packed rows a w2 target takes: its column group for a column shard."""
        return self.w2_fp8.col_group if column_shard and self.w2_fp8 is not None else BLOCK

    def _target(self, shape: tuple[int, ...], load, read, *, w2: bool = False) -> Target:
        """An expert tensor's target (w2: a column shard of w2)."""
        layout = self.w2_fp8 if w2 else self.w13_fp8
        return Target(shape, load, read, fp8=self.experts_fp8, block_k=self._w2_block(w2),
                      row_group=layout.row_group if layout is not None else 1)

    def _load(self, name: str, experts: int | slice, row_offset: int, t: torch.Tensor,
              columns: tuple[int, int] | None = None, block_k: int = BLOCK) -> None:
        """Checkpoint rows (packed FP8 rows when the experts are FP8, with a multiplier per block_k columns,
        else dense) -> rows row_offset.. of expert(s) `experts` of w13 / w2; columns (start, stop): only those
        checkpoint columns (the shared expert's down projection slices)."""
        if self.__dict__[f"{name}_fp8"] is not None:
            full = getattr(self, name)
            dst = BlockFp8Weight(full.qweight[experts], full.scale[experts], full.row_group, full.col_group)
            load_fp8_rows(dst, row_offset, t, columns=columns, block_k=block_k)
            return
        param = self._parameters[name]  # dense: the loader dequantised an FP8 checkpoint tensor already
        if columns is not None:
            t = t[..., columns[0] : columns[1]]
        param.data[experts, row_offset : row_offset + t.shape[-2]].copy_(t)

    def _load_shared(self, t: torch.Tensor, row_offset: int, *, rows: bool) -> None:
        """Shared-expert gate / up rows [S, H] -> w13 rows of the slices; down [H, S] -> w2 columns (`t` holds
        this rank's columns of each slice, one after another)."""
        i, n = self.local_intermediate, self.local_experts
        for j in range(self.shared_slices):
            if rows:
                self._load("w13", n + j, row_offset, t[j * i : (j + 1) * i])
            else:
                self._load("w2", n + j, 0, t, columns=(j * i, (j + 1) * i), block_k=self._w2_block(self.parallel.sharded))
