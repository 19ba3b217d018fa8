"""The scheduler and the engine loop against a fake runner (no model): token budget, sequence cap,
chunked prefill, continuous admission, preemption and recomputation, freeing."""

from __future__ import annotations

import random

import pytest

from deltaserve.cache.manager import HybridCacheManager
from deltaserve.cache.plan import CachePlan
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.engine.scheduler import Scheduler, SchedulerConfig
from deltaserve.engine.sequence import Request, Sequence
from deltaserve.sampling_params import SamplingParams

from .fakes import VOCAB, FakeRunner, reference_tokens, tiny_model_config


def fake_engine(*, num_blocks=256, block_size=4, num_slots=8, max_num_seqs=8, budget=64, max_model_len=512,
                eos=None, async_scheduling=False) -> LLMEngine:
    plan = CachePlan(num_slots=num_slots, num_blocks=num_blocks, max_num_seqs=min(max_num_seqs, num_slots),
                     max_model_len=max_model_len, budget_bytes=0, used_bytes=0)
    return LLMEngine(model_config=tiny_model_config(eos_token_id=eos), tokenizer=None,
                     runner=FakeRunner(block_size), cache=HybridCacheManager(
                         num_blocks=num_blocks, block_size=block_size, num_slots=num_slots),
                     plan=plan, config=EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                                    block_size=block_size, async_scheduling=async_scheduling))


def run_all(engine: LLMEngine, max_steps: int = 10_000) -> dict:
    finals = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        engine.cache.check_integrity()
    assert not engine.has_unfinished_requests()
    return finals


def random_prompts(n, seed=0, lo=1, hi=40):
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def assert_all_free(engine: LLMEngine):
    engine.cache.check_integrity()
    stats = engine.get_stats()
    assert stats.kv_blocks_used == 0 and stats.state_slots_used == 0
    assert stats.num_running == 0 and stats.num_waiting == 0


@pytest.mark.parametrize("budget", [1, 3, 16, 1000])
def test_budget_and_sequence_cap_respected_and_outputs_exact(budget):
    engine = fake_engine(budget=budget, max_num_seqs=5)
    prompts = random_prompts(12, seed=budget)
    max_toks = [1 + i % 7 for i in range(12)]
    for i, (p, m) in enumerate(zip(prompts, max_toks)):
        engine.add_request(f"r{i}", p, greedy(m))
    finals = run_all(engine)
    for i, (p, m) in enumerate(zip(prompts, max_toks)):
        out = finals[f"r{i}"].outputs[0]
        assert out.token_ids == reference_tokens(p, m) and out.finish_reason == "length"
    for step in engine.runner.steps:
        assert step.num_tokens <= budget
        assert len(step.chunks) <= 5
    assert_all_free(engine)


def test_long_prompt_is_chunked_across_steps():
    engine = fake_engine(budget=16)
    prompt = random_prompts(1, lo=50, hi=50)[0]
    engine.add_request("long", prompt, greedy(3))
    run_all(engine)
    sizes = [c.num_new for s in engine.runner.steps for c in s.chunks]
    assert sizes == [16, 16, 16, 2, 1, 1]


def test_new_requests_join_the_running_batch_and_decodes_come_first():
    engine = fake_engine(budget=8)
    engine.add_request("a", [1, 2, 3], greedy(10))
    engine.step()
    engine.step()
    engine.add_request("b", list(range(20)), greedy(2))
    engine.step()
    step = engine.runner.steps[-1]
    a_id = engine._requests["a"].seqs[0].seq_id
    assert [(c.seq_id == a_id, c.num_new) for c in step.chunks] == [(True, 1), (False, 7)]  # a's decode first
    run_all(engine)
    assert_all_free(engine)


def test_admission_is_first_come_first_served():
    engine = fake_engine(num_blocks=10, block_size=4, budget=100)
    engine.add_request("big", list(range(30)), greedy(2))       # 8 blocks
    engine.add_request("huge", list(range(36)), greedy(2))      # needs 10: waits for big
    engine.add_request("small", [1], greedy(2))                 # would fit, but must not overtake huge
    engine.step()
    running = {engine._seqs[s.seq_id].request.request_id for s in engine.scheduler.running}
    assert running == {"big"}
    finals = run_all(engine)
    assert set(finals) == {"big", "huge", "small"}


def test_preemption_recomputes_and_keeps_outputs_identical():
    engine = fake_engine(num_blocks=14, block_size=4, budget=32)
    prompts = random_prompts(10, seed=3, lo=3, hi=20)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(30))
    finals = run_all(engine)
    assert engine.get_stats().num_preempted_total > 0
    for i, p in enumerate(prompts):
        assert finals[f"r{i}"].outputs[0].token_ids == reference_tokens(p, 30)
    assert_all_free(engine)


