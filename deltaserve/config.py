"""Frozen configuration objects. `ModelConfig.from_hf` is the only reader of a checkpoint's config.json.

A config that deltaserve cannot run faithfully is refused with a ConfigError naming the field: an
unknown model_type, a RoPE scaling it does not implement, a hidden activation other than SiLU, a
quantization_config other than block-FP8 (QuantizationConfig), ...
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# model_type (top level or text_config) -> family. The family fixes the GDN projection layout,
# the weight prefix and which FFN fields apply.
FAMILIES = {
    "qwen3_next": "qwen3_next",
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
}
LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"


class ConfigError(ValueError):
    """A config.json deltaserve cannot run faithfully; the message names the field."""


# quantization_config.quant_method values seen in the wild, none of which is implemented except "fp8"
_KNOWN_METHODS = ("awq", "gptq", "compressed-tensors", "bitsandbytes", "mxfp4", "modelopt", "modelopt_fp4",
                  "fbgemm_fp8", "bitnet", "hqq", "eetq", "torchao", "quark", "gguf", "exl2", "aqlm", "marlin")
_FP8_FIELDS = ("quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert",
               "ignored_layers")
_LAYER_PREFIX = re.compile(r"^(model\.language_model\.|model\.)?((mtp\.)?layers\.\d+\.|mtp\.)?")


@dataclasses.dataclass(frozen=True)
class QuantizationConfig:
    """Block-FP8 weights (wave2.md §3): e4m3 values with one fp32 dequantisation multiplier per
    weight_block_size block, activations unquantised (the dynamic scheme's per-token scales are a kernel
    matter); modules_to_not_convert stay in the checkpoint dtype. online: a bf16 checkpoint quantised at load
    (LLM(quantization="fp8")) into the same format, with Qwen's not-convert list."""

    method: str = "fp8"
    weight_block_size: tuple[int, int] = (128, 128)
    activation_scheme: str = "dynamic"
    modules_to_not_convert: tuple[str, ...] = ()
    online: bool = False

    def converts(self, *names: str) -> bool:
        """Whether the checkpoint tensors of these modules (names relative to a decoder layer, e.g.
        "self_attn.o_proj", or top level, "lm_head") are FP8 in every layer: no not-convert entry overlaps
        any of them (an entry naming one layer's module keeps that module dense in every layer: a layer
        kind has one representation, and dequantising the others at load is exact)."""
        rel = [_LAYER_PREFIX.sub("", e) for e in self.modules_to_not_convert]
        return not any(n == r or n.startswith(r + ".") or r.startswith(n + ".") for n in names for r in rel if r)


# Qwen's modules_to_not_convert for online FP8 (published FP8 configs, wave2.md §3): routers, norms, the GDN
# gate projections, conv and gates, the embeddings, lm_head and the MTP head's fc stay in the checkpoint dtype.
ONLINE_FP8_NOT_CONVERT = ("lm_head", "embed_tokens", "input_layernorm", "post_attention_layernorm",
                          "linear_attn.A_log", "linear_attn.conv1d", "linear_attn.dt_bias", "linear_attn.in_proj_ba",
                          "linear_attn.in_proj_a", "linear_attn.in_proj_b", "linear_attn.norm", "mlp.gate",
                          "mlp.shared_expert_gate", "self_attn.q_norm", "self_attn.k_norm", "mtp.fc", "mtp.norm",
                          "mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_hidden", "visual")


def online_fp8() -> QuantizationConfig:
    return QuantizationConfig(modules_to_not_convert=ONLINE_FP8_NOT_CONVERT, online=True)


