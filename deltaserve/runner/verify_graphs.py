"""Speculative verify steps as CUDA-graph replays, one forward graph and one commit graph per (batch bucket,
width).

A step whose chunks are all verify chunks (a sequence's last known token and its drafts) or one-token decodes,
N <= the largest bucket of them, at most `max_drafts` drafts each, runs as the graph of the smallest bucket
B >= N at width W = 1 + the step's most drafts: every sequence owns W consecutive token rows of the static
inputs, its real tokens first, padding after. Every row of the graph is a verify chunk to the model
(num_prefills = num_verifies = B, cu_seqlens fixed at W per row): attention writes the real rows' K/V and
runs each row's W queries causally, each GDN layer runs gdn_verify into its stash (pools untouched). A
decode chunk is a verify chunk without drafts: it samples as a plain row and commits one token.

The commit graph (every GDN layer's gdn_commit of the step, one replay) reads a static count per row:
accepted drafts + 1 for a verify chunk, 1 for a decode, 0 for padding (slot -1: skipped anyway).

Padding never touches shared state: padded tokens of a real row and every token of a padded row have KV
slot -1 (the store skips them); padded rows have state slot -1 (gdn_verify and gdn_commit skip them) and a
context of W (their queries read block 0 through a zero table row: finite, dropped). A real row's context
length is its first position + W, so its real queries see exactly their causal prefix; its padded queries
look further (the block table has spare zero columns for them) and are dropped. Rows are independent in
every token-wise op (the MoE routes each token alone), so padding never reaches a real row.

What a graph fixes at capture: B, W (so every launch shape) and the static buffers' addresses, including
the per-layer VerifyStash (one set, allocated with the static buffers and shared by every key: a step's
commit graph reads it before the next step's forward writes it). Verify graphs are captured after the decode graphs,
when speculation is enabled, on CUDA with Triton ops on the verify path; steps with prefills (or more
sequences or drafts than the buckets) stay on the piecewise / eager path. On a CPU device a "graph" is an
eager call over the same static buffers: the padded path, testable without a GPU.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from ..batch import CacheBuffers, ForwardBatch, VerifyRecord
from ..ops import Kernels
from .cuda_graphs import DECODE_PATH_OPS, _EagerGraph, begin_capture, bucket_for, capture_sizes, eager_reason

logger = logging.getLogger(__name__)

MiB = 1 << 20

MAX_VERIFY_BATCH = 16           # verify graphs cover the batches where speculation can pay (spec/adaptive.py)
VERIFY_PATH_OPS = (*DECODE_PATH_OPS, "gdn_verify", "gdn_commit")


def verify_capture_sizes(max_batch: int) -> list[int]:
    """Batch buckets of the verify graphs: the decode ladder up to min(max_batch, MAX_VERIFY_BATCH)."""
    return capture_sizes(min(max_batch, MAX_VERIFY_BATCH))


def plan_verify_graphs(device: torch.device, kernels: Kernels, *, max_batch: int, enforce_eager: bool) -> list[int]:
    """The batch buckets to capture verify graphs for ([]: verify steps run piecewise / eagerly, logged once)."""
    why = eager_reason(device, kernels, enforce_eager=enforce_eager)
    if why is None:
        reference = [op for op in ("gdn_verify", "gdn_commit") if kernels.backend.get(op) != "triton"]
        if reference:
            why = "verify-path ops run their torch reference: " + ", ".join(reference)
    if why is not None:
        expected = enforce_eager or torch.device(device).type != "cuda"
        logger.log(logging.DEBUG if expected else logging.INFO, "verify steps run without CUDA graphs: %s", why)
        return []
    return verify_capture_sizes(max_batch)


def verify_stashes(model: torch.nn.Module, num_tokens: int, dtype: torch.dtype) -> list:
    """A VerifyStash of num_tokens rows per GDN layer, in layer order (what the model's verify forwards fill)."""
    return [layer.mixer.verify_stash(num_tokens, dtype) for layer in model.layers
            if hasattr(layer.mixer, "verify_stash")]


def padded_verify_batch(num_rows: int, width: int, device: torch.device, block_size: int) -> ForwardBatch:
    """A verify batch of padding rows only (nothing read from or written to any pool, stashes its own): the
    shape a verify graph of num_rows x width is captured with; also used to measure the graphs' memory."""
    t = num_rows * width
    tok = torch.zeros(3, t, dtype=torch.long, device=device)
    tok[2] = -1
    cu = torch.arange(0, t + 1, width, dtype=torch.int32, device=device)
    slots = torch.full((num_rows,), -1, dtype=torch.int32, device=device)
    return ForwardBatch(
        input_ids=tok[0], positions=tok[1], slot_mapping=tok[2], cu_seqlens=cu,
        seq_lens=torch.full((num_rows,), width, dtype=torch.int32, device=device), state_slots=slots,
        has_initial_state=torch.ones(num_rows, dtype=torch.bool, device=device),
        block_tables=torch.zeros(num_rows, -(-width // block_size), dtype=torch.int32, device=device),
        num_prefills=num_rows, num_prefill_tokens=t, max_prefill_len=width, num_verifies=num_rows,
        num_verify_tokens=t, verify=VerifyRecord(cu, slots))


class VerifyGraphs:
    """Static buffers, their pinned staging, and per (bucket, width) a forward graph and a commit graph."""

    def __init__(self, model: torch.nn.Module, cache: CacheBuffers, sizes: list[int], max_drafts: int, *,
                 max_blocks_per_seq: int, device: torch.device):
        if max_drafts < 1:
            raise ValueError(f"verify graphs need max_drafts >= 1, got {max_drafts}")
        self.model, self.cache, self.device = model, cache, torch.device(device)
        self.sizes = sorted(sizes)
        self.widths = list(range(2, max_drafts + 2))
        B, W = self.sizes[-1], self.widths[-1]
        bs = cache.block_size
        # padded queries of a row near max_model_len look up to W - 1 positions past it: spare zero columns
        self.table_width = max_blocks_per_seq + -(-W // bs) + 1
        dev = self.device
        self._tok = torch.zeros(3, B * W, dtype=torch.long, device=dev)      # ids, positions, KV slots
        self._seq = torch.zeros(3, B, dtype=torch.int32, device=dev)         # context lengths, state slots, counts
        self._tables = torch.zeros(B, self.table_width, dtype=torch.int32, device=dev)
        self._cu = {w: torch.arange(0, B * w + 1, w, dtype=torch.int32, device=dev) for w in self.widths}
        self._has_init = torch.ones(B, dtype=torch.bool, device=dev)
        # one stash per GDN layer for every graph (a step's commit reads it before the next replay writes it)
        self._stashes = verify_stashes(model, B * W, cache.conv.dtype)
        self.stash_bytes = sum(t.numel() * t.element_size() for st in self._stashes
                               for t in (st.x, st.k, st.g, st.delta))
        cuda = dev.type == "cuda"
        pin = (lambda t: t.pin_memory()) if cuda else (lambda t: t)  # noqa: E731
        self._h_tok = pin(torch.zeros(3, B * W, dtype=torch.long))
        self._h_seq = pin(torch.zeros(3, B, dtype=torch.int32))
        self._h_tables = pin(torch.zeros(B * self.table_width, dtype=torch.int32))
        self._n_tok, self._n_seq, self._n_tables = self._h_tok.numpy(), self._h_seq.numpy(), self._h_tables.numpy()
        self._copied = torch.cuda.Event() if cuda else None
        if self._copied is not None:
            self._copied.record()
        # (b, w) -> (forward graph, its output [b w, H], its VerifyRecord, commit graph)
        self._graphs: dict[tuple[int, int], tuple] = {}
        self.pool_bytes = 0
        self.capture_seconds = 0.0
        self.num_replays = 0

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    @property
    def max_width(self) -> int:
        return self.widths[-1]

    def key_for(self, num_seqs: int, max_tokens: int) -> tuple[int, int] | None:
        """(bucket, width) of a step of num_seqs sequences whose longest chunk has max_tokens tokens (None:
        beyond the graphs)."""
        b = bucket_for(num_seqs, self.sizes)
        if b is None or max_tokens > self.max_width:
            return None
        return b, max(2, max_tokens)

    def _batch(self, b: int, w: int, record: VerifyRecord) -> ForwardBatch:
        t = b * w
        return ForwardBatch(
            input_ids=self._tok[0, :t], positions=self._tok[1, :t], slot_mapping=self._tok[2, :t],
            cu_seqlens=self._cu[w][: b + 1], seq_lens=self._seq[0, :b], state_slots=self._seq[1, :b],
            has_initial_state=self._has_init[:b], block_tables=self._tables[:b], num_prefills=b,
            num_prefill_tokens=t, max_prefill_len=w, num_verifies=b, num_verify_tokens=t, verify=record)

    def _record(self, b: int, w: int) -> VerifyRecord:
        return VerifyRecord(self._cu[w][: b + 1], self._seq[1, :b], stashes=self._stashes)

    def _commit(self, record: VerifyRecord, b: int) -> None:
        counts = self._seq[2, :b]
        for stash, conv_state, ssm_state in record.layers:
            self.model.kernels.gdn_commit(counts, cu_seqlens=record.cu_seqlens, state_indices=record.state_slots,
                                          conv_state=conv_state, ssm_state=ssm_state, stash=stash)

    def _pad_all(self) -> None:
        self._tok.zero_()
        self._tok[2] = -1
        self._seq[0] = self.max_width
        self._seq[1] = -1
        self._seq[2] = 0
        self._tables.zero_()

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every (bucket, width), largest first, into one shared pool. The inputs are all
        padding rows, so neither the warm-up nor the capture touches the cache."""
        self._pad_all()
        keys = sorted(((b, w) for b in self.sizes for w in self.widths), key=lambda k: (-k[0] * k[1], -k[0]))
        if self.device.type != "cuda":
            for b, w in keys:
                record = self._record(b, w)

                def forward(b=b, w=w, record=record):
                    record.layers.clear()
                    return self.model(self._batch(b, w, record), self.cache)

                out = forward()
                commit = _EagerCall(lambda record=record, b=b: self._commit(record, b))
                self._graphs[(b, w)] = (_EagerGraph(forward, out), out, record, commit)
            return
        start, reserved, pool, side = begin_capture(self.device)
        for b, w in keys:
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):            # this shape's kernels are built outside the capture
                warm = self._record(b, w)
                self.model(self._batch(b, w, warm), self.cache)
                self._commit(warm, b)
                del warm
            torch.cuda.current_stream(self.device).wait_stream(side)
            record = self._record(b, w)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(self._batch(b, w, record), self.cache)
            commit = torch.cuda.CUDAGraph()
            with torch.cuda.graph(commit, pool=pool):
                self._commit(record, b)
            self._graphs[(b, w)] = (graph, out, record, commit)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        torch.cuda.empty_cache()
        self.pool_bytes = torch.cuda.memory_reserved(self.device) - reserved
        logger.debug("captured %d verify CUDA graphs (batches %s x widths %s) in %.1f s; graph memory %.0f MiB",
                     len(self._graphs), self.sizes, self.widths, self.capture_seconds, self.pool_bytes / MiB)

    def replay(self, key: tuple[int, int], input_ids: list[int], positions: list[int], slot_mapping: list[int],
               seq_lens: list[int], state_slots: list[int], block_tables: np.ndarray) -> torch.Tensor:
        """Run n = len(seq_lens) rows of w tokens each (the lists hold n * w entries: padding already in place)
        through the graph of key = (b, w); returns the static output [b w, H] (valid until the key's next
        replay). The commit counts of the rows are set to 0 here; `commit` sets the verify rows'."""
        b, w = key
        n = len(seq_lens)
        assert n <= b and len(input_ids) == n * w, "a verify-graph step's rows are padded to the width"
        if self._copied is not None:
            self._copied.synchronize()              # the previous step's copies have left the staging
        tok, seq, t = self._n_tok, self._n_seq, n * w
        tok[0, :t], tok[1, :t], tok[2, :t] = input_ids, positions, slot_mapping
        tok[:2, t : b * w], tok[2, t : b * w] = 0, -1
        seq[0, :n], seq[1, :n], seq[2, :n] = seq_lens, state_slots, 1
        seq[0, n:b], seq[1, n:b], seq[2, n:b] = w, -1, 0
        mb = block_tables.shape[1]
        self._n_tables[: b * self.table_width] = 0
        self._n_tables.reshape(-1, self.table_width)[:n, :mb] = block_tables
        self._tok[:, : b * w].copy_(self._h_tok[:, : b * w], non_blocking=True)
        self._seq[:, :b].copy_(self._h_seq[:, :b], non_blocking=True)
        self._tables[:b].copy_(self._h_tables[: b * self.table_width].view(b, self.table_width), non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        graph, out, _, _ = self._graphs[key]
        graph.replay()
        self.num_replays += 1
        return out

    def commit(self, key: tuple[int, int], num_accepted: torch.Tensor) -> None:
        """Commit the last replay of key: rows [:V] (V = len(num_accepted), the verify chunks, first) commit
        their accepted drafts + 1, the decode rows after them 1 token (set by replay), padding nothing."""
        b, _ = key
        v = num_accepted.shape[0]
        self._seq[2, :v].copy_(num_accepted + 1)
        self._graphs[key][3].replay()

    def record(self, key: tuple[int, int]) -> VerifyRecord:
        """The forward graph's VerifyRecord (its stashes: read by the commit graph)."""
        return self._graphs[key][2]


class _EagerCall:
    """CPU stand-in for a captured graph without an output."""

    def __init__(self, fn):
        self.fn = fn

    def replay(self) -> None:
        self.fn()