def test_preemption_takes_the_newest_running_sequence():
    cache = HybridCacheManager(num_blocks=4, block_size=2, num_slots=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=100), cache)
    seqs = []
    for i in range(3):
        req = Request(f"r{i}", None, [1, 2], greedy(8), 0.0)
        seq = Sequence(i, req, 0, max_new_tokens=8, eos_token_ids=frozenset(), detokenizer=None)
        req.seqs = [seq]
        seqs.append(seq)
        sched.add(seq)
    out = sched.schedule()                      # all three admitted, one block each (3 of 4 used)
    assert [c.seq_id for c in out.chunks] == [0, 1, 2]
    sched.update(out)
    for s in seqs:
        s.token_ids.append(5)                   # a sampled token: each now needs a second block
    out = sched.schedule()                      # seq 0 takes the last block, seq 1 preempts seq 2
    assert [c.seq_id for c in out.chunks] == [0, 1] and out.num_preempted == 1
    assert out.freed_seq_ids == [2] and list(sched.waiting) == [seqs[2]]
    assert seqs[2].num_computed == 0 and seqs[2].num_preemptions == 1
    assert not cache.holds(2)


def test_finished_requests_free_everything_in_the_same_step():
    engine = fake_engine()
    engine.add_request("a", [1, 2, 3], greedy(1))
    engine.add_request("b", [4, 5], greedy(5))
    outs = engine.step()
    assert [o.request_id for o in outs if o.finished] == ["a"]
    assert engine.get_stats().state_slots_used == 1      # only b holds a slot now
    assert not engine.cache.holds(engine.runner.steps[0].new_seqs[0].seq_id)
    run_all(engine)
    assert_all_free(engine)


def test_abort_between_steps_frees_at_once_and_reports_abort():
    engine = fake_engine()
    engine.add_request("a", list(range(10)), greedy(50))
    engine.add_request("b", list(range(5)), greedy(50))
    for _ in range(3):
        engine.step()
    engine.abort_request("a")
    assert engine.get_stats().state_slots_used == 1      # freed before the next step
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == "a"]
    assert len(aborted) == 1 and aborted[0].finished and aborted[0].outputs[0].finish_reason == "abort"
    assert len(aborted[0].outputs[0].token_ids) == 3
    engine.abort_request(["b", "unknown-id"])            # unknown ids are ignored
    engine.abort_request("b")                            # twice is harmless
    outs = engine.step()
    assert [o.request_id for o in outs] == ["b"] and outs[0].outputs[0].finish_reason == "abort"
    assert_all_free(engine)
    assert not engine.has_unfinished_requests()
    assert engine.get_stats().num_finished_total == {"abort": 2}


def test_abort_of_a_waiting_request_and_reuse_of_its_id():
    engine = fake_engine(num_slots=1, max_num_seqs=1)
    engine.add_request("a", [1], greedy(5))
    engine.add_request("b", [2], greedy(5))
    engine.step()
    engine.abort_request("b")                            # still waiting
    outs = {o.request_id: o for o in engine.step()}
    assert outs["b"].outputs[0].finish_reason == "abort" and outs["b"].outputs[0].token_ids == []
    assert not outs["a"].finished
    engine.add_request("b", [3], greedy(2))              # the id is free again
    finals = run_all(engine)
    assert finals["b"].outputs[0].token_ids == reference_tokens([3], 2)


def test_n_completions_run_as_independent_sequences():
    engine = fake_engine()
    engine.add_request("a", [1, 2, 3], greedy(4, n=3))
    finals = run_all(engine)
    outs = finals["a"].outputs
    assert [o.index for o in outs] == [0, 1, 2]
    assert all(o.token_ids == reference_tokens([1, 2, 3], 4) for o in outs)
    assert_all_free(engine)


