"""Load a Hugging Face checkpoint directory (config.json + safetensors, single file or sharded) into a
HybridForCausalLM.

Tensors are memory-mapped and copied one at a time into the preallocated parameters, so peak host
memory stays near one copy of the weights. Before any copy, every expected tensor is checked for
presence and shape; a problem is a CheckpointError naming the tensor. Unexpected tensors are listed in
a warning, except the vision tower (model.visual.*), which is skipped on purpose, and quantization tensors
(`*_scale*`, `*qweight*`, `*zeros*`, `*g_idx*`, ...) that nothing consumes, which are an error: dropping
them would compute with the raw quantized values.

Block-FP8 (config.quantization): each FP8 `X.weight` comes with `X.weight_scale_inv` (fused experts:
`X_scale_inv`), both checked. A target that stores FP8 (Target.fp8) gets packed rows (values + block scales,
ops/quant/fp8.py) so the layers' row regroupings move scales with their rows; a dense target (a module whose
kind is not converted everywhere, e.g. the GDN in_proj beside the bf16 in_proj_ba) gets the tensor
dequantised in fp32 (exact at fp32; rounded once in bf16). Online FP8 (quantization.online) quantises each
dense tensor that lands in an FP8 target in 128 x 128 blocks first, into the same format.

Under tensor parallelism each rank builds its shard of the model and reads only its slices of each tensor
(a target's `read`, over the memory-mapped safetensors slice). An FP8 tensor's shard carries its checkpoint
blocks' multipliers (layers/weights.py fp8_shard_rows; the scale tensor is read whole); online FP8 quantises
each rank's shard in its own blocks.

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
from ..distributed.parallel import SINGLE, Parallel, ShardingError
from ..layers.weights import Slices, Target, fp8_shard_dense, fp8_shard_rows
from ..ops import Kernels
from ..ops.quant.fp8 import BLOCK, FP8_DTYPE, dequantize_blocks, pack_rows, quantize_blocks
from .dummy_weights import init_dummy_weights
from .qwen3_next import HybridForCausalLM

logger = logging.getLogger(__name__)

_VISION = re.compile(r"^(model\.)?visual\.")
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")
_LANGUAGE_PREFIX = "model.language_model."
# tensors a checkpoint may have or not: the FP8 KV-cache multipliers of an attention layer
_OPTIONAL = re.compile(r"\.self_attn\.(k|v)_scale$")
# names of quantization tensors (FP8 / INT scales, GPTQ / AWQ packing, KV-cache scales): never silently dropped
_QUANT_TENSOR = re.compile(r"(_scale(_inv)?|\.scales?|qweight|qzeros|\.zeros|g_idx|_zero_point|\.absmax|"
                           r"quant_state|weight_packed|_amax)$|\.(k|v|q)_scale$")
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

    scale_of = _fp8_scales(config, expected, by_name, path)
    for name in [n for n in expected if _OPTIONAL.search(n) and n not in by_name]:
        del expected[name]
    missing = [n for n in expected if n not in by_name]
    if missing:
        shown = ", ".join(f"{n} {list(expected[n].shape)}" for n in missing[:8])
        more = f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""
        raise CheckpointError(f"checkpoint {path} is missing {len(missing)} tensor(s): {shown}{more}")
    consumed = set(scale_of.values())
    unexpected = sorted(n for n in by_name if n not in expected and n not in consumed)
    if config.tie_word_embeddings and "lm_head.weight" in unexpected:
        unexpected.remove("lm_head.weight")  # some exporters write the tied head out; it equals embed_tokens
    quant_leftovers = [n for n in unexpected if _QUANT_TENSOR.search(n)]
    if quant_leftovers:
        method = config.quantization.method if config.quantization else "none (no quantization_config)"
        raise CheckpointError(
            f"checkpoint {path} has {len(quant_leftovers)} quantization tensor(s) this model does not consume "
            f"(quantization: {method}): {', '.join(quant_leftovers[:8])}{' ...' if len(quant_leftovers) > 8 else ''}"
            "; loading without them would compute with the raw quantized values")
    if unexpected:
        logger.warning("ignoring %d unexpected tensor(s) in %s: %s%s", len(unexpected), path,
                       ", ".join(unexpected[:10]), " ..." if len(unexpected) > 10 else "")
    if skipped_vision:
        logger.info("skipped %d vision-tower tensors (text model only)", skipped_vision)

    per_file: dict[Path, list[str]] = {}
    for name in expected:
        per_file.setdefault(by_name[name][1], []).append(name)
    _check_shapes(per_file, by_name, expected, scale_of)
    # A bar only when loading takes more than a moment (hundreds of MB or more).
    total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # Read straight onto the target device (safetensors memory-maps the file and copies one tensor at a time).
    read_device = str(torch.device(device)) if torch.device(device).type == "cuda" else "cpu"
    with tqdm(total=len(expected), desc="Loading weights", unit="tensor",
              disable=not show_progress or total_bytes < (256 << 20)) as bar:
        for file, names in per_file.items():
            with safe_open(str(file), framework="pt", device=read_device) as st:
                for name in names:
                    target, source = expected[name], by_name[name][0]
                    tensor = st.get_tensor(source) if target.read is None else target.read(st.get_slice(source))
                    if tensor is not None:      # None: a tensor this rank does not hold (another's experts)
                        if target.read is not None and name in scale_of and not isinstance(target.read, Slices):
                            raise NotImplementedError(f"{name}: an FP8 shard needs a Slices read (layers/weights.py)")
                        scale = _read(files, by_name, scale_of[name], read_device) if name in scale_of else None
                        tensor = _prepare(source, tensor, scale, target, config)
                    try:
                        target.load(tensor)
                    except ShardingError as e:
                        raise ShardingError(f"{source}: {e}") from None
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


def _check_shapes(per_file, by_name, expected, scale_of) -> None:
    for file, names in per_file.items():
        with safe_open(str(file), framework="pt") as st:
            for name in names:
                shape = tuple(st.get_slice(by_name[name][0]).get_shape())
                if _OPTIONAL.search(name) and shape in ((), (1,)):
                    continue
                if shape != expected[name].shape:
                    raise CheckpointError(
                        f"tensor {by_name[name][0]} has shape {list(shape)}, expected {list(expected[name].shape)}")
                if name in scale_of:
                    dtype = st.get_slice(by_name[name][0]).get_dtype()
                    if dtype not in ("F8_E4M3", "float8_e4m3fn"):
                        raise CheckpointError(f"tensor {by_name[name][0]} has a weight_scale_inv but dtype {dtype} "
                                              "(block-FP8 weights are float8_e4m3fn)")
                    want = (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128))
                    scale_file = by_name[scale_of[name]][1]
                    with safe_open(str(scale_file), framework="pt") as ss:
                        got = tuple(ss.get_slice(by_name[scale_of[name]][0]).get_shape())
                    if got != want:
                        raise CheckpointError(f"tensor {by_name[scale_of[name]][0]} has shape {list(got)}, expected "
                                              f"{list(want)} (one scale per 128 x 128 block of {list(shape)})")


def _scale_name(name: str) -> str:
    return name[: -len(".weight")] + ".weight_scale_inv" if name.endswith(".weight") else name + "_scale_inv"


def _fp8_scales(config: ModelConfig, expected, by_name, path: Path) -> dict[str, str]:
    """Expected tensor -> its weight_scale_inv's name, for the FP8 tensors of the checkpoint; scales in a
    checkpoint without a quantization_config are an error (the values would be read as weights)."""
    scale_of = {n: _scale_name(n) for n in expected if _scale_name(n) in by_name}
    if scale_of and (config.quantization is None or config.quantization.online):
        some = ", ".join(sorted(scale_of.values())[:4])
        raise CheckpointError(f"checkpoint {path} holds FP8 scales ({some}, ...) but its config.json has no "
                              "quantization_config (quant_method 'fp8')")
    return scale_of


def _read(files, by_name, name: str, device: str) -> torch.Tensor:
    with safe_open(str(by_name[name][1]), framework="pt", device=device) as st:
        return st.get_tensor(by_name[name][0])


def _prepare(name: str, tensor: torch.Tensor, scale: torch.Tensor | None, target: Target,
             config: ModelConfig) -> torch.Tensor:
    """The tensor a target takes: packed FP8 rows for an FP8 target, a dense tensor otherwise. `tensor` is
    this rank's part (target.read's) of the checkpoint tensor, `scale` its whole weight_scale_inv."""
    quant, fp8_target = config.quantization, target.fp8
    if scale is None and tensor.dtype == FP8_DTYPE:
        raise CheckpointError(f"tensor {name} is float8_e4m3fn but has no weight_scale_inv")
    if scale is not None:
        if target.read is not None:     # a shard: its rows' / columns' block multipliers
            if fp8_target:
                return fp8_shard_rows(name, tensor, scale, target.read, block_k=target.block_k,
                                      row_group=target.row_group)
            return fp8_shard_dense(name, tensor, scale, target.read)
        return pack_rows(tensor, scale) if fp8_target else dequantize_blocks(tensor, scale.float())
    if fp8_target:
        if quant is not None and quant.online:      # a shard is quantised in its own blocks
            block = (BLOCK, target.block_k)
            return pack_rows(*quantize_blocks(tensor, block), block)
        raise CheckpointError(f"tensor {name} is {tensor.dtype} without a weight_scale_inv, but the "
                              "quantization_config converts it (not in modules_to_not_convert)")
    return tensor
