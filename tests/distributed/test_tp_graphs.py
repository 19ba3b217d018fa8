"""Decode graphs per rank under tensor parallelism: every rank captures the same buckets in the same order and
replays the bucket the broadcast SchedulerOutput gives, so the all-reduces inside the graphs pair up. On CPU
(gloo, two ranks) the capture is DecodeGraphs' eager stand-in over the static buffers (forced on: CPU plans
no graphs), checked against the eager TP = 1 engine; on two or more GPUs (NCCL) real CUDA graphs, on by
default, are checked against enforce_eager."""

from __future__ import annotations

import logging

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.engine import executor
from tests.conftest import TinySpec, random_ids

ENGINE = {"dtype": "float32", "max_num_seqs": 4, "max_num_batched_tokens": 48, "block_size": 16}


def _workload():
    """Staggered output lengths: the decode batch shrinks through the buckets 4, 2, 1 (padded replays)."""
    prompts = [{"prompt_token_ids": random_ids(5 + 7 * i, seed=i)} for i in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=4 + 5 * i, logprobs=2, ignore_eos=True) for i in range(4)]
    return prompts, params


def _outputs(llm: LLM):
    prompts, params = _workload()
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def _assert_same(ref, ours) -> None:
    for a, b in zip(ref, ours):
        assert b.token_ids == a.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            assert la.keys() == lb.keys() and max(abs(la[t].logprob - lb[t].logprob) for t in la) < 1e-4


def test_cpu_stand_in_graphs_under_tp2_give_the_tp1_tokens(tiny_model, monkeypatch, caplog):
    path = tiny_model(TinySpec(family="qwen3_next", ratio=2, seed=5))
    ref = _outputs(LLM(path, device="cpu", **ENGINE))
    monkeypatch.setattr(executor, "forced_graph_sizes", [1, 2, 4])
    with caplog.at_level(logging.INFO, logger="deltaserve.engine.executor"):
        llm = LLM(path, device="cpu", tensor_parallel_size=2, **ENGINE)
    try:
        graphs = llm.engine.runner.graphs
        assert graphs is not None and graphs.sizes == [1, 2, 4]
        assert any("decode CUDA graphs on every rank" in r.message for r in caplog.records)
        _assert_same(ref, _outputs(llm))
        assert graphs.num_replays > 0 and graphs.num_padded_replays > 0
    finally:
        llm.shutdown()


@pytest.mark.gpu
@pytest.mark.multi_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_graphs_under_tp2_equal_eager(tiny_model):
    """Graphs are on by default under TP on CUDA; their tokens and logprobs equal enforce_eager's."""
    path = tiny_model(TinySpec(family="qwen3_next", ratio=2, seed=5))
    results = []
    for eager in (True, False):
        llm = LLM(path, device="cuda", tensor_parallel_size=2, enforce_eager=eager, num_gpu_blocks=64, **ENGINE)
        try:
            graphs = llm.engine.runner.graphs
            assert (graphs is None) == eager
            results.append(_outputs(llm))
            if not eager:
                assert graphs.num_replays > 0 and graphs.num_padded_replays > 0
        finally:
            llm.shutdown()
    _assert_same(*results)


@pytest.mark.parametrize("in_flight", [True, False], ids=["step-in-flight", "idle"])
def test_a_rank_dying_under_a_graph_step_ends_rank_0_not_hangs(monkeypatch, in_flight):
    """A collective captured in a CUDA graph cannot time out: a worker's death while a step is in flight that
    the step does not report within HANG_GRACE_S exits rank 0's process (a fake runner with graphs on a CUDA
    device; exit recorded instead of taken). Idle, the next step reports the death instead."""
    import multiprocessing
    import time
    import types

    monkeypatch.setattr(executor, "HANG_GRACE_S", 0.3)
    worker = types.SimpleNamespace(runner=types.SimpleNamespace(graphs=object()),
                                   config=types.SimpleNamespace(device=types.SimpleNamespace(type="cuda")))
    proc = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(1.0,))  # dies after set-up
    exits = []
    runner = executor.TensorParallelRunner.__new__(executor.TensorParallelRunner)
    try:
        proc.start()
        runner.__init__(worker, [proc])
        runner._exit = exits.append
        runner._inflight = 1 if in_flight else 0
        deadline = time.monotonic() + 10
        while runner.dead_reason() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.6)
        assert "rank 1" in runner.dead_reason() and "code 0" in runner.dead_reason()
        assert exits == ([1] if in_flight else [])
    finally:
        runner._closing = True
        proc.join(5)
