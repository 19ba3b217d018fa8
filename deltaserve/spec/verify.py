"""The runner's half of a verify step (torch): the target's tokens at every position of the step's verify
chunks, accepted against the drafts, and the commit of the accepted prefix into each GDN layer's pools.

Each verify position is sampled by the plain sampler as a row of its own (runner/sampler.py `process` then
`draw`): the row's history is the sequence's tokens plus the drafts before that position, so penalties,
bad words and min_tokens see exactly what plain decoding would see there, and its uniform is the one plain
decoding would use for that token index (seeded rows: seeded_uniform(seed, index), as spec_uniforms).
The drafters are deterministic (q one-hot at the draft), so lossless rejection sampling is the coupled
rule (spec/rejection.py): accept while the draw equals the draft, emit the draw at the first mismatch or
the bonus draw. A seeded request therefore emits the very tokens plain decoding draws, whatever K, the
drafts or the batch. Logprobs of emitted tokens come from the raw target distribution, as plain sampling.
"""

from __future__ import annotations

import dataclasses

import torch

from ..batch import VerifyRecord
from ..ops import Kernels
from ..runner.sampler import HostCopy, PendingLogprobs, Sampler, SamplingRow, _logprob_tensors, log_softmax, to_device
from .rejection import accept_draws, spec_uniforms


@dataclasses.dataclass
class PendingVerify:
    """A verify step's results on their way to the host (`get` waits)."""

    tokens: torch.Tensor              # [B, W] int64 on the device: accepted drafts, the emitted token, -1
    num_accepted: torch.Tensor        # [B] int64 on the device
    num_drafts: list[int]
    copy: HostCopy
    logprobs: PendingLogprobs | None  # every position of the lp rows (lp_rows' positions, packed)
    lp_rows: list[int]                # verify chunks whose sequence asked for logprobs

    def get(self) -> tuple[list[list[int]], list[int], list[list | None]]:
        """Per chunk its emitted tokens (accepted drafts then the target's token), the accepted count, and
        the emitted tokens' logprob entries (None where not asked for)."""
        tokens, accepted = self.copy.get()
        emitted = [row[: a + 1] for row, a in zip(tokens, accepted)]
        lps: list[list | None] = [None] * len(emitted)
        if self.logprobs is not None:
            entries = self.logprobs.get()
            start = 0
            for i in self.lp_rows:
                width = self.num_drafts[i] + 1
                lps[i] = entries[start : start + accepted[i] + 1]
                start += width
        return emitted, accepted, lps


def position_rows(row: SamplingRow, drafts: list[int]) -> list[SamplingRow]:
    """The sampling row of each verify position j (0..len(drafts)): the sequence's row with drafts[:j]
    appended to its history (copied only where sampling reads token values)."""
    if row.needs_history() or row.params.bad_words:
        return [SamplingRow(row.params, row.seed, row.token_ids + drafts[:j], row.num_prompt_tokens,
                            row.stop_token_ids, row.num_pending) for j in range(len(drafts) + 1)]
    return [SamplingRow(row.params, row.seed, row.token_ids, row.num_prompt_tokens, row.stop_token_ids,
                        row.num_pending + j) for j in range(len(drafts) + 1)]


def launch_verify(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow],
                  drafts: list[list[int]]) -> PendingVerify:
    """logits [sum(len(d) + 1), V]: the verify chunks' positions in packed order (chunk i's rows are
    contiguous); rows: each chunk's sampling row (its history ends before the chunk's first position);
    drafts: each chunk's draft tokens. Queues the draws and the acceptance; nothing waits."""
    dev = logits.device
    B = len(rows)
    widths = [len(d) + 1 for d in drafts]
    W = max(widths)
    expanded = [r for row, d in zip(rows, drafts) for r in position_rows(row, d)]
    # the uniform of every position: token index num_generated + j (sampled rows only draw)
    uniforms: list[float] = []
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    u_rows: dict[int, list[float]] = {}
    if sampled:
        u, _ = spec_uniforms([rows[i].seed for i in sampled], [rows[i].num_generated for i in sampled], W,
                             sampler.shared)
        u_rows = {i: u[n].tolist() for n, i in enumerate(sampled)}
    for i, w in enumerate(widths):
        uniforms.extend(u_rows[i][:w] if i in u_rows else [0.0] * w)
    draws = sampler.draw(sampler.process(logits, expanded), expanded, uniforms)
    # padded [B, W] views: position j of chunk i is flat row offset_i + min(j, width_i - 1)
    offsets, flat = [], 0
    for w in widths:
        offsets.append(flat)
        flat += w
    gather = [[o + min(j, w - 1) for j in range(W)] for o, w in zip(offsets, widths)]
    index = to_device(torch.tensor(gather, dtype=torch.long).view(B, W), dev)
    d_pad = to_device(torch.tensor([d + [-1] * (W - 1 - len(d)) for d in drafts], dtype=torch.long).view(B, W - 1),
                      dev)
    n_drafts = to_device(torch.tensor([len(d) for d in drafts], dtype=torch.long), dev)
    tokens, num_accepted = accept_draws(draws[index], d_pad, n_drafts)
    lp_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    pending_lp = None
    if lp_rows:
        flat_rows = [offsets[i] + j for i in lp_rows for j in range(widths[i])]
        pos_rows = [[i, j] for i in lp_rows for j in range(widths[i])]
        pr = to_device(torch.tensor(pos_rows, dtype=torch.long).view(-1, 2), dev)
        targets = tokens[pr[:, 0], pr[:, 1]].clamp_min(0)
        raw = log_softmax(logits[to_device(torch.tensor(flat_rows, dtype=torch.long), dev)].float())
        ns = [rows[i].params.logprobs for i in lp_rows for _ in range(widths[i])]
        k = min(max(ns), raw.shape[1])
        pending_lp = PendingLogprobs(None, ns, HostCopy(targets, *_logprob_tensors(raw, targets, k)))
    return PendingVerify(tokens, num_accepted, [len(d) for d in drafts], HostCopy(tokens, num_accepted),
                         pending_lp, lp_rows)


def commit(kernels: Kernels, record: VerifyRecord, num_accepted: torch.Tensor) -> None:
    """Write each GDN layer's state and conv window after the accepted drafts and the chunk's first
    (known) token into the verify chunks' slots."""
    counts = (num_accepted + 1).to(torch.int32)
    for stash, conv_state, ssm_state in record.layers:
        kernels.gdn_commit(counts, cu_seqlens=record.cu_seqlens, state_indices=record.state_slots,
                           conv_state=conv_state, ssm_state=ssm_state, stash=stash)
