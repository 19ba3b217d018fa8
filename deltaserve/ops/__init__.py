"""Public op API. Every op has a plain-torch reference (the CPU path and the test oracle); a Triton
implementation with the same signature replaces it on CUDA devices where one exists.

The choice is made once, by `select_kernels`, when a model is built (Kernels.summary() says it in a line,
the per-op list is logged at DEBUG). Nothing here falls back silently at call time: a Triton op that cannot
handle its inputs raises. Where a sublayer step can run fused or as plain ops, its composite op
(ops/fusion.py, called as a Kernels method) chooses from the batch shape, by the fold rules that
select_kernels takes from beside the fused kernels.
Block-FP8 weights (ops/quant/fp8.py BlockFp8Weight) are taken by the references natively (dequantised, fp32
math). With fp8_weights, select_kernels replaces the Triton weight-reading ops (FP8_WEIGHT_OPS) by their FP8
forms (ops/linear/triton_fp8.py, ops/moe/triton_fp8.py: weight-only FP8 GEMV at decode, W8A8 block GEMM
above FP8_GEMV_MAX_ROWS rows, FP8 fused MoE; dense weights still reach the dense kernels); the decode-graph
ops have no FP8 kernels and dequantise to the activation dtype per call. Kernels.summary() says which.
This package imports nothing from the rest of deltaserve.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections import Counter
from typing import Callable, Mapping

import torch

from . import decode_graph, fusion
from .activation import reference as activation_ref
from .attention import reference as attention_ref
from .conv1d import reference as conv1d_ref
from .embedding import reference as embedding_ref
from .fusion import GdnProjection
from .gdn import reference as gdn_ref
from .linear import reference as linear_ref
from .moe import reference as moe_ref
from .norm import reference as norm_ref
from .quant.fp8 import BlockFp8Weight

VerifyStash = gdn_ref.VerifyStash

logger = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class Kernels:
    """One implementation of every op, chosen together; `backend` names the source of each op ("reference",
    "triton", "decode-graph"). The composite ops (methods below) compose the chosen ops and read the fold
    rules, so a replaced op (dataclasses.replace) is what they call."""

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
    fused_moe_routed: Callable       # topk_softmax + fused_moe (Triton, T <= 2: shared slots' w13 in the routing)
    silu_and_mul: Callable           # SwiGLU middle: [.., 2I] (gate | up) -> silu(gate) * up
    sigmoid_mul: Callable            # x * sigmoid(gate): the attention output gate
    linear: Callable                 # y = x W^T: every projection and the logits
    rms_norm_linear: Callable        # (normed @ W^T, normed, x + residual): a pre-norm sublayer's input projection
    rms_norm_linear_conv: Callable   # rms_norm_linear + the one-token conv of a GDN layer's q|k|v columns (decode)
    gated_linear: Callable           # (gate [after a per-head norm] * x) @ W^T: a gated sublayer's output projection
    embed_rope: Callable             # token embeddings (pending ids resolved on device) + the positions' RoPE tables
    # Fold rules of the fused kernels chosen (0: never fold), read by the composite ops (ops/fusion.py):
    # decode batches of conv_fold_rows (lo, hi) sequences run gdn_in_proj's conv in rms_norm_linear_conv;
    # decode steps of up to gate_fold_rows rows run gdn_out_proj's gated norm in gated_linear.
    conv_fold_rows: tuple[int, int] = (0, 0)
    gate_fold_rows: int = 0
    kept_reference: Mapping[str, str] = dataclasses.field(default_factory=dict)  # op -> why its kernel was refused
    fp8_path: str = ""               # how FP8 weights are read: "" (none), "reference", the FP8 kernels (_fp8_ops)

    # ---- composite ops (ops/fusion.py): the sublayer steps that choose their fusions ----
    def gdn_in_proj(self, *args, **kwargs) -> GdnProjection:
        """A GDN layer's input projection, the conv folded in where it pays: fusion.gdn_in_proj."""
        return fusion.gdn_in_proj(self, *args, **kwargs)

    def gdn_out_proj(self, *args, **kwargs) -> torch.Tensor:
        """A GDN layer's decode recurrence and output projection, the norm folded in where it pays:
        fusion.gdn_out_proj."""
        return fusion.gdn_out_proj(self, *args, **kwargs)

    def summary(self) -> str:
        """The choice in a few words: "triton (25 ops)", or "triton 23, reference 2 (chunk_gated_delta_rule,
        gdn_prefill: needs ...)"."""
        counts = Counter(self.backend.values())
        fp8 = f"; FP8 weights: {self.fp8_path}" if self.fp8_path else ""
        if len(counts) == 1:
            (name, n), = counts.items()
            return f"{name} ({n} ops){fp8}"
        parts = ", ".join(f"{name} {n}" for name, n in counts.most_common())
        why = "; ".join(f"{', '.join(ops)}: {reason}" for reason, ops in _by_reason(self.kept_reference).items())
        return (f"{parts} ({why})" if why else parts) + fp8


