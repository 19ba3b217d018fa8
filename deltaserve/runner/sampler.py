"""Logits -> next tokens (+ logprobs), each row with its own SamplingParams, vectorised over the batch.

Order of operations (vLLM's): returned logprobs come from the raw model distribution; then logit_bias,
penalties (repetition over prompt + output, presence / frequency over output), bad words (the last token
of a bad word whose earlier tokens end the output; one-token words always) and min_tokens suppression of
stop tokens, then the structured-output bitmask (structured/manager.py: disallowed tokens to -inf), then
greedy argmax, or temperature -> top-k -> top-p -> min-p -> sample.

Sampling inverts the CDF with one uniform number per row, in two levels (which block of 128 tokens, then
which token in it) with the cumulative sums in float64, so a 150k vocabulary loses no precision
(ops/sampling). A batch without top-k / top-p / min-p rows draws through the `temperature_sample` op it
is given (default: the torch reference; ops/sampling/triton.py does it in two launches). A row
with a seed takes its uniform from a hash of (seed, index of the token being sampled), so its tokens do
not depend on what else is in the batch, on chunking, or on preemption and recomputation; rows without a
seed draw from the sampler's own seeded stream. No device random generator is involved: nothing per row
runs on the device and the uniforms are plain inputs (CUDA-graph friendly). Host values reach the device
from pinned memory, and nothing reads a device value on the host (no .item(), no boolean-mask indexing, no
bincount) except the one transfer of the sampled tokens (with the logprobs, when asked for) at the end.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Callable

import torch

from ..ops.sampling import reference as sampling_ref
from ..ops.sampling.reference import inverse_cdf
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
    num_pending: int = 0             # sampled by a launched step, not yet appended to token_ids

    @property
    def num_generated(self) -> int:
        """Tokens sampled so far, the ones still in flight included (the index of the next draw)."""
        return len(self.token_ids) + self.num_pending - self.num_prompt_tokens

    def needs_history(self) -> bool:
        """Whether sampling reads the generated token values (penalties, bad words of several tokens), not
        just how many there are."""
        p = self.params
        return (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
                or any(len(w) > 1 for w in p.bad_words_token_ids))

    def adjusts_logits(self) -> bool:
        p = self.params
        return (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
                or bool(p.logit_bias) or bool(p.bad_words)
                or (bool(self.stop_token_ids) and self.num_generated < p.min_tokens))


@dataclasses.dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[PositionLogprobs | None]


class HostCopy:
    """Device tensors on their way to the host: the copies are queued on the stream behind the work that
    makes them, and `get()` waits for them (the step's one host sync) and returns Python lists."""

    def __init__(self, *tensors: torch.Tensor):
        if tensors and tensors[0].device.type == "cuda":
            self._host = [t.to("cpu", non_blocking=True) for t in tensors]     # into pinned memory
            self._done: torch.cuda.Event | None = torch.cuda.Event()
            self._done.record()
        else:
            self._host, self._done = list(tensors), None

    def get(self) -> list[list]:
        if self._done is not None:
            self._done.synchronize()
        return [h.tolist() for h in self._host]


@dataclasses.dataclass
class PendingLogprobs:
    """Logprob entries whose tensors are still on their way to the host."""

    token_ids: list[int] | None      # the chosen tokens when known on the host (prompt tokens); None: copy[0]
    ns: list[int]
    copy: HostCopy

    def get(self) -> list[PositionLogprobs]:
        host = self.copy.get()
        if self.token_ids is None:
            return _logprob_entries(host[0], self.ns, host[1:])
        return _logprob_entries(self.token_ids, self.ns, host)


@dataclasses.dataclass
class PendingSample:
    """The sampler's result before it is read: the tokens on the device (the next step may feed them
    without a host round trip) and their copy to the host."""

    tokens: torch.Tensor             # [N] int64 on the device
    num_rows: int
    copy: HostCopy                   # tokens, then the logprob tensors of lp_rows
    lp_rows: list[int]
    lp_ns: list[int]

    def get(self) -> SamplerOutput:
        host = self.copy.get()
        token_ids = host[0]
        logprobs: list[PositionLogprobs | None] = [None] * self.num_rows
        if self.lp_rows:
            chosen = [token_ids[i] for i in self.lp_rows]
            for i, entry in zip(self.lp_rows, _logprob_entries(chosen, self.lp_ns, host[1:])):
                logprobs[i] = entry
        return SamplerOutput(token_ids, logprobs)


def seeded_uniform(seed: int, index: int) -> float:
    """A uniform number in [0, 1) for token `index` of a sequence seeded with `seed` (splitmix64 mixing;
    the top 53 bits, so it is exact in float64 and never 1.0)."""
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((x ^ (x >> 31)) >> 11) * (1.0 / (1 << 53))


def _top_k(params, V: int) -> int:
    return params.top_k if 0 < params.top_k < V else V


def _no_filters(rows: list[SamplingRow], V: int) -> bool:
    """No row of the batch has top-k, top-p or min-p: the batch draws through the temperature op."""
    return all(_top_k(r.params, V) >= V and r.params.top_p >= 1.0 and r.params.min_p <= 0.0 for r in rows)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim as x - logsumexp(x): the reductions run over the whole GPU, where
    torch.log_softmax gives each row one thread block (slow for few rows of a large vocabulary)."""
    return logits - torch.logsumexp(logits, dim=-1, keepdim=True)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` with no host sync: staged in pinned memory (torch's caching host allocator
    keeps the block until the copy has run) and copied asynchronously. A copy from pageable memory may
    wait for the stream to drain."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def to_host(*tensors: torch.Tensor) -> list[list]:
    """Device tensors as Python lists, with one wait for all of them."""
    return HostCopy(*tensors).get()


def _logprob_tensors(logprobs: torch.Tensor, targets: torch.Tensor, k: int) -> list[torch.Tensor]:
    """On the device: the targets' logprobs and ranks, and the top-k values and ids (k = 0: none)."""
    chosen = logprobs.gather(1, targets[:, None])
    ranks = (logprobs > chosen).sum(1) + 1
    out = [chosen[:, 0], ranks]
    if k > 0:
        out += list(logprobs.topk(k, dim=-1))
    return out


def _logprob_entries(token_ids: list[int], ns: list[int], host: list[list]) -> list[PositionLogprobs]:
    chosen, ranks = host[0], host[1]
    top_v, top_i = (host[2], host[3]) if len(host) > 2 else ([], [])
    out = []
    for r, (tok, n) in enumerate(zip(token_ids, ns)):
        entry: PositionLogprobs = {tok: Logprob(chosen[r], ranks[r])}
        for rank in range(min(n, len(top_v[r]) if top_v else 0)):
            entry.setdefault(top_i[r][rank], Logprob(top_v[r][rank], rank + 1))
        out.append(entry)
    return out


def top_logprobs(logprobs: torch.Tensor, token_ids: list[int], ns: list[int]) -> PendingLogprobs:
    """For rows of logprobs [R, V]: the chosen token's logprob and rank plus the top-n alternatives
    (`.get()` waits for them)."""
    targets = to_device(torch.tensor(token_ids, dtype=torch.long), logprobs.device)
    k = min(max(ns, default=0), logprobs.shape[1])
    return PendingLogprobs(token_ids, ns, HostCopy(*_logprob_tensors(logprobs, targets, k)))


def _banned_by_bad_words(row: SamplingRow) -> list[int]:
    """Tokens a row may not sample next: the last token of each bad word whose other tokens end the output
    (vLLM's rule; the output only, not the prompt)."""
    out = row.token_ids[row.num_prompt_tokens:]
    banned = []
    for word in row.params.bad_words_token_ids:
        k = len(word) - 1
        if k == 0 or (len(out) >= k and out[len(out) - k:] == word[:-1]):
            banned.append(word[-1])
    return banned


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow], which: list[int]) -> None:
    """logit_bias, penalties, bad words and min_tokens suppression of rows `which` of logits [N, V], in
    place, in this order per row: logit_bias added, repetition (prompt + output tokens), presence /
    frequency (output tokens), bad words' and (before min_tokens) stop tokens to -inf. Gathered over the
    rows into one index list per kind (no per-row transfers)."""
    V, dev = logits.shape[1], logits.device
    bias: list[list] = [[], [], []]      # row, token, bias
    rep: list[list] = [[], [], []]       # row, token, penalty
    cnt: list[list] = [[], []]           # row (index into cnt_rows), output token
    cnt_rows, freq, pres = [], [], []
    stop: list[list] = [[], []]          # row, token
    for i in which:
        row, p = rows[i], rows[i].params
        if p.logit_bias:
            items = sorted((t, b) for t, b in p.logit_bias.items() if t < V)
            bias[0] += [i] * len(items)
            bias[1] += [t for t, _ in items]
            bias[2] += [b for _, b in items]
        if p.bad_words:
            ids = sorted({t for t in _banned_by_bad_words(row) if t < V})
            stop[0] += [i] * len(ids)
            stop[1] += ids
        if p.repetition_penalty != 1.0:
            seen = sorted(set(row.token_ids))
            rep[0] += [i] * len(seen)
            rep[1] += seen
            rep[2] += [p.repetition_penalty] * len(seen)
        if (p.presence_penalty or p.frequency_penalty) and row.num_generated:
            out = row.token_ids[row.num_prompt_tokens:]
            cnt[0] += [len(cnt_rows)] * len(out)
            cnt[1] += out
            cnt_rows.append(i)
            freq.append(p.frequency_penalty)
            pres.append(p.presence_penalty)
        if row.num_generated < p.min_tokens and row.stop_token_ids:
            ids = sorted(t for t in row.stop_token_ids if t < V)
            stop[0] += [i] * len(ids)
            stop[1] += ids
    if bias[0]:
        r, t = to_device(torch.tensor(bias[:2], dtype=torch.long), dev)
        logits.index_put_((r, t), to_device(torch.tensor(bias[2], dtype=logits.dtype), dev), accumulate=True)
    if rep[0]:
        r, t = to_device(torch.tensor(rep[:2], dtype=torch.long), dev)
        pen = to_device(torch.tensor(rep[2], dtype=logits.dtype), dev)
        vals = logits[r, t]
        logits[r, t] = torch.where(vals > 0, vals / pen, vals * pen)
    if cnt_rows:
        c, t = to_device(torch.tensor(cnt, dtype=torch.long), dev)
        r = to_device(torch.tensor(cnt_rows, dtype=torch.long), dev)
        fp = to_device(torch.tensor([freq, pres], dtype=logits.dtype), dev)
        counts = torch.zeros(len(cnt_rows), V, dtype=logits.dtype, device=dev)
        counts.index_put_((c, t), torch.ones_like(t, dtype=logits.dtype), accumulate=True)
        logits[r] = logits[r] - (fp[0, :, None] * counts + fp[1, :, None] * (counts > 0).to(logits.dtype))
    if stop[0]:
        r, t = to_device(torch.tensor(stop, dtype=torch.long), dev)
        logits.index_put_((r, t), torch.full(t.shape, float("-inf"), dtype=logits.dtype, device=dev))


