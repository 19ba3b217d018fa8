"""Logits -> next tokens (+ logprobs), each row with its own SamplingParams, vectorised over the batch.

Order of operations (vLLM's): returned logprobs come from the raw model distribution; then penalties
(repetition over prompt + output, presence / frequency over output) and min_tokens suppression of stop
tokens, then greedy argmax, or temperature -> top-k -> top-p -> min-p -> sample.

Sampling inverts the CDF with one uniform number per row, in two levels (which block of 128 tokens, then
which token in it) with the cumulative sums in float64, so a 150k vocabulary loses no precision. A row
with a seed takes its uniform from a hash of (seed, index of the token being sampled), so its tokens do
not depend on what else is in the batch, on chunking, or on preemption and recomputation; rows without a
seed draw from the sampler's own seeded stream. No device random generator is involved: nothing per row
runs on the device and the uniforms are plain inputs (CUDA-graph friendly). The only host sync is reading
the sampled tokens (and the logprobs, when asked for).
"""

from __future__ import annotations

import dataclasses
import random

import torch
import torch.nn.functional as F

from ..outputs import Logprob, PositionLogprobs
from ..sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


@dataclasses.dataclass
class SamplingRow:
    params: SamplingParams
    seed: int | None                 # the sequence's own seed; None: the shared generator
    token_ids: list[int]             # prompt + generated so far (penalties read these)
    num_prompt_tokens: int
    stop_token_ids: frozenset[int] = frozenset()  # EOS + stop_token_ids, suppressed until min_tokens

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def adjusts_logits(self) -> bool:
        p = self.params
        return (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
                or (bool(self.stop_token_ids) and self.num_generated < p.min_tokens))


@dataclasses.dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[PositionLogprobs | None]


_BLOCK = 128


def seeded_uniform(seed: int, index: int) -> float:
    """A uniform number in [0, 1) for token `index` of a sequence seeded with `seed` (splitmix64 mixing;
    the top 53 bits, so it is exact in float64 and never 1.0)."""
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((x ^ (x >> 31)) >> 11) * (1.0 / (1 << 53))


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [N, V] (unnormalised, >= 0, some mass in every row), u [N] float64 in [0, 1) -> token [N]: the
    first token whose cumulative mass exceeds u x total. Never picks a zero-probability token."""
    N, V = probs.shape
    pad = (-V) % _BLOCK
    blocks = (F.pad(probs, (0, pad)) if pad else probs).view(N, -1, _BLOCK)
    mass = blocks.sum(-1).double()            # [N, C]; a 128-term fp32 sum is exact to ~1e-7 of the block
    cdf = mass.cumsum(-1)
    x = (u * cdf[:, -1])[:, None]
    b = torch.searchsorted(cdf, x, right=True).clamp_max_(cdf.shape[1] - 1)     # [N, 1] block holding x
    before = torch.where(b > 0, cdf.gather(1, (b - 1).clamp_min(0)), 0.0)
    frac = ((x - before) / mass.gather(1, b)).clamp(0.0, 1.0 - 2.0 ** -52)
    inner = blocks.gather(1, b[:, :, None].expand(N, 1, _BLOCK))[:, 0].double().cumsum(-1)   # [N, BLOCK]
    j = torch.searchsorted(inner, frac * inner[:, -1:], right=True).clamp_max_(_BLOCK - 1)
    return (b * _BLOCK + j)[:, 0]


def top_logprobs(logprobs: torch.Tensor, token_ids: list[int], ns: list[int]) -> list[PositionLogprobs]:
    """For rows of logprobs [R, V]: the chosen token's logprob and rank plus the top-n alternatives."""
    targets = torch.tensor(token_ids, dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(1, targets[:, None])
    ranks = (logprobs > chosen).sum(1) + 1
    k = min(max(ns, default=0), logprobs.shape[1])
    top_v, top_i = logprobs.topk(k, dim=-1) if k > 0 else (None, None)
    chosen, ranks = chosen[:, 0].tolist(), ranks.tolist()
    top_v, top_i = (top_v.tolist(), top_i.tolist()) if k > 0 else ([], [])
    out = []
    for r, (tok, n) in enumerate(zip(token_ids, ns)):
        entry: PositionLogprobs = {tok: Logprob(chosen[r], ranks[r])}
        for rank in range(min(n, k)):
            entry.setdefault(top_i[r][rank], Logprob(top_v[r][rank], rank + 1))
        out.append(entry)
    return out


def _adjust(logits: torch.Tensor, row: SamplingRow) -> None:
    """Penalties and min_tokens suppression on one row [V], in place."""
    p, V = row.params, logits.shape[0]
    dev = logits.device
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.token_ids)), dtype=torch.long, device=dev)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and row.num_generated:
        out = torch.tensor(row.token_ids[row.num_prompt_tokens:], dtype=torch.long, device=dev)
        counts = torch.bincount(out, minlength=V)[:V].to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    if row.num_generated < p.min_tokens and row.stop_token_ids:
        ids = [t for t in row.stop_token_ids if t < V]
        if ids:
            logits[torch.tensor(ids, dtype=torch.long, device=dev)] = float("-inf")


