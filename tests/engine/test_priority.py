"""Priority scheduling (scheduling_policy="priority"): the waiting queue admits lower priority values
first, ties by arrival; FCFS (the default) refuses a non-zero priority, as vLLM does."""

from __future__ import annotations

import pytest

from deltaserve.cache.manager import HybridCacheManager
from deltaserve.cache.plan import CachePlan
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.sampling_params import SamplingParams

from .fakes import FakeRunner, reference_tokens, tiny_model_config
from .test_scheduler import assert_all_free, greedy, random_prompts, run_all


def engine_with(policy: str, *, max_num_seqs: int = 1, num_blocks: int = 256) -> LLMEngine:
    plan = CachePlan(num_slots=8, num_blocks=num_blocks, max_num_seqs=max_num_seqs, max_model_len=512,
                     budget_bytes=0, used_bytes=0)
    return LLMEngine(model_config=tiny_model_config(), tokenizer=None, runner=FakeRunner(4),
                     cache=HybridCacheManager(num_blocks=num_blocks, block_size=4, num_slots=8), plan=plan,
                     config=EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, block_size=4,
                                         async_scheduling=False, scheduling_policy=policy))


def admission_order(finals: dict) -> list[str]:
    return sorted(finals, key=lambda rid: finals[rid].metrics["first_scheduled_time"])


def test_priority_policy_admits_lower_values_first_ties_by_arrival():
    engine = engine_with("priority")
    prompts = random_prompts(6, seed=1, lo=3, hi=9)
    priorities = [5, 1, 5, -2, 1, 0]
    for i, (p, prio) in enumerate(zip(prompts, priorities)):
        engine.add_request(f"r{i}", p, greedy(3), arrival_time=float(i), priority=prio)
    finals = run_all(engine)
    # one sequence at a time: the admission order is the queue order
    assert admission_order(finals) == ["r3", "r5", "r1", "r4", "r0", "r2"]
    for i, p in enumerate(prompts):
        assert finals[f"r{i}"].outputs[0].token_ids == reference_tokens(p, 3)
    assert_all_free(engine)


def test_late_urgent_request_overtakes_the_waiting_queue():
    engine = engine_with("priority")
    prompts = random_prompts(4, seed=2, lo=3, hi=6)
    for i in range(3):
        engine.add_request(f"r{i}", prompts[i], greedy(4), arrival_time=float(i))
    engine.step()                                  # r0 runs; r1, r2 wait
    engine.add_request("urgent", prompts[3], greedy(4), arrival_time=10.0, priority=-1)
    finals = run_all(engine)
    assert admission_order(finals) == ["r0", "urgent", "r1", "r2"]
    assert_all_free(engine)


def test_fcfs_is_arrival_order_and_the_default():
    assert EngineConfig().scheduling_policy == "fcfs"
    engine = engine_with("fcfs")
    prompts = random_prompts(4, seed=3, lo=3, hi=6)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(2))
    assert admission_order(run_all(engine)) == ["r0", "r1", "r2", "r3"]


def test_priority_under_fcfs_is_refused_by_name():
    engine = engine_with("fcfs")
    with pytest.raises(ValueError, match="priority=3 needs scheduling_policy='priority'"):
        engine.add_request("r", [1, 2, 3], greedy(2), priority=3)
    with pytest.raises(ValueError, match="priority must be an integer"):
        engine_with("priority").add_request("r", [1, 2, 3], greedy(2), priority=1.5)
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lifo")


def test_priority_with_preemption_and_n_keeps_outputs_exact():
    engine = engine_with("priority", max_num_seqs=4, num_blocks=14)   # tight pool: preemptions happen
    prompts = random_prompts(8, seed=4, lo=5, hi=12)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=2),
                           arrival_time=float(i), priority=i % 3)
    finals = run_all(engine)
    assert engine.get_stats().num_preempted_total > 0
    for i, p in enumerate(prompts):
        assert [c.token_ids for c in finals[f"r{i}"].outputs] == [reference_tokens(p, 6)] * 2
    assert_all_free(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prefill_only_request_generates_nothing_and_frees(async_scheduling):
    """max_tokens=0 (scoring): the prompt runs, the token sampled after it is dropped, finish "length"."""
    engine = engine_with("fcfs", max_num_seqs=4)
    engine.async_scheduling = async_scheduling
    prompts = random_prompts(3, seed=5, lo=20, hi=90)         # longer than the 64-token budget: chunked
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, SamplingParams(max_tokens=0, prompt_logprobs=0))
    engine.add_request("g", prompts[0], greedy(3))
    finals = run_all(engine)
    for i in range(3):
        out = finals[f"s{i}"].outputs[0]
        assert out.token_ids == [] and out.finish_reason == "length"
    assert finals["g"].outputs[0].token_ids == reference_tokens(prompts[0], 3)
    assert engine.get_stats().generation_tokens_total == 3
    assert_all_free(engine)


def test_max_tokens_0_needs_prompt_logprobs_and_truncation_validates():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)
    engine = engine_with("fcfs")
    engine.add_request("t", list(range(1, 30)), greedy(2, truncate_prompt_tokens=5))
    out = run_all(engine)["t"]
    assert out.prompt_token_ids == list(range(25, 30))
    assert out.outputs[0].token_ids == reference_tokens(list(range(25, 30)), 2)


@pytest.mark.parametrize("policy, victim", [("fcfs", "r2"), ("priority", "r1")])
def test_preemption_takes_the_least_urgent_under_priority_the_newest_under_fcfs(policy, victim):
    """r2 arrives after r0 and r1 run, more urgent under "priority": it is the newest admitted, but the pool's
    shortage preempts r1 (the least urgent) under "priority", r2 (the newest) under FCFS."""
    engine = engine_with(policy, max_num_seqs=3, num_blocks=9)
    preempted = []
    take = engine.scheduler._preempt
    engine.scheduler._preempt = lambda seq: (preempted.append(seq.request.request_id), take(seq))
    prompts = random_prompts(3, seed=4, lo=4, hi=5)
    late = 0 if policy == "fcfs" else -1
    for i in range(2):
        engine.add_request(f"r{i}", prompts[i], greedy(12), arrival_time=float(i))
    engine.step()
    engine.add_request("r2", prompts[2], greedy(12), arrival_time=2.0, priority=late)
    finals = run_all(engine)
    assert preempted and preempted[0] == victim, preempted
    for i, p in enumerate(prompts):
        assert finals[f"r{i}"].outputs[0].token_ids == reference_tokens(p, 12)
    assert_all_free(engine)