def test_stop_token_ids_eos_min_tokens_and_length():
    prompt = [7, 8, 9]
    ref = reference_tokens(prompt, 20)
    stop_tok = ref[4]
    first = ref.index(stop_tok)
    engine = fake_engine(eos=ref[2])
    engine.add_request("stop", prompt, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok],
                                                      ignore_eos=True))
    engine.add_request("eos", prompt, SamplingParams(temperature=0, max_tokens=20))
    engine.add_request("min", prompt, SamplingParams(temperature=0, max_tokens=20, min_tokens=first + 2,
                                                     stop_token_ids=[stop_tok], ignore_eos=True))
    engine.add_request("ctx", prompt, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    finals = run_all(engine)
    out = finals["stop"].outputs[0]
    assert out.token_ids == ref[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_tok
    out = finals["eos"].outputs[0]
    assert out.token_ids == ref[: ref.index(ref[2]) + 1] and out.finish_reason == "stop" and out.stop_reason is None
    # min_tokens: the fake runner does not suppress, so the stop token may come before min_tokens and is
    # then not a stop; the engine stops at the first occurrence at or after min_tokens, or at max_tokens.
    out = finals["min"].outputs[0]
    later = [i for i, t in enumerate(ref) if t == stop_tok and i >= first + 1]
    assert len(out.token_ids) == (later[0] + 1 if later else 20)
    out = finals["ctx"].outputs[0]
    assert len(out.token_ids) == 512 - 3 and out.finish_reason == "length"


def test_streamed_outputs_are_cumulative_with_metrics():
    engine = fake_engine(budget=4)
    engine.add_request("a", list(range(9)), greedy(3), arrival_time=123.0)
    seen = []
    while engine.has_unfinished_requests():
        seen.extend(engine.step())
    assert [len(o.outputs[0].token_ids) for o in seen] == [1, 2, 3]   # nothing while prefilling 9 tokens
    assert [o.finished for o in seen] == [False, False, True]
    m = seen[-1].metrics
    assert m["arrival_time"] == 123.0 and m["first_token_time"] <= m["last_token_time"]
    assert seen[0].outputs[0].token_ids == seen[-1].outputs[0].token_ids[:1]


def test_non_streamed_requests_report_only_when_finished():
    engine = fake_engine()
    engine.add_request("a", [1, 2], greedy(3), stream=False)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    assert len(outs) == 1 and outs[0].finished


def test_add_request_validation():
    engine = fake_engine(num_blocks=8, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("x", [], greedy(1))
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request("x", [1, VOCAB], greedy(1))
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request("x", [1, -1], greedy(1))
    with pytest.raises(ValueError, match="context limit"):
        engine.add_request("x", list(range(64)), greedy(1))
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request("x", "hello", greedy(1))
    with pytest.raises(ValueError, match="stop strings"):
        engine.add_request("x", [1], greedy(1, stop=["a"]))
    with pytest.raises(ValueError, match="whole pool"):
        engine.add_request("x", [1], greedy(40))          # 41 tokens > 8 blocks x 4
    with pytest.raises(ValueError, match="SamplingParams"):
        engine.add_request("x", [1], {"temperature": 0})
    engine.add_request("x", [1], greedy(2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", [2], greedy(2))
    assert engine.get_stats().num_waiting == 0            # still pending, applied at the next step
    run_all(engine)


def test_add_request_from_another_thread_while_stepping():
    import threading

    engine = fake_engine(budget=8)
    prompts = random_prompts(20, seed=5)
    engine.add_request("r0", prompts[0], greedy(5))

    def producer():
        for i in range(1, 20):
            engine.add_request(f"r{i}", prompts[i], greedy(5))

    t = threading.Thread(target=producer)
    t.start()
    finals = {}
    while t.is_alive() or engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    t.join()
    assert all(finals[f"r{i}"].outputs[0].token_ids == reference_tokens(prompts[i], 5) for i in range(20))
    assert_all_free(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_random_workload_with_aborts_keeps_the_cache_consistent(async_scheduling):
    rng = random.Random(11)
    engine = fake_engine(num_blocks=30, block_size=4, budget=12, num_slots=6, max_num_seqs=6,
                         async_scheduling=async_scheduling)
    expected, live = {}, []
    for step in range(400):
        if rng.random() < 0.3:
            rid = f"r{step}"
            p = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
            m = rng.randint(1, 20)
            engine.add_request(rid, p, greedy(m))
            expected[rid] = reference_tokens(p, m)
            live.append(rid)
        if live and rng.random() < 0.05:
            rid = live.pop(rng.randrange(len(live)))
            engine.abort_request(rid)
            expected.pop(rid)
        for out in engine.step():
            if out.finished and out.request_id in expected:
                assert out.outputs[0].token_ids == expected.pop(out.request_id)
                live.remove(out.request_id)
        engine.cache.check_integrity()
    run_all(engine)
    assert engine.get_stats().num_preempted_total > 0
    assert_all_free(engine)


def test_preempted_sequence_recomputes_partial_prompt_logprobs_only():
    req = Request("r", None, [1, 2, 3, 4], greedy(4, prompt_logprobs=1), 0.0)
    seq = Sequence(0, req, 0, max_new_tokens=4, eos_token_ids=frozenset(), detokenizer=None)
    req.seqs = [seq]
    assert seq.runner_data(0, []).prompt_logprobs == 1
    req.prompt_logprobs.extend([{2: None}])            # 2 of 4 positions done when preempted
    seq.reset_for_recompute()
    assert req.prompt_logprobs == [None] and seq.runner_data(0, []).prompt_logprobs == 1
    req.prompt_logprobs.extend([{2: None}, {3: None}, {4: None}])   # complete: kept, not asked again
    seq.reset_for_recompute()
    assert len(req.prompt_logprobs) == 4 and seq.runner_data(0, []).prompt_logprobs is None
    sibling = Sequence(1, req, 1, max_new_tokens=4, eos_token_ids=frozenset(), detokenizer=None)
    assert Sequence(2, Request("q", None, [1, 2], greedy(2, prompt_logprobs=1), 0.0), 0, max_new_tokens=2,
                    eos_token_ids=frozenset(), detokenizer=None).runner_data(0, []).prompt_logprobs == 1
    assert sibling.runner_data(0, []).prompt_logprobs is None      # only completion 0 computes them