def parse_quantization(raw: Any) -> QuantizationConfig | None:
    """config.json's quantization_config -> QuantizationConfig; anything not implemented is a ConfigError
    naming the method or the field."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"quantization_config must be an object, got {type(raw).__name__}")
    method = raw.get("quant_method")
    if method != "fp8":
        known = " (a known method, not implemented)" if method in _KNOWN_METHODS else ""
        raise ConfigError(f"quantization_config.quant_method {method!r} is not supported{known}: only 'fp8' with "
                          "128 x 128 weight blocks (Qwen's FP8 checkpoints) is implemented")
    unknown = sorted(set(raw) - set(_FP8_FIELDS))
    if unknown:
        raise ConfigError(f"quantization_config fields {unknown} (quant_method 'fp8') are not implemented")
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"quantization_config.fmt {fmt!r} is not supported (only 'e4m3')")
    scheme = raw.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ConfigError(f"quantization_config.activation_scheme {scheme!r} is not supported (only 'dynamic': "
                          "static activation scales are not implemented)")
    block = raw.get("weight_block_size")
    if block is None:
        raise ConfigError("quantization_config.weight_block_size is missing: per-tensor / per-channel FP8 scales "
                          "are not implemented (only weight_block_size [128, 128])")
    if list(block) != [128, 128]:
        raise ConfigError(f"quantization_config.weight_block_size {list(block)} is not supported (only [128, 128])")
    skip = list(raw.get("modules_to_not_convert") or []) + list(raw.get("ignored_layers") or [])
    if not all(isinstance(m, str) for m in skip):
        raise ConfigError("quantization_config.modules_to_not_convert must be a list of module names")
    return QuantizationConfig(weight_block_size=(128, 128), activation_scheme=scheme,
                              modules_to_not_convert=tuple(skip))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything about a checkpoint that changes the forward pass (model_spec.md §1)."""

    family: str                      # "qwen3_next" | "qwen3_5" | "qwen3_5_moe"
    model_type: str                  # as written in config.json (top level)
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]     # per layer: "linear_attention" (GDN) or "full_attention"
    moe_layers: tuple[bool, ...]     # per layer: sparse MoE FFN (True) or dense SwiGLU MLP
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    # gated deltanet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    gdn_norm_activation: str         # "silu" (published models) or "sigmoid" (the sigmoid-gated variant)
    # feed-forward
    intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    # multi-token prediction head (mtp.* tensors); 0 = none declared by the config
    mtp_num_layers: int
    # token ids from config.json / generation_config.json
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str                 # the checkpoint's dtype ("bfloat16", ...)
    quantization: QuantizationConfig | None = None   # block-FP8 weights (checkpoint or online); None: dense

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @property
    def gdn_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def kernel_shapes(self) -> dict[str, int]:
        """The dims kernel selection checks (ops.select_kernels)."""
        return {"gdn_head_k": self.linear_key_head_dim, "gdn_head_v": self.linear_value_head_dim,
                "attn_head_dim": self.head_dim}

    @property
    def weight_prefix(self) -> str:
        """Prefix of the language model's tensors in published checkpoints of this family."""
        return "model." if self.family == "qwen3_next" else "model.language_model."

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def from_hf(cls, path: str | os.PathLike) -> "ModelConfig":
        """Read `path`/config.json (and generation_config.json when present)."""
        path = Path(path)
        cfg_file = path / "config.json" if path.is_dir() else path
        if not cfg_file.is_file():
            raise ConfigError(f"no config.json at {cfg_file}")
        raw = json.loads(cfg_file.read_text())
        gen_file = cfg_file.parent / "generation_config.json"
        gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
        return cls.from_dict(raw, generation_config=gen)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation_config: dict[str, Any] | None = None) -> "ModelConfig":
        top_type = raw.get("model_type")
        if top_type not in FAMILIES:
            raise ConfigError(
                f"model_type {top_type!r} is not supported (supported: {', '.join(sorted(FAMILIES))})"
            )
        family = FAMILIES[top_type]
        text = raw
        if "text_config" in raw:
            text = dict(raw["text_config"])
            inner = text.get("model_type")
            if inner is not None and FAMILIES.get(inner) != family:
                raise ConfigError(f"text_config.model_type {inner!r} does not belong to model_type {top_type!r}")
        # The VLM class reads tie_word_embeddings from the top level (model_spec.md §1.2).
        tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        config = _build(family, top_type, text, bool(tie), generation_config or {})
        quant = parse_quantization(raw.get("quantization_config", text.get("quantization_config")))
        return dataclasses.replace(config, quantization=quant) if quant else config

    def with_quantization(self, quantization: str | None) -> "ModelConfig":
        """The config for LLM(quantization=...): None keeps the checkpoint's; "fp8" quantises a dense checkpoint
        at load (an FP8 checkpoint is already FP8); anything else is refused."""
        if quantization is None:
            return self
        if quantization != "fp8":
            raise ConfigError(f"quantization {quantization!r} is not supported (only 'fp8')")
        if self.quantization is not None:
            return self
        return dataclasses.replace(self, quantization=online_fp8())


def _get(text: dict[str, Any], key: str, default: Any = dataclasses.MISSING) -> Any:
    if key in text and text[key] is not None:
        return text[key]
    if default is dataclasses.MISSING:
        raise ConfigError(f"config field {key!r} is missing")
    return default


def _layer_types(text: dict[str, Any], n: int) -> tuple[str, ...]:
    types = text.get("layer_types")
    if types is None:
        interval = int(_get(text, "full_attention_interval", 4))
        if interval <= 0:
            raise ConfigError(f"full_attention_interval must be positive, got {interval}")
        types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(n)]
    types = tuple(types)
    if len(types) != n:
        raise ConfigError(f"layer_types has {len(types)} entries but num_hidden_layers is {n}")
    bad = sorted({t for t in types if t not in (LINEAR_ATTENTION, FULL_ATTENTION)})
    if bad:
        raise ConfigError(f"layer_types contains unsupported layer kinds {bad}")
    return types


