"""Logits -> next tokens (+ logprobs), per row with its own SamplingParams.

Order of operations (vLLM's): returned logprobs come from the raw model distribution; then penalties
(repetition over prompt + output, presence / frequency over output), min_tokens suppression of stop
tokens, then greedy argmax or temperature -> top-k -> top-p -> min-p -> sample. Sampling uses the
exponential race (argmax p / E with E ~ Exp(1)) with the row's own generator when it has a seed, so a
seeded request draws the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import dataclasses

import torch

from ..outputs import Logprob, PositionLogprobs
from ..sampling_params import SamplingParams


@dataclasses.dataclass
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator | None      # the request's own (seeded) generator, or None: the shared one
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    stop_token_ids: frozenset[int] = frozenset()  # EOS + stop_token_ids, suppressed until min_tokens


@dataclasses.dataclass
class SampleResult:
    token_id: int
    logprobs: PositionLogprobs | None


def top_logprobs(logprobs: torch.Tensor, token_id: int, n: int) -> PositionLogprobs:
    """The chosen token's logprob and rank plus the top-n alternatives, for one position [V]."""
    chosen = float(logprobs[token_id])
    rank = int((logprobs > chosen).sum()) + 1
    result: PositionLogprobs = {token_id: Logprob(chosen, rank)}
    if n > 0:
        values, ids = logprobs.topk(n)
        for r, (v, i) in enumerate(zip(values.tolist(), ids.tolist()), start=1):
            result.setdefault(i, Logprob(v, r))
    return result


def _apply_penalties(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    p = row.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_token_ids) | set(row.output_token_ids)),
                            dtype=torch.long, device=logits.device)
        if seen.numel():
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and row.output_token_ids:
        out = torch.tensor(row.output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(out, minlength=logits.shape[0]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    if len(row.output_token_ids) < p.min_tokens and row.stop_token_ids:
        ids = torch.tensor(sorted(row.stop_token_ids), dtype=torch.long, device=logits.device)
        logits[ids[ids < logits.shape[0]]] = float("-inf")
    return logits


def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on one row; returns probabilities."""
    logits = logits / p.temperature
    if 0 < p.top_k < logits.shape[0]:
        kth = logits.topk(p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        mass_before = sorted_probs.cumsum(0) - sorted_probs
        drop = mass_before > p.top_p
        drop[0] = False
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def sample(logits: torch.Tensor, rows: list[SamplingRow], shared_generator: torch.Generator | None = None
           ) -> list[SampleResult]:
    """logits [N, V] (any float dtype) for N rows -> one sampled token per row."""
    logits = logits.float()
    raw = torch.log_softmax(logits, dim=-1)
    results = []
    for i, row in enumerate(rows):
        p = row.params
        row_logits = _apply_penalties(logits[i].clone(), row)
        if p.greedy:
            token = int(row_logits.argmax())
        else:
            probs = _filter(row_logits, p)
            gen = row.generator or shared_generator
            u = torch.rand(probs.shape, generator=gen, device=probs.device, dtype=torch.float64)
            race = -torch.log1p(-u).clamp_min(1e-30)  # Exp(1)
            token = int((probs.double() / race).argmax())
        lp = top_logprobs(raw[i], token, p.logprobs) if p.logprobs is not None else None
        results.append(SampleResult(token, lp))
    return results
