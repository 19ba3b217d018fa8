"""One forward step: SchedulerOutput -> packed ForwardBatch -> model -> sampler -> RunnerOutput.

The runner owns the model, the cache buffers and a little state per running sequence (its tokens, state
slot, block table row, how to sample it), set up from `NewSequence` and dropped when the scheduler says
the sequence was freed. It knows nothing about request lifecycles. All host work (packing the batch)
happens before the forward, host tensors reach the device from pinned memory (no sync), and the only
host sync after it is reading the sampled tokens (and logprobs).

The runner is built by runner/worker.py, which also has it capture its decode CUDA graphs once the cache
exists: on CUDA with Triton ops, decode-only steps of up to the largest captured bucket replay a graph
(runner/cuda_graphs.py); prefill and mixed steps, and larger decode batches, run eagerly.

A step is `launch` (pack, queue the forward, the logits and the sampler; returns a StepHandle at once on
CUDA) then `collect` (wait for the tokens, append them, build the logprob entries); `execute` does both.
Between the two the engine may schedule and launch the next step (async scheduling): the sampled tokens
are also scattered on the device into `last_tokens[state slot]`, and a decode row whose input token has
not reached the host yet (`num_pending`) takes it from there, so the next forward needs no host round
trip. Penalties read the token values on the host, so a row that has them cannot run ahead
(`can_launch_ahead`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ..batch import CacheBuffers, ForwardBatch, VerifyRecord
from ..env import settings
from ..models.qwen3_next import HybridForCausalLM
from ..spec import verify as spec_verify
from ..spec.config import SpeculativeConfig
from ..step_io import NewSequence, RunnerOutput, ScheduledChunk, SchedulerOutput
from .cuda_graphs import DecodeGraphs, capture_sizes
from .prefill_graphs import PrefillGraphs
from .sampler import PendingLogprobs, PendingSample, Sampler, SamplingRow, log_softmax, to_device, top_logprobs
from .speculation import Speculation
from .verify_graphs import VerifyGraphs


@dataclasses.dataclass
class _SeqState:
    sampling: SamplingRow            # holds the token list (prompt + generated), appended as we sample
    prompt_logprobs: int | None
    state_slot: int
    block_ids: list[int]

    @property
    def token_ids(self) -> list[int]:
        return self.sampling.token_ids

    @property
    def num_tokens(self) -> int:
        """Known tokens plus the one being sampled by a launched step."""
        return len(self.sampling.token_ids) + self.sampling.num_pending


@dataclasses.dataclass
class StepHandle:
    """A launched step whose results have not been read: `ModelRunner.collect` turns it into a RunnerOutput."""

    samples: list[tuple[int, _SeqState]] = dataclasses.field(default_factory=list)   # (seq id, state), packed order
    sample: PendingSample | None = None
    prompt_parts: list[tuple[int, PendingLogprobs]] = dataclasses.field(default_factory=list)
    # speculative decoding: the verify chunks' sequences (after `samples` in the output) and their results
    verifies: list[tuple[int, _SeqState]] = dataclasses.field(default_factory=list)
    verify: spec_verify.PendingVerify | None = None
    draft_k: int = 0                     # drafts to propose per sequence once the tokens are read
    batch: ForwardBatch | None = None    # kept for a drafter that reads the step's rows (draft_k or MTP)
    hidden: torch.Tensor | None = None
    sample_rows: list[int] = dataclasses.field(default_factory=list)   # packed row of each sample's logits
    verify_rows: list[int] = dataclasses.field(default_factory=list)   # packed row of each verify chunk's first
    chunk_index: list[int] = dataclasses.field(default_factory=list)   # per seq_ids entry: its chunk's index
    chunk_next: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # _LogitRows.chunk_next

    @property
    def seq_ids(self) -> list[int]:
        """The sequences that sample in this step (one token each, or a verify chunk's accepted run)."""
        return [seq_id for seq_id, _ in self.samples] + [seq_id for seq_id, _ in self.verifies]

    @property
    def collect_first(self) -> bool:
        """The next step cannot be scheduled before this one's tokens are read: it verifies drafts (the
        accepted count moves the sequences), proposes drafts for the next step, or has a drafter read its
        rows (MTP: its hidden states may be a graph's output buffer, and its K/V go into blocks the next
        schedule could hand to another sequence once this one is aborted)."""
        return bool(self.verifies) or self.draft_k > 0 or self.batch is not None


@dataclasses.dataclass
class _LogitRows:
    rows: list[int]                                  # packed-batch rows to compute logits for
    sample_rows: list[int]                           # index into rows of each sampling sequence
    samples: list[tuple[int, _SeqState]]             # (seq id, state) of each sampling sequence
    prompt_parts: list[tuple[int, _SeqState, int, int, int]]  # seq id, state, first row, count, chunk start
    # verify chunks: (seq id, state, index into rows of its first position, drafts)
    verifies: list[tuple[int, _SeqState, int, list[int]]] = dataclasses.field(default_factory=list)
    chunk_index: dict[int, int] = dataclasses.field(default_factory=dict)   # seq id -> its chunk's index
    chunk_start: dict[int, int] = dataclasses.field(default_factory=dict)   # seq id -> its chunk's first row
    # (packed row, token) of each chunk that ends before its sequence's known tokens: the token after its last row
    chunk_next: list[tuple[int, int]] = dataclasses.field(default_factory=list)


def _temperature_sample_op(device: torch.device):
    """The sampler's draw for plain temperature batches: the Triton op (two launches instead of ~25; against
    DELTASERVE_FUSED_SAMPLER=0: `PYTHONPATH=. python benchmarks/e2e_gpu.py --no-peer`) on CUDA, otherwise
    the torch reference (the same math).
    DELTASERVE_FUSED_SAMPLER=0 or DELTASERVE_REFERENCE_OPS=1 keep the reference on CUDA too."""
    env = settings()
    if device.type == "cuda" and env.fused_sampler and not env.force_reference_ops:
        from ..ops.sampling import triton as sampling_triton

        return sampling_triton.temperature_sample
    return None


def _aligned_sections(parts: list[list[int]], dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, list]:
    """The lists packed into one host tensor, each starting on a 16-byte boundary, copied to the device
    at once; returns the device tensor and a view of each list's section."""
    per = 16 // torch.empty((), dtype=dtype).element_size()
    flat: list[int] = []
    bounds = []
    for part in parts:
        flat.extend([0] * (-len(flat) % per))
        bounds.append((len(flat), len(flat) + len(part)))
        flat.extend(part)
    dev = to_device(torch.tensor(flat, dtype=dtype), device)
    return dev, [dev[a:b] for a, b in bounds]


class ModelRunner:
    def __init__(self, model: HybridForCausalLM, cache: CacheBuffers, *, device: torch.device | str,
                 max_model_len: int, seed: int | None = 0):
        self.model, self.cache, self.device = model, cache, torch.device(device)
        self.block_size = cache.block_size
        self.sampler = Sampler(self.device, seed, temperature_sample=_temperature_sample_op(self.device))
        self._seqs: dict[int, _SeqState] = {}
        # Block table row of each state slot (a sequence keeps its slot for life), kept on the host and
        # updated as blocks are added; a step gathers the rows of its sequences.
        self._block_table = np.zeros((cache.num_slots, -(-max_model_len // self.block_size)), dtype=np.int32)
        # The last token sampled for each state slot, on the device: the input of a decode row whose token
        # has not reached the host yet (async scheduling).
        self.last_tokens = torch.zeros(cache.num_slots, dtype=torch.long, device=self.device)
        self.graphs: DecodeGraphs | None = None
        # Runs the steps the decode graphs do not take (prefills, mixed steps, larger decode batches) of up to
        # its largest bucket as piecewise graphs (runner/prefill_graphs.py) when set.
        self.prefill_graphs: PrefillGraphs | None = None
        # Runs decode-only batches in place of self.model when set (the compiled CPU step, cpu_compile.py);
        # called like the model: (batch, cache) -> hidden, and .compute_logits(hidden).
        self.compiled_decode = None
        self.speculation: Speculation | None = None      # speculative decoding (enable_speculation)
        self.verify_graphs: VerifyGraphs | None = None   # verify steps as graph replays (enable_speculation)

    def enable_speculation(self, config: SpeculativeConfig, verify_graph_sizes: list[int] | tuple[int, ...] = ()
                           ) -> None:
        """Propose drafts with config's method after every step and verify them when scheduled; with
        verify_graph_sizes (verify_graphs.plan_verify_graphs: the caller has checked the verify path is
        capturable), capture verify graphs for steps of up to max(sizes) sequences."""
        self.speculation = Speculation.create(config, self.model, self.cache, self.device, sampler=self.sampler)
        if verify_graph_sizes:
            self.verify_graphs = VerifyGraphs(self.model, self.cache, list(verify_graph_sizes),
                                              config.num_speculative_tokens,
                                              max_blocks_per_seq=self._block_table.shape[1], device=self.device)
            self.verify_graphs.capture()

    def capture_decode_graphs(self, max_batch: int) -> None:
        """Capture decode CUDA graphs for batches of up to max_batch sequences (the caller has checked
        that the decode path is capturable: cuda_graphs.plan_decode_graphs)."""
        sizes = capture_sizes(max_batch)
        if not sizes:
            return
        self.graphs = DecodeGraphs(self.model, self.cache, sizes, max_blocks_per_seq=self._block_table.shape[1],
                                   device=self.device, last_tokens=self.last_tokens)
        self.graphs.capture()

    def capture_prefill_graphs(self, sizes: list[int], *, warm_up: bool = True) -> None:
        """Capture piecewise graphs for steps of up to max(sizes) tokens (the caller has checked that the
        token-wise ops are capturable: prefill_graphs.plan_prefill_graphs), then (warm_up) run each bucket
        once as a lone prompt so the cores build their kernels now: before any sequence holds slot 0."""
        if not sizes:
            return
        graphs = PrefillGraphs(self.model, sizes, device=self.device)
        graphs.capture()
        if warm_up:
            assert not self._seqs, "the cores' warm-up writes slot 0: capture before serving"
            graphs.warm_up_cores(self.cache, self.block_size)
        self.prefill_graphs = graphs

    @property
    def num_live_seqs(self) -> int:
        return len(self._seqs)

    # ---- per-sequence state -------------------------------------------------------------------
    def _add(self, new: NewSequence) -> None:
        row = SamplingRow(new.params, new.seed, list(new.token_ids), new.num_prompt_tokens, new.stop_token_ids)
        self._seqs[new.seq_id] = _SeqState(row, new.prompt_logprobs, new.state_slot, list(new.block_ids))
        self._block_table[new.state_slot, : len(new.block_ids)] = new.block_ids

    def _grow(self, state: _SeqState, new_blocks: list[int]) -> None:
        start = len(state.block_ids)
        state.block_ids.extend(new_blocks)
        self._block_table[state.state_slot, start : start + len(new_blocks)] = new_blocks

    def _apply_changes(self, out: SchedulerOutput) -> None:
        for seq_id in out.freed_seq_ids:
            self._seqs.pop(seq_id, None)
        if self.speculation is not None and out.freed_seq_ids:
            self.speculation.drafter.release(out.freed_seq_ids)
        for src, dst in out.state_copies:   # one by one: a snapshot saved here may be restored by a later pair
            self.cache.copy_slot(src, dst)
        if out.block_copies:                 # distinct fresh destinations: one gather, then one scatter
            src, dst = (to_device(torch.tensor(x), self.device) for x in zip(*out.block_copies))
            self.cache.kv[:, :, dst] = self.cache.kv[:, :, src]
        for new in out.new_seqs:
            self._add(new)
        for chunk in out.chunks:
            if chunk.new_block_ids:
                self._grow(self._seqs[chunk.seq_id], chunk.new_block_ids)

    # ---- packing ------------------------------------------------------------------------------
    @staticmethod
    def is_decode(chunk: ScheduledChunk) -> bool:
        return chunk.num_new == 1 and chunk.num_computed > 0

    @staticmethod
    def packing_order(chunk: ScheduledChunk) -> int:
        """Prefill chunks first, then verify chunks, then decodes."""
        return 1 if chunk.draft_token_ids else 2 if ModelRunner.is_decode(chunk) else 0

    def _pack_decodes(self, chunks: list[ScheduledChunk]) -> tuple[list[int], ...]:
        """Host values of one-token chunks: input ids (-1: still being sampled, read from last_tokens on the
        device), positions, KV slots, context lengths, state slots."""
        bs = self.block_size
        ids, pos, slot_map, seq_lens, slots = [], [], [], [], []
        for c in chunks:
            st = self._seqs[c.seq_id]
            p = c.num_computed
            ids.append(st.token_ids[p] if p < len(st.token_ids) else -1)
            pos.append(p)
            slot_map.append(st.block_ids[p // bs] * bs + p % bs)
            seq_lens.append(p + 1)
            slots.append(st.state_slot)
        return ids, pos, slot_map, seq_lens, slots

    def _replay_decodes(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        ids, pos, slot_map, seq_lens, slots = self._pack_decodes(chunks)
        tables = self._block_table[slots, : -(-max(seq_lens) // self.block_size)]
        return self.graphs.replay(ids, pos, slot_map, seq_lens, slots, tables)

    def verify_graph_key(self, chunks: list[ScheduledChunk]) -> tuple[int, int] | None:
        """The verify graph of a step (None: not one for them): verify chunks and one-token decodes whose
        input tokens are known, at least one verify chunk, within the graphs' buckets."""
        if self.verify_graphs is None or not any(c.draft_token_ids for c in chunks):
            return None
        for c in chunks:
            known = c.num_computed < len(self._seqs[c.seq_id].token_ids)     # its input token is on the host
            if not c.draft_token_ids and not (self.is_decode(c) and known):
                return None
        return self.verify_graphs.key_for(len(chunks), max(c.num_new for c in chunks))

    def _replay_verify(self, key: tuple[int, int], chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Run the chunks (packing order: verify chunks, then decodes) through the verify graph of key; returns
        the hidden states of their tokens, packed as build_batch packs them."""
        _, w = key
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slot_map: list[int] = []
        seq_lens, slots, rows = [], [], []
        for i, c in enumerate(chunks):
            st = self._seqs[c.seq_id]
            start, n = c.num_computed, c.num_new
            ids.append(st.token_ids[start])
            ids.extend(c.draft_token_ids)
            ids.extend([0] * (w - n))
            pos.extend(range(start, start + w))
            slot_map.extend(st.block_ids[p // bs] * bs + p % bs for p in range(start, start + n))
            slot_map.extend([-1] * (w - n))
            seq_lens.append(start + w)               # w queries per row: the real ones see their causal prefix
            slots.append(st.state_slot)
            rows.extend(range(i * w, i * w + n))
        cols = min(-(-max(seq_lens) // bs), self._block_table.shape[1])
        hidden = self.verify_graphs.replay(key, ids, pos, slot_map, seq_lens, slots, self._block_table[slots, :cols])
        return hidden if len(rows) == hidden.shape[0] else hidden[self._index(rows)]

    def uses_graph(self, chunks: list[ScheduledChunk]) -> bool:
        """Decode-only steps that fit a captured bucket replay a CUDA graph."""
        return (self.graphs is not None and len(chunks) <= self.graphs.max_size
                and all(self.is_decode(c) for c in chunks))

    def build_batch(self, chunks: list[ScheduledChunk]) -> ForwardBatch:
        """Pack chunks, which must be prefills first, then verify chunks, then decodes (packing_order)."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slot_map: list[int] = []
        cu = [0]
        seq_lens, slots, has_init = [], [], []
        pending: list[int] = []                      # token rows whose input is still being sampled
        pending_slots: list[int] = []                # ... and the state slot whose last token it is
        max_blocks = 0
        verify_cu, verify_slots = [0], []
        for c in chunks:
            st = self._seqs[c.seq_id]
            start, end = c.num_computed, c.num_computed + c.num_new
            blocks = st.block_ids
            if c.draft_token_ids:
                assert start == len(st.token_ids) - 1 and c.num_new == 1 + len(c.draft_token_ids), \
                    "a verify chunk feeds the last known token and its drafts"
                verify_cu.append(verify_cu[-1] + c.num_new)
                verify_slots.append(st.state_slot)
            elif end > len(st.token_ids):            # only ever the last position of a decode row
                pending.append(len(ids) + c.num_new - 1)
                pending_slots.append(st.state_slot)
            if c.num_new == 1:
                ids.append(st.token_ids[start] if start < len(st.token_ids) else 0)
                pos.append(start)
                slot_map.append(blocks[start // bs] * bs + start % bs)
            else:
                if c.draft_token_ids:
                    ids.append(st.token_ids[start])
                    ids.extend(c.draft_token_ids)
                else:
                    assert end <= len(st.token_ids), "a multi-token chunk never ends in a pending token"
                    ids.extend(st.token_ids[start:end])
                pos.extend(range(start, end))
                p = start
                while p < end:                       # one range per block touched, not per token
                    off = p % bs
                    take = min(bs - off, end - p)
                    base = blocks[p // bs] * bs + off
                    slot_map.extend(range(base, base + take))
                    p += take
            cu.append(cu[-1] + c.num_new)
            seq_lens.append(end)
            slots.append(st.state_slot)
            has_init.append(start > 0)
            max_blocks = max(max_blocks, -(-end // bs))
        num_prefills = sum(not self.is_decode(c) for c in chunks)
        num_verifies = len(verify_slots)
        # Two host tensors (int64 per token, int32 per sequence) and one copy each to the device; every
        # section starts 16-byte aligned (Triton builds a kernel variant per pointer alignment).
        per_token, tok = _aligned_sections([ids, pos, slot_map, pending, pending_slots], torch.long, self.device)
        per_seq, seq = _aligned_sections([cu, seq_lens, slots, has_init, slots[num_prefills:], verify_cu,
                                          verify_slots], torch.int32, self.device)
        tables = to_device(torch.from_numpy(self._block_table[slots, :max_blocks]), self.device)
        input_ids = tok[0]
        if pending:
            input_ids = input_ids.index_copy(0, tok[3], self.last_tokens.index_select(0, tok[4]))
        return ForwardBatch(
            input_ids=input_ids, positions=tok[1], slot_mapping=tok[2], cu_seqlens=seq[0], seq_lens=seq[1],
            state_slots=seq[2], has_initial_state=seq[3].bool(), block_tables=tables,
            num_prefills=num_prefills, num_prefill_tokens=cu[num_prefills], decode_state_slots=seq[4],
            max_prefill_len=max((cu[i + 1] - cu[i] for i in range(num_prefills)), default=0),
            num_verifies=num_verifies, num_verify_tokens=verify_cu[-1],
            verify=VerifyRecord(seq[5], seq[6]) if num_verifies else None,
        )

    # ---- one step -----------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run one step and wait for its results."""
        return self.collect(self.launch(out))

    def can_launch_ahead(self, out: SchedulerOutput) -> bool:
        """Whether `out` may be launched before the tokens of the step in flight are read: not when one of
        its sampling rows needs the token values themselves (penalties) and one of them is still pending."""
        for chunk in out.chunks:
            st = self._seqs.get(chunk.seq_id)
            if st is not None and st.sampling.num_pending and st.sampling.needs_history():
                return False
        return True

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> StepHandle:
        """Queue the step's forward, logits and sampling; on CUDA nothing waits for the GPU."""
        self._apply_changes(out)
        if not out.chunks:
            return StepHandle()
        chunks = sorted(out.chunks, key=self.packing_order)  # stable: prefills, verify chunks, decodes
        plan = self._logit_rows(chunks)
        model = self.model
        graphed = self.uses_graph(chunks)
        verify_key = None if graphed else self.verify_graph_key(chunks)
        batch = None
        if graphed or verify_key is not None:
            hidden = self._replay_decodes(chunks) if graphed else self._replay_verify(verify_key, chunks)
            if self.speculation is not None and self.speculation.uses_hidden:
                batch = self.build_batch(chunks)             # the drafter reads the step's rows
        else:
            if self.compiled_decode is not None and self.is_decode(chunks[0]):  # prefills sort first
                model = self.compiled_decode
            batch = self.build_batch(chunks)
            pieces = self.prefill_graphs if model is self.model else None
            if pieces is not None and pieces.handles(batch.num_tokens):
                hidden = pieces.run(batch, self.cache)
            else:
                hidden = model(batch, self.cache)
        handle = StepHandle(plan.samples, verifies=[(seq_id, st) for seq_id, st, _, _ in plan.verifies])
        if self.speculation is not None:
            self.speculation.keep_step(handle, batch, hidden, plan)
        if not plan.rows:                                    # only mid-prompt chunks: nothing to read out
            return handle
        # rows are increasing and distinct, so as many rows as tokens means every row (decode-only batches)
        picked = hidden if len(plan.rows) == hidden.shape[0] else hidden[self._index(plan.rows)]
        logits = model.compute_logits(picked)       # the activation dtype: the sampler widens where it must
        if plan.verifies:
            commit = (batch.verify if verify_key is None
                      else lambda accepted: self.verify_graphs.commit(verify_key, accepted))
            self.speculation.launch_verify(handle, logits, plan.verifies, commit, self._index)
        if plan.samples:
            states = [st for _, st in plan.samples]
            assert not any(st.sampling.num_pending and st.sampling.needs_history() for st in states), \
                "penalties need the pending token: collect the step in flight first (can_launch_ahead)"
            rows = [st.sampling for st in states]
            # the state slots of the sampling rows on the device: when every row of a graph step samples, the
            # graph's static input already holds them in this order, so nothing is copied for them
            slots = self.graphs.state_slots(len(rows)) if graphed and len(rows) == len(chunks) \
                else self._index([st.state_slot for st in states])
            handle.sample = self.sampler.launch(
                logits[self._index(plan.sample_rows)] if len(plan.sample_rows) < len(plan.rows) else logits, rows,
                record=(self.last_tokens, slots), masks=self._grammar_masks(out, plan.samples))
            for row in rows:
                row.num_pending += 1
        for seq_id, st, first, count, start in plan.prompt_parts:
            handle.prompt_parts.append((seq_id, self._prompt_logprobs(logits[first : first + count], st, start)))
        return handle

    @staticmethod
    def _grammar_masks(out: SchedulerOutput, samples: list[tuple[int, _SeqState]]):
        """Structured output: the step's bitmasks (waited for here, after the forward was queued) and the
        sampling row of each; None when no sequence of the step is constrained."""
        if out.grammar is None or not out.grammar.seq_ids:
            return None
        row_of = {seq_id: i for i, (seq_id, _) in enumerate(samples)}
        missing = [s for s in out.grammar.seq_ids if s not in row_of]
        assert not missing, f"grammar masks for sequences that do not sample this step: {missing}"
        return out.grammar.get(), [row_of[s] for s in out.grammar.seq_ids]

    def collect(self, handle: StepHandle) -> RunnerOutput:
        """Wait for a launched step's tokens (the host sync), append them and return the step's output."""
        result = RunnerOutput(handle.seq_ids, [], [])
        if handle.sample is not None:
            sampled = handle.sample.get()
            result.token_ids, result.logprobs = sampled.token_ids, sampled.logprobs
            for (_, st), tok in zip(handle.samples, sampled.token_ids):
                st.sampling.num_pending -= 1
                st.token_ids.append(tok)
        for seq_id, pending in handle.prompt_parts:
            result.prompt_logprobs[seq_id] = pending.get()
        if self.speculation is not None:
            self.speculation.collect(handle, result)
        return result

    def _index(self, rows: list[int]) -> torch.Tensor:
        return to_device(torch.tensor(rows, dtype=torch.long), self.device)

    def _logit_rows(self, chunks: list[ScheduledChunk]) -> "_LogitRows":
        """Rows of the packed batch that need logits: every position of a prompt-logprob chunk whose next token
        is in the prompt, and the last position of each chunk that reaches the end of its sequence's tokens
        (that sequence samples)."""
        plan = _LogitRows([], [], [], [])
        offset = 0
        for i, c in enumerate(chunks):
            st = self._seqs[c.seq_id]
            end = c.num_computed + c.num_new
            plan.chunk_index[c.seq_id] = i
            plan.chunk_start[c.seq_id] = offset
            if c.draft_token_ids:                    # a verify chunk: every position samples
                plan.verifies.append((c.seq_id, st, len(plan.rows), list(c.draft_token_ids)))
                plan.rows.extend(range(offset, offset + c.num_new))
                offset += c.num_new
                continue
            if st.prompt_logprobs is not None:
                count = min(end, st.sampling.num_prompt_tokens - 1) - c.num_computed
                if count > 0:
                    plan.prompt_parts.append((c.seq_id, st, len(plan.rows), count, c.num_computed))
                    plan.rows.extend(range(offset, offset + count))
            if end < len(st.token_ids):
                plan.chunk_next.append((offset + c.num_new - 1, st.token_ids[end]))
            if end == st.num_tokens:
                plan.sample_rows.append(len(plan.rows))
                plan.samples.append((c.seq_id, st))
                plan.rows.append(offset + c.num_new - 1)
            offset += c.num_new
        return plan

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, st: _SeqState, start: int) -> PendingLogprobs:
        """Logprobs of prompt tokens start + 1, start + 2, ... each given everything before it."""
        targets = st.token_ids[start + 1 : start + 1 + logits.shape[0]]
        lp = log_softmax(logits.float())
        return top_logprobs(lp, targets, [st.prompt_logprobs] * len(targets))
