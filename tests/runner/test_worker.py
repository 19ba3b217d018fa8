"""The runner-side worker: the device half of start-up in phases (a driver may plan the cache itself between
them), the one start-up summary line, and the short kernels summary."""

from __future__ import annotations

import logging
import re

import torch

from deltaserve import LLM
from deltaserve.cache.plan import plan_cache
from deltaserve.config import ModelConfig
from deltaserve.runner.worker import Worker, WorkerConfig
from tests.conftest import TinySpec


def _config(path, **kw) -> WorkerConfig:
    cfg = ModelConfig.from_hf(path)
    base = dict(model=cfg, model_path=path, load_format="auto", device=torch.device("cpu"), dtype=torch.float32,
                max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, block_size=8,
                gpu_memory_utilization=0.9, cpu_cache_bytes=1 << 24)
    return WorkerConfig(**{**base, **kw})


def test_phases_let_a_driver_plan_the_cache_before_any_allocation(tiny_model):
    """load_model -> cache_spec / cache_budget -> plan (here: half the budget, as a driver over ranks with less
    memory would) -> initialize_cache allocates exactly the plan and builds the runner over it."""
    w = Worker(_config(tiny_model(TinySpec(family="qwen3_5", layout="text", seed=3))))
    w.load_model()
    assert w.model is not None and w.runner is None and w.graph_sizes == []
    budget = w.cache_budget()
    assert budget == 1 << 24
    plan = plan_cache(w.cache_spec(), budget_bytes=budget // 2, max_num_seqs=4, max_model_len=256)
    runner = w.initialize_cache(plan)
    assert w.plan is plan and w.runner is runner and runner.model is w.model
    assert (runner.cache.num_slots, runner.cache.num_blocks, runner.cache.block_size) == (plan.num_slots,
                                                                                          plan.num_blocks, 8)
    assert runner.graphs is None and runner.compiled_decode is None


def test_start_gives_the_engine_the_same_pools_as_llm(tiny_model):
    path = tiny_model(TinySpec(family="qwen3_5", layout="text", seed=3))
    w = Worker(_config(path, max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=4096, block_size=16,
                       cpu_cache_bytes=1 << 22))
    runner = w.start()
    llm = LLM(path, device="cpu", max_num_seqs=8, cpu_cache_bytes=1 << 22)
    assert w.plan == llm.engine.plan
    assert runner.cache.kv.shape == llm.engine.runner.cache.kv.shape
    assert runner.cache.ssm.shape == llm.engine.runner.cache.ssm.shape


def test_start_up_logs_one_summary_line_with_the_detail_at_debug(tiny_model, caplog):
    path = tiny_model(TinySpec(family="qwen3_next", seed=5))
    with caplog.at_level(logging.DEBUG, logger="deltaserve"):
        llm = LLM(path, device="cpu", max_num_seqs=6, num_gpu_blocks=40, block_size=8)
    info = [r for r in caplog.records if r.levelno == logging.INFO]
    assert [r.name for r in info] == ["deltaserve.engine.llm_engine"], [r.getMessage() for r in info]
    line = info[0].getMessage()
    plan = llm.engine.plan
    for part in (path.name, "qwen3_next", "on cpu", "float32", "kernels: reference (25 ops)",
                 f"{plan.num_slots} state slots", "40 KV blocks x 8 tokens", "max_model_len 320", "max_num_seqs 6",
                 "decode: eager"):
        assert part in line, (part, line)
    assert re.search(r"engine ready in [0-9.]+ s \(load [0-9.]+ s\)", line), line   # the start-up phases

    debug = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG)
    assert "cache: 40 KV blocks x 8 tokens" in debug and "decode steps run eagerly" in debug
