"""A compiled decode step for the CPU: torch.compile (inductor) over one decode-only forward.

On a small CPU an eager decode step is bound by per-op dispatch (~1400 aten ops at ~8 us each), not by the
math. Compiling the forward fuses the pointwise work into a few dozen C++ loops and leaves the GEMVs as
library calls; this is the CPU analogue of a CUDA graph per decode batch.

What is compiled is a *decode twin* of the model: a shallow copy sharing every parameter, whose ops are the
decode-graph backend (ops/decode_graph.py: the references' math without host reads, so it traces into one
graph). Two more changes make the step cheaper without changing its numbers beyond fp32 rounding:
  - Weights whose fp32 values are exactly bf16 values (every weight of a bf16 checkpoint) are stored as bf16
    copies, which the decode-graph ops widen in the loop: the experts in both graphs, every projection in the
    single-token graph (its GEMVs are bound by the weight bytes; batches keep the fp32 weights for the BLAS
    GEMM).
  - The KV / state pools enter the graph as one input per layer, so inductor updates them in place (a
    mutation through a view of one big pool is functionalised into a copy of the whole pool).

Two graphs at most: one for a single decode token (the `generate` case) and one with a dynamic batch
size; both dynamic in the context length. `CompiledDecode` compiles them in a background thread on
scratch pools and runs the eager model until a graph is ready, so start-up stays instant; inductor's
on-disk cache makes later runs on the same machine ready within seconds. A process that exits while a
compile runs stops it first (see _stop_compile_at_exit), keeping the exit status its program chose.
"""

from __future__ import annotations

import atexit
import copy
import ctypes
import dataclasses
import logging
import threading
import time
from types import MappingProxyType

import torch
import torch.nn.functional as F

from ..batch import CacheBuffers, ForwardBatch
from ..layers.linear import Linear
from ..layers.moe import SparseMoeBlock
from ..models.qwen3_next import HybridForCausalLM
from ..ops import select_kernels

logger = logging.getLogger(__name__)

COMPILE_MODES = ("auto", "on", "off")
# cpp_wrapper: the graph's kernels are called from C++, not from a Python wrapper (~1 ms less per batch-1
# step here, for a compile ~2-3x longer, which runs in the background). compile_threads=1: C++ builds in this
# process, no worker pool (its threads abort the interpreter at exit when a background compile is still
# running; and the other core is decoding meanwhile).
INDUCTOR_OPTIONS = MappingProxyType({"cpp_wrapper": True, "compile_threads": 1})
GRAPHS = MappingProxyType({"one": 1, "many": 2})  # graph -> batch size it is compiled at (1: static; 2: dynamic N)


def resolve_compile_mode(mode: str, device: torch.device) -> str:
    """'auto': compile in the background on CPU (eager until ready), nothing elsewhere; 'on': compile on CPU
    before the first decode step (blocking); 'off': eager always."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    if mode == "on" and device.type != "cpu":
        raise ValueError(f"compile='on' is the compiled CPU decode step; device is {device}")
    return mode if device.type == "cpu" else "off"


# ---- the decode twins -----------------------------------------------------------------------------

def _bf16_copy(w: torch.Tensor) -> torch.Tensor | None:
    """w as bf16 when that is exact (fp32 w whose every value is a bf16 value), else None."""
    if w.dtype != torch.float32:
        return None
    narrow = w.to(torch.bfloat16)
    return narrow if torch.equal(narrow.float(), w) else None


def _swap_weight(module: torch.nn.Module, name: str, narrow: torch.Tensor | None) -> None:
    if narrow is not None:
        delattr(module, name)
        setattr(module, name, narrow)


def decode_twin(model: HybridForCausalLM, *, narrow_projections: bool,
                narrow: dict[int, torch.Tensor | None] | None = None) -> HybridForCausalLM:
    """A copy of `model` sharing its parameters, running the decode-graph ops, with bf16 copies (where exact)
    of the expert weights and, with narrow_projections, of every projection and the logits head (`head_weight`,
    which twin_logits reads); no MTP head. `narrow` caches the copies by id of the weight (shared by twins)."""
    narrow = {} if narrow is None else narrow

    def narrowed(w: torch.Tensor) -> torch.Tensor | None:
        if id(w) not in narrow:
            narrow[id(w)] = _bf16_copy(w.data)
        return narrow[id(w)]

    memo: dict[int, object] = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    memo[id(model.config)] = model.config
    memo[id(model.kernels)] = select_kernels(model.embed_tokens.device, decode_graph_ops=True)
    mtp, model.mtp = model.mtp, None
    try:
        twin = copy.deepcopy(model, memo)
    finally:
        model.mtp = mtp
    for module in twin.modules():
        if isinstance(module, SparseMoeBlock):
            for name in ("w13", "w2"):
                _swap_weight(module, name, narrowed(getattr(module, name)))
        elif type(module) is Linear and narrow_projections:
            _swap_weight(module, "weight", narrowed(module.weight))
    head = model.embed_tokens if model.lm_head is None else model.lm_head.weight
    head_narrow = narrowed(head) if narrow_projections else None
    twin.head_weight = head if head_narrow is None else head_narrow
    return twin


def twin_logits(twin: HybridForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
    return twin.kernels.linear(hidden, twin.head_weight)


def layer_pools(cache: CacheBuffers) -> CacheBuffers:
    """The same pools as tuples of per-layer views: indexed like the tensors by the model (`cache.ssm[j]`),
    but each layer's pool is its own graph input, updated in place."""
    return CacheBuffers(tuple(cache.ssm.unbind(0)), tuple(cache.conv.unbind(0)), tuple(cache.kv.unbind(0)))


