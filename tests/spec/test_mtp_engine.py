"""MTP speculative decoding through the engine on the embedded model (fp32, CPU): the output never changes
(greedy with MTP drafts == greedy without, token for token; seeded sampling likewise), the head's drafts
are accepted (stats), and the drafts the engine proposes are the MTP head's over the whole committed
sequence (spec/mtp.py; the oracle of tests/spec/test_mtp.py) wherever the head's K/V can be exact: after
a prompt split into chunks (prefix caching always splits off its last token), in a batch."""

from __future__ import annotations

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.batch import CacheBuffers
from deltaserve.config import ConfigError
from tests.spec.helpers import generate, greedy, mixed_prompts, pin_k, tokens
from tests.spec.test_mtp import _prefill, oracle_drafts, target_hidden

MTP = {"method": "mtp", "num_speculative_tokens": 4}


def mtp_llm(k: int = 4, **kw) -> LLM:
    llm = LLM(device="cpu", speculative_config={**MTP, "num_speculative_tokens": k}, **kw)
    pin_k(llm, k)
    return llm


class Recorder:
    """Wraps the engine's drafter: every proposal (the sequence's known tokens, its drafts) is kept."""

    def __init__(self, llm: LLM):
        self.speculation = llm.engine.runner.speculation
        self.inner = self.speculation.drafter
        self.name, self.uses_hidden = self.inner.name, self.inner.uses_hidden
        self.log: list[tuple[list[int], list[int]]] = []
        self.kv: list[tuple[list[int], torch.Tensor]] = []   # (known tokens, the head's K/V at positions 0..t)
        self.capacity: list[tuple[int, int]] = []            # (emitted token's position, positions its blocks hold)
        self.speculation.drafter = self

    def propose(self, ctx) -> torch.Tensor:
        out = self.inner.propose(ctx)
        if ctx.k <= 0:
            return out
        pool = ctx.cache.mtp_kv(self.inner.model.config, 0)            # [2, B, BS, NKV, HD]
        for i, (known, row) in enumerate(zip(ctx.token_ids, out.tolist(), strict=True)):
            self.log.append((list(known), row))
            t = len(known) - 1                                          # the emitted token's position
            table = ctx.batch.block_tables[ctx.batch_index[i]].long()
            bs = pool.shape[2]
            slots = torch.arange(t)
            self.kv.append((list(known), pool[:, table[slots // bs], slots % bs].clone()))
            if ctx.kv_capacity is not None:
                self.capacity.append((t, int(ctx.kv_capacity[i])))
        return out

    def release(self, seq_ids):
        self.inner.release(seq_ids)

    def restore(self) -> None:
        self.speculation.drafter = self.inner


@pytest.fixture(scope="module")
def plain():
    return LLM(device="cpu", enable_prefix_caching=False)


@pytest.fixture(scope="module")
def spec():
    return mtp_llm(4)


def test_drafts_after_a_chunked_prompt_are_the_heads_over_the_whole_sequence():
    """The prompt's chunks end inside the prompt (a small step budget, and prefix caching splitting off the
    last prompt token): the head's K/V at each chunk's last position takes the prompt token after it, so the
    first drafts after the prompt equal the head run over the whole sequence at once."""
    llm = mtp_llm(3, max_num_batched_tokens=16, enable_prefix_caching=True)
    rec = Recorder(llm)
    prompts = [p[:40] for p in mixed_prompts(3, seed=5, lo=20, hi=40)]
    for p in prompts:                             # one at a time: each prompt's chunks are steps of their own
        generate(llm, [p], greedy(2))
    rec.restore()
    firsts = [(toks, row) for toks, row in rec.log if any(toks[:-1] == p for p in prompts)]
    assert len(firsts) == len(prompts)
    for toks, row in firsts:
        assert row == oracle_drafts(llm.model, toks, 3), len(toks)
    for toks, kv in rec.kv:
        if any(toks[:-1] == p for p in prompts):
            want = oracle_kv(llm.model, toks)
            bad = [t for t in range(len(toks) - 1) if not torch.allclose(kv[:, t], want[:, t], atol=1e-4, rtol=1e-4)]
            assert not bad, f"the head's K/V differs at positions {bad} of {len(toks) - 1}"


@torch.inference_mode()
def oracle_kv(model, committed: list[int]) -> torch.Tensor:
    """The MTP head's K/V [2, t, NKV, HD] at positions 0..t-1 (t + 1 = len(committed)), written by one pass of
    the head over the whole sequence (contiguous cache)."""
    n = len(committed) - 1
    hidden = target_hidden(model, committed[:-1])
    cache = CacheBuffers.allocate(model.config, num_slots=1, num_blocks=-(-n // 16), block_size=16, device="cpu",
                                  dtype=torch.float32, num_attention_layers=1)
    model.mtp(model.embed_tokens[torch.tensor(committed[1:])], hidden, _prefill(n), cache.kv[0], model.rope)
    kv = cache.kv[0]                                                    # [2, B, 16, NKV, HD]
    return kv.reshape(2, -1, *kv.shape[3:])[:, :n]


def test_mtp_is_refused_with_an_fp8_kv_cache_and_tensor_parallelism():
    with pytest.raises(ConfigError, match="method 'mtp' with kv_cache_dtype='fp8'"):
        LLM(device="cpu", kv_cache_dtype="fp8", speculative_config=MTP)
    with pytest.raises(ConfigError, match="tensor_parallel_size > 1"):
        LLM(device="cpu", tensor_parallel_size=2, speculative_config=MTP)


def test_seeded_sampling_is_unchanged(plain, spec):
    prompts = mixed_prompts(3, seed=7)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, ignore_eos=True, seed=123)
    want = tokens(generate(plain, prompts, params))
    assert tokens(generate(spec, prompts, params)) == want


TEXTS = [
    "The committee reviewed the proposal in detail. The committee noted that the proposal, as written, would",
    "Once upon a time there was a little fox who lived in a forest. Every morning the little fox went to the",
    "Alice said hello to Bob. Bob said hello to Carol. Carol said hello to",
    "To install the package, run pip install. To upgrade the package, run",
    "Monday: wake up, run, work, cook, read. Tuesday: wake up, run, work,",
    "The weather today is",
]


def english(llm: LLM, n: int = len(TEXTS)) -> list[list[int]]:
    return [llm.tokenizer.encode(t) for t in TEXTS[:n]]


def _max_tokens(i: int) -> int:
    return (23, 6, 31, 1, 14, 9)[i % 6]


def test_greedy_matches_plain_for_k_1_to_4(plain, spec):
    """A batch of English and random prompts of mixed lengths and max_tokens, K pinned to 1..4; the head's
    drafts are accepted (several tokens per verify step)."""
    prompts = english(plain, 4) + mixed_prompts(2, seed=3)
    params = [greedy(_max_tokens(i)) for i in range(len(prompts))]
    want = tokens(generate(plain, prompts, params))
    for k in (1, 2, 3, 4):
        pin_k(spec, k)
        before = spec.engine.get_stats()
        assert tokens(generate(spec, prompts, params)) == want, k
        after = spec.engine.get_stats()
        drafts = after.spec_num_drafts_total - before.spec_num_drafts_total
        accepted = after.spec_num_accepted_tokens_total - before.spec_num_accepted_tokens_total
        assert drafts > 0 and 1 + accepted / drafts > 1.2, (k, drafts, accepted)   # mean accepted length
    pin_k(spec, 4)


def test_chunked_prefill_preemption_and_n2(plain, caplog):
    """Prompts in chunks beside speculating sequences, a pool small enough to preempt, n = 2; every step with
    rows showed them to the drafter."""
    prompts = english(plain) + mixed_prompts(2, seed=13, lo=30, hi=60)
    params = greedy(24, n=2)
    want = tokens(generate(plain, prompts, params))
    llm = mtp_llm(3, max_num_batched_tokens=48, num_gpu_blocks=12, enable_prefix_caching=True)
    assert tokens(generate(llm, prompts, params)) == want
    stats = llm.engine.get_stats()
    assert stats.num_preempted_total > 0 and stats.spec_num_accepted_tokens_total > 0
    assert "without exposing its hidden states" not in caplog.text


def test_stop_strings_and_max_tokens_inside_an_accepted_run(plain, spec):
    prompt = TEXTS[1]
    full = plain.generate([prompt], greedy(40), use_tqdm=False)[0].outputs[0]
    for stop in (full.text[10:13], full.text[len(full.text) // 2 : len(full.text) // 2 + 4]):
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])
        want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        got = spec.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == \
            (want.text, want.token_ids, want.finish_reason, want.stop_reason)
    for m in (2, 3, 7):
        assert spec.generate([prompt], greedy(m), use_tqdm=False)[0].outputs[0].token_ids == full.token_ids[:m]


def test_prefix_cache_hits_before_and_after_speculation(plain):
    """Hits on what a speculating request left (the same prompt again; the next turn of the conversation;
    a prompt that branches off a cached one) give the plain output: after a hit of length L the head's K/V
    at L - 1 may be another branch's (drafts only)."""
    prompts = english(plain, 3)
    params = greedy(20)
    ref = generate(plain, prompts, params)
    llm = mtp_llm(3, enable_prefix_caching=True)
    assert tokens(generate(llm, prompts, params)) == tokens(ref)
    again = generate(llm, prompts, params)
    assert tokens(again) == tokens(ref) and all(o.num_cached_tokens > 0 for o in again)
    turns = [p + o.outputs[0].token_ids + [11, 12, 13] for p, o in zip(prompts, ref)]
    branches = [p[: len(p) * 2 // 3] + [7, 8, 9, 10] for p in prompts]
    for batch in (turns, branches, turns):
        want = generate(plain, batch, params)
        got = generate(llm, batch, params)
        assert tokens(got) == tokens(want)
    assert llm.engine.get_stats().prefix_cache_hits_total > 0


def test_async_scheduling_and_logprobs(plain):
    prompts = english(plain, 3)
    params = greedy(16, logprobs=2)
    ref = generate(plain, prompts, params)
    llm = mtp_llm(3, async_scheduling=True)
    got = generate(llm, prompts, params)
    assert tokens(got) == tokens(ref)
    for a, b in zip(got, ref):
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys() and all(abs(la[t].logprob - lb[t].logprob) < 1e-4 for t in la)
    assert llm.engine.get_stats().spec_num_accepted_tokens_total > 0


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_every_draft_is_the_heads_over_the_committed_sequence(prefix_caching):
    """Greedy decoding with K = 3 drafts over many verify steps (acceptances of every length; draft rows
    crossing block ends, which the scheduler's lookahead blocks hold): each proposal equals the head run
    over the whole committed sequence, and the head's K/V at every committed position is that run's."""
    llm = mtp_llm(3, block_size=4, enable_prefix_caching=prefix_caching)
    rec = Recorder(llm)
    prompt = llm.tokenizer.encode(TEXTS[0])
    generate(llm, [prompt], greedy(40))
    rec.restore()
    ends = [len(toks) - 1 for toks, _ in rec.log]
    assert len(rec.log) >= 12 and any(t % 4 >= 2 for t in ends), ends      # draft rows past a block end
    # the draft rows (positions t .. t + 1 after the last accepted one, t - 1) all lie in the sequence's blocks
    assert len(rec.capacity) == len(rec.log)
    assert all(cap >= min(t + 2, len(prompt) + 40) for t, cap in rec.capacity), rec.capacity
    for (toks, row), (_, kv) in zip(rec.log, rec.kv, strict=True):
        assert row == oracle_drafts(llm.model, toks, 3), len(toks)
        want = oracle_kv(llm.model, toks)
        assert torch.allclose(kv, want, atol=1e-4, rtol=1e-4), len(toks)
    stats = llm.engine.get_stats()
    assert stats.spec_num_accepted_tokens_total > stats.spec_num_drafts_total / 2


def test_the_context_limit_cuts_inside_an_accepted_run(plain):
    """Lookahead blocks stop at the tokens a sequence may hold; the last steps' draft rows store nothing."""
    prompt = english(plain, 2)[1]
    ref = generate(plain, [prompt], greedy(64 - len(prompt)))
    llm = mtp_llm(4, max_model_len=64, block_size=4)
    out = generate(llm, [prompt], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=None))[0].outputs[0]
    assert out.token_ids == ref[0].outputs[0].token_ids and len(out.token_ids) == 64 - len(prompt)
    assert out.finish_reason == "length" and llm.engine.get_stats().spec_num_accepted_tokens_total > 0
