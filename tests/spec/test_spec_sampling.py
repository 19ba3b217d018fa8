"""Sampling with drafts stays lossless and seeded requests reproducible: the verify path (spec/verify.py) draws
each position through the plain sampler's own processing (temperature, top-k, top-p, min-p, penalties over
the history plus the earlier drafts) and the coupled acceptance rule. Chi-square on a tiny vocabulary with
fixed seeds; on the embedded model a seeded request gives the same tokens alone, in another batch, with
and without drafts."""

from __future__ import annotations

import random

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.runner.sampler import Sampler, SamplingRow
from deltaserve.spec.rejection import accept_draws, rejection_sample
from deltaserve.spec.verify import launch_verify
from tests.spec.helpers import generate, mixed_prompts, spec_llm, tokens, use_oracle
from tests.spec.test_rejection import chi2

# chi-square critical values at p = 0.001 by degrees of freedom
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}
V = 8


def _filtered(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The target distribution written out: temperature, top-k, top-p, min-p (the sampler's documented order)."""
    x = logits.double() / p.temperature
    if 0 < p.top_k < V:
        x = torch.where(x >= x.topk(p.top_k).values[-1], x, torch.tensor(float("-inf"), dtype=x.dtype))
    probs = torch.softmax(x, -1)
    order = probs.argsort(descending=True)
    mass_before = probs[order].cumsum(0) - probs[order]
    keep = torch.zeros(V, dtype=torch.bool)
    keep[order[mass_before <= p.top_p]] = True
    probs = torch.where(keep, probs, 0.0)
    probs = torch.where(probs >= p.min_p * probs.max(), probs, 0.0)
    return probs / probs.sum()


def _check(tokens: torch.Tensor, p: torch.Tensor) -> None:
    support = p > 0
    assert bool((tokens[..., None] == torch.nonzero(~support)[:, 0]).sum() == 0), "drew a filtered-out token"
    stat = chi2(torch.searchsorted(torch.nonzero(support)[:, 0], tokens), p[support])
    assert stat < CHI2_999[int(support.sum()) - 1], stat


@pytest.mark.parametrize("penalty", [False, True])
def test_verify_draws_are_the_target_distribution(penalty):
    """20,000 rows, one draft each: the first emitted token follows position 0's processed distribution and,
    where the draft was accepted, the second follows position 1's, processed over history + the draft."""
    g = torch.Generator().manual_seed(0)
    l0, l1 = torch.randn(V, generator=g) * 1.5, torch.randn(V, generator=g) * 1.5
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.92, min_p=0.05, max_tokens=10,
                            repetition_penalty=1.7 if penalty else 1.0)
    # the draft is likely at position 0 and the favourite at position 1, where its penalty (history + the
    # draft) then moves the distribution
    draft = int(l1.argmax())
    l0[draft] = l0.max() + 0.5
    n = 20_000
    sampler = Sampler(torch.device("cpu"), seed=0)
    rows = [SamplingRow(params, None, [1, 2, 3], 3) for _ in range(n)]
    logits = torch.stack([l0, l1]).repeat(n, 1)
    pending = launch_verify(sampler, logits, rows, [[draft]] * n)
    emitted, accepted, _ = pending.get()
    first = torch.tensor([e[0] for e in emitted])
    hist = {1, 2, 3}
    p0 = _filtered(_penalised(l0, hist, params.repetition_penalty), params)
    _check(first, p0)
    second = torch.tensor([e[1] for e, a in zip(emitted, accepted) if a == 1])
    assert second.numel() > 2000
    p1 = _filtered(_penalised(l1, hist | {draft}, params.repetition_penalty), params)
    _check(second, p1)


def _penalised(logits: torch.Tensor, seen: set[int], penalty: float) -> torch.Tensor:
    x = logits.clone()
    for t in seen:
        x[t] = x[t] / penalty if x[t] > 0 else x[t] * penalty
    return x


def test_accept_draws_is_the_one_hot_rejection_rule():
    g = torch.Generator().manual_seed(3)
    B, K = 64, 3
    probs = torch.rand(B, K + 1, V, generator=g)
    drafts = torch.randint(0, V, (B, K), generator=g)
    num_drafts = torch.randint(0, K + 1, (B,), generator=g)
    greedy = torch.rand(B, generator=g) < 0.3
    u = torch.rand(B, K + 1, generator=g, dtype=torch.float64)
    want = rejection_sample(probs, drafts, num_drafts, greedy, u)
    from deltaserve.ops.sampling.reference import inverse_cdf

    x = inverse_cdf(probs.reshape(-1, V), u.reshape(-1)).view(B, K + 1)
    x = torch.where(greedy[:, None], probs.argmax(-1), x)
    got = accept_draws(x, drafts, num_drafts)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.fixture(scope="module")
def plain():
    return LLM(device="cpu", enable_prefix_caching=False)


def test_seeded_requests_reproducible_across_batches_with_drafts(plain):
    prompts = mixed_prompts(4, seed=91)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    others = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, seed=s)
              for n, s in ((9, None), (30, 7), (14, None))]
    ref = generate(plain, prompts[:1], seeded)
    # the oracle drafts the tokens the plain seeded run drew: most are accepted, some replaced
    llm = spec_llm(3)
    use_oracle(llm, prompts[:1], ref, reject_prob=0.2, seed=random.Random(5).randrange(100))
    alone = tokens(generate(llm, prompts[:1], seeded))
    mixed = tokens(generate(llm, prompts, [seeded, *others]))[0]
    mixed_again = tokens(generate(llm, prompts[::-1], [*others[::-1], seeded]))[-1]
    assert alone == tokens(ref) and [mixed] == alone and [mixed_again] == alone
    assert llm.engine.get_stats().spec_num_accepted_tokens_total > 10
