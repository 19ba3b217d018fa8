"""Tiny checkpoints in Qwen's published block-FP8 layout (wave2.md §3), written from a transformers-built tiny
model: every convertible weight quantised in 128 x 128 blocks (float8_e4m3fn `weight` + fp32
`weight_scale_inv`), the not-convert modules left in bf16, and quantization_config in config.json; plus the
"dequantised twin": the same directory with every weight replaced by exactly what the FP8 one describes (fp32),
which transformers runs as the oracle."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deltaserve.config import ONLINE_FP8_NOT_CONVERT
from deltaserve.ops.quant.fp8 import dequantize_blocks, quantize_blocks

_LAYER = re.compile(r"^(model\.language_model\.|model\.)?(mtp\.)?(layers\.\d+\.)?")


def not_convert_list(names: list[str], dense: tuple[str, ...]) -> list[str]:
    """A published-style modules_to_not_convert: every module (full name, per layer) kept dense."""
    out = set()
    for name in names:
        module = name.rsplit(".", 1)[0] if name.endswith(".weight") else name
        if not converts(name, dense):
            out.add(module)
    return sorted(out)


def converts(name: str, dense: tuple[str, ...] = ONLINE_FP8_NOT_CONVERT) -> bool:
    """Whether Qwen quantises this checkpoint tensor (matrices of the projections and experts only, minus the
    modules of `dense`, names relative to a layer)."""
    rel = _LAYER.sub("", name)
    if name.startswith("mtp.") and not name.startswith("mtp.layers."):
        rel = name[len("mtp."):]
        rel = "mtp." + rel
    if any(rel == r or rel.startswith(r + ".") for r in dense):
        return False
    if rel.endswith("norm.weight") or rel.startswith("visual") or "visual." in name:
        return False
    return (re.search(r"(_proj|in_proj_\w+)\.weight$", rel) is not None
            or rel.endswith(("experts.gate_up_proj", "experts.down_proj")))


def write_fp8_checkpoint(src: Path, dst: Path, *, twin: Path | None = None,
                         dense: tuple[str, ...] = ONLINE_FP8_NOT_CONVERT) -> Path:
    """src: a bf16/fp32 tiny checkpoint (single file). dst: its block-FP8 version (the modules of `dense` kept
    bf16); twin: the dequantised twin."""
    shutil.copytree(src, dst)
    file = dst / "model.safetensors"
    with safe_open(str(file), framework="pt") as st:
        tensors = {n: st.get_tensor(n) for n in st.keys()}
    fp8, deq = {}, {}
    for name, t in tensors.items():
        if converts(name, dense):
            q, s = quantize_blocks(t.float())
            fp8[name] = q
            scale_name = (name[: -len(".weight")] + ".weight_scale_inv" if name.endswith(".weight")
                          else name + "_scale_inv")
            fp8[scale_name] = s
            deq[name] = dequantize_blocks(q, s)
        else:
            fp8[name] = t.to(torch.bfloat16) if t.is_floating_point() else t
            deq[name] = fp8[name].float() if t.is_floating_point() else t
    save_file(fp8, str(file), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128],
                                  "modules_to_not_convert": not_convert_list(list(tensors), dense)}
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    if twin is not None:
        shutil.copytree(src, twin)
        save_file(deq, str(twin / "model.safetensors"), metadata={"format": "pt"})
    return dst
