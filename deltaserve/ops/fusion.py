"""Composite ops: one step of a sublayer's math that runs either as the plain ops composed or with a fused
kernel, chosen here from the batch shape and the fold rules of the chosen kernels (Kernels.conv_fold_rows,
Kernels.gate_fold_rows: set by select_kernels from the constants beside the fused kernels). Layers call
these through their Kernels (`kernels.gdn_in_proj(...)`) and never choose a kernel themselves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from . import Kernels


class GdnProjection(NamedTuple):
    """gdn_in_proj's result: the projection [T, N], the normed rows, x + residual (the next residual), and
    whether the projection's first conv_weight.shape[0] columns are the causal conv's output already (the conv
    windows then shifted)."""

    projected: torch.Tensor
    normed: torch.Tensor
    total: torch.Tensor
    conv_applied: bool


def gdn_in_proj(k: Kernels, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor, *, conv_weight: torch.Tensor, conv_state: torch.Tensor,
                decode_slots: torch.Tensor | None, zero_centered: bool = True) -> GdnProjection:
    """A GDN layer's input projection, rms_norm_linear(x, residual, norm_weight, eps, weight). decode_slots:
    the state slot of every row when each row is one decode token of its sequence (a decode-only batch), else
    None. At decode batches of k.conv_fold_rows sequences the causal conv update of the q|k|v columns runs in
    the projection's epilogue (k.rms_norm_linear_conv; conv_applied=True); otherwise the conv is left to the
    recurrence (conv_applied=False)."""
    lo, hi = k.conv_fold_rows
    if decode_slots is not None and 0 < lo <= x.shape[0] <= hi:
        y, normed, total = k.rms_norm_linear_conv(x, residual, norm_weight, eps, weight, conv_weight=conv_weight,
                                                  conv_state=conv_state, state_indices=decode_slots,
                                                  zero_centered=zero_centered)
        return GdnProjection(y, normed, total, True)
    return GdnProjection(*k.rms_norm_linear(x, residual, norm_weight, eps, weight, zero_centered=zero_centered), False)


def gdn_out_proj(k: Kernels, prefill_out: torch.Tensor | None, mixed_qkv: torch.Tensor, z: torch.Tensor,
                 a: torch.Tensor, b: torch.Tensor, *, conv_weight: torch.Tensor, A_log: torch.Tensor,
                 dt_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float, scale: float,
                 conv_state: torch.Tensor, ssm_state: torch.Tensor, state_indices: torch.Tensor,
                 norm_activation: str, conv_applied: bool, weight: torch.Tensor) -> torch.Tensor:
    """A GDN layer's output: the decode tokens' recurrence (k.gdn_decode of mixed_qkv, z [N, HV, V], a, b:
    conv update unless conv_applied, gates, delta rule, gated RMSNorm) after the prefill rows' gated-normed
    output prefill_out [P, HV, V] (None: no prefill rows), all rows through the output projection `weight`.
    A step of at most k.gate_fold_rows rows, all decode, hands the gated norm to the projection
    (k.gated_linear; gdn_decode returns o before the norm)."""
    N, HV, V = z.shape
    if conv_applied and prefill_out is not None:
        raise ValueError("gdn_out_proj: conv_applied needs a decode-only batch (the prefill conv runs in the layer)")
    decode = dict(conv_weight=conv_weight, A_log=A_log, dt_bias=dt_bias, norm_weight=norm_weight, eps=eps,
                  scale=scale, conv_state=conv_state, ssm_state=ssm_state, state_indices=state_indices,
                  norm_activation=norm_activation, conv_applied=conv_applied)
    if prefill_out is None and 0 < N <= k.gate_fold_rows:
        o = k.gdn_decode(mixed_qkv, z, a, b, gated_norm=False, **decode)
        return k.gated_linear(o.view(N, HV * V), z.reshape(N, HV * V), weight, norm_weight=norm_weight, eps=eps,
                              activation=norm_activation)
    outs = [] if prefill_out is None else [prefill_out]
    if N:
        outs.append(k.gdn_decode(mixed_qkv, z, a, b, **decode))
    o = outs[0] if len(outs) == 1 else torch.cat(outs)
    return k.linear(o.reshape(o.shape[0], HV * V), weight)
