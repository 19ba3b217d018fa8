"""Decode steps as CUDA-graph replays, one graph per batch-size bucket.

A decode-only step (every chunk is one token of a running sequence) of N <= the largest bucket sequences
runs as the graph of the smallest bucket B >= N, captured once at load after the cache is allocated (the
graphs bake in the cache's addresses). The graph reads static device buffers sized for the largest
bucket; a step writes its packed host values into pinned staging buffers, copies them into the static
buffers, replays, and reads rows :N of the static output. An input id of -1 marks a row whose token is
still being sampled by the previous step (async scheduling): the graph reads it from the runner's
last-token-per-slot buffer. Rows N..B-1 are padding that no op lets touch
shared state: state slot -1 (the GDN ops skip it), KV slot -1 (store_kv skips it), context length 0 (no
keys to attend to), cu_seqlens one token per row; their hidden states are dropped by the caller.

What the graph fixes at capture: every shape (B tokens, B sequences, a block table of
ceil(max_model_len / block_size) columns with that row stride), every launch choice derived from shapes
(the attention kernel's split-K count and tiles come from T, N and the head dims; the MoE tiles and block
bound from T, top_k and E), and the buffers' addresses. Everything that varies per step (context lengths,
block ids, slots, positions) is read on the device; the kernels size their loops from those values, so
one graph serves every context length. Capture is allowed only when every op on the decode path is a
Triton kernel: the torch references may read device values on the host (.tolist(), boolean masks).

The graphs share one memory pool (captured largest first, so the smaller ones reuse its blocks); its
size is reserved in the cache budget before the pools are sized (runner/memory.py measures a decode
forward of the largest bucket), since the graphs cannot be captured before the cache they write into.

On a CPU device a "graph" is an eager forward over the same static buffers (no capture, no pinned
staging): the padded static-buffer path, testable without a GPU.
"""

from __future__ import annotations

import bisect
import logging
import time

import numpy as np
import torch

from ..batch import CacheBuffers, ForwardBatch
from ..ops import Kernels

logger = logging.getLogger(__name__)

MiB = 1 << 20

# Ops a decode step calls (GDN: gdn_decode holds conv update, gates, delta rule and, unless gated_linear
# folds it into out_proj, the gated norm).
DECODE_PATH_OPS = ("linear", "rms_norm", "rms_norm_linear", "gated_linear", "gdn_decode", "attention_prologue",
                   "paged_attention", "fused_paged_attention", "topk_softmax", "fused_moe", "fused_moe_routed",
                   "silu_and_mul", "sigmoid_mul", "embed_rope", "rms_norm_linear_conv")
MAX_CAPTURE_SIZE = 512


def capture_sizes(max_batch: int) -> list[int]:
    """Bucket sizes for decode batches of up to max_batch sequences (vLLM's): 1, 2, 4, then every 8 up to
    256, every 16 beyond, the last one the first size >= max_batch; never above MAX_CAPTURE_SIZE."""
    if max_batch < 1:
        return []
    ladder = [1, 2, 4, *range(8, 257, 8), *range(272, MAX_CAPTURE_SIZE + 1, 16)]
    top = min(max_batch, MAX_CAPTURE_SIZE)
    return [s for s in ladder if s < top] + [next(s for s in ladder if s >= top)]


