"""Temperature sampling (Triton, two launches) against the plain-torch reference: the same token for the
same uniform, across vocabulary sizes that end mid-block and mid-chunk, temperatures, peaky and flat
rows, and rows whose whole first chunks are suppressed (-inf)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops.sampling import reference as ref
from deltaserve.ops.sampling import triton as tri

from .helpers import gen


@pytest.mark.parametrize("V", [1000, 4097, 2 * 2048 + 130])
def test_same_tokens_as_the_reference(V, device):
    g = gen(V)
    N = 12
    logits = torch.randn(N, V, generator=g) * torch.linspace(0.5, 8.0, N)[:, None]   # flat to peaky rows
    logits[3, : min(V - 1, 2048 + 7)] = float("-inf")          # whole chunks with no mass
    logits[4, 1:] = float("-inf")                              # one token left
    temp = torch.linspace(0.3, 1.7, N, dtype=torch.float32)
    u = torch.rand(N, generator=g, dtype=torch.float64)
    u[0], u[1] = 0.0, 1.0 - 2.0 ** -40
    logits, temp, u = logits.to(device), temp.to(device), u.to(device)
    want = ref.temperature_sample(logits, temp, u)
    got = tri.temperature_sample(logits, temp, u)
    assert got.dtype == torch.long and got.tolist() == want.tolist()
    assert got[4].item() == 0 and got[3].item() >= min(V - 1, 2048 + 7)
    bf = logits.to(torch.bfloat16)                              # the logits dtype the model may give
    assert tri.temperature_sample(bf, temp, u).tolist() == ref.temperature_sample(bf, temp, u).tolist()


def test_many_draws_follow_the_distribution(device):
    """Over 400 uniforms spread evenly on [0, 1) a 4-token distribution comes out in its proportions."""
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = p.log().repeat(400, 1).to(device)
    u = ((torch.arange(400, dtype=torch.float64) + 0.5) / 400).to(device)
    tokens = tri.temperature_sample(logits, torch.ones(400, dtype=torch.float32, device=device), u)
    counts = torch.bincount(tokens.cpu(), minlength=4).tolist()
    assert counts == [40, 80, 120, 160]


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_record_writes_the_tokens_by_slot_and_float64_temperature(slot_dtype, device):
    """record = (last_tokens, slots): the tokens also land in last_tokens[slots] (nothing else changes);
    a float64 temperature (the sampler's option tensor, no conversion kernel) draws as its float32 value."""
    g = gen(5)
    logits = (torch.randn(3, 3000, generator=g) * 4).to(device)
    temp = torch.tensor([0.7, 1.0, 1.3], dtype=torch.float64, device=device)
    u = torch.rand(3, generator=g, dtype=torch.float64).to(device)
    slots = torch.tensor([5, 0, 2], dtype=slot_dtype, device=device)
    for impl in (ref, tri):
        last = torch.full((8,), -7, dtype=torch.long, device=device)
        got = impl.temperature_sample(logits, temp, u, record=(last, slots))
        assert got.tolist() == ref.temperature_sample(logits, temp.float(), u).tolist()
        want = [-7] * 8
        for s_, t in zip(slots.tolist(), got.tolist()):
            want[s_] = t
        assert last.tolist() == want


def test_bad_inputs_raise(device):
    x = torch.zeros(2, 10, device=device)
    t, u = torch.ones(2, device=device), torch.zeros(2, dtype=torch.float64, device=device)
    with pytest.raises(ValueError, match="temperature and u"):
        tri.temperature_sample(x, t[:1], u)
    with pytest.raises(ValueError, match="float32"):
        tri.temperature_sample(x, t.half(), u)
    with pytest.raises(ValueError, match="record"):
        tri.temperature_sample(x, t, u, record=(torch.zeros(4, dtype=torch.int32, device=device),
                                                torch.zeros(2, dtype=torch.long, device=device)))
    assert tri.temperature_sample(x[:0], t[:0], u[:0]).shape == (0,)


def test_sampler_with_the_op_gives_the_reference_tokens(device):
    """A Sampler drawing through the Triton op picks what the default (reference) Sampler picks for a plain
    temperature batch with greedy, seeded and unseeded rows; a top-p row sends the batch down the general
    path, which does not use the op."""
    from deltaserve.runner.sampler import Sampler, SamplingRow
    from deltaserve.sampling_params import SamplingParams

    x = (torch.randn(6, 3000, generator=gen(7)) * 4).to(device)
    rows = [SamplingRow(SamplingParams(**kw), seed, [1, 2, 3], 3) for seed, kw in
            [(None, dict(temperature=0)), (3, dict(temperature=0.8)), (None, dict(temperature=1.0)),
             (5, dict(temperature=1.3)), (None, dict(temperature=0.6)), (9, dict(temperature=1.0))]]
    calls = []

    def op(*a):
        calls.append(1)
        return tri.temperature_sample(*a)

    want = Sampler(device, 11)(x, rows).token_ids
    assert Sampler(device, 11, temperature_sample=op)(x, rows).token_ids == want and calls == [1]
    assert want[0] == int(x[0].argmax())
    rows[2] = SamplingRow(SamplingParams(temperature=1.0, top_p=0.9), None, [1, 2, 3], 3)
    Sampler(device, 11, temperature_sample=op)(x, rows)
    assert calls == [1]
