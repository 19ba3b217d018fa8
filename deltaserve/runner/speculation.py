"""The runner's speculative decoding (spec/ holds the pieces): per step, adaptive K, the verify of the
step's verify chunks with the commit of the accepted prefix, and the drafts for the next step.

Life of a speculating sequence's step: the scheduler feeds a verify chunk (its last known token and the
drafts proposed at the end of the previous step); the forward runs it like a prefill chunk for attention
(all K+1 K/V written; the rejected ones are overwritten later) and through gdn_verify for the GDN layers
(pools untouched, a stash per layer); `launch_verify` samples every position as plain decoding would,
accepts against the drafts and commits accepted + 1 tokens into every GDN layer's pools; `collect`
appends the emitted tokens, feeds the acceptance to adaptive K and has the drafter propose the next
drafts (runner/model_runner.py calls these). Verify steps of up to 16 sequences replay a verify graph
(runner/verify_graphs.py: the forward, then the commit of every GDN layer in one replay); larger ones and
steps with prefills run piecewise / eagerly; plain decode steps keep their decode graphs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..batch import CacheBuffers, ForwardBatch, VerifyRecord
from ..spec import verify as spec_verify
from ..spec.adaptive import AdaptiveK, AdaptivePolicy
from ..spec.config import SpeculativeConfig
from ..spec.drafter import DraftContext, Drafter, make_drafter
from ..step_io import RunnerOutput
from .sampler import Sampler, to_device

logger = logging.getLogger(__name__)


class Speculation:
    def __init__(self, config: SpeculativeConfig, drafter: Drafter, adaptive: AdaptiveK, sampler: Sampler,
                 kernels, cache: CacheBuffers, device: torch.device):
        self.config, self.drafter, self.adaptive = config, drafter, adaptive
        self.sampler, self.kernels, self.cache, self.device = sampler, kernels, cache, device
        # a drafter with its own state (MTP) reads the step's rows every step; n-gram reads host tokens only
        self.uses_hidden = bool(getattr(drafter, "uses_hidden", True))

    @classmethod
    def create(cls, config: SpeculativeConfig, model, cache: CacheBuffers, device: torch.device, *,
               sampler: Sampler) -> Speculation:
        drafter = make_drafter(config, model, cache, device)
        adaptive = AdaptiveK(config.num_speculative_tokens, AdaptivePolicy.for_device(device.type, config.method))
        logger.info("speculative decoding: method %s; %s", config.method, adaptive.describe())
        return cls(config, drafter, adaptive, sampler, model.kernels, cache, device)

    def reset(self) -> None:
        """Forget the measured acceptance (after the engine's warm-up requests)."""
        self.adaptive = AdaptiveK(self.adaptive.max_k, self.adaptive.policy)

    # ---- launch -------------------------------------------------------------------------------
    def keep_step(self, handle, batch: ForwardBatch | None, hidden: torch.Tensor, plan) -> None:
        """Pick the next step's K from this step's sampling sequences (they decode next) and keep what the
        drafter will read at collect."""
        num_sampling = len(plan.samples) + len(plan.verifies)
        handle.draft_k = self.adaptive.k_for_step(num_sampling) if num_sampling else 0
        handle.sample_rows = [plan.rows[i] for i in plan.sample_rows]
        handle.verify_rows = [plan.rows[first] for _, _, first, _ in plan.verifies]
        handle.chunk_index = [plan.chunk_index[seq_id] for seq_id in handle.seq_ids]
        if self.uses_hidden:
            handle.batch, handle.hidden = batch, hidden
            handle.chunk_next = plan.chunk_next

    def launch_verify(self, handle, logits: torch.Tensor, verifies: list, commit: VerifyRecord | Callable,
                      index) -> None:
        """Sample and accept the verify chunks' positions (logits: the step's logit rows, verify chunk
        positions among them), then commit every GDN layer's accepted prefix: the step's VerifyRecord
        (eager forwards) or a callable taking the accepted counts (a verify graph's commit)."""
        rows = [i for _, _, first, drafts in verifies for i in range(first, first + len(drafts) + 1)]
        part = logits if len(rows) == logits.shape[0] else logits[index(rows)]
        samplings = [st.sampling for _, st, _, _ in verifies]
        handle.verify = spec_verify.launch_verify(self.sampler, part, samplings, [d for *_, d in verifies])
        if isinstance(commit, VerifyRecord):
            spec_verify.commit(self.kernels, commit, handle.verify.num_accepted)
        else:
            commit(handle.verify.num_accepted)
        for row in samplings:
            row.num_pending += 1

    # ---- collect ------------------------------------------------------------------------------
    def collect(self, handle, result: RunnerOutput) -> None:
        """Append the verify chunks' emitted tokens to the result, update adaptive K, and propose drafts."""
        if handle.verify is not None:
            emitted, accepted, lps = handle.verify.get()
            for i, ((seq_id, st), toks, lp) in enumerate(zip(handle.verifies, emitted, lps, strict=True)):
                st.sampling.num_pending -= 1
                st.token_ids.extend(toks)
                result.token_ids.append(toks[-1])
                result.logprobs.append(None if lp is None else lp[-1])
                result.accepted_token_ids[seq_id] = toks[:-1]
                result.accepted_logprobs[seq_id] = [None] * accepted[i] if lp is None else lp[:-1]
                result.num_drafts_verified[seq_id] = handle.verify.num_drafts[i]
            self.adaptive.observe(handle.verify.num_drafts, accepted)
        states = handle.samples + handle.verifies
        if handle.draft_k <= 0 and (not self.uses_hidden or (handle.batch is None and not states)):
            return      # nothing to propose, and no rows for the drafter to read (a step without chunks)
        ctx = DraftContext(
            seq_ids=[seq_id for seq_id, _ in states], k=handle.draft_k, token_ids=[st.token_ids for _, st in states],
            batch=handle.batch, hidden=handle.hidden, batch_index=handle.chunk_index,
            last_rows=self._last_rows(handle) if self.uses_hidden else None,
            next_tokens=self._next_tokens(handle) if self.uses_hidden else None,
            num_accepted=self._num_accepted(handle) if self.uses_hidden else None, cache=self.cache)
        if self.uses_hidden and handle.draft_k > 1 and states:
            ctx.kv_capacity, ctx.block_tables = self._draft_blocks([st for _, st in states])
        handle.batch = handle.hidden = None
        proposed = self.drafter.propose(ctx)
        if handle.draft_k <= 0 or not states:
            return
        for seq_id, row in zip(ctx.seq_ids, proposed.tolist(), strict=True):
            n = next((i for i, t in enumerate(row) if t < 0), len(row))
            if n:
                result.draft_token_ids[seq_id] = row[:n]

    def _draft_blocks(self, states) -> tuple[torch.Tensor, torch.Tensor]:
        """Per drafting sequence the positions its blocks hold (the scheduler's lookahead blocks included) and
        its block table: where the draft rows may write."""
        bs = self.cache.block_size
        width = max(len(st.block_ids) for st in states)
        table = torch.zeros((len(states), width), dtype=torch.int32)
        for i, st in enumerate(states):
            table[i, : len(st.block_ids)] = torch.tensor(st.block_ids, dtype=torch.int32)
        capacity = torch.tensor([len(st.block_ids) * bs for st in states], dtype=torch.long)
        return to_device(capacity, self.device), to_device(table, self.device)

    def _num_accepted(self, handle) -> torch.Tensor:
        plain = torch.zeros(len(handle.samples), dtype=torch.long, device=self.device)
        if handle.verify is None:
            return plain
        return torch.cat([plain, handle.verify.num_accepted])

    def _last_rows(self, handle) -> torch.Tensor:
        rows = torch.tensor(handle.sample_rows + handle.verify_rows, dtype=torch.long).to(self.device)
        if handle.verify is not None:
            rows[len(handle.sample_rows):] += handle.verify.num_accepted
        return rows

    def _next_tokens(self, handle) -> torch.Tensor | None:
        """Per packed row the token that follows it: the next input within a chunk, the sequence's next known
        token at the last row of a chunk that ends inside them (a prompt chunk before the prompt's end: host
        values from packing), the sampled token at a sampling row, the accepted draft or emitted token at a
        verify row (rows past the emitted one: -1)."""
        batch = handle.batch
        if batch is None:
            return None
        ids = batch.input_ids
        nxt = torch.cat([ids[1:], ids.new_zeros(1)])
        if handle.chunk_next:
            rows, toks = zip(*handle.chunk_next)
            both = torch.tensor([rows, toks], dtype=torch.long).to(self.device)
            nxt.index_copy_(0, both[0], both[1])
        if handle.sample is not None and handle.sample_rows:
            rows = torch.tensor(handle.sample_rows, dtype=torch.long).to(self.device)
            nxt.index_copy_(0, rows, handle.sample.tokens.long())
        if handle.verify is not None:
            widths = [k + 1 for k in handle.verify.num_drafts]
            rows = torch.tensor([r + j for r, w in zip(handle.verify_rows, widths) for j in range(w)],
                                dtype=torch.long).to(self.device)
            tokens = handle.verify.tokens
            cols = torch.tensor([j for w in widths for j in range(w)], dtype=torch.long).to(self.device)
            which = torch.tensor([i for i, w in enumerate(widths) for _ in range(w)], dtype=torch.long).to(self.device)
            nxt.index_copy_(0, rows, tokens[which, cols])
        return nxt