def bucket_for(n: int, sizes: list[int]) -> int | None:
    """The smallest bucket holding n sequences (sizes ascending), None when n exceeds them all."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def eager_reason(device: torch.device, kernels: Kernels, *, enforce_eager: bool) -> str | None:
    """Why decode steps cannot be captured on this setup (None: they can)."""
    if enforce_eager:
        return "enforce_eager=True"
    if torch.device(device).type != "cuda":
        return f"CUDA graphs need a CUDA device, the model runs on {torch.device(device).type}"
    reference = [op for op in DECODE_PATH_OPS if kernels.backend.get(op) != "triton"]
    if reference:
        return ("decode-path ops run their torch reference, which may sync with the host: " + ", ".join(reference)
                + " (reference ops forced, or a model shape the Triton kernels refuse: see the op selection log)")
    return None


def plan_decode_graphs(device: torch.device, kernels: Kernels, *, max_batch: int, enforce_eager: bool) -> list[int]:
    """The buckets to capture for decode batches of up to max_batch sequences; [] (logged once, with the
    reason) when decode steps must run eagerly: at INFO where graphs were possible (a CUDA device, not
    enforce_eager), else at DEBUG."""
    why = eager_reason(device, kernels, enforce_eager=enforce_eager)
    if why is not None:
        expected = enforce_eager or torch.device(device).type != "cuda"
        logger.log(logging.DEBUG if expected else logging.INFO, "decode steps run eagerly (no CUDA graphs): %s", why)
        return []
    return capture_sizes(max_batch)


def padded_decode_batch(num_rows: int, device: torch.device, max_blocks: int = 1) -> ForwardBatch:
    """A decode batch of padding rows only (nothing read from or written to any pool): the shape a graph
    of num_rows rows is captured with; also used to measure the graphs' memory."""
    tok = torch.zeros(3, num_rows, dtype=torch.long, device=device)
    tok[2] = -1
    return ForwardBatch(
        input_ids=tok[0], positions=tok[1], slot_mapping=tok[2],
        cu_seqlens=torch.arange(num_rows + 1, dtype=torch.int32, device=device),
        seq_lens=torch.zeros(num_rows, dtype=torch.int32, device=device),
        state_slots=torch.full((num_rows,), -1, dtype=torch.int32, device=device),
        has_initial_state=torch.zeros(num_rows, dtype=torch.bool, device=device),
        block_tables=torch.zeros(num_rows, max_blocks, dtype=torch.int32, device=device),
        num_prefills=0, num_prefill_tokens=0)


