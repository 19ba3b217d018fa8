"""Checkpoint loading: layouts, MTP, and clear errors for bad checkpoints."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltaserve.config import ConfigError
from deltaserve.models.loader import CheckpointError, load_model
from deltaserve.ops import select_kernels
from tests.conftest import TinySpec

KERNELS = select_kernels("cpu")


def load(path, **kw):
    return load_model(path, device="cpu", dtype=torch.float32, kernels=KERNELS, show_progress=False, **kw)


def copy_with(tmp_path, src, edit):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_fused_and_per_expert_checkpoints_load_identically(tiny_model):
    a = load(tiny_model(TinySpec(family="qwen3_5_moe", ratio=2, seed=5)))
    b = load(tiny_model(TinySpec(family="qwen3_5_moe", ratio=2, fused_experts=True, mtp=True, seed=5)))
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        if not name.startswith("mtp."):
            assert torch.equal(p, q), name


def test_mtp_head_is_loaded_and_kept(tiny_model):
    path = tiny_model(TinySpec(family="qwen3_next", ratio=3, decoder_sparse_step=2, mtp=True, seed=2))
    model = load(path)
    assert model.mtp is not None and len(model.mtp.layers) == 1
    raw = load_file(str(path / "model.safetensors"))
    assert torch.equal(model.mtp.fc.weight, raw["mtp.fc.weight"])
    attn = model.mtp.layers[0].self_attn
    assert torch.equal(attn.o_proj.weight, raw["mtp.layers.0.self_attn.o_proj.weight"])


def test_qwen3_next_interleaved_projection_is_deinterleaved(tiny_model):
    """Row h*... of our fused in_proj must be value head h of key group h // r (model_spec.md §2.4)."""
    path = tiny_model(TinySpec(family="qwen3_next", ratio=3, decoder_sparse_step=2, mtp=True, seed=2))
    model = load(path)
    raw = load_file(str(path / "model.safetensors"))["model.layers.0.linear_attn.in_proj_qkvz.weight"]
    gdn = model.layers[0].linear_attn
    nk, r, dk, dv = gdn.nk, gdn.nv // gdn.nk, gdn.dk, gdn.dv
    group = raw.view(nk, 2 * dk + 2 * r * dv, -1)
    for h in range(gdn.nv):
        g, j = divmod(h, r)
        v_rows = group[g, 2 * dk + j * dv : 2 * dk + (j + 1) * dv]
        ours = gdn.in_proj.weight[2 * gdn.key_dim + h * dv : 2 * gdn.key_dim + (h + 1) * dv]
        assert torch.equal(ours, v_rows)


def test_missing_tensor_is_named_with_its_shape(tiny_model, tmp_path):
    src = tiny_model(TinySpec(family="qwen3_next", ratio=2))
    bad = copy_with(tmp_path, src, lambda t: t.pop("model.layers.1.linear_attn.A_log"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.linear_attn\.A_log \[4\]"):
        load(bad)


def test_wrong_shape_is_named(tiny_model, tmp_path):
    src = tiny_model(TinySpec(family="qwen3_next", ratio=2))
    def edit(t):
        t["model.layers.3.self_attn.k_proj.weight"] = torch.zeros(32, 64)
    with pytest.raises(CheckpointError, match=r"self_attn\.k_proj\.weight has shape \[32, 64\], expected \[64, 64\]"):
        load(copy_with(tmp_path, src, edit))


def test_unexpected_tensors_are_listed_and_vision_is_skipped(tiny_model, tmp_path, caplog):
    src = tiny_model(TinySpec(family="qwen3_5", ratio=1, seed=8))
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    extra = {"model.language_model.layers.0.mystery.weight": torch.zeros(3), "model.visual.blocks.99.w": torch.zeros(2)}
    save_file(extra, str(path / "extra.safetensors"))
    with caplog.at_level(logging.WARNING):
        load(path)
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert "model.layers.0.mystery.weight" in warned and "visual" not in warned


def test_unknown_model_type_is_refused(tiny_model, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_model(TinySpec(family="qwen3_next", ratio=2)), path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "model_type": "mamba2"}))
    with pytest.raises(ConfigError, match="model_type 'mamba2'"):
        load(path)


def test_index_naming_a_missing_shard(tiny_model, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_model(TinySpec(family="qwen3_5", ratio=3, shards=True, seed=3)), path)
    shard = sorted(path.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        load(path)
