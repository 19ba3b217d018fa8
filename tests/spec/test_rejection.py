"""Rejection sampling of drafts: the rule against its formula, greedy, the coupled rule of one-hot drafts
equal to plain seeded sampling, and losslessness (chi-square on a tiny vocabulary, fixed seeds)."""

from __future__ import annotations

import random

import pytest
import torch

from deltaserve.runner.sampler import Sampler, SamplingRow
from deltaserve.sampling_params import SamplingParams
from deltaserve.spec.rejection import rejection_sample, spec_uniforms

# chi-square critical values at p = 0.001 by degrees of freedom (no scipy in the test environment)
CHI2_999 = {3: 16.27, 4: 18.47, 5: 20.52}


def chi2(tokens: torch.Tensor, p: torch.Tensor) -> float:
    n = tokens.numel()
    counts = torch.bincount(tokens, minlength=p.numel()).double()
    expected = p.double() / p.sum() * n
    return float(((counts - expected) ** 2 / expected).sum())


def _row_inputs(p, q, d, n, greedy=False):
    """One row: p [K+1, V], q [K, V] or None, drafts d [K]."""
    return (p[None], torch.tensor([d]), torch.tensor([n]), torch.tensor([greedy]),
            None if q is None else q[None])


def test_accepts_with_probability_min_one_p_over_q():
    p = torch.tensor([[0.1, 0.6, 0.3], [1 / 3, 1 / 3, 1 / 3]])
    q = torch.tensor([[0.4, 0.2, 0.4]])
    for d, ratio in ((0, 0.25), (1, 1.0), (2, 0.75)):
        tp, dt, nd, g, qq = _row_inputs(p, q, [d], 1)
        for u, accepted in ((ratio - 1e-6, 1), (min(ratio + 1e-6, 1 - 1e-9), int(ratio >= 1.0))):
            tokens, a = rejection_sample(tp, dt, nd, g, torch.tensor([[0.5, 0.5]], dtype=torch.float64),
                                         torch.tensor([[u]], dtype=torch.float64), qq)
            assert int(a) == accepted, (d, u)
            assert tokens[0, 0] == (d if accepted else tokens[0, 0])


def test_rejection_draws_from_the_normalised_residual():
    p = torch.tensor([[0.1, 0.6, 0.3, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.4, 0.2, 0.1, 0.3]])
    residual = (p[0] - q[0]).clamp_min(0)
    residual = residual / residual.sum()            # [0, 0.6667, 0.3333, 0]
    N = 3000
    # always reject (u_accept ~ 1 and draft 0 has p/q = 1/4); a uniform grid of sample uniforms
    u_s = torch.stack([(torch.arange(N, dtype=torch.float64) + 0.5) / N, torch.full((N,), 0.5,
                                                                                    dtype=torch.float64)], 1)
    tokens, a = rejection_sample(p.expand(N, 2, 4), torch.zeros(N, 1, dtype=torch.long),
                                 torch.ones(N, dtype=torch.long), torch.zeros(N, dtype=torch.bool), u_s,
                                 torch.full((N, 1), 0.999, dtype=torch.float64), q.expand(N, 1, 4))
    assert (a == 0).all() and (tokens[:, 1] == -1).all()
    freq = torch.bincount(tokens[:, 0], minlength=4).double() / N
    assert torch.allclose(freq, residual.double(), atol=1.5 / N)


def test_full_acceptance_emits_the_bonus_from_the_last_position():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    tokens, a = rejection_sample(p[None], torch.tensor([[1, 2]]), torch.tensor([2]), torch.tensor([False]),
                                 torch.full((1, 3), 0.3, dtype=torch.float64))
    assert tokens.tolist() == [[1, 2, 0]] and a.tolist() == [2]
    # one draft of two: the bonus comes from position 1, the padding draft is ignored
    tokens, a = rejection_sample(p[None], torch.tensor([[1, 0]]), torch.tensor([1]), torch.tensor([False]),
                                 torch.full((1, 3), 0.3, dtype=torch.float64))
    assert tokens.tolist() == [[1, 2, -1]] and a.tolist() == [1]
    # no drafts: a plain draw from position 0
    tokens, a = rejection_sample(p[None], torch.tensor([[1, 2]]), torch.tensor([0]), torch.tensor([False]),
                                 torch.full((1, 3), 0.3, dtype=torch.float64))
    assert tokens.tolist() == [[1, -1, -1]] and a.tolist() == [0]


