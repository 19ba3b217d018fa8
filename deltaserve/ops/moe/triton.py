"""Triton MoE ops (same signatures as reference.fused_moe / fused_moe_routed, plus an optional launch
`config`): the routed experts on device with shapes known to the host (no syncs; CUDA-graph capturable).

The path is chosen per call from host-side shapes by config.default_moe_config:

* GEMV path (triton_gemv.py): small batches, the decode case; with the shared expert folded in
  (fused_moe_routed's shared_slices) on Hopper at T <= 2, its slots start before the routing is known.
* Grouped-GEMM path (triton_grouped.py): the assignments aligned by expert (triton_align.py), one w13 and
  one w2 grouped GEMM, a fixed-order combine.

Routing is triton_routing.py.
"""

from __future__ import annotations

import torch

from ..triton_common import ACTIVATION_DTYPES, check, check_last_contiguous, check_same_device, pdl_launch
from . import triton_routing as route_ops
from .config import GemvMoeConfig, MoeConfig, MoeConfigs, default_moe_config
from .triton_gemv import gemv_moe, gemv_moe_shared_apart
from .triton_grouped import grouped_moe

__all__ = ["GemvMoeConfig", "MoeConfig", "MoeConfigs", "default_moe_config", "fused_moe", "fused_moe_routed"]


def _check_experts(op: str, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> None:
    check(x.dim() == 2, op, f"x must be [T, H], got {tuple(x.shape)}")
    H = x.shape[1]
    check(w13.dim() == 3 and w13.shape[2] == H and w13.shape[1] % 2 == 0, op,
          f"w13 must be [E, 2I, {H}], got {tuple(w13.shape)}")
    E, inter = w13.shape[0], w13.shape[1] // 2
    check(w2.shape == (E, H, inter), op, f"w2 must be [{E}, {H}, {inter}], got {tuple(w2.shape)}")
    check(x.dtype in ACTIVATION_DTYPES and w13.dtype == x.dtype and w2.dtype == x.dtype, op,
          f"x, w13, w2 must share a float dtype, got {x.dtype}, {w13.dtype}, {w2.dtype}")
    check(E <= 4096, op, f"{E} experts: at most 4096 supported")
    check_last_contiguous(op, x=x, w13=w13, w2=w2)
    check(w13.stride(1) == H and w2.stride(1) == inter, op, "expert weight rows must be dense ([E, rows, cols] views)")


def _check_config(op: str, cfg: MoeConfigs, x: torch.Tensor, shared_slices: int | None) -> None:
    """`shared_slices`: fused_moe_routed's (None: fused_moe, where the shared slots are not known)."""
    gemv = isinstance(cfg, GemvMoeConfig)
    check(gemv or isinstance(cfg, MoeConfig), op, f"config must be a MoeConfig or GemvMoeConfig, got {cfg!r}")
    for name in ("block_n1", "block_k1", "block_n2", "block_k2") + (() if gemv else ("block_m",)):
        v, least = getattr(cfg, name), 1 if gemv else 16
        check(v >= least and v & (v - 1) == 0, op, f"config {name}={v} must be a power of two >= {least}")
    if not gemv:
        return
    if cfg.shared_in_route:
        check(shared_slices is not None and shared_slices >= 1, op, "config shared_in_route needs "
              "fused_moe_routed with shared_slices >= 1 (the shared slots must be known before the routing)")
    check(not cfg.shared_w2 or (cfg.shared_in_route and cfg.all_experts), op,
          "config shared_w2 needs shared_in_route=True and all_experts=True")
    if cfg.pdl_w13:
        check(pdl_launch(x.device), op, "config pdl_w13=True needs a CUDA device of compute capability 9.0 or newer")
    if cfg.pdl:
        check(cfg.all_experts, op, "config pdl=True needs all_experts=True")
        check(pdl_launch(x.device), op, "config pdl=True needs a CUDA device of compute capability 9.0 or newer")


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    *, config: MoeConfigs | None = None,
) -> torch.Tensor:
    """See reference.fused_moe. `config` (optional) picks the path (GemvMoeConfig: small batches,
    MoeConfig: grouped GEMMs) and its tiles; expert ids must lie in [0, E) (they are not checked on
    device)."""
    op = "fused_moe"
    _check_experts(op, x, w13, w2)
    T, H = x.shape
    E, inter = w13.shape[0], w2.shape[-1]
    check(topk_ids.dim() == 2 and topk_ids.shape[0] == T and topk_weights.shape == topk_ids.shape, op,
          f"topk_ids and topk_weights must be [{T}, top_k], got {tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}")
    check(topk_ids.dtype in (torch.int32, torch.int64), op, f"topk_ids must be int32/int64, got {topk_ids.dtype}")
    check(topk_weights.dtype.is_floating_point, op, f"topk_weights must be floating point, got {topk_weights.dtype}")
    check(topk_ids.is_contiguous(), op, "topk_ids must be contiguous")
    check_last_contiguous(op, topk_weights=topk_weights)
    check_same_device(op, x, w13, w2, topk_weights, topk_ids)
    top_k = topk_ids.shape[1]
    if T * top_k == 0:
        return torch.zeros((T, H), dtype=x.dtype, device=x.device)
    cfg = config or default_moe_config(T, top_k, E, H, inter, pdl=pdl_launch(x.device))
    _check_config(op, cfg, x, None)
    if isinstance(cfg, GemvMoeConfig):
        return gemv_moe(x, w13, w2, topk_weights, topk_ids, cfg)
    return grouped_moe(x, w13, w2, topk_weights, topk_ids, cfg)


def fused_moe_routed(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, router_logits: torch.Tensor, top_k: int,
    renormalize: bool, *, shared_slices: int = 0, config: MoeConfigs | None = None,
) -> torch.Tensor:
    """See reference.fused_moe_routed: triton_routing.topk_softmax then fused_moe, or, where the config
    sets the shared slots apart (GemvMoeConfig.shared_in_route, the default at T <= 2 on Hopper), the
    routing kernel also computing the shared slots' w13 rows (triton_gemv.gemv_moe_shared_apart)."""
    op = "fused_moe_routed"
    E = route_ops.check_routing(op, router_logits, top_k, shared_slices)
    check(x.dim() == 2 and router_logits.shape[0] == x.shape[0], op,
          f"router_logits {tuple(router_logits.shape)} and x {tuple(x.shape)} must have the same tokens")
    check(w13.dim() == 3 and w13.shape[0] >= E + shared_slices, op,
          f"w13 holds {w13.shape[0] if w13.dim() == 3 else '?'} experts, the routing needs {E + shared_slices}")
    check_same_device(op, x, router_logits)
    T, width = x.shape[0], top_k + shared_slices
    cfg = config
    if cfg is None and T >= 1:
        cfg = default_moe_config(T, width, w13.shape[0], x.shape[1], w2.shape[-1], pdl=pdl_launch(x.device),
                                 shared_slices=shared_slices)
    if T == 0:
        return torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    if isinstance(cfg, GemvMoeConfig) and cfg.shared_in_route:
        _check_experts(op, x, w13, w2)
        check_same_device(op, x, w13, w2)
        _check_config(op, cfg, x, shared_slices)
        return gemv_moe_shared_apart(x, w13, w2, router_logits, top_k, bool(renormalize), shared_slices, cfg)
    weights, ids = route_ops.topk_softmax(router_logits, top_k, renormalize, shared_slices=shared_slices)
    return fused_moe(x, w13, w2, weights, ids, config=cfg)