# ---- compile in the background, swap in when ready ---------------------------------------------------

class CompileStopped(BaseException):
    """Raised inside the compile thread at interpreter exit (a BaseException: library code that catches
    Exception lets it through)."""


STOP_TIMEOUT_S = 30.0   # longest wait for the compile thread at exit (it can be inside one compiler subprocess)


def _stop_compile_at_exit(thread: threading.Thread, stopping: threading.Event) -> None:
    """At interpreter exit with a compile still running: stop the thread at its next Python line and wait for
    it. Finalising the interpreter under a running daemon thread stops it wherever it next takes the GIL,
    inside torch's C++ code too (pthread_exit through noexcept frames), which aborts the process. Stopping it
    first keeps the exit status the program chose; a thread still waiting on a compiler subprocess after
    STOP_TIMEOUT_S is left to the interpreter (it is then in C code, where that exit is clean)."""
    if not thread.is_alive():
        return
    stopping.set()
    logger.info("stopping the CPU decode step's compile at exit (inductor's cache keeps what was built)")
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while thread.is_alive() and time.monotonic() < deadline:
        # re-raised until it takes: a handler in the compiler may swallow one
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(CompileStopped))
        thread.join(0.2)


def _argument_guards_only(entries) -> list[bool]:
    """Dynamo guard filter: keep the guards on the step's arguments (batch layout, pool shapes, the shape
    environment) and drop the ~1300 on the twin's modules and parameters, which nothing mutates: checking
    them cost ~0.6 ms per step."""
    return [e.name == "" or e.name.split(".")[0].split("[")[0] in ("batch", "pools") for e in entries]


def _example_batch(n: int, cache: CacheBuffers) -> ForwardBatch:
    """A decode-only batch of n sequences laid out as ModelRunner.build_batch lays it out (dtypes, one int64
    host tensor per token, one int32 per sequence): sequence i at position 0 of block 2i, in slot i (both
    wrapped into the pools)."""
    blocks = [(2 * i + j) % cache.num_blocks for i in range(n) for j in range(2)]
    per_token = torch.tensor([0] * n + [0] * n + blocks[::2], dtype=torch.long)
    per_token[2 * n:] *= cache.block_size
    per_seq = torch.tensor(list(range(n + 1)) + [1] * n + [i % cache.num_slots for i in range(n)] + [1] * n,
                           dtype=torch.int32)
    return ForwardBatch(
        input_ids=per_token[:n], positions=per_token[n: 2 * n], slot_mapping=per_token[2 * n:],
        cu_seqlens=per_seq[: n + 1], seq_lens=per_seq[n + 1: 2 * n + 1], state_slots=per_seq[2 * n + 1: 3 * n + 1],
        has_initial_state=per_seq[3 * n + 1:].bool(),
        block_tables=torch.tensor(blocks, dtype=torch.int32).view(n, 2), num_prefills=0, num_prefill_tokens=0)


def _mark_dynamic(batch: ForwardBatch, batch_dim: bool) -> None:
    torch._dynamo.maybe_mark_dynamic(batch.block_tables, 1)
    if batch_dim:
        for t in (batch.input_ids, batch.positions, batch.slot_mapping, batch.seq_lens, batch.state_slots,
                  batch.has_initial_state, batch.block_tables, batch.cu_seqlens):
            torch._dynamo.maybe_mark_dynamic(t, 0)


