"""Load a Hugging Face checkpoint directory (config.json + safetensors, single file or sharded) into a
HybridForCausalLM.

Tensors are memory-mapped and copied one at a time into the preallocated parameters, so peak host
memory stays near one copy of the weights. Before any copy, every expected tensor is checked for
presence and shape; a problem is a CheckpointError naming the tensor. Unexpected tensors are listed in
a warning, except the vision tower (model.visual.*), which is skipped on purpose.

Under tensor parallelism each rank builds its shard of the model and reads only its slices of each tensor
(a target's `read`, over the memory-mapped safetensors slice).

`load_format="dummy"` builds the model from its config alone with random weights drawn on the device
(dummy_weights.py), for benchmarks at published shapes without a checkpoint.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from ..config import ModelConfig
from ..distributed.parallel import SINGLE, Parallel
from ..ops import Kernels
from .dummy_weights import init_dummy_weights
from .qwen3_next import HybridForCausalLM

logger = logging.getLogger(__name__)

_VISION = re.compile(r"^(model\.)?visual\.")
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")
_LANGUAGE_PREFIX = "model.language_model."
LOAD_FORMATS = ("auto", "safetensors", "dummy")     # vLLM's names; "auto" reads safetensors


class CheckpointError(ValueError):
    """A checkpoint that does not match its config: the message names the tensor."""


def checkpoint_files(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from model.safetensors.index.json or the single file(s)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if missing:
            raise CheckpointError(f"{index} names shard files that do not exist: {missing}")
        return {name: path / f for name, f in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    names: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            names.update({name: f for name in st.keys()})
    return names


def canonical_name(name: str, family: str) -> str:
    """Checkpoint name -> the name our model expects: Qwen3.5's `model.language_model.` becomes `model.`
    (text-only Qwen3_5ForCausalLM checkpoints already use `model.`)."""
    if name.startswith(_LANGUAGE_PREFIX):
        return "model." + name[len(_LANGUAGE_PREFIX):]
    return name


def load_model(path: str | Path, *, device: torch.device | str, dtype: torch.dtype, kernels: Kernels,
               config: ModelConfig | None = None, show_progress: bool = True,
               parallel: Parallel = SINGLE) -> HybridForCausalLM:
    path = Path(path)
    config = config or ModelConfig.from_hf(path)
    files = checkpoint_files(path)
    by_name = {canonical_name(n, config.family): (n, f) for n, f in files.items() if not _VISION.match(n)}
    skipped_vision = len(files) - len(by_name)

    mtp_ids = {int(m.group(1)) for n in by_name if (m := _MTP_LAYER.match(n))}
    mtp_layers = max(mtp_ids) + 1 if mtp_ids else 0
    fused_experts = any(".mlp.experts.gate_up_proj" in n for n in by_name)
    model = HybridForCausalLM(config, kernels, dtype=dtype, device=device, mtp_layers=mtp_layers, parallel=parallel)
    expected = model.checkpoint_weights(fused_experts)

    missing = [n for n in expected if n not in by_name]
    if missing:
        shown = ", ".join(f"{n} {list(expected[n].shape)}" for n in missing[:8])
        more = f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""
        raise CheckpointError(f"checkpoint {path} is missing {len(missing)} tensor(s): {shown}{more}")
    unexpected = sorted(n for n in by_name if n not in expected)
    if config.tie_word_embeddings and "lm_head.weight" in unexpected:
        unexpected.remove("lm_head.weight")  # some exporters write the tied head out; it equals embed_tokens
    if unexpected:
        logger.warning("ignoring %d unexpected tensor(s) in %s: %s%s", len(unexpected), path,
                       ", ".join(unexpected[:10]), " ..." if len(unexpected) > 10 else "")
    if skipped_vision:
        logger.info("skipped %d vision-tower tensors (text model only)", skipped_vision)

    per_file: dict[Path, list[str]] = {}
    for name in expected:
        per_file.setdefault(by_name[name][1], []).append(name)
    _check_shapes(per_file, by_name, expected)
    # A bar only when loading takes more than a moment (hundreds of MB or more).
    total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # Read straight onto the target device (safetensors memory-maps the file and copies one tensor at a time).
    read_device = str(torch.device(device)) if torch.device(device).type == "cuda" else "cpu"
    with tqdm(total=len(expected), desc="Loading weights", unit="tensor",
              disable=not show_progress or total_bytes < (256 << 20)) as bar:
        for file, names in per_file.items():
            with safe_open(str(file), framework="pt", device=read_device) as st:
                for name in names:
                    target = expected[name]
                    source = by_name[name][0]
                    target.load(st.get_tensor(source) if target.read is None else target.read(st.get_slice(source)))
                    bar.update(1)
    logger.debug("loaded %s: %s, %d layers (%d GDN, %d attention), %d MTP layer(s), %s on %s",
                 path.name, config.family, config.num_hidden_layers, len(config.gdn_layer_ids),
                 len(config.attention_layer_ids), mtp_layers, dtype, device)
    return model.eval()


def check_load_format(load_format: str) -> str:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not supported (one of {', '.join(LOAD_FORMATS)})")
    return load_format


def build_dummy_model(config: ModelConfig, *, device: torch.device | str, dtype: torch.dtype, kernels: Kernels,
                      seed: int = 0, parallel: Parallel = SINGLE) -> HybridForCausalLM:
    """The model of `config` (with its MTP head when the config declares one, as a published checkpoint
    has) holding seeded random weights created on `device`."""
    model = HybridForCausalLM(config, kernels, dtype=dtype, device=device, mtp_layers=config.mtp_num_layers,
                              parallel=parallel)
    init_dummy_weights(model, seed=seed)
    logger.debug("dummy weights: %s, %d layers (%d GDN, %d attention), %d MTP layer(s), %.2f GB %s on %s",
                 config.family, config.num_hidden_layers, len(config.gdn_layer_ids), len(config.attention_layer_ids),
                 config.mtp_num_layers, sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9,
                 dtype, device)
    return model.eval()


def _check_shapes(per_file, by_name, expected) -> None:
    for file, names in per_file.items():
        with safe_open(str(file), framework="pt") as st:
            for name in names:
                shape = tuple(st.get_slice(by_name[name][0]).get_shape())
                if shape != expected[name].shape:
                    raise CheckpointError(
                        f"tensor {by_name[name][0]} has shape {list(shape)}, expected {list(expected[name].shape)}")
