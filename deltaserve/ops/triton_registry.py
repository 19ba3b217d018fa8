"""The Triton implementations of the ops, by op name, for a CUDA device (imported only on CUDA: it
imports triton). Each has its reference's signature (plus an optional launch `config`)."""

from __future__ import annotations

import logging
from typing import Callable, Mapping

import torch

logger = logging.getLogger(__name__)

# Tensor-core dots on bf16 operands need Ampere or newer.
MIN_CAPABILITY = (8, 0)

# Which model dims each kernel needs in SUPPORTED_HEAD_DIMS (shape keys as select_kernels receives them).
_GDN_DIMS = ("gdn_head_k", "gdn_head_v")
_ATTN_DIMS = ("attn_head_dim",)
SHAPE_LIMITS = {
    "chunk_gated_delta_rule": _GDN_DIMS, "fused_recurrent_gated_delta_rule": _GDN_DIMS, "gdn_prefill": _GDN_DIMS,
    "gdn_decode": _GDN_DIMS, "gdn_verify": _GDN_DIMS, "gdn_commit": _GDN_DIMS,
    "store_kv": _ATTN_DIMS, "attention_prologue": _ATTN_DIMS, "paged_attention": _ATTN_DIMS,
    "fused_paged_attention": _ATTN_DIMS,
}


def _refusal(op: str, shapes: Mapping[str, int]) -> str | None:
    from .gdn.dispatch import DEVICE_VERIFIED_DIMS
    from .triton_common import SUPPORTED_HEAD_DIMS

    # the chunked prefill only at the head dims verified on the device (its bf16 kernels gave non-finite
    # outputs on the H200 at 16 and 32)
    dims = DEVICE_VERIFIED_DIMS if op in ("chunk_gated_delta_rule", "gdn_prefill") else SUPPORTED_HEAD_DIMS
    bad = {k: shapes[k] for k in SHAPE_LIMITS.get(op, ()) if k in shapes and shapes[k] not in dims}
    return f"{', '.join(f'{k}={v}' for k, v in bad.items())} not in {dims}" if bad else None


def available_ops(device: torch.device, shapes: Mapping[str, int] | None = None
                  ) -> tuple[dict[str, Callable], dict[str, str]]:
    """(usable Triton ops by name, refused op -> reason) for `device` and a model of `shapes`."""
    if device.type != "cuda":
        return {}, {}
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        logger.warning("GPU capability %s < %s: no Triton ops; every op uses its torch reference",
                       capability, MIN_CAPABILITY)
        return {}, {}
    ops = _all_ops()
    refused = {name: why for name in ops if (why := _refusal(name, shapes or {}))}
    return {name: fn for name, fn in ops.items() if name not in refused}, refused


def fold_rules(ops: Mapping[str, Callable]) -> dict[str, object]:
    """Kernels' fold-rule fields for the fused kernels among `ops` (the rules live beside the kernels)."""
    from .linear import triton as linear_triton

    rules: dict[str, object] = {}
    if "rms_norm_linear_conv" in ops:
        rules["conv_fold_rows"] = linear_triton.CONV_FOLD_ROWS
    if "gated_linear" in ops:
        rules["gate_fold_rows"] = linear_triton.GATE_FOLD_MAX_ROWS
    return rules


def _all_ops() -> dict[str, Callable]:
    from .activation import triton as activation_triton
    from .attention import triton as attention_triton
    from .conv1d import triton as conv1d_triton
    from .embedding import triton as embedding_triton
    from .gdn import triton_chunk, triton_recurrent, triton_verify
    from .linear import triton as linear_triton
    from .moe import triton as moe_triton
    from .moe import triton_routing
    from .norm import triton as norm_triton

    return {
        "causal_conv1d_fn": conv1d_triton.causal_conv1d_fn,
        "causal_conv1d_update": conv1d_triton.causal_conv1d_update,
        "gdn_gating": triton_recurrent.gdn_gating,
        "chunk_gated_delta_rule": triton_chunk.chunk_gated_delta_rule,
        "fused_recurrent_gated_delta_rule": triton_recurrent.fused_recurrent_gated_delta_rule,
        "gdn_prefill": triton_chunk.gdn_prefill,
        "gdn_decode": triton_recurrent.gdn_decode,
        "gdn_verify": triton_verify.gdn_verify,
        "gdn_commit": triton_verify.gdn_commit,
        "rms_norm": norm_triton.rms_norm,
        "rms_norm_gated": norm_triton.rms_norm_gated,
        "store_kv": attention_triton.store_kv,
        "attention_prologue": attention_triton.attention_prologue,
        "paged_attention": attention_triton.paged_attention,
        "fused_paged_attention": attention_triton.fused_paged_attention,
        "topk_softmax": triton_routing.topk_softmax,
        "fused_moe": moe_triton.fused_moe,
        "fused_moe_routed": moe_triton.fused_moe_routed,
        "linear": linear_triton.linear,
        "rms_norm_linear": linear_triton.rms_norm_linear,
        "rms_norm_linear_conv": linear_triton.rms_norm_linear_conv,
        "gated_linear": linear_triton.gated_linear,
        "silu_and_mul": activation_triton.silu_and_mul,
        "sigmoid_mul": activation_triton.sigmoid_mul,
        "embed_rope": embedding_triton.embed_rope,
    }
