"""The device half of start-up, and the unit that owns one device's model, cache pools and runner (one
per tensor-parallel rank, later).

One Worker per tensor-parallel rank (engine/executor.py starts the others): `parallel` says which shard of
the model it holds; kernel selection sees the rank's head counts and the pools hold the rank's heads.

`Worker.start()` runs the phases in order: `load_model` (select the kernels for the device and the
model's shapes, build the model from the checkpoint or from dummy weights, decide whether decode steps
will be CUDA graphs), `cache_budget` (GPU: measured after a warm-up forward of the largest step, the
graphs' pool set aside; CPU: the configured bytes), `plan_cache` on that budget (cache/plan.py), and
`initialize_cache` (allocate the pools, build the ModelRunner over them, capture the decode graphs and the
piecewise prefill graphs, run a lone prompt per prefill bucket so its kernels are built, set up the compiled
CPU decode step). They are separate methods so that a driver over several workers can
take the smallest budget of all before any of them allocates. The engine's half (tokenizer, cache
manager, scheduler, warm-up requests) stays in engine/llm_engine.py.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch

from ..cache.plan import DEFAULT_PREFIX_CACHE_STATE_FRACTION, CachePlan, CacheSpec, MiB, plan_cache
from ..config import ModelConfig
from ..distributed.parallel import SINGLE, Parallel
from ..models.loader import build_dummy_model, load_model
from ..models.qwen3_next import HybridForCausalLM
from ..ops import Kernels, select_kernels
from . import cpu_compile
from .cuda_graphs import plan_decode_graphs
from .kv_calibration import calibrate_kv_scales
from .memory import allocate_cache, profile_gpu_cache_budget
from .model_runner import ModelRunner
from .prefill_graphs import plan_prefill_graphs, prefill_capture_sizes, warm_up_lone_prompts
from .verify_graphs import plan_verify_graphs

logger = logging.getLogger(__name__)

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")     # vLLM's names; fp8 = fp8_e4m3
# the ops that read or write the KV pool
FP8_KV_OPS = ("store_kv", "attention_prologue", "paged_attention", "fused_paged_attention")


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    """What the device half of start-up is asked for, already resolved (no "auto" device or dtype left)."""

    model: ModelConfig
    model_path: Path | None          # the checkpoint directory; None: dummy weights from `model` alone
    load_format: str                 # "auto" (safetensors) | "dummy" (seeded random weights)
    device: torch.device
    dtype: torch.dtype
    max_num_seqs: int                # the scheduler's caps the pools and graphs are sized for
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    gpu_memory_utilization: float    # GPU: fraction of total memory the process may use
    cpu_cache_bytes: int             # CPU: bytes for the pools
    num_kv_blocks: int | None = None  # fix the KV pool size instead of deriving it from the budget
    seed: int | None = 0             # dummy weights and the sampler's shared generator
    force_reference_ops: bool = False
    enforce_eager: bool = False      # no CUDA graphs, no compiled CPU decode step
    prefill_cuda_graphs: bool = True  # prefill / mixed steps as piecewise CUDA graphs (runner/prefill_graphs.py)
    compile: str = "off"             # the compiled CPU decode step: "auto" | "on" | "off" (cpu_compile.py)
    kv_cache_dtype: str = "auto"     # "auto" (the activation dtype) | "fp8" (e4m3 with per-layer multipliers)
    prefix_cache_state_fraction: float = DEFAULT_PREFIX_CACHE_STATE_FRACTION  # snapshots' budget share (0: none)
    parallel: Parallel = SINGLE      # this worker's tensor-parallel rank (its shard of the model)
    mtp_kv_layers: int = 0           # speculation with mtp: a KV layer per MTP layer in the pools (0: none)
    num_speculative_tokens: int = 0  # speculation's most drafts per step: verify graphs are sized for it (0: off)


class Worker:
    def __init__(self, config: WorkerConfig):
        self.config = config
        # validated before anything loads; "auto" / "on" become "off" off CPU
        self.compile_mode = cpu_compile.resolve_compile_mode(config.compile, config.device)
        self.kernels: Kernels | None = None
        self.model: HybridForCausalLM | None = None
        self.graph_sizes: list[int] = []             # decode batch buckets to capture ([]: eager decodes)
        self.prefill_sizes: list[int] = []           # prefill token-count buckets ([]: eager prefills)
        self.verify_sizes: list[int] = []            # verify-step batch buckets ([]: no verify graphs)
        self.plan: CachePlan | None = None
        self.runner: ModelRunner | None = None
        self.phase_seconds: dict[str, float] = {}    # start-up phases: the engine's ready line reports them

    def start(self) -> ModelRunner:
        """Every phase, for a single device."""
        c = self.config
        t0 = time.perf_counter()
        self.load_model()
        t1 = time.perf_counter()
        self.phase_seconds["load"] = t1 - t0
        logger.debug("model %s in %.1f s", "built with dummy weights" if c.load_format == "dummy" else "loaded", t1 - t0)
        budget = self.cache_budget()
        if c.device.type == "cuda":      # a forward of the largest step: the first kernel builds happen here
            self.phase_seconds["memory profile"] = time.perf_counter() - t1
            logger.debug("memory profile (a %d-token forward, kernel builds included) in %.1f s",
                         c.max_num_batched_tokens, self.phase_seconds["memory profile"])
        plan = plan_cache(self.cache_spec(), budget_bytes=budget, max_num_seqs=c.max_num_seqs,
                          max_model_len=c.max_model_len, num_blocks=c.num_kv_blocks,
                          snapshot_fraction=c.prefix_cache_state_fraction)
        return self.initialize_cache(plan)

    def load_model(self) -> HybridForCausalLM:
        c = self.config
        self.kernels = select_kernels(c.device, force_reference=c.force_reference_ops, shapes=self.kernel_shapes(),
                                      fp8_weights=c.model.quantization is not None)
        if c.load_format == "dummy":
            self.model = build_dummy_model(c.model, device=c.device, dtype=c.dtype, kernels=self.kernels,
                                           seed=c.seed or 0, parallel=c.parallel)
        else:
            self.model = load_model(c.model_path, device=c.device, dtype=c.dtype, kernels=self.kernels, config=c.model,
                                    parallel=c.parallel, show_progress=c.parallel.rank == 0)
        n_mtp = len(self.model.mtp.layers) if self.model.mtp is not None else 0
        if c.mtp_kv_layers and c.mtp_kv_layers != n_mtp:
            raise ValueError(f"speculative_config: method 'mtp' needs the checkpoint's MTP head, and it has {n_mtp} "
                             f"MTP layers, not {c.mtp_kv_layers}")
        if c.mtp_kv_layers and c.kv_cache_dtype == "fp8":
            raise ValueError("speculative_config: method 'mtp' with kv_cache_dtype='fp8' is not implemented (the "
                             "MTP head's KV multipliers are not calibrated); use kv_cache_dtype='auto'")
        if c.kv_cache_dtype == "fp8":
            # the references and the Triton attention kernels read and write an FP8 pool (ops.quant Fp8KvCache)
            other = [f"{op} ({self.kernels.backend[op]})" for op in FP8_KV_OPS
                     if self.kernels.backend[op] not in ("reference", "triton")]
            if other:
                raise ValueError(f"kv_cache_dtype='fp8' on {c.device}: the attention kernels {', '.join(other)} "
                                 "do not read an FP8 cache; use kv_cache_dtype='auto' (or enforce_reference_ops=True: "
                                 "the slow reference path)")
        # under tensor parallelism every rank plans the same buckets (engine/executor.py checks they agree)
        self.graph_sizes = plan_decode_graphs(c.device, self.kernels,
                                              max_batch=min(c.max_num_seqs, c.max_num_batched_tokens),
                                              enforce_eager=c.enforce_eager)
        self.prefill_sizes = plan_prefill_graphs(c.device, self.kernels,
                                                 max_num_batched_tokens=c.max_num_batched_tokens,
                                                 enforce_eager=c.enforce_eager or c.parallel.sharded,
                                                 enabled=c.prefill_cuda_graphs)
        if c.num_speculative_tokens and self.graph_sizes:
            self.verify_sizes = plan_verify_graphs(c.device, self.kernels, max_batch=min(c.max_num_seqs,
                                                   c.max_num_batched_tokens // (c.num_speculative_tokens + 1)),
                                                   enforce_eager=c.enforce_eager)
        return self.model

    def kernel_shapes(self) -> dict[str, int]:
        """The model's kernel-selection dims plus this rank's head counts (what its kernels are called with)."""
        m, p = self.config.model, self.config.parallel
        return {**m.kernel_shapes, "gdn_num_k_heads": m.linear_num_key_heads // p.size,
                "gdn_num_v_heads": m.linear_num_value_heads // p.size,
                "attn_num_heads": m.num_attention_heads // p.size,
                "attn_num_kv_heads": max(1, m.num_key_value_heads // p.size)}

    def cache_spec(self) -> CacheSpec:
        """Bytes per KV block and per state slot at this worker's dtype (this rank's heads)."""
        c = self.config
        elem = torch.empty((), dtype=c.dtype).element_size()
        kv = 1 if c.kv_cache_dtype == "fp8" else elem
        return CacheSpec.from_model(c.model, block_size=c.block_size, kv_dtype_bytes=kv, conv_dtype_bytes=elem,
                                    mtp_kv_layers=c.mtp_kv_layers, tp_size=c.parallel.size)

    def cache_budget(self) -> int:
        """Bytes the pools may take on this device (after load_model: a GPU budget is measured on the model)."""
        c = self.config
        if c.device.type != "cuda":
            return c.cpu_cache_bytes
        return profile_gpu_cache_budget(self.model, device=c.device, dtype=c.dtype,
                                        max_num_batched_tokens=c.max_num_batched_tokens, max_num_seqs=c.max_num_seqs,
                                        block_size=c.block_size, utilization=c.gpu_memory_utilization,
                                        graph_batch_size=max(self.graph_sizes, default=0),
                                        prefill_graph_sizes=self.prefill_sizes, mtp_kv_layers=c.mtp_kv_layers,
                                        verify_graphs=(max(self.verify_sizes), c.num_speculative_tokens + 1,
                                                       len(self.verify_sizes) * c.num_speculative_tokens)
                                        if self.verify_sizes else None)

    def initialize_cache(self, plan: CachePlan) -> ModelRunner:
        """Allocate the pools of `plan`, build the runner over them, capture the decode and prefill graphs (they
        bake in the pools' addresses, so they come after; on CUDA each prefill bucket then runs once, graphs or
        not, so the first prompts of those lengths build no kernels) and set up the compiled CPU decode step."""
        c = self.config
        fp8_kv = c.kv_cache_dtype == "fp8"
        if fp8_kv:
            calibrate_kv_scales(self.model, device=c.device, dtype=c.dtype, block_size=c.block_size, seed=c.seed or 0)
        buffers = allocate_cache(self.model, num_slots=plan.num_slots, num_blocks=plan.num_blocks,
                                 block_size=c.block_size, device=c.device, dtype=c.dtype,
                                 kv_dtype=torch.float8_e4m3fn if fp8_kv else None, tp_size=c.parallel.size,
                                 mtp_kv_layers=c.mtp_kv_layers)
        runner = ModelRunner(self.model, buffers, device=c.device, max_model_len=plan.max_model_len, seed=c.seed)
        if self.graph_sizes:
            runner.capture_decode_graphs(min(plan.max_num_seqs, c.max_num_batched_tokens))
        if self.prefill_sizes:
            runner.capture_prefill_graphs(self.prefill_sizes)
            g = runner.prefill_graphs
            logger.info("captured %d piecewise prefill CUDA graphs (%d layers + 1 pieces x token buckets %s) in "
                        "%.1f s; graph memory %s (pool) + %s (static buffers)", g.num_graphs, len(self.model.layers),
                        ", ".join(map(str, g.sizes)), g.capture_seconds, _size(g.pool_bytes), _size(g.buffer_bytes))
        elif c.device.type == "cuda" and not c.parallel.sharded:   # eager prefills: their kernels now
            warm_up_lone_prompts(self.model, buffers, c.block_size, prefill_capture_sizes(c.max_num_batched_tokens),
                                 c.device)
        compiled = self.compile_mode != "off" and not c.enforce_eager and not c.parallel.sharded
        if compiled and (c.model.quantization is not None or fp8_kv):
            logger.warning("compiled CPU decode is not implemented for FP8 weights or an FP8 KV cache; decoding "
                           "eagerly")
        elif compiled:
            runner.compiled_decode = cpu_compile.CompiledDecode(self.model, buffers,
                                                                background=self.compile_mode == "auto")
        self.plan, self.runner = plan, runner
        return runner

    def summary(self) -> str:
        """One line: the model, device, dtype, kernels, cache plan and how decode steps run (after start)."""
        c, m, plan = self.config, self.config.model, self.plan
        name = c.model_path.name if c.model_path is not None else "a config dict"
        n_mtp = len(self.model.mtp.layers) if self.model.mtp is not None else 0
        mtp = f", {n_mtp} MTP layer{'s' if n_mtp > 1 else ''}" if n_mtp else ""
        weights = (_size(sum(p.numel() * p.element_size() for p in self.model.parameters()))
                   + (" dummy" if c.load_format == "dummy" else "") + " weights")
        ep = " (experts: expert parallel)" if c.parallel.expert_parallel else ""
        tp = f"; tensor parallel {c.parallel.size}{ep}" if c.parallel.sharded else ""
        return (f"{name} ({m.family}, {m.num_hidden_layers} layers: {len(m.gdn_layer_ids)} GDN + "
                f"{len(m.attention_layer_ids)} attention{mtp}; {weights}{tp}) on {c.device}, "
                f"{str(c.dtype).removeprefix('torch.')}; kernels: {self.kernels.summary()}; "
                f"cache: {plan.num_slots} state slots, {plan.num_blocks} KV blocks x {c.block_size} tokens"
                f"{' (fp8 e4m3)' if c.kv_cache_dtype == 'fp8' else ''}"
                f"{f' (+{c.mtp_kv_layers} MTP KV layer)' if c.mtp_kv_layers else ''} "
                f"({_size(plan.used_bytes)}); max_model_len {plan.max_model_len}, max_num_seqs {plan.max_num_seqs}; "
                f"{self._decode_summary()}")

    def _decode_summary(self) -> str:
        pg = self.runner.prefill_graphs
        prefill = (f"; prefill: piecewise CUDA graphs for steps up to {pg.max_size} tokens "
                   f"({_size(pg.pool_bytes + pg.buffer_bytes)})" if pg is not None else "")
        return self._decode_only_summary() + prefill

    def _decode_only_summary(self) -> str:
        graphs, vg = self.runner.graphs, self.runner.verify_graphs
        verify = (f"; speculative verify: {len(vg.sizes) * len(vg.widths)} CUDA graphs for batches up to "
                  f"{vg.max_size} x {vg.max_width} tokens ({_size(vg.pool_bytes + vg.stash_bytes)})"
                  if vg is not None else "")
        if graphs is not None:
            return (f"decode: {len(graphs.sizes)} CUDA graphs for batches up to {graphs.max_size} "
                    f"({_size(graphs.pool_bytes)}){verify}")
        if self.runner.compiled_decode is not None:
            return "decode: compiled" + (" (in the background)" if self.compile_mode == "auto" else "")
        if self.config.device.type == "cuda" and not self.config.enforce_eager:
            return "decode: eager (reference ops on the decode path: no CUDA graphs)"
        return "decode: eager"


def _size(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 30):.1f} GiB" if num_bytes >= 1 << 30 else f"{num_bytes / MiB:.0f} MiB"