def _apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Structured output: logits row rows[i] keeps only the tokens bitmask[i] (host int32) allows. On CPU
    xgrammar's own kernel (the masks come from xgrammar; about twice the torch reference's speed), elsewhere
    the torch reference."""
    everything = rows == list(range(logits.shape[0]))
    if logits.device.type == "cpu":
        import xgrammar

        if everything:
            xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1])
        else:
            index = torch.tensor(rows)
            part = logits[index]
            xgrammar.apply_token_bitmask_inplace(part, bitmask, vocab_size=logits.shape[1])
            logits[index] = part
        return
    index = None if everything else to_device(torch.tensor(rows), logits.device)
    sampling_ref.apply_token_bitmask(logits, to_device(bitmask, logits.device), index)


class Sampler:
    def __init__(self, device: torch.device, seed: int | None, temperature_sample: Callable | None = None):
        self.device = torch.device(device)
        self._shared = random.Random(seed)     # uniforms of rows without their own seed
        # draws of batches without top-k / top-p / min-p: (logits, temperature [N] fp32, u [N] fp64) -> tokens
        self.temperature_sample = temperature_sample or sampling_ref.temperature_sample

    @property
    def shared(self) -> random.Random:
        """The stream of rows without their own seed (speculative verify draws from it too)."""
        return self._shared

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits [N, V] (any float dtype) for N rows -> one token per row (launch, then wait)."""
        return self.launch(logits, rows).get()

    def launch(self, logits: torch.Tensor, rows: list[SamplingRow], *,
               record: tuple[torch.Tensor, torch.Tensor] | None = None,
               masks: tuple[torch.Tensor, list[int]] | None = None) -> PendingSample:
        """Queue the sampling of one token per row. Per-row options reach the device as one pinned copy;
        the tokens (and logprobs) go back in one transfer, read by `.get()` (the only host sync).
        Logits stay in their dtype where the result cannot depend on it (argmax; the temperature op widens
        as it reads); everything else works on an fp32 copy. record = (last_tokens, slots [N] on the
        device): row i's token is also written to last_tokens[slots[i]] on the device (by the temperature
        op itself where it draws every row: no extra kernel). masks = (bitmask int32 [M, ceil(V / 32)] on
        the host, the row of each mask row): structured output; those rows sample only allowed tokens."""
        dev = logits.device
        lp_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if lp_rows:
            lp_index = None if len(lp_rows) == len(rows) else to_device(torch.tensor(lp_rows), dev)
            raw = log_softmax((logits if lp_index is None else logits[lp_index]).float())
        tokens = self.draw(self.process(logits, rows, masks), rows, record=record)
        if not lp_rows:
            return PendingSample(tokens, len(rows), HostCopy(tokens), [], [])
        ns = [rows[i].params.logprobs for i in lp_rows]
        k = min(max(ns), raw.shape[1])
        lp = _logprob_tensors(raw, tokens if lp_index is None else tokens[lp_index], k)
        return PendingSample(tokens, len(rows), HostCopy(tokens, *lp), lp_rows, ns)

    @staticmethod
    def process(logits: torch.Tensor, rows: list[SamplingRow],
                masks: tuple[torch.Tensor, list[int]] | None = None) -> torch.Tensor:
        """The logits each row samples from: logit_bias, penalties, bad words, min_tokens suppression and the
        structured-output mask applied (a copy; the input is returned as it is when nothing applies). fp32
        wherever the draw can depend on the dtype."""
        adjust = [i for i, r in enumerate(rows) if r.adjusts_logits()]
        if adjust or masks is not None or not _no_filters(rows, logits.shape[1]):
            logits = logits.float()
        if adjust or masks is not None:
            logits = logits.clone()
        if adjust:
            _apply_penalties(logits, rows, adjust)
        if masks is not None:
            _apply_bitmask(logits, *masks)
        return logits

    def draw(self, logits: torch.Tensor, rows: list[SamplingRow], uniforms: list[float] | None = None, *,
             record: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """One token per row from processed logits (`process`): greedy rows the argmax, the others
        temperature -> top-k -> top-p -> min-p -> the inverse CDF at the row's uniform. uniforms: one per
        row (speculative verify passes its own); None: each row's seeded uniform for its next token
        index, or the shared stream's next. record: as in `launch`."""
        greedy = [r.params.greedy for r in rows]
        if all(greedy):
            tokens = logits.argmax(dim=-1)
        else:
            tokens, recorded = self._sample(logits, rows, greedy, record, uniforms)
            if recorded:
                record = None
        if record is not None:
            record[0].index_copy_(0, record[1].long(), tokens)
        return tokens

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow], greedy: list[bool],
                record: tuple[torch.Tensor, torch.Tensor] | None,
                uniforms: list[float] | None = None) -> tuple[torch.Tensor, bool]:
        """(tokens, whether they were written to `record` already)."""
        V = logits.shape[1]
        params = [r.params for r in rows]
        top_k = [_top_k(p, V) for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        if uniforms is not None:
            u = [0.0 if g else x for g, x in zip(greedy, uniforms, strict=True)]
        else:
            u = [0.0 if g else self._shared.random() if r.seed is None else seeded_uniform(r.seed, r.num_generated)
                 for g, r in zip(greedy, rows)]
        # every per-row option in one host tensor, one copy: temperature, top_k, top_p, min_p, uniform, greedy
        opts = to_device(torch.tensor([[1.0 if g else p.temperature for g, p in zip(greedy, params)], top_k, top_p,
                                       min_p, u, greedy], dtype=torch.float64), logits.device)
        if _no_filters(rows, V):
            # float64 temperatures go in as they are (the op narrows them as it reads: no conversion kernel)
            if any(greedy):
                return torch.where(opts[5].bool(), logits.argmax(dim=-1), self.temperature_sample(
                    logits, opts[0], opts[4])), False
            return self.temperature_sample(logits, opts[0], opts[4], record=record), record is not None
        x = logits / opts[0].float()[:, None]
        if min(top_k) < V:
            kmax = max(k for k in top_k if k < V)
            kth = x.topk(kmax, dim=-1).values                 # [N, kmax], descending
            k = opts[1].long()
            kth = kth.gather(1, (k.clamp_max(kmax) - 1)[:, None])
            x = x.masked_fill((x < kth) & (k < V)[:, None], float("-inf"))
        # unnormalised probabilities: inverse_cdf and min_p do not need the sum, and torch's softmax runs a
        # row on one thread block (slow for a 248k-vocab row); amax and exp spread over the GPU
        probs = (x - x.amax(dim=-1, keepdim=True)).exp_()
        if min(top_p) < 1.0:
            probs = probs / probs.sum(dim=-1, keepdim=True)
            sorted_p, order = probs.sort(dim=-1, descending=True)
            mass_before = sorted_p.cumsum(dim=-1) - sorted_p
            drop = mass_before > opts[2].float()[:, None]
            drop[:, 0] = False
            probs = probs.scatter(1, order, sorted_p.masked_fill(drop, 0.0))
        if max(min_p) > 0:
            floor = opts[3].float()[:, None] * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < floor, 0.0)
        sampled = inverse_cdf(probs, opts[4])
        if any(greedy):
            sampled = torch.where(opts[5].bool(), logits.argmax(dim=-1), sampled)
        return sampled, False
