"""Speculative decoding through the engine on the embedded model (fp32, CPU): the output never changes.
Greedy with drafts == greedy without, token for token, for K = 1..4, with n-gram drafts and with an oracle
drafter that proposes the tokens the target will produce (recorded from a plain run) with some wrong ones,
so acceptance is high and rollback runs often; with chunked prefill, preemption, stops inside an accepted
run, n > 1, abort, async scheduling and prefix-cache hits before and after speculation."""

from __future__ import annotations

import pytest

from deltaserve import LLM, SamplingParams
from tests.spec.helpers import generate, greedy, mixed_prompts, pin_k, spec_llm, tokens, use_oracle


@pytest.fixture(scope="module")
def plain():
    return LLM(device="cpu", enable_prefix_caching=False)


@pytest.fixture(scope="module")
def spec():
    return spec_llm(4)


def _max_tokens(i: int) -> int:
    return (5, 17, 9, 30, 1, 12)[i % 6]


def test_ngram_greedy_matches_plain_for_k_1_to_4(plain, spec):
    prompts = mixed_prompts(6, seed=1)
    want = [tokens(generate(plain, [p], greedy(_max_tokens(i)))) for i, p in enumerate(prompts)]
    for k in (1, 2, 3, 4):
        pin_k(spec, k)
        before = spec.engine.get_stats()
        got = [tokens(generate(spec, [p], greedy(_max_tokens(i)))) for i, p in enumerate(prompts)]
        assert got == want, k
        after = spec.engine.get_stats()
        assert after.spec_num_draft_tokens_total > before.spec_num_draft_tokens_total
    pin_k(spec, 4)


def test_ngram_batch_of_mixed_lengths_matches_plain(plain, spec):
    prompts = mixed_prompts(6, seed=2)
    params = [greedy(_max_tokens(i)) for i in range(len(prompts))]
    want = tokens(generate(plain, prompts, params))
    before = spec.engine.get_stats().spec_num_accepted_tokens_total
    assert tokens(generate(spec, prompts, params)) == want
    assert spec.engine.get_stats().spec_num_accepted_tokens_total > before   # repeats were drafted and accepted


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_oracle_drafts_with_rejections_match_plain(plain, spec, k):
    prompts = mixed_prompts(5, seed=10 + k)
    params = [greedy(m) for m in (24, 7, 31, 16, 3)]
    ref = generate(plain, prompts, params)
    pin_k(spec, k)
    use_oracle(spec, prompts, ref, reject_prob=0.25, seed=k)
    before = spec.engine.get_stats()
    try:
        assert tokens(generate(spec, prompts, params)) == tokens(ref)
    finally:
        spec.engine.runner.speculation.drafter = _ngram(spec)
        pin_k(spec, 4)
    after = spec.engine.get_stats()
    drafted = after.spec_num_draft_tokens_total - before.spec_num_draft_tokens_total
    accepted = after.spec_num_accepted_tokens_total - before.spec_num_accepted_tokens_total
    assert drafted > 0 and 0.4 * drafted < accepted < drafted    # mostly accepted, some rolled back
    # fewer steps than tokens: several tokens per step
    assert after.num_steps_total - before.num_steps_total < sum(len(t) for t in tokens(ref))


def _ngram(llm):
    from deltaserve.spec.drafter import make_drafter

    return make_drafter(llm.engine.config.speculative_config, llm.model, llm.engine.runner.cache, "cpu")


def _oracle_engine(plain, prompts, params, reject_prob=0.2, k=3, **kw):
    ref = generate(plain, prompts, params)
    llm = spec_llm(k, **kw)
    use_oracle(llm, prompts, ref, reject_prob=reject_prob)
    return llm, ref


def test_chunked_prefill_and_speculating_sequences_in_one_step(plain):
    prompts = mixed_prompts(5, seed=21, lo=30, hi=90)
    params = [greedy(m) for m in (20, 11, 25, 6, 14)]
    llm, ref = _oracle_engine(plain, prompts, params, max_num_batched_tokens=24)
    assert tokens(generate(llm, prompts, params)) == tokens(ref)
    assert llm.engine.get_stats().spec_num_accepted_tokens_total > 0