class Sampler:
    def __init__(self, device: torch.device, seed: int | None):
        self.device = torch.device(device)
        self._shared = random.Random(seed)     # uniforms of rows without their own seed

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits [N, V] (any float dtype) for N rows -> one token per row."""
        logits = logits.float()
        lp_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        raw = torch.log_softmax(logits[lp_rows], dim=-1) if lp_rows else None
        adjust = [i for i, r in enumerate(rows) if r.adjusts_logits()]
        if adjust:
            logits = logits.clone()
            for i in adjust:
                _adjust(logits[i], rows[i])
        greedy = [r.params.greedy for r in rows]
        if all(greedy):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, rows, greedy)
        token_ids = tokens.tolist()
        logprobs: list[PositionLogprobs | None] = [None] * len(rows)
        if lp_rows:
            tops = top_logprobs(raw, [token_ids[i] for i in lp_rows], [rows[i].params.logprobs for i in lp_rows])
            for i, entry in zip(lp_rows, tops):
                logprobs[i] = entry
        return SamplerOutput(token_ids, logprobs)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow], greedy: list[bool]) -> torch.Tensor:
        N, V = logits.shape
        dev = logits.device
        params = [r.params for r in rows]
        temps = torch.tensor([1.0 if g else p.temperature for g, p in zip(greedy, params)], device=dev)
        x = logits / temps[:, None]
        top_k = [p.top_k if 0 < p.top_k < V else V for p in params]
        if min(top_k) < V:
            kth = x.topk(max(k for k in top_k if k < V), dim=-1).values   # [N, kmax], descending
            kth = kth.gather(1, torch.tensor([min(k, kth.shape[1]) - 1 for k in top_k], device=dev)[:, None])
            keep_all = torch.tensor([k >= V for k in top_k], device=dev)[:, None]
            x = x.masked_fill((x < kth) & ~keep_all, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        top_p = [p.top_p for p in params]
        if min(top_p) < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            mass_before = sorted_p.cumsum(dim=-1) - sorted_p
            drop = mass_before > torch.tensor(top_p, device=dev)[:, None]
            drop[:, 0] = False
            probs = probs.scatter(1, order, sorted_p.masked_fill(drop, 0.0))
        min_p = [p.min_p for p in params]
        if max(min_p) > 0:
            floor = torch.tensor(min_p, device=dev)[:, None] * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < floor, 0.0)

        u = torch.tensor([0.0 if g else self._shared.random() if r.seed is None else
                          seeded_uniform(r.seed, r.num_generated) for g, r in zip(greedy, rows)],
                         dtype=torch.float64, device=dev)
        sampled = inverse_cdf(probs, u)
        if any(greedy):
            sampled = torch.where(torch.tensor(greedy, device=dev), logits.argmax(dim=-1), sampled)
        return sampled