def _by_reason(refused: Mapping[str, str]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for name, why in sorted(refused.items()):
        groups.setdefault(why, []).append(name)
    return groups


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


# The ops that read a projection or expert weight (the ones an FP8 weight reaches).
FP8_WEIGHT_OPS = ("linear", "rms_norm_linear", "rms_norm_linear_conv", "gated_linear", "fused_moe",
                  "fused_moe_routed")
FP8_GEMV_MAX_ROWS = 16           # ops/linear/triton_fp8_gemv.MAX_ROWS (that module imports triton)


def _dequantizing(op: Callable) -> Callable:
    """op with every BlockFp8Weight argument dequantised to the activation's (first argument's) dtype first."""

    @functools.wraps(op)
    def run(x, *args, **kwargs):
        args = [a.dequantize(x.dtype) if isinstance(a, BlockFp8Weight) else a for a in args]
        kwargs = {k: v.dequantize(x.dtype) if isinstance(v, BlockFp8Weight) else v for k, v in kwargs.items()}
        return op(x, *args, **kwargs)

    return run


def _fp8_ops(device: torch.device, chosen: dict[str, Callable], backend: Mapping[str, str]
             ) -> tuple[dict[str, Callable], str]:
    """The FP8_WEIGHT_OPS for a model holding block-FP8 weights, and how they read them (Kernels.fp8_path):
    the references read them natively; a Triton op is replaced by its FP8 form (ops/linear/triton_fp8.py,
    ops/moe/triton_fp8.py: FP8 kernels for FP8 weights, the dense kernel for the rest); any other backend's op
    (the CPU decode graph) dequantises per call, with a warning."""
    chosen = dict(chosen)
    triton_ops = [op for op in FP8_WEIGHT_OPS if backend[op] == "triton"]
    if triton_ops:
        from .linear import triton_fp8 as linear_fp8
        from .moe import triton_fp8 as moe_fp8

        fp8_kernels = {**linear_fp8.OPS, **moe_fp8.OPS}
        chosen.update({op: fp8_kernels[op] for op in triton_ops})
    other = sorted({backend[op] for op in FP8_WEIGHT_OPS} - {"reference", "triton"})
    slow = [op for op in FP8_WEIGHT_OPS if backend[op] in other]
    for op in slow:
        chosen[op] = _dequantizing(chosen[op])
    if slow:
        logger.warning("FP8 weights on %s: no FP8 %s kernels; %s dequantise the weight to the activation dtype "
                       "per call (correct, not fast)", device, "/".join(other), ", ".join(slow))
    parts = []
    if triton_ops:
        parts.append(f"triton FP8 kernels ({', '.join(triton_ops)}: weight-only GEMV up to "
                     f"{FP8_GEMV_MAX_ROWS} rows, W8A8 block GEMM above; FP8 fused MoE)")
    if slow:
        parts.append(f"dequantize-then-{'/'.join(other)} ({', '.join(slow)})")
    if len(triton_ops) + len(slow) < len(FP8_WEIGHT_OPS):
        parts.append("reference")
    return chosen, "; ".join(parts)


def _triton_ops(device: torch.device, shapes: Mapping[str, int]
                ) -> tuple[dict[str, Callable], dict[str, str], dict[str, object]]:
    """The Triton implementations usable on `device` for a model of these shapes, why the others are not,
    and the fold rules of the fused kernels (all empty where Triton or the device cannot run any)."""
    if device.type != "cuda":
        return {}, {}, {}
    try:
        from . import triton_registry
    except ImportError as exc:  # triton missing from this install
        logger.warning("Triton unavailable (%s); every op uses its torch reference", exc)
        return {}, {}, {}
    ops, refused = triton_registry.available_ops(device, shapes)
    return ops, refused, triton_registry.fold_rules(ops) if ops else {}


def select_kernels(device: torch.device | str, *, force_reference: bool = False,
                   shapes: Mapping[str, int] | None = None, decode_graph_ops: bool = False,
                   fp8_weights: bool = False) -> Kernels:
    """Pick each op's implementation once for `device` and a model of `shapes` (head dims, see
    triton_registry.SHAPE_LIMITS); log the choice (DEBUG; Kernels.summary() says it in a line). An op whose
    Triton kernel cannot take these shapes keeps its reference, with a warning saying why, so the choice
    never changes at call time. decode_graph_ops: the decode-graph backend (ops/decode_graph.py) over the
    references, for a compiled graph of decode-only batches (CPU only: no Triton there). fp8_weights: the model
    holds block-FP8 weights (see the module docstring for how each backend reads them)."""
    device = torch.device(device)
    chosen = dict(REFERENCE_OPS)
    backend = {name: "reference" for name in chosen}
    refused: dict[str, str] = {}
    rules: dict[str, object] = {}
    if decode_graph_ops:
        if device.type != "cpu":
            raise ValueError(f"the decode-graph ops are the compiled CPU decode step's; device is {device}")
        chosen.update(decode_graph.OPS)
        backend.update(dict.fromkeys(decode_graph.OPS, decode_graph.BACKEND))
    elif not force_reference:
        triton_ops, refused, rules = _triton_ops(device, shapes or {})
        chosen.update(triton_ops)
        backend.update(dict.fromkeys(triton_ops, "triton"))
        for why, names in _by_reason(refused).items():
            logger.warning("%s on %s: torch reference (%s)", ", ".join(names), device, why)
    fp8_path = ""
    if fp8_weights:
        chosen, fp8_path = _fp8_ops(device, chosen, backend)
    kernels = Kernels(backend=backend, **chosen, **rules, kept_reference=refused, fp8_path=fp8_path)
    logger.debug("ops on %s%s: %s", device, " (reference forced)" if force_reference else "",
                 ", ".join(f"{k}={v}" for k, v in sorted(backend.items())))
    return kernels