def test_preemption_with_drafts(plain):
    prompts = mixed_prompts(6, seed=31, lo=20, hi=40)
    params = greedy(40)
    llm, ref = _oracle_engine(plain, prompts, params, num_gpu_blocks=22, max_num_batched_tokens=64)
    assert tokens(generate(llm, prompts, params)) == tokens(ref)
    stats = llm.engine.get_stats()
    assert stats.num_preempted_total > 0 and stats.spec_num_accepted_tokens_total > 0


def test_async_scheduling_n2_and_logprobs(plain):
    prompts = mixed_prompts(3, seed=41)
    params = greedy(18, n=2, logprobs=2)
    ref = generate(plain, prompts, params)
    llm = spec_llm(3, async_scheduling=True)
    use_oracle(llm, [p for p in prompts], [o for o in ref], reject_prob=0.3)
    got = generate(llm, prompts, params)
    assert tokens(got) == tokens(ref)
    for a, b in zip(got, ref):
        for ca, cb in zip(a.outputs, b.outputs):
            for la, lb in zip(ca.logprobs, cb.logprobs):
                assert la.keys() == lb.keys()
                assert all(abs(la[t].logprob - lb[t].logprob) < 1e-4 for t in la)
    assert llm.engine.get_stats().spec_num_accepted_tokens_total > 0


def test_stops_and_max_tokens_cut_inside_an_accepted_run(plain):
    prompt = mixed_prompts(1, seed=51)[0]
    ref = generate(plain, [prompt], greedy(30))[0].outputs[0].token_ids
    llm = spec_llm(4)
    use_oracle(llm, [prompt], generate(plain, [prompt], greedy(30)), reject_prob=0.0)
    # a stop token id in the middle of a run of accepted drafts
    stop_at = next(i for i in range(6, 30) if ref[i] not in ref[:i])
    out = generate(llm, [prompt], greedy(30, stop_token_ids=[ref[stop_at]]))[0].outputs[0]
    assert out.token_ids == ref[: stop_at + 1] and out.finish_reason == "stop"
    # the stopped sequence's state is past its last kept token (the rest of the run was committed), so it
    # leaves no snapshot there; the next turn hits the prompt's and gives the plain output
    turn = prompt + out.token_ids + [5, 6, 7]
    hit = generate(llm, [turn], greedy(8))[0]
    assert hit.num_cached_tokens >= len(prompt) - 1
    assert hit.outputs[0].token_ids == generate(plain, [turn], greedy(8))[0].outputs[0].token_ids
    # max_tokens not a multiple of K + 1
    for m in (1, 2, 7, 11):
        out = generate(llm, [prompt], greedy(m))[0].outputs[0]
        assert out.token_ids == ref[:m] and out.finish_reason == "length"
    stats = llm.engine.get_stats()
    assert stats.spec_num_accepted_tokens_total == stats.spec_num_draft_tokens_total   # the oracle never misses


def test_stop_string_inside_an_accepted_run(plain):
    prompt = "The quick brown fox jumps over the lazy dog. The quick brown fox"
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    full = plain.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    text = full.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    want = plain.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop]),
                          use_tqdm=False)[0].outputs[0]
    llm = spec_llm(4)
    ptoks = plain.tokenizer.encode(prompt)
    use_oracle(llm, [ptoks], [plain.generate([{"prompt_token_ids": ptoks}], sp, use_tqdm=False)[0]], 0.0)
    got = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == \
        (want.text, want.token_ids, want.finish_reason, want.stop_reason)
    assert llm.engine.get_stats().spec_num_accepted_tokens_total > 0