class CompiledDecode:
    """Runs decode-only batches through the compiled twin once its graph is ready, else through the eager
    model. Called as the model is: `(batch, cache) -> hidden` and `compute_logits(hidden)`. Batches have no
    padded rows (ModelRunner.build_batch never pads)."""

    def __init__(self, model: HybridForCausalLM, cache: CacheBuffers, *, background: bool = True,
                 graphs: tuple[str, ...] = ("one", "many"), inductor_options: dict | None = None):
        """Compile `graphs` ("one": a single decode token; "many": N >= 2, dynamic) in that order, in a
        background thread (or before returning); inductor_options override INDUCTOR_OPTIONS."""
        if not graphs or set(graphs) - set(GRAPHS):
            raise ValueError(f"graphs must name some of {sorted(GRAPHS)}, got {graphs!r}")
        # a pool of one slot never runs a batch of two
        self.graphs = tuple(g for g in graphs if GRAPHS[g] <= cache.num_slots)
        inductor_options = inductor_options or {}
        self.model, self.cache = model, cache
        narrow: dict[int, torch.Tensor | None] = {}
        self.twins = {"one": decode_twin(model, narrow_projections=True, narrow=narrow),
                      "many": decode_twin(model, narrow_projections=False, narrow=narrow)}
        self._pools = layer_pools(cache)
        twin_one, twin_many = self.twins["one"], self.twins["many"]

        # Separate top-level functions, so each graph has its own dynamo cache (no lookup of one while the
        # other is being compiled). Each returns the hidden states and their logits.
        def one(batch: ForwardBatch, pools: CacheBuffers) -> tuple[torch.Tensor, torch.Tensor]:
            hidden = twin_one(batch, pools)
            return hidden, twin_logits(twin_one, hidden)

        def many(batch: ForwardBatch, pools: CacheBuffers) -> tuple[torch.Tensor, torch.Tensor]:
            hidden = twin_many(batch, pools)
            return hidden, twin_logits(twin_many, hidden)

        options = {"guard_filter_fn": _argument_guards_only, **INDUCTOR_OPTIONS, **inductor_options}
        self._compiled = {"one": torch.compile(one, fullgraph=True, options=options),
                          "many": torch.compile(many, fullgraph=True, options=options)}
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None   # (hidden, logits) of the last step
        self._ready: dict[str, bool] = {"one": False, "many": False}   # written by the compile thread only
        self.compile_seconds: dict[str, float] = {}
        self.compiled_steps = 0                                          # decode steps run compiled
        self.error: BaseException | None = None
        # inductor's C++ kernels are built for the intra-op thread count seen when compiling: the caller's
        self._threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._compile_all, name="deltaserve-compile", daemon=True)
        self._stopping = threading.Event()
        if background:
            atexit.register(_stop_compile_at_exit, self._thread, self._stopping)
            self._thread.start()
        else:
            self._compile_all()
            if self.error is not None:
                raise RuntimeError("compiling the CPU decode step failed") from self.error

    # The runner calls these for decode-only batches.
    def __call__(self, batch: ForwardBatch, cache: CacheBuffers) -> torch.Tensor:
        kind = "one" if batch.num_seqs == 1 else "many"
        if not self._ready[kind] or cache is not self.cache:
            return self.model(batch, cache)
        if batch.block_tables.shape[1] < 2:          # widths 0/1 would be specialised: keep the graph dynamic
            batch = dataclasses.replace(batch, block_tables=F.pad(batch.block_tables, (0, 1)))
        self.compiled_steps += 1
        if self.ready:   # never recompile on the decode path (a guard miss runs the twin eagerly for that step)
            with torch.compiler.set_stance("eager_on_recompile"):
                self._last = self._compiled[kind](batch, self._pools)
        else:            # the stance is process-wide: not while the other graph is still compiling
            self._last = self._compiled[kind](batch, self._pools)
        return self._last[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits the compiled step computed with `hidden` (the runner asks for every row of a decode-only
        batch), else the eager model's."""
        last, self._last = self._last, None
        if last is not None and hidden is last[0]:
            return last[1]
        return self.model.compute_logits(hidden)

    @property
    def ready(self) -> bool:
        return all(self._ready[g] for g in self.graphs)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until both graphs are compiled (or failed); True when ready."""
        if self._thread.is_alive():
            self._thread.join(timeout)
        return self.ready

    def _compile_all(self) -> None:
        # Scratch pools of the real pools' shapes (the graphs are specialised to them); only the example's
        # slots and blocks are ever touched.
        scratch = CacheBuffers(*(torch.empty_like(t) for t in (self.cache.ssm, self.cache.conv, self.cache.kv)))
        scratch.ssm[:, :2].zero_()
        scratch.conv[:, :2].zero_()
        scratch.kv[:, :, :4].zero_()
        pools = layer_pools(scratch)
        torch.set_num_threads(self._threads)
        try:
            with torch.inference_mode():
                for kind in self.graphs:
                    n = GRAPHS[kind]
                    start = time.perf_counter()
                    batch = _example_batch(n, scratch)
                    _mark_dynamic(batch, batch_dim=n > 1)
                    self._compiled[kind](batch, pools)
                    self.compile_seconds[kind] = time.perf_counter() - start
                    self._ready[kind] = True
                    logger.info("compiled CPU decode step (%s sequence%s) in %.1f s", "1" if n == 1 else "N >= 2",
                                "" if n == 1 else "s", self.compile_seconds[kind])
        except CompileStopped:
            return
        except Exception as exc:  # noqa: BLE001  a failed compile leaves the eager path in place; say so once
            if self._stopping.is_set():     # the compiler wrapped CompileStopped in an error of its own
                return
            self.error = exc
            logger.warning("compiling the CPU decode step failed; decoding stays eager: %s", exc)
