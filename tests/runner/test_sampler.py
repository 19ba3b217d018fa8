"""The sampler on hand-made logits: greedy, the sampled distribution and its filters, seeds that ignore the
rest of the batch, penalties, min_tokens, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from deltaserve.runner.sampler import Sampler, SamplingRow, inverse_cdf, seeded_uniform
from deltaserve.sampling_params import SamplingParams

V = 12


def row(prompt=(1, 2), out=(), seed=None, stop=(), **kw) -> SamplingRow:
    return SamplingRow(SamplingParams(**kw), seed, list(prompt) + list(out), len(prompt), frozenset(stop))


def logits(n=1, seed=0, v=V):
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * 2


def frequencies(tokens, v=V):
    return torch.bincount(torch.tensor(tokens), minlength=v).double() / len(tokens)


def test_greedy_is_argmax():
    x = logits(5)
    out = Sampler(torch.device("cpu"), 0)(x, [row(temperature=0) for _ in range(5)])
    assert out.token_ids == x.argmax(-1).tolist() and out.logprobs == [None] * 5


@pytest.mark.parametrize("kw, allowed", [
    (dict(temperature=0.7), None),
    (dict(temperature=1.3, top_k=3), "top_k"),
    (dict(temperature=1.0, top_p=0.6), "top_p"),
    (dict(temperature=1.0, min_p=0.2), "min_p"),
])
def test_sampled_distribution_matches_the_filtered_softmax(kw, allowed):
    n = 6000
    x = logits(1, seed=3).expand(n, V).contiguous()
    tokens = Sampler(torch.device("cpu"), 1)(x, [row(**kw) for _ in range(n)]).token_ids
    p = torch.softmax(x[0].double() / kw["temperature"], -1)
    if allowed == "top_k":
        keep = p >= p.topk(kw["top_k"]).values[-1]
    elif allowed == "top_p":
        sp, order = p.sort(descending=True)
        keep = torch.zeros(V, dtype=torch.bool)
        keep[order[(sp.cumsum(0) - sp) <= kw["top_p"]]] = True
    elif allowed == "min_p":
        keep = p >= kw["min_p"] * p.max()
    else:
        keep = torch.ones(V, dtype=torch.bool)
    want = torch.where(keep, p, 0.0)
    want /= want.sum()
    got = frequencies(tokens)
    assert got[~keep].sum() == 0, "a filtered-out token was sampled"
    # 6000 draws: every frequency within 4.5 standard errors of its probability
    se = (want * (1 - want) / n).sqrt().clamp_min(1e-9)
    assert ((got - want).abs() <= 4.5 * se + 1e-9).all(), (got, want)


def test_seeded_rows_ignore_the_rest_of_the_batch():
    x = logits(6, seed=4)
    mine = [row(seed=42, temperature=0.9, top_p=0.9, out=(3,) * k) for k in range(3)]
    alone = [Sampler(torch.device("cpu"), s)(x[i : i + 1], [mine[i]]).token_ids[0] for i, s in enumerate((0, 1, 2))]
    others = [row(temperature=1.0), row(temperature=0), row(seed=7, temperature=2.0, top_k=4)]
    together = Sampler(torch.device("cpu"), 99)(x[[3, 0, 4, 1, 5, 2]], [others[0], mine[0], others[1], mine[1],
                                                                         others[2], mine[2]]).token_ids
    assert [together[1], together[3], together[5]] == alone


def test_seeded_draws_depend_on_seed_and_position_only():
    x = logits(1, seed=5, v=1000) * 0   # uniform: the draw alone decides
    s = Sampler(torch.device("cpu"), 0)
    take = lambda seed, k: s(x, [row(seed=seed, out=(1,) * k)]).token_ids[0]  # noqa: E731
    assert take(3, 0) == take(3, 0) and take(3, 5) == take(3, 5)
    assert len({take(3, k) for k in range(8)}) > 4          # a new draw per position
    assert len({take(seed, 0) for seed in range(8)}) > 4    # and per seed
    assert seeded_uniform(1, 2) != seeded_uniform(2, 1)
    assert all(0 <= seeded_uniform(s, k) < 1 for s in (0, 2**62, 2**70) for k in (0, 2**40))


def test_inverse_cdf_picks_the_token_holding_u_and_never_a_zero_one():
    V = 1000                                          # not a multiple of the 128-token block
    probs = torch.zeros(4, V)
    probs[:, [3, 130, 999]] = torch.tensor([0.25, 0.5, 0.25])
    u = torch.tensor([0.0, 0.2499, 0.25, 1 - 2**-53], dtype=torch.float64)
    assert inverse_cdf(probs, u).tolist() == [3, 3, 130, 999]
    # unnormalised rows, mass in one block only, many zero neighbours
    probs = torch.zeros(3, V)
    probs[0, 500] = 7.0
    probs[1, 0], probs[1, 127] = 1e-30, 1.0
    probs[2] = torch.rand(V, generator=torch.Generator().manual_seed(0)) * (torch.arange(V) % 3 == 0)
    for trial in range(50):
        u = torch.rand(3, generator=torch.Generator().manual_seed(trial), dtype=torch.float64)
        tok = inverse_cdf(probs, u)
        assert tok[0] == 500 and tok[1] in (0, 127) and probs[2, tok[2]] > 0


def test_unseeded_rows_follow_the_engine_seed():
    x = logits(4, seed=6)
    rows = [row(temperature=1.0) for _ in range(4)]
    a = Sampler(torch.device("cpu"), 123)(x, rows).token_ids
    assert a == Sampler(torch.device("cpu"), 123)(x, rows).token_ids


def test_repetition_presence_frequency_penalties():
    x = torch.zeros(1, V)
    x[0, 5], x[0, 6], x[0, 7] = 2.0, 1.9, -1.0
    s = Sampler(torch.device("cpu"), 0)
    assert s(x, [row(temperature=0)]).token_ids == [5]
    assert s(x, [row(prompt=(5,), temperature=0, repetition_penalty=1.2)]).token_ids == [6]   # 2.0/1.2 < 1.9
    assert s(x, [row(out=(5,), temperature=0, presence_penalty=0.2)]).token_ids == [6]
    assert s(x, [row(out=(5,), temperature=0, frequency_penalty=0.05)]).token_ids == [5]       # 1.95 > 1.9
    assert s(x, [row(out=(5, 5, 5), temperature=0, frequency_penalty=0.05)]).token_ids == [6]  # 1.85
    # a negative logit is pushed further down by the repetition penalty, not up
    y = torch.full((1, V), -5.0)
    y[0, 7] = -1.0
    y[0, 8] = -1.1
    assert s(y, [row(prompt=(7,), temperature=0, repetition_penalty=1.2)]).token_ids == [8]


def test_min_tokens_suppresses_stop_tokens_until_reached():
    x = torch.zeros(1, V)
    x[0, 3] = 5.0
    s = Sampler(torch.device("cpu"), 0)
    assert s(x, [row(temperature=0, min_tokens=2, stop=(3,), out=(1,))]).token_ids != [3]
    assert s(x, [row(temperature=0, min_tokens=2, stop=(3,), out=(1, 1))]).token_ids == [3]
    assert s(x, [row(temperature=1.0, seed=1, min_tokens=1, stop=(3,))]).token_ids != [3]


def test_logprobs_are_raw_with_rank_and_top_n():
    x = logits(3, seed=8)
    rows = [row(temperature=0, logprobs=3), row(temperature=1.0, seed=2, logprobs=0, repetition_penalty=1.5),
            row(temperature=0)]
    out = Sampler(torch.device("cpu"), 0)(x, rows)
    raw = torch.log_softmax(x, -1)
    for i in (0, 1):
        tok = out.token_ids[i]
        entry = out.logprobs[i]
        assert math.isclose(entry[tok].logprob, raw[i, tok].item(), rel_tol=1e-6)
        assert entry[tok].rank == int((raw[i] > raw[i, tok]).sum()) + 1
    top = raw[0].topk(3)
    assert set(out.logprobs[0]) == set(top.indices.tolist())   # greedy: the chosen token is the top one
    assert [out.logprobs[0][t].rank for t in top.indices.tolist()] == [1, 2, 3]
    assert len(out.logprobs[1]) == 1 and out.logprobs[2] is None


def test_mixed_filters_in_one_batch_equal_each_row_alone():
    x = logits(5, seed=9)
    rows = [row(seed=i, temperature=t, top_k=k, top_p=p, min_p=m)
            for i, (t, k, p, m) in enumerate([(0.5, 0, 1.0, 0.0), (1.0, 2, 1.0, 0.0), (1.0, 0, 0.5, 0.0),
                                               (2.0, 5, 0.9, 0.1), (0, 3, 0.5, 0.0)])]
    together = Sampler(torch.device("cpu"), 0)(x, rows).token_ids
    alone = [Sampler(torch.device("cpu"), 0)(x[i : i + 1], [r]).token_ids[0] for i, r in enumerate(rows)]
    assert together == alone


@pytest.mark.parametrize("kws", [
    [dict(temperature=0)] * 3,                                              # greedy: argmax in bf16
    [dict(temperature=0.8), dict(temperature=1.5), dict(temperature=0)],   # the temperature op, one greedy row
    [dict(temperature=1.0, top_k=4), dict(temperature=0.7)],               # a filter: the fp32 path
    [dict(temperature=0.9, logprobs=2), dict(temperature=0.9)],            # logprobs: the fp32 path
])
def test_bf16_logits_sample_as_their_fp32_widening(kws):
    """The runner hands over logits in the activation dtype; the sampler's tokens and logprobs equal those of
    the same logits widened to fp32 (seeded rows, so the draws are comparable)."""
    x = logits(len(kws), seed=21, v=300).bfloat16()
    rows = lambda: [row(seed=7 + i, **kw) for i, kw in enumerate(kws)]          # noqa: E731
    got = Sampler(torch.device("cpu"), 0)(x, rows())
    want = Sampler(torch.device("cpu"), 0)(x.float(), rows())
    assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