def test_prefix_cache_hits_before_and_after_speculation(plain):
    """Only committed states are cached: a request that hits what a speculating request left behind (its
    prompt, or its whole conversation so far) gives the plain output, and so does one speculating from a hit."""
    prompts = mixed_prompts(2, seed=61, lo=40, hi=70)
    params = greedy(25)
    llm, ref = _oracle_engine(plain, prompts, params, reject_prob=0.3)
    assert tokens(generate(llm, prompts, params)) == tokens(ref)       # fills the cache while speculating
    # the same prompts again: prompt hits, then speculation from the restored state
    again = generate(llm, prompts, params)
    assert tokens(again) == tokens(ref) and all(o.num_cached_tokens > 0 for o in again)
    # the next turn: prompt + output + more; it hits the state saved at the end of the speculating run
    turns = [p + o.outputs[0].token_ids + [11, 12, 13] for p, o in zip(prompts, ref)]
    want = generate(plain, turns, params)
    got = generate(llm, turns, params)
    assert tokens(got) == tokens(want)
    assert all(o.num_cached_tokens >= len(p) for o, p in zip(got, prompts))


def test_abort_while_speculating(plain):
    prompts = mixed_prompts(3, seed=71)
    llm, ref = _oracle_engine(plain, prompts, greedy(40))
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, greedy(40))
    for _ in range(4):
        eng.step()
    eng.abort_request("r1")
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    assert outs["r1"].outputs[0].finish_reason == "abort"
    assert outs["r0"].outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert outs["r2"].outputs[0].token_ids == ref[2].outputs[0].token_ids
    eng.cache.check_integrity()
    assert eng.get_stats().kv_blocks_used == 0 and eng.get_stats().state_slots_used == 0


def test_stats_counters(plain):
    prompts = mixed_prompts(3, seed=81)
    llm, ref = _oracle_engine(plain, prompts, greedy(20), reject_prob=0.3, k=3)
    generate(llm, prompts, greedy(20))
    s = llm.engine.get_stats()
    per = [s.spec_num_accepted_tokens_per_pos[j] for j in range(3)]
    assert sorted(s.spec_num_accepted_tokens_per_pos) == [0, 1, 2]
    assert len(per) == 3 and sum(per) == s.spec_num_accepted_tokens_total > 0
    assert per[0] >= per[1] >= per[2]
    assert per[0] <= s.spec_num_drafts_total
    assert s.spec_num_accepted_tokens_total <= s.spec_num_draft_tokens_total <= 3 * s.spec_num_drafts_total
    assert s.generation_tokens_total == sum(len(t) for t in tokens(ref))


def test_the_context_limit_cuts_inside_an_accepted_run(plain):
    prompt = mixed_prompts(1, seed=91, lo=30, hi=31)[0][:41]
    ref = generate(plain, [prompt], greedy(64 - len(prompt)))
    llm = spec_llm(4, max_model_len=64)
    use_oracle(llm, [prompt], ref, reject_prob=0.0)
    out = generate(llm, [prompt], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=None))[0].outputs[0]
    assert out.token_ids == ref[0].outputs[0].token_ids and len(out.token_ids) == 64 - len(prompt)
    assert out.finish_reason == "length"


def test_abort_with_a_verify_step_in_flight_caches_no_speculative_state(plain):
    """Async scheduling: an abort applied while a verify step is in flight frees the sequence before its
    accepted count is known; nothing it left in the prefix cache may claim a state it does not have."""
    prompt = mixed_prompts(1, seed=101, lo=30, hi=40)[0]
    ref = generate(plain, [prompt], greedy(30))
    llm = spec_llm(4, async_scheduling=True)
    use_oracle(llm, [prompt], ref, reject_prob=0.3)
    eng = llm.engine
    eng.add_request("a", {"prompt_token_ids": prompt}, greedy(30))
    for _ in range(50):
        eng.step()
        if eng._inflight is not None and eng._inflight.verifies:
            break
    assert eng._inflight is not None and eng._inflight.verifies, "no verify step in flight"
    seq = eng._requests["a"].seqs[0]
    known = list(seq.token_ids)
    eng.abort_request("a")                     # applied at once: no step is running
    while eng.has_unfinished_requests():
        eng.step()
    eng.cache.check_integrity()
    turn = known + [3, 4]
    got = generate(llm, [turn], greedy(10))[0]
    assert got.outputs[0].token_ids == generate(plain, [turn], greedy(10))[0].outputs[0].token_ids