def _rope(text: dict[str, Any], head_dim: int) -> tuple[int, float]:
    """(rotary_dim, theta). Only the default RoPE is implemented; mRoPE sections reduce to 1-D RoPE
    for text-only input (all three position rows equal), so they are accepted."""
    params = dict(text.get("rope_parameters") or {})
    scaling = text.get("rope_scaling")
    if scaling:
        params = {**scaling, **params}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ConfigError(f"rope_parameters.rope_type {rope_type!r} is not implemented (only 'default')")
    theta = float(params.get("rope_theta", text.get("rope_theta", 10000.0)))
    factor = float(params.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
    rotary_dim = int(head_dim * factor)
    if rotary_dim <= 0 or rotary_dim > head_dim or rotary_dim % 2:
        raise ConfigError(f"partial_rotary_factor {factor} gives rotary dim {rotary_dim} for head_dim {head_dim}")
    return rotary_dim, theta


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))


def _build(family: str, top_type: str, text: dict[str, Any], tie: bool, gen: dict[str, Any]) -> ModelConfig:
    if _get(text, "hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {text['hidden_act']!r} is not supported (only 'silu')")
    if text.get("attention_bias"):
        raise ConfigError("attention_bias=true is not supported (published models have no attention biases)")
    if text.get("use_sliding_window"):
        raise ConfigError("use_sliding_window=true is not supported")
    if text.get("attn_output_gate") is False:
        raise ConfigError("attn_output_gate=false is not supported (the gated q_proj layout is assumed)")
    n = int(_get(text, "num_hidden_layers"))
    hidden = int(_get(text, "hidden_size"))
    heads = int(_get(text, "num_attention_heads"))
    head_dim = int(_get(text, "head_dim", hidden // heads))
    rotary_dim, theta = _rope(text, head_dim)
    layer_types = _layer_types(text, n)

    num_experts = int(text.get("num_experts") or 0)
    if family == "qwen3_5":
        moe_layers = (False,) * n
        norm_topk = True
    elif family == "qwen3_5_moe":
        if num_experts <= 0:
            raise ConfigError("num_experts must be positive for qwen3_5_moe")
        moe_layers = (True,) * n
        if text.get("norm_topk_prob") is False:
            logger.warning("norm_topk_prob=false is ignored for qwen3_5_moe: its router always renormalises")
        norm_topk = True
    else:  # qwen3_next: decoder_sparse_step / mlp_only_layers decide
        step = int(text.get("decoder_sparse_step") or 1)
        dense_only = set(text.get("mlp_only_layers") or [])
        moe_layers = tuple(num_experts > 0 and i not in dense_only and (i + 1) % step == 0 for i in range(n))
        norm_topk = bool(text.get("norm_topk_prob", True))

    nk, nv = int(_get(text, "linear_num_key_heads")), int(_get(text, "linear_num_value_heads"))
    if nv % nk:
        raise ConfigError(f"linear_num_value_heads ({nv}) must be a multiple of linear_num_key_heads ({nk})")
    if heads % int(_get(text, "num_key_value_heads")):
        raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
    gate_act = text.get("linear_norm_activation", "silu")
    if gate_act not in ("silu", "sigmoid"):
        raise ConfigError(f"linear_norm_activation {gate_act!r} is not supported ('silu' or 'sigmoid')")

    mtp = int(text.get("mtp_num_hidden_layers", text.get("num_nextn_predict_layers", 0)) or 0)
    eos = _token_ids(gen.get("eos_token_id")) or _token_ids(text.get("eos_token_id"))
    bos = gen.get("bos_token_id", text.get("bos_token_id"))
    dtype = text.get("dtype", text.get("torch_dtype")) or "bfloat16"

    return ModelConfig(
        family=family,
        model_type=top_type,
        vocab_size=int(_get(text, "vocab_size")),
        hidden_size=hidden,
        num_hidden_layers=n,
        layer_types=layer_types,
        moe_layers=moe_layers,
        rms_norm_eps=float(_get(text, "rms_norm_eps", 1e-6)),
        tie_word_embeddings=tie,
        max_position_embeddings=int(_get(text, "max_position_embeddings", 32768)),
        num_attention_heads=heads,
        num_key_value_heads=int(_get(text, "num_key_value_heads")),
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        rope_theta=theta,
        linear_num_key_heads=nk,
        linear_num_value_heads=nv,
        linear_key_head_dim=int(_get(text, "linear_key_head_dim")),
        linear_value_head_dim=int(_get(text, "linear_value_head_dim")),
        linear_conv_kernel_dim=int(_get(text, "linear_conv_kernel_dim", 4)),
        gdn_norm_activation=gate_act,
        intermediate_size=int(text.get("intermediate_size") or 0),
        num_experts=num_experts,
        num_experts_per_tok=int(text.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(text.get("moe_intermediate_size") or 0),
        shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size") or 0),
        norm_topk_prob=norm_topk,
        mtp_num_layers=mtp,
        eos_token_ids=eos,
        bos_token_id=None if bos is None else int(bos),
        torch_dtype=str(dtype),
    )
