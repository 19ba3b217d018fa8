"""A compiled decode step for the CPU: torch.compile (inductor) over one decode-only forward.

On a small CPU an eager decode step is bound by per-op dispatch (~1400 aten ops at ~8 us each), not by the
math. Compiling the forward fuses the pointwise work into a few dozen C++ loops and leaves the GEMVs as
library calls; this is the CPU analogue of a CUDA graph per decode batch.

What is compiled is a *decode twin* of the model: a shallow copy sharing every parameter, whose ops are
the decode-only forms below (same math as the references, written without host reads so they trace into
one graph; checked against the references in tests). Two more changes make the step cheaper without
changing its numbers beyond fp32 rounding:
  - Weights whose fp32 values are exactly bf16 values (every weight of a bf16 checkpoint) are read as
    bf16 and widened in the loop, by single-token GEMVs and the experts: the same products, half the
    bytes. Memory-bandwidth is what bounds a single-token step once dispatch is gone.
  - The KV / state pools enter the graph as one input per layer, so inductor updates them in place (a
    mutation through a view of one big pool is functionalised into a copy of the whole pool).

Two graphs at most: one for a single decode token (the `generate` case) and one with a dynamic batch
size; both dynamic in the context length. `CompiledDecode` compiles them in a background thread on
scratch pools and runs the eager model until a graph is ready, so start-up stays instant; inductor's
on-disk cache makes later runs on the same machine ready within seconds.
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import logging
import os
import sys
import threading
import time
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import nn

from ..batch import CacheBuffers, ForwardBatch
from ..layers.linear import Linear
from ..layers.moe import SparseMoeBlock
from ..models.qwen3_next import HybridForCausalLM
from ..ops import Kernels
from ..ops.attention import reference as attention_ref
from ..ops.gdn import reference as gdn_ref
from ..ops.moe import reference as moe_ref
from ..ops.norm import reference as norm_ref

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


# ---- decode-only ops: the references' math without host reads -------------------------------------------

def store_kv_decode(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """store_kv for tokens without padding (slot >= 0), indexing the pool itself (blocks, offsets) so the
    write stays in place in a compiled graph."""
    bs = kv_cache.shape[2]
    which = torch.arange(2, device=k.device)[:, None]
    kv_cache.index_put_((which, (slot_mapping // bs)[None], (slot_mapping % bs)[None]),
                        torch.stack([k, v]).to(kv_cache.dtype))


def attention_prologue_decode(q, k, v, q_norm_weight, k_norm_weight, eps, cos, sin, kv_cache, slot_mapping):
    """attention_prologue with store_kv_decode's in-place store."""
    q = attention_ref.apply_rope(norm_ref.rms_norm(q, q_norm_weight, eps), cos, sin)
    store_kv_decode(attention_ref.apply_rope(norm_ref.rms_norm(k, k_norm_weight, eps), cos, sin), v, kv_cache,
                    slot_mapping)
    return q.contiguous()


