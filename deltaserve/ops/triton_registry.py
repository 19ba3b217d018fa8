"""The Triton implementations of the ops, by op name, for a CUDA device (imported only on CUDA: it
imports triton). Each has its reference's signature (plus an optional launch `config`)."""

from __future__ import annotations

import logging
from typing import Callable

import torch

logger = logging.getLogger(__name__)

# Tensor-core dots on bf16 operands need Ampere or newer.
MIN_CAPABILITY = (8, 0)


def available_ops(device: torch.device) -> dict[str, Callable]:
    if device.type != "cuda":
        return {}
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        logger.warning("GPU capability %s < %s: no Triton ops; every op uses its torch reference",
                       capability, MIN_CAPABILITY)
        return {}
    from .attention import triton as attention_triton
    from .conv1d import triton as conv1d_triton
    from .gdn import triton_chunk, triton_recurrent
    from .moe import triton as moe_triton
    from .norm import triton as norm_triton

    return {
        "causal_conv1d_fn": conv1d_triton.causal_conv1d_fn,
        "causal_conv1d_update": conv1d_triton.causal_conv1d_update,
        "gdn_gating": triton_recurrent.gdn_gating,
        "chunk_gated_delta_rule": triton_chunk.chunk_gated_delta_rule,
        "fused_recurrent_gated_delta_rule": triton_recurrent.fused_recurrent_gated_delta_rule,
        "gdn_prefill": triton_chunk.gdn_prefill,
        "gdn_decode": triton_recurrent.gdn_decode,
        "gdn_verify": triton_recurrent.gdn_verify,
        "gdn_commit": triton_recurrent.gdn_commit,
        "rms_norm": norm_triton.rms_norm,
        "rms_norm_gated": norm_triton.rms_norm_gated,
        "store_kv": attention_triton.store_kv,
        "paged_attention": attention_triton.paged_attention,
        "topk_softmax": moe_triton.topk_softmax,
        "fused_moe": moe_triton.fused_moe,
    }