@pytest.mark.parametrize("with_q", [False, True])
def test_greedy_rows_accept_while_the_draft_is_the_argmax(with_q):
    g = torch.Generator().manual_seed(0)
    p = torch.rand(1, 4, 7, generator=g)
    top = p.argmax(-1)[0].tolist()                  # [K+1]
    q = torch.softmax(torch.randn(1, 3, 7, generator=g), -1) if with_q else None
    u = torch.full((1, 4), 0.99, dtype=torch.float64)
    ua = torch.full((1, 3), 0.99, dtype=torch.float64)
    wrong = (top[1] + 1) % 7
    tokens, a = rejection_sample(p, torch.tensor([[top[0], wrong, top[2]]]), torch.tensor([3]),
                                 torch.tensor([True]), u, ua, q)
    assert a.tolist() == [1] and tokens.tolist() == [[top[0], top[1], -1, -1]]
    tokens, a = rejection_sample(p, torch.tensor([top[:3]]), torch.tensor([3]), torch.tensor([True]), u, ua, q)
    assert a.tolist() == [3] and tokens.tolist() == [top]
    # target_argmax overrides the argmax of the probabilities (ties broken as plain greedy breaks them)
    forced = torch.tensor([[5, 5, 5, 5]])
    tokens, a = rejection_sample(p, torch.tensor([[5, 5, 1]]), torch.tensor([3]), torch.tensor([True]), u, ua, q,
                                 target_argmax=forced)
    assert a.tolist() == [2] and tokens.tolist() == [[5, 5, 5, -1]]


def test_one_hot_drafts_emit_the_plain_seeded_draws():
    """With a deterministic drafter a seeded row emits exactly what plain decoding samples, whatever the
    drafts and the batch."""
    V, K, T = 50, 3, 0.8
    logits = torch.randn(K + 1, V, generator=torch.Generator().manual_seed(3)) * 3
    seed, n0 = 1234, 5
    prompt = [1, 2]
    sampler = Sampler(torch.device("cpu"), 0)
    plain = [sampler(logits[i:i + 1], [SamplingRow(SamplingParams(temperature=T, seed=seed), seed,
                                                   prompt + [0] * (n0 + i), len(prompt))]).token_ids[0]
             for i in range(K + 1)]
    x = logits / T
    p = (x - x.amax(-1, keepdim=True)).exp()
    for drafts in (plain[:K], [plain[0], (plain[1] + 1) % V, plain[2]], [(plain[0] + 7) % V] * K):
        u_s, _ = spec_uniforms([seed], [n0], K + 1, random.Random(0))
        tokens, a = rejection_sample(p[None], torch.tensor([drafts]), torch.tensor([K]), torch.tensor([False]),
                                     u_s)
        n = int(a) + 1
        assert tokens[0, :n].tolist() == plain[:n]
        assert n == next((i + 1 for i in range(K) if drafts[i] != plain[i]), K + 1)


def test_seeded_uniforms_depend_on_seed_and_index_only():
    a_s, a_a = spec_uniforms([7, None, 9], [3, 0, 4], 4, random.Random(0))
    b_s, b_a = spec_uniforms([9, 7], [4, 3], 4, random.Random(1))
    assert torch.equal(a_s[0], b_s[1]) and torch.equal(a_s[2], b_s[0]) and torch.equal(a_a[0], b_a[1])
    # the window one token later is the same stream shifted by one
    c_s, _ = spec_uniforms([7], [4], 4, random.Random(0))
    assert torch.equal(a_s[0, 1:], c_s[0, :3])
    assert not torch.equal(a_s[0, :3], a_a[0])              # acceptance uniforms are a separate stream


def _lossless_check(q_fn, V=5, K=3, N=20_000, seed=0):
    """N rows of K drafts over a fixed target; the emitted token at every reached position must be
    distributed as that position's target (the target here does not depend on the prefix)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(K + 1, V, generator=g) * 1.5, -1)
    q, drafts = q_fn(g, V, K, N, p)
    u_s, u_a = spec_uniforms(list(range(seed * N, seed * N + N)), [0] * N, K + 1, random.Random(seed))
    tokens, a = rejection_sample(p.expand(N, K + 1, V), drafts, torch.full((N,), K), torch.zeros(N, dtype=torch.bool),
                                 u_s, u_a, q)
    assert ((tokens >= 0).sum(1) == a + 1).all()
    for i in range(K + 1):
        reached = a >= i
        assert reached.sum() > 500, i
        stat = chi2(tokens[reached, i], p[i])
        assert stat < CHI2_999[V - 1], (i, stat)
    return a.double().mean().item()


def test_lossless_with_draft_probabilities():
    def q_fn(g, V, K, N, p):
        q = torch.softmax(torch.randn(K, V, generator=g), -1)
        drafts = torch.multinomial(q, N, replacement=True, generator=g).T        # [N, K]
        return q.expand(N, K, V), drafts
    mean_accepted = _lossless_check(q_fn)
    assert mean_accepted > 0.3                                  # the test exercises acceptances


def test_lossless_with_one_hot_drafts():
    def q_fn(g, V, K, N, p):
        # a deterministic drafter whose guess depends on the row (as n-gram's does): guesses that lean
        # towards the target, so later positions are reached often enough to test
        lean = 0.6 * p[:K] + 0.4 / V
        return None, torch.multinomial(lean, N, replacement=True, generator=g).T
    _lossless_check(q_fn, seed=1)


def test_chi2_detects_a_wrong_distribution():
    """The losslessness check has power: accepting every draft is caught."""
    g = torch.Generator().manual_seed(2)
    p = torch.softmax(torch.randn(5, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(5, generator=g), -1)
    drafts = torch.multinomial(q, 20_000, replacement=True, generator=g)
    assert chi2(drafts, p) > CHI2_999[4]