def paged_attention_decode(q: torch.Tensor, kv_cache: torch.Tensor, *, cu_seqlens: torch.Tensor,
                           seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """paged_attention when every sequence has exactly one query token (cu_seqlens is then 0..N): all
    sequences at once over the block table's width, positions past each context masked out (their keys
    get -inf, their values zero: unwritten cache memory may hold anything)."""
    N, nh, d = q.shape
    nkv = kv_cache.shape[-2]
    kv = kv_cache[:, block_tables.long()].reshape(2, N, -1, nkv, d).to(q.dtype).transpose(2, 3)  # [2,N,NKV,C,D]
    valid = torch.arange(kv.shape[3], device=q.device)[None, :] < seq_lens[:, None]             # [N, C]
    scores = q.view(N, nkv, nh // nkv, d) @ kv[0].transpose(-1, -2) * scale                    # [N,NKV,G,C]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return (probs @ torch.where(valid[:, None, :, None], kv[1], 0.0)).reshape(N, nh, d)


def fused_paged_attention_decode(q, k, v, q_norm_weight, k_norm_weight, eps, cos, sin, kv_cache, slot_mapping, *,
                                 cu_seqlens, seq_lens, block_tables, scale, max_query_len=None):
    """fused_paged_attention as the two decode functions above (decode batches: one token per sequence)."""
    q = attention_prologue_decode(q, k, v, q_norm_weight, k_norm_weight, eps, cos, sin, kv_cache, slot_mapping)
    return paged_attention_decode(q, kv_cache, cu_seqlens=cu_seqlens, seq_lens=seq_lens, block_tables=block_tables,
                                  scale=scale)


def fused_moe_decode(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor) -> torch.Tensor:
    """fused_moe as a gather + multiply-reduce per (token, expert) pair: inductor fuses the gather and the
    widening of bf16-stored experts into the reduction loop, so only the chosen experts are read."""
    inter = w2.shape[-1]
    h = (x[:, None, None, :].float() * w13[topk_ids].float()).sum(-1)          # [N, k, 2I]
    act = (F.silu(h[..., :inter]) * h[..., inter:]).to(x.dtype)
    y = (act[:, :, None, :].float() * w2[topk_ids].float()).sum(-1).to(x.dtype)  # [N, k, H]
    return (y.float() * topk_weights.float()[..., None]).sum(1).to(x.dtype)


def fused_moe_routed_decode(x, w13, w2, router_logits, top_k, renormalize, *, shared_slices=0):
    """fused_moe_routed as the reference routing and fused_moe_decode."""
    weights, ids = moe_ref.topk_softmax(router_logits, top_k, renormalize, shared_slices=shared_slices)
    return fused_moe_decode(x, w13, w2, weights, ids)


def decode_kernels(kernels: Kernels) -> Kernels:
    return dataclasses.replace(
        kernels, store_kv=store_kv_decode, attention_prologue=attention_prologue_decode,
        paged_attention=paged_attention_decode, fused_paged_attention=fused_paged_attention_decode,
        fused_moe=fused_moe_decode, fused_moe_routed=fused_moe_routed_decode, gdn_decode=gdn_ref.gdn_decode_unpadded,
        backend={**kernels.backend, **{n: "compiled-decode" for n in
                                      ("store_kv", "attention_prologue", "paged_attention", "fused_paged_attention",
                                       "fused_moe", "fused_moe_routed", "gdn_decode")}})


# ---- the decode twin ----------------------------------------------------------------------------------

def _bf16_copy(w: torch.Tensor) -> torch.Tensor | None:
    """w as bf16 when that is exact (fp32 w whose every value is a bf16 value), else None."""
    if w.dtype != torch.float32:
        return None
    narrow = w.to(torch.bfloat16)
    return narrow if torch.equal(narrow.float(), w) else None


def gemv_bf16(x: torch.Tensor, w16: torch.Tensor) -> torch.Tensor:
    """x [T, in] fp32 @ w16 [out, in]^T with w16 widened to fp32 inside the loop: F.linear's products and
    fp32 accumulation, half the weight bytes."""
    return (x[:, None, :] * w16.float()[None]).sum(-1)


class DecodeLinear(nn.Module):
    """A Linear for the decode twin: single-token inputs read the bf16 copy (when exact), batches use the
    shared fp32 weight and the BLAS GEMM."""

    def __init__(self, linear: Linear):
        super().__init__()
        self.weight = linear.weight
        self.weight_bf16 = _bf16_copy(linear.weight.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_bf16 is not None and x.shape[0] == 1:
            return gemv_bf16(x, self.weight_bf16)
        return F.linear(x, self.weight)


def decode_twin(model: HybridForCausalLM) -> HybridForCausalLM:
    """A copy of `model` sharing its parameters, with the decode-only ops and DecodeLinear layers (and
    bf16 expert weights when exact); no MTP head."""
    memo: dict[int, object] = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    memo[id(model.config)] = model.config
    memo[id(model.kernels)] = decode_kernels(model.kernels)
    mtp, model.mtp = model.mtp, None
    try:
        twin = copy.deepcopy(model, memo)
    finally:
        model.mtp = mtp
    for parent in list(twin.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is Linear:
                setattr(parent, name, DecodeLinear(child))
        if isinstance(parent, SparseMoeBlock):
            for name in ("w13", "w2"):
                narrow = _bf16_copy(getattr(parent, name).data)
                if narrow is not None:
                    delattr(parent, name)
                    setattr(parent, name, narrow)
    head = model.embed_tokens if model.lm_head is None else model.lm_head.weight
    twin.head_bf16 = _bf16_copy(head.data)
    return twin


def twin_logits(twin: HybridForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
    if twin.head_bf16 is not None and hidden.shape[0] == 1:
        return gemv_bf16(hidden, twin.head_bf16)
    return twin.compute_logits(hidden)


def layer_pools(cache: CacheBuffers) -> CacheBuffers:
    """The same pools as tuples of per-layer views: indexed like the tensors by the model (`cache.ssm[j]`),
    but each layer's pool is its own graph input, updated in place."""
    return CacheBuffers(tuple(cache.ssm.unbind(0)), tuple(cache.conv.unbind(0)), tuple(cache.kv.unbind(0)))


# ---- compile in the background, swap in when ready ---------------------------------------------------

def _exit_now_if_compiling(thread: threading.Thread) -> None:
    """At interpreter exit with a compile still running: end the process here. Finalising the interpreter
    would stop the daemon compile thread inside C++ code (pthread_exit through noexcept frames), which
    aborts the process; there is nothing of ours left to clean up at this point."""
    if thread.is_alive():
        logger.info("exiting with the CPU decode step still compiling (inductor's cache keeps what was built)")
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(1 if getattr(sys, "last_value", None) is not None else 0)


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
        self.twin = decode_twin(model)
        self._pools = layer_pools(cache)
        twin = self.twin

        # Separate top-level functions, so each graph has its own dynamo cache (no lookup of one while the
        # other is being compiled). Each returns the hidden states and their logits.
        def one(batch: ForwardBatch, pools: CacheBuffers) -> tuple[torch.Tensor, torch.Tensor]:
            hidden = twin(batch, pools)
            return hidden, twin_logits(twin, hidden)

        def many(batch: ForwardBatch, pools: CacheBuffers) -> tuple[torch.Tensor, torch.Tensor]:
            hidden = twin(batch, pools)
            return hidden, twin_logits(twin, hidden)

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
        if background:
            atexit.register(_exit_now_if_compiling, self._thread)
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
        except Exception as exc:  # noqa: BLE001  a failed compile leaves the eager path in place; say so once
            self.error = exc
            logger.warning("compiling the CPU decode step failed; decoding stays eager: %s", exc)
