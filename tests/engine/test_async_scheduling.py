"""Async scheduling: step N+1 is scheduled and launched before step N's tokens are read. Outputs must equal
synchronous scheduling (greedy and seeded sampling), sequences that stopped run at most one wasted position,
length-limited ones none, and rows with penalties make the engine read the step in flight first.

First against the fake runner (real cache semantics, tokens computed at launch like a device would; the
random workload with aborts and preemption runs in both modes in test_scheduler.py), then end to end with a
real tiny model on CPU, eager and through the static-buffer graph path.
"""

from __future__ import annotations

import random

import pytest

from deltaserve.llm import LLM
from deltaserve.sampling_params import SamplingParams

from ..conftest import TinySpec, random_ids
from .fakes import next_token, reference_tokens
from .test_scheduler import fake_engine, greedy, random_prompts, run_all, assert_all_free


def _finals(engine, prompts, params) -> dict:
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    return run_all(engine)


def _tokens(finals: dict) -> dict:
    return {rid: [c.token_ids for c in out.outputs] for rid, out in finals.items()}


@pytest.mark.parametrize("budget,num_blocks", [(1, 256), (5, 256), (64, 256), (16, 24)])
def test_async_equals_sync_on_the_fake_runner(budget, num_blocks):
    """Chunked prompts, continuous admission, preemption (24 blocks), EOS stops and length limits."""
    prompts = random_prompts(12, seed=budget)
    rng = random.Random(budget)
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 25), n=1 + (i % 4 == 0)) for i in range(12)]
    results = []
    for async_scheduling in (False, True):
        engine = fake_engine(budget=budget, num_blocks=num_blocks, eos=3, async_scheduling=async_scheduling)
        results.append(_tokens(_finals(engine, prompts, params)))
        assert_all_free(engine)
        if num_blocks == 24:
            assert engine.get_stats().num_preempted_total > 0
    assert results[0] == results[1]
    assert any(len(t[0]) < p.max_tokens for t, p in zip(results[1].values(), params))   # some stopped at EOS


def test_outputs_lag_one_step_and_length_limits_waste_nothing():
    engine = fake_engine(async_scheduling=True)
    engine.add_request("a", [1, 2, 3], greedy(4))
    assert engine.step() == []                             # step 1 launched; nothing read yet
    outs = engine.step()                                   # step 2 launched, step 1 read
    assert [len(o.outputs[0].token_ids) for o in outs] == [1]
    finals = run_all(engine)
    assert finals["a"].outputs[0].token_ids == reference_tokens([1, 2, 3], 4)
    # the prompt plus 3 decode positions: the step after the 4th token is never launched
    assert sum(c.num_new for s in engine.runner.steps for c in s.chunks) == 3 + 3
    assert_all_free(engine)


def test_a_stopped_sequence_runs_one_wasted_position_and_frees_everything():
    prompt = [5, 6]
    eos = next_token(prompt)                              # the first sampled token is EOS
    engine = fake_engine(async_scheduling=True, eos=eos)
    engine.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=10))
    finals = run_all(engine)
    out = finals["a"].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop"
    fed = [c.num_new for s in engine.runner.steps for c in s.chunks]
    assert fed == [2, 1]                                  # the prompt, then one position whose token is dropped
    assert engine.get_stats().generation_tokens_total == 1
    assert_all_free(engine)


def test_abort_while_a_step_is_in_flight():
    engine = fake_engine(async_scheduling=True)
    engine.add_request("a", list(range(10)), greedy(50))
    engine.add_request("b", list(range(5)), greedy(6))
    for _ in range(3):
        engine.step()
    engine.abort_request("a")
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == "a"]
    assert len(aborted) == 1 and aborted[0].outputs[0].finish_reason == "abort"
    finals = run_all(engine)
    assert finals["b"].outputs[0].token_ids == reference_tokens(list(range(5)), 6)
    assert_all_free(engine)
    assert engine.get_stats().num_finished_total == {"abort": 1, "length": 1}


def test_rows_that_need_the_tokens_read_the_step_in_flight_first():
    """When the runner says a step cannot run ahead (penalties), the step in flight is read before the
    launch: no two steps are ever unread at once, and the outputs are unchanged."""
    engine = fake_engine(async_scheduling=True)
    engine.runner.needs_sync = True
    launched, collected = [], []
    launch, collect = engine.runner.launch, engine.runner.collect

    def checked_launch(out):
        assert len(collected) == len(launched), "launched with a step still unread"
        launched.append(1)
        return launch(out)
    engine.runner.launch = checked_launch
    engine.runner.collect = lambda h: collected.append(1) or collect(h)
    engine.add_request("a", [1, 2, 3], greedy(6))
    finals = run_all(engine)
    assert len(launched) == len(collected) > 1
    assert finals["a"].outputs[0].token_ids == reference_tokens([1, 2, 3], 6)


# ---- a real model on CPU ------------------------------------------------------------------------------

def _requests(seed: int, n: int = 9):
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": random_ids(rng.randint(1, 30), vocab=128, seed=seed * 100 + i)} for i in range(n)]
    kinds = [dict(temperature=0), dict(temperature=0.9, top_p=0.9, seed=11), dict(temperature=0, logprobs=2),
             dict(temperature=0.7, top_k=20, seed=5, logprobs=1), dict(temperature=0, prompt_logprobs=1),
             dict(temperature=0, repetition_penalty=1.3, presence_penalty=0.5), dict(temperature=0.8, seed=3, n=2),
             dict(temperature=0, stop_token_ids=[7, 9, 11]), dict(temperature=0, min_tokens=4, stop_token_ids=[1, 2])]
    params = [SamplingParams(max_tokens=rng.randint(2, 14), **kinds[i % len(kinds)]) for i in range(n)]
    return prompts, params


def _summary(outs):
    def lp(entries):
        return None if entries is None else [{t: round(v.logprob, 4) for t, v in e.items()} if e else e
                                             for e in entries]
    return [([c.token_ids for c in o.outputs], [lp(c.logprobs) for c in o.outputs], lp(o.prompt_logprobs),
             [c.finish_reason for c in o.outputs]) for o in outs]


@pytest.mark.parametrize("graphs", [False, True])
def test_async_equals_sync_with_a_real_model(tiny_model, graphs):
    """Greedy, seeded sampling, logprobs, prompt logprobs, penalties (read first), n = 2, stop tokens and
    min_tokens, with a small KV pool (preemption) and a small token budget (chunked prompts, mixed steps);
    graphs=True runs decode steps through the padded static-buffer path, where pending rows resolve
    their input token inside the "graph"."""
    path = tiny_model(TinySpec(family="qwen3_next", ratio=2, seed=5))
    prompts, params = _requests(seed=3)
    results = []
    for async_scheduling in (False, True):
        llm = LLM(path, device="cpu", max_num_seqs=6, max_num_batched_tokens=24, num_gpu_blocks=14, block_size=4,
                  compile="off", async_scheduling=async_scheduling)
        assert llm.engine.async_scheduling is async_scheduling
        if graphs:
            llm.engine.runner.capture_decode_graphs(8)
        results.append(_summary(llm.generate(prompts, params, use_tqdm=False)))
        if graphs:
            assert llm.engine.runner.graphs.num_replays > 0
    assert llm.engine.get_stats().num_preempted_total > 0
    assert results[0] == results[1]


def test_async_scheduling_defaults_off_on_cpu(tiny_model):
    llm = LLM(tiny_model(TinySpec(family="qwen3_next", ratio=2, seed=5)), device="cpu", compile="off")
    assert llm.engine.async_scheduling is False
