"""Sharding without processes: each rank's parameters, loaded from a checkpoint or drawn as dummy weights,
are exactly the slices of the tp = 1 model's (distributed/parallel.py's Split), and shapes that do not divide
are refused naming the field."""

from __future__ import annotations

import pytest
import torch

from deltaserve.config import ModelConfig
from deltaserve.distributed.parallel import Parallel, ShardingError, Split, check_model_divides, refuse_split_blocks
from deltaserve.models.loader import build_dummy_model, load_model
from deltaserve.ops import select_kernels
from tests.conftest import TinySpec, _text_config

KERNELS = select_kernels("cpu", force_reference=True)


def _splits(model) -> dict[str, Split]:
    """Parameter name -> its Split, for the sharded parameters of a rank's model."""
    out = {}
    for mod_name, module in model.named_modules():
        for name, split in getattr(module, "param_splits", {}).items():
            out[f"{mod_name}.{name}" if mod_name else name] = split
    return out


def _assert_slices(full_model, rank_models) -> None:
    full = dict(full_model.named_parameters())
    for parallel, model in rank_models:
        splits = _splits(model)
        assert splits, "a sharded model lists its splits"
        for name, p in model.named_parameters():
            expected = splits[name].take(full[name], parallel) if name in splits else full[name]
            assert p.shape == expected.shape, name
            assert torch.equal(p, expected), f"rank {parallel.rank}: {name} is not the tp=1 slice"


def _dummy_config(family: str, shared_folded: bool) -> ModelConfig:
    cfg = _text_config(TinySpec(family=family, ratio=2))
    if shared_folded:
        cfg["shared_expert_intermediate_size"] = cfg["moe_intermediate_size"]   # stored as one more expert
    cfg["model_type"] = family if family != "qwen3_5_moe" else "qwen3_5_moe_text"
    return ModelConfig.from_dict(cfg)


@pytest.mark.parametrize("family,shared_folded,ep", [("qwen3_next", True, False), ("qwen3_next", True, True),
                                                     ("qwen3_5", False, False), ("qwen3_5_moe", False, True)])
def test_dummy_weights_per_rank_are_the_tp1_slices(family, shared_folded, ep):
    config = _dummy_config(family, shared_folded)
    kw = {"device": "cpu", "dtype": torch.float32, "kernels": KERNELS, "seed": 3}
    full = build_dummy_model(config, **kw)
    ranks = [(p, build_dummy_model(config, parallel=p, **kw)) for p in (Parallel(r, 2, ep) for r in range(2))]
    _assert_slices(full, ranks)


@pytest.mark.parametrize("spec,ep", [
    (TinySpec(family="qwen3_next", ratio=2, mtp=True), False),
    (TinySpec(family="qwen3_next", ratio=3, seed=2), True),
    (TinySpec(family="qwen3_5", ratio=3, shards=True, seed=3), False),
    (TinySpec(family="qwen3_5_moe", ratio=2, fused_experts=True, mtp=True, seed=5), False),
    (TinySpec(family="qwen3_5_moe", ratio=2, fused_experts=True, seed=5), True),
    (TinySpec(family="qwen3_5_moe", layout="text", ratio=1, seed=6), True),
])
def test_checkpoint_shards_are_the_tp1_slices(tiny_model, spec, ep):
    path = tiny_model(spec)
    kw = {"device": "cpu", "dtype": torch.float32, "kernels": KERNELS, "show_progress": False}
    full = load_model(path, **kw)
    ranks = [(p, load_model(path, parallel=p, **kw)) for p in (Parallel(r, 2, ep) for r in range(2))]
    _assert_slices(full, ranks)


def test_kv_heads_replicated_when_ranks_outnumber_them():
    p = [Parallel(r, 4) for r in range(4)]
    split = Split(0, ((8, 2),))          # 2 KV heads of 4 rows over 4 ranks
    assert [split.ranges(x) for x in p] == [[(0, 4)], [(0, 4)], [(4, 8)], [(4, 8)]]


@pytest.mark.parametrize("field,value,ep", [
    ("linear_num_key_heads", 3, False), ("num_attention_heads", 3, False), ("vocab_size", 161, False),
    ("intermediate_size", 97, False), ("moe_intermediate_size", 33, False), ("num_experts", 5, True),
])
def test_shapes_that_do_not_divide_are_refused_naming_the_field(field, value, ep):
    family = "qwen3_5" if field == "intermediate_size" else "qwen3_next"
    cfg = _text_config(TinySpec(family=family, ratio=2))
    cfg.update({field: value, "model_type": family})
    if field == "linear_num_key_heads":
        cfg["linear_num_value_heads"] = 6
    if field == "num_attention_heads":
        cfg["num_key_value_heads"] = 1
    config = ModelConfig.from_dict(cfg)
    with pytest.raises(ShardingError, match=field):
        check_model_divides(config, Parallel(0, 2, ep))
    with pytest.raises(ShardingError, match=field):      # the layers refuse the same when built
        build_dummy_model(config, device="cpu", dtype=torch.float32, kernels=KERNELS, parallel=Parallel(1, 2, ep))


def test_kv_heads_that_do_not_divide_refused():
    cfg = _text_config(TinySpec(family="qwen3_5"))
    cfg.update(model_type="qwen3_5", num_key_value_heads=3, num_attention_heads=6)
    with pytest.raises(ShardingError, match="num_key_value_heads"):
        check_model_divides(ModelConfig.from_dict(cfg), Parallel(0, 2))


def test_block_quantised_shards_start_and_end_on_the_scale_groups():
    refuse_split_blocks("experts.w2", [(448, 512)], 64, what="columns")    # TP8 of I = 512: 64-column groups
    with pytest.raises(ShardingError, match="experts.w2: this rank's columns 448..512 .* 128-column"):
        refuse_split_blocks("experts.w2", [(448, 512)], 128, what="columns")


def test_distributed_package_imports_only_torch():
    """distributed/ is a leaf under the layers: it imports torch and itself, nothing else of deltaserve."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "deltaserve" / "distributed"
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                assert node.level == 1, (path.name, node.module)
            elif isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("deltaserve"), (path.name, node.module)