def begin_capture(device: torch.device) -> tuple[float, int, object, torch.cuda.Stream]:
    """Before capturing a set of graphs: the device idle and its cache emptied, then (start time, memory reserved,
    one graph pool, a side stream for the warm-up runs): the capture's log line reports time and memory from them."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    start, reserved = time.perf_counter(), torch.cuda.memory_reserved(device)
    return start, reserved, torch.cuda.graph_pool_handle(), torch.cuda.Stream(device)


class _EagerGraph:
    """CPU stand-in for a captured graph: replay runs the forward and writes the static output."""

    def __init__(self, forward, out: torch.Tensor):
        self.forward, self.out = forward, out

    def replay(self) -> None:
        self.out.copy_(self.forward())


class DecodeGraphs:
    """The static buffers, the pinned staging they are filled from, and one graph per bucket."""

    def __init__(self, model: torch.nn.Module, cache: CacheBuffers, sizes: list[int], *, max_blocks_per_seq: int,
                 device: torch.device, last_tokens: torch.Tensor | None = None):
        self.model, self.cache, self.device = model, cache, torch.device(device)
        # per state slot, the token last sampled for it: a row whose input id is -1 reads it (inside the graph)
        self.last_tokens = last_tokens
        self.sizes = sorted(sizes)
        B, W = self.sizes[-1], max_blocks_per_seq
        self.max_blocks_per_seq = W
        # static device inputs: per token (input ids, positions, KV slots), per sequence (context length,
        # state slot), block tables with a fixed row stride; cu_seqlens / has_initial_state never change
        self._tok = torch.zeros(3, B, dtype=torch.long, device=self.device)
        self._seq = torch.zeros(2, B, dtype=torch.int32, device=self.device)
        self._tables = torch.zeros(B, W, dtype=torch.int32, device=self.device)
        self._cu = torch.arange(B + 1, dtype=torch.int32, device=self.device)
        self._has_init = torch.ones(B, dtype=torch.bool, device=self.device)
        # pinned host staging (numpy views for cheap writes), reused once the last copy out of it is done
        cuda = self.device.type == "cuda"
        pin = (lambda t: t.pin_memory()) if cuda else (lambda t: t)  # noqa: E731
        self._h_tok = pin(torch.zeros(3, B, dtype=torch.long))
        self._h_seq = pin(torch.zeros(2, B, dtype=torch.int32))
        self._h_tables = pin(torch.zeros(B * W, dtype=torch.int32))
        self._n_tok, self._n_seq, self._n_tables = self._h_tok.numpy(), self._h_seq.numpy(), self._h_tables.numpy()
        self._copied = torch.cuda.Event() if cuda else None
        if self._copied is not None:
            self._copied.record()
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph | _EagerGraph, torch.Tensor]] = {}
        self.pool_bytes = 0
        self.capture_seconds = 0.0
        self.num_replays = 0              # decode steps run as a graph
        self.num_padded_replays = 0       # ... of them in a bucket larger than the batch

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def _batch(self, b: int) -> ForwardBatch:
        # last_tokens: the model resolves rows still being sampled on the host (input id -1), in the graph
        return ForwardBatch(
            input_ids=self._tok[0, :b], positions=self._tok[1, :b], slot_mapping=self._tok[2, :b],
            cu_seqlens=self._cu[: b + 1], seq_lens=self._seq[0, :b], state_slots=self._seq[1, :b],
            has_initial_state=self._has_init[:b], block_tables=self._tables[:b], num_prefills=0, num_prefill_tokens=0,
            last_tokens=self.last_tokens)

    def _pad_all(self) -> None:
        self._tok.zero_()
        self._tok[2] = -1
        self._seq[0] = 0
        self._seq[1] = -1

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every bucket, largest first, into one shared pool. Inputs are all padding
        rows, so neither the warm-up nor the capture touches the cache."""
        self._pad_all()
        if self.device.type != "cuda":
            for b in self.sizes:
                forward = lambda b=b: self.model(self._batch(b), self.cache)  # noqa: E731
                out = forward()
                self._graphs[b] = (_EagerGraph(forward, out), out)
            return
        start, reserved, pool, side = begin_capture(self.device)
        for b in reversed(self.sizes):
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):            # compiles this shape's kernels outside the capture
                self.model(self._batch(b), self.cache)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(self._batch(b), self.cache)
            self._graphs[b] = (graph, out)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        torch.cuda.empty_cache()                    # drop the warm-ups' cached blocks; the graphs' pool stays
        self.pool_bytes = torch.cuda.memory_reserved(self.device) - reserved
        logger.debug("captured %d decode CUDA graphs (batch sizes %s) in %.1f s; graph memory %.0f MiB",
                     len(self._graphs), _ranges(self.sizes), self.capture_seconds, self.pool_bytes / MiB)

    def replay(self, input_ids: list[int], positions: list[int], slot_mapping: list[int], seq_lens: list[int],
               state_slots: list[int], block_tables: np.ndarray) -> torch.Tensor:
        """Run N decode rows (N <= max_size) through the bucket's graph; returns the hidden states of the
        N rows, a view of the graph's static output (valid until the next replay)."""
        n = len(input_ids)
        b = bucket_for(n, self.sizes)
        if b is None:
            raise ValueError(f"decode batch of {n} sequences exceeds the largest captured bucket {self.max_size}")
        mb = block_tables.shape[1]
        if self._copied is not None:
            self._copied.synchronize()              # the previous step's copies have left the staging
        tok, seq = self._n_tok, self._n_seq
        tok[0, :n], tok[1, :n], tok[2, :n] = input_ids, positions, slot_mapping
        tok[:2, n:b], tok[2, n:b] = 0, -1
        seq[0, :n], seq[1, :n] = seq_lens, state_slots
        seq[0, n:b], seq[1, n:b] = 0, -1
        self._n_tables[: n * mb] = block_tables.reshape(-1)
        self._tok.copy_(self._h_tok, non_blocking=True)
        self._seq.copy_(self._h_seq, non_blocking=True)
        if mb:
            self._tables[:n, :mb].copy_(self._h_tables[: n * mb].view(n, mb), non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        graph, out = self._graphs[b]
        graph.replay()
        self.num_replays += 1
        self.num_padded_replays += b > n
        return out[:n]

    def state_slots(self, n: int) -> torch.Tensor:
        """The last replay's state slots of its n rows (int32, on the device; valid until the next replay's
        copies, which the stream orders after anything queued now)."""
        return self._seq[1, :n]

    def replay_static(self, n: int) -> None:
        """Replay the bucket for n rows on whatever its static inputs hold now (no host packing, no copies):
        the forward's own GPU time, for benchmarks. It advances the state of the sequences last replayed."""
        graph, _ = self._graphs[bucket_for(n, self.sizes)]
        graph.replay()


def _ranges(sizes: list[int]) -> str:
    return ", ".join(map(str, sizes)) if len(sizes) <= 6 else f"{sizes[0]}, {sizes[1]}, ..., {sizes[-1]}"
