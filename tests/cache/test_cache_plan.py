"""Memory planning (cache/plan.py): bytes per block / slot match the buffers both allocators make, the GPU
budget sets aside what the process needs, pool sizing clamps concurrency and context length (with a
warning) instead of refusing to start, impossible budgets raise."""

from __future__ import annotations

import logging
import types

import pytest
import torch

from deltaserve.batch import CacheBuffers
from deltaserve.cache.plan import CacheSpec, MiB, gpu_cache_budget, plan_cache
from deltaserve.config import ModelConfig

CFG = ModelConfig.from_dict(dict(
    model_type="qwen3_next", vocab_size=160, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, intermediate_size=96, num_experts=0,
    full_attention_interval=2, max_position_embeddings=4096))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("allocate", ["CacheBuffers.allocate", "runner allocate_cache"])
def test_spec_bytes_match_allocated_buffers(dtype, allocate):
    bs = 16
    spec = CacheSpec.from_model(CFG, block_size=bs, kv_dtype_bytes=dtype.itemsize, conv_dtype_bytes=dtype.itemsize)
    if allocate == "CacheBuffers.allocate":
        buf = CacheBuffers.allocate(CFG, num_slots=3, num_blocks=5, block_size=bs, device="meta", dtype=dtype)
    else:
        from deltaserve.runner.memory import allocate_cache

        model = types.SimpleNamespace(config=CFG)
        buf = allocate_cache(model, num_slots=3, num_blocks=5, block_size=bs, device=torch.device("cpu"), dtype=dtype)
    assert spec.kv_block_bytes * 5 == buf.kv.numel() * buf.kv.element_size()
    assert spec.state_slot_bytes * 3 == (buf.ssm.numel() * buf.ssm.element_size()
                                         + buf.conv.numel() * buf.conv.element_size())
    assert (buf.num_slots, buf.num_blocks, buf.block_size) == (3, 5, bs)


def test_gpu_budget_sets_aside_what_the_process_needs_besides_the_pools():
    budget = gpu_cache_budget(total_bytes=1000 * MiB, utilization=0.9, peak_bytes=300 * MiB,
                              outside_torch_bytes=50 * MiB, graph_bytes=20 * MiB)
    assert budget == 530 * MiB
    # memory outside torch can read negative (freed by another process meanwhile): never adds to the budget
    assert gpu_cache_budget(total_bytes=1000 * MiB, utilization=0.5, peak_bytes=100 * MiB,
                            outside_torch_bytes=-10 * MiB, graph_bytes=0) == 400 * MiB
    with pytest.raises(ValueError, match="no GPU memory left for the cache"):
        gpu_cache_budget(total_bytes=1000 * MiB, utilization=0.3, peak_bytes=250 * MiB, outside_torch_bytes=50 * MiB,
                         graph_bytes=0)


def _spec(slot=1000, block=100, bs=16):
    return CacheSpec(block_size=bs, kv_block_bytes=block, state_slot_bytes=slot)


def test_plan_fits_everything_when_budget_is_ample():
    plan = plan_cache(_spec(), budget_bytes=1_000_000, max_num_seqs=64, max_model_len=1024)
    assert plan.num_slots == 64 and plan.max_num_seqs == 64 and plan.max_model_len == 1024
    assert plan.num_blocks == (1_000_000 - 64 * 1000) // 100
    assert plan.used_bytes <= plan.budget_bytes


def test_plan_clamps_concurrency_to_slots_with_a_warning(caplog):
    # 64 blocks (100 B) reserved for one 1024-token sequence, the rest holds 9 slots of 1000 B.
    with caplog.at_level(logging.WARNING):
        plan = plan_cache(_spec(), budget_bytes=6400 + 9500, max_num_seqs=64, max_model_len=1024)
    assert plan.num_slots == 9 and plan.max_num_seqs == 9
    assert plan.num_blocks >= 64 and plan.max_model_len == 1024
    assert "max_num_seqs 64 clamped to 9" in caplog.text


def test_plan_clamps_context_to_a_fixed_small_pool(caplog):
    with caplog.at_level(logging.WARNING):
        plan = plan_cache(_spec(), budget_bytes=10_000_000, max_num_seqs=4, max_model_len=1024, num_blocks=10)
    assert plan.num_blocks == 10 and plan.max_model_len == 160 and plan.num_slots == 4
    assert "max_model_len 1024 clamped to 160" in caplog.text


def test_plan_keeps_spare_slots_apart_from_concurrency():
    plan = plan_cache(_spec(), budget_bytes=1_000_000, max_num_seqs=8, max_model_len=64, spare_slots=2)
    assert plan.num_slots == 10 and plan.max_num_seqs == 8


def test_plan_without_attention_layers_or_gdn_layers():
    plan = plan_cache(_spec(block=0), budget_bytes=10_000, max_num_seqs=4, max_model_len=64)
    assert plan.num_slots == 4 and plan.num_blocks >= 4 * 4
    plan = plan_cache(_spec(slot=0), budget_bytes=10_000, max_num_seqs=4, max_model_len=64)
    assert plan.num_slots == 4 and plan.num_blocks == 100


def test_plan_refuses_a_budget_that_holds_nothing():
    with pytest.raises(ValueError, match="too small"):
        plan_cache(_spec(), budget_bytes=500, max_num_seqs=4, max_model_len=64)
    with pytest.raises(ValueError, match="max_num_seqs"):
        plan_cache(_spec(), budget_bytes=10_000, max_num_seqs=0, max_model_len=64)
