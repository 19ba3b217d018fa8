"""Public op API. Every op has a plain-torch reference (the CPU path and the test oracle); a Triton
implementation with the same signature replaces it on CUDA devices where one exists.

The choice is made once, by `select_kernels`, when a model is built, and logged once. Nothing here
falls back silently at call time: a Triton op that cannot handle its inputs raises.
This package imports nothing from the rest of deltaserve.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Mapping

import torch

from .activation import reference as activation_ref
from .attention import reference as attention_ref
from .conv1d import reference as conv1d_ref
from .embedding import reference as embedding_ref
from .gdn import reference as gdn_ref
from .linear import reference as linear_ref
from .moe import reference as moe_ref
from .norm import reference as norm_ref

VerifyStash = gdn_ref.VerifyStash

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Kernels:
    """One implementation of every op, chosen together. `backend` names the source of each op."""

    backend: dict[str, str]
    causal_conv1d_fn: Callable
    causal_conv1d_update: Callable
    gdn_gating: Callable
    chunk_gated_delta_rule: Callable
    fused_recurrent_gated_delta_rule: Callable
    gdn_prefill: Callable            # gates + L2 norm + chunked delta rule (prefill core of a GDN layer)
    gdn_decode: Callable             # conv update + gates + L2 norm + delta rule + gated norm, 1 token/seq
    gdn_verify: Callable             # gdn_decode over K+1 draft tokens/seq into a VerifyStash, pools untouched
    gdn_commit: Callable             # state + conv window of each sequence's accepted prefix into its slot
    rms_norm: Callable
    rms_norm_gated: Callable
    store_kv: Callable
    attention_prologue: Callable     # q/k RMSNorm + partial RoPE + KV store, between QKV proj and attention
    paged_attention: Callable
    fused_paged_attention: Callable  # attention_prologue + paged_attention (one launch for decode batches)
    topk_softmax: Callable
    fused_moe: Callable
    fused_moe_routed: Callable       # topk_softmax + fused_moe (the Triton op routes inside w13 at decode)
    silu_and_mul: Callable           # SwiGLU middle: [.., 2I] (gate | up) -> silu(gate) * up
    sigmoid_mul: Callable            # x * sigmoid(gate): the attention output gate
    linear: Callable                 # y = x W^T: every projection and the logits
    rms_norm_linear: Callable        # (normed @ W^T, normed, x + residual): a pre-norm sublayer's input projection
    rms_norm_linear_conv: Callable   # rms_norm_linear + the one-token conv of a GDN layer's q|k|v columns (decode)
    gated_linear: Callable           # (gate [after a per-head norm] * x) @ W^T: a gated sublayer's output projection
    embed_rope: Callable             # token embeddings (pending ids resolved on device) + the positions' RoPE tables


REFERENCE_OPS: dict[str, Callable] = {
    "causal_conv1d_fn": conv1d_ref.causal_conv1d_fn,
    "causal_conv1d_update": conv1d_ref.causal_conv1d_update,
    "gdn_gating": gdn_ref.gdn_gating,
    "chunk_gated_delta_rule": gdn_ref.chunk_gated_delta_rule,
    "fused_recurrent_gated_delta_rule": gdn_ref.fused_recurrent_gated_delta_rule,
    "gdn_prefill": gdn_ref.gdn_prefill,
    "gdn_decode": gdn_ref.gdn_decode,
    "gdn_verify": gdn_ref.gdn_verify,
    "gdn_commit": gdn_ref.gdn_commit,
    "rms_norm": norm_ref.rms_norm,
    "rms_norm_gated": norm_ref.rms_norm_gated,
    "store_kv": attention_ref.store_kv,
    "attention_prologue": attention_ref.attention_prologue,
    "paged_attention": attention_ref.paged_attention,
    "fused_paged_attention": attention_ref.fused_paged_attention,
    "topk_softmax": moe_ref.topk_softmax,
    "fused_moe": moe_ref.fused_moe,
    "fused_moe_routed": moe_ref.fused_moe_routed,
    "silu_and_mul": activation_ref.silu_and_mul,
    "sigmoid_mul": activation_ref.sigmoid_mul,
    "linear": linear_ref.linear,
    "rms_norm_linear": linear_ref.rms_norm_linear,
    "rms_norm_linear_conv": linear_ref.rms_norm_linear_conv,
    "gated_linear": linear_ref.gated_linear,
    "embed_rope": embedding_ref.embed_rope,
}


def _triton_ops(device: torch.device, shapes: Mapping[str, int]) -> tuple[dict[str, Callable], dict[str, str]]:
    """The Triton implementations usable on `device` for a model of these shapes, and why the others
    are not (empty where Triton or the device cannot run any)."""
    if device.type != "cuda":
        return {}, {}
    try:
        from . import triton_registry
    except ImportError as exc:  # triton missing from this install
        logger.warning("Triton unavailable (%s); every op uses its torch reference", exc)
        return {}, {}
    return triton_registry.available_ops(device, shapes)


def select_kernels(device: torch.device | str, *, force_reference: bool = False,
                   shapes: Mapping[str, int] | None = None) -> Kernels:
    """Pick each op's implementation once for `device` and a model of `shapes` (head dims, see
    triton_registry.SHAPE_LIMITS); log the choice. An op whose Triton kernel cannot take these shapes
    keeps its reference, with a warning saying why, so the choice never changes at call time."""
    device = torch.device(device)
    chosen = dict(REFERENCE_OPS)
    backend = {name: "reference" for name in chosen}
    if not force_reference:
        triton_ops, refused = _triton_ops(device, shapes or {})
        for name, fn in triton_ops.items():
            chosen[name] = fn
            backend[name] = "triton"
        for name, why in sorted(refused.items()):
            logger.warning("op %s uses its torch reference on %s: the Triton kernel %s", name, device, why)
    kernels = Kernels(backend=backend, **chosen)
    summary = ", ".join(f"{k}={v}" for k, v in sorted(backend.items()))
    logger.info("ops on %s%s: %s", device, " (reference forced)" if force_reference else "", summary)
    return kernels
