"""Triton MoE ops (same signatures as reference.fused_moe / fused_moe_routed) for a model whose experts are
block-FP8 (w13, w2 ops/quant/fp8.py BlockFp8Weight [E, 2I, H] / [E, H, I]), chosen by select_kernels in place of
triton.py's; dense experts go to triton.py's ops unchanged. The e4m3 weights are streamed (one byte each) and
widened in registers; every K step is one column group (128 at published shapes), so a step needs one multiplier
per weight row, applied to the step's partial product before it joins the fp32 accumulator (weight-only
quantisation: the activations stay in their dtype, as the reference, which multiplies the dequantised experts).

* GEMV path (T * top_k <= config.GEMV_MAX_ASSIGNMENTS, the decode case), two launches: per (assignment, slice of
  I) SiLU(gate) * up into an fp32 intermediate; per (token, slice of H) its experts' w2 products, weighted and
  summed in fp32, rounded once (the reference keeps the intermediate and the expert outputs in fp32 too).
* Grouped path (larger batches): triton_grouped.grouped_moe, the dense path's kernels compiled for FP8
  experts: a w13 and a w2 grouped GEMM on tensor cores (the fp8 tile widened to the activation dtype, exact),
  the intermediate in the activation dtype (the w2 dot's operand), the expert outputs in fp32, the
  fixed-order combine.

Not yet here: the bf16 path's PDL overlaps and the shared slots set apart from the routing (fused_moe_routed
routes first, then runs every slot), and W8A8 dots for prefill. Launch parameters come from the shapes only
(no host reads: CUDA-graph capturable).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ..quant.fp8 import FP8_DTYPE, BlockFp8Weight
from ..triton_common import ACTIVATION_DTYPES, check, check_last_contiguous, check_same_device, silu
from . import triton as dense
from . import triton_routing as route_ops
from .config import GEMV_MAX_ASSIGNMENTS, MoeConfig, default_moe_config
from .triton_grouped import grouped_moe


@dataclasses.dataclass(frozen=True)
class Fp8GemvMoeConfig:
    """Tiles of the FP8 GEMV path: weight rows per program and column groups per K step of each kernel
    (w2's groups are raised to cover all of I where that is at most 8 groups: one step per expert). Many
    small programs with wide steps keep the most loads in flight (not tuned on the device yet:
    `benchmarks/fp8_ops.py --moe`)."""

    block_n1: int = 4
    k_groups1: int = 4
    block_n2: int = 4
    k_groups2: int = 4
    warps: int = 4
    stages: int = 3


@triton.jit
def _fp8_gemv_w13_kernel(x, q13, s13, ids, inter, H, I, KG, s_x, s_qe, s_qn, s_se, s_sn,
                         TOP_K: tl.constexpr, RG: tl.constexpr, BN: tl.constexpr, G: tl.constexpr,
                         GS: tl.constexpr):
    """Per (assignment, BN rows of I): SiLU(gate) * up in fp32, GS column groups of G per step of H; the
    products kept elementwise in fp32 [BN, GS, G] (scaled by their group's multiplier), reduced once."""
    a = tl.program_id(0)
    e = tl.load(ids + a).to(tl.int64)
    t = (a // TOP_K).to(tl.int64)
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    row_ok = rows < I
    gi = tl.arange(0, GS)
    cols = gi[:, None] * G + tl.arange(0, G)[None, :]                                        # [GS, G]
    wg = q13 + e * s_qe + rows[:, None, None].to(tl.int64) * s_qn + cols[None, :, :]
    wu = wg + I * s_qn
    sg = s13 + e * s_se + (rows // RG)[:, None].to(tl.int64) * s_sn + gi[None, :]
    su = s13 + e * s_se + ((rows + I) // RG)[:, None].to(tl.int64) * s_sn + gi[None, :]
    acc_g = tl.zeros([BN, GS, G], dtype=tl.float32)
    acc_u = tl.zeros([BN, GS, G], dtype=tl.float32)
    for j in range(tl.cdiv(KG, GS)):
        k0 = j * GS * G
        g_ok = j * GS + gi < KG
        k_ok = (k0 + cols < H) & g_ok[:, None]
        xv = tl.load(x + t * s_x + k0 + cols, mask=k_ok, other=0.0).to(tl.float32)[None, :, :]
        m = row_ok[:, None, None] & k_ok[None, :, :]
        ms = row_ok[:, None] & g_ok[None, :]
        g = tl.load(wg + k0, mask=m, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        u = tl.load(wu + k0, mask=m, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        acc_g += g * tl.load(sg + j * GS, mask=ms, other=0.0)[:, :, None] * xv
        acc_u += u * tl.load(su + j * GS, mask=ms, other=0.0)[:, :, None] * xv
    hg = tl.sum(tl.sum(acc_g, 2), 1)
    hu = tl.sum(tl.sum(acc_u, 2), 1)
    tl.store(inter + a.to(tl.int64) * I + rows, silu(hg) * hu, mask=row_ok)


@triton.jit
def _fp8_gemv_w2_kernel(inter, q2, s2, ids, weights, out, H, I, KG, s_qe, s_qn, s_se, s_sn, s_w, s_o,
                        TOP_K: tl.constexpr, RG: tl.constexpr, BN: tl.constexpr, G: tl.constexpr,
                        GS: tl.constexpr):
    """Per (token, BN rows of H): its experts' w2 products, GS column groups of G per step of I (with
    GS * G >= I, the default, one step per expert: the unrolled experts' loads all in flight), weighted
    and summed in fp32, rounded once."""
    t = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    row_ok = rows < H
    gi = tl.arange(0, GS)
    cols = gi[:, None] * G + tl.arange(0, G)[None, :]                                        # [GS, G]
    srow = (rows // RG)[:, None].to(tl.int64) * s_sn + gi[None, :]
    total = tl.zeros([BN], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        a = t * TOP_K + j
        e = tl.load(ids + a).to(tl.int64)
        wp = q2 + e * s_qe + rows[:, None, None].to(tl.int64) * s_qn + cols[None, :, :]
        acc = tl.zeros([BN, GS, G], dtype=tl.float32)
        for k in range(tl.cdiv(KG, GS)):
            k0 = k * GS * G
            g_ok = k * GS + gi < KG
            k_ok = (k0 + cols < I) & g_ok[:, None]
            hv = tl.load(inter + a * I + k0 + cols, mask=k_ok, other=0.0)                   # [GS, G] fp32
            w = tl.load(wp + k0, mask=row_ok[:, None, None] & k_ok[None, :, :], other=0).to(tl.float8e4nv,
                                                                                             bitcast=True)
            sc = tl.load(s2 + e * s_se + srow + k * GS, mask=row_ok[:, None] & g_ok[None, :], other=0.0)
            acc += w.to(tl.float32) * sc[:, :, None] * hv[None, :, :]
        total += tl.load(weights + t * s_w + j).to(tl.float32) * tl.sum(tl.sum(acc, 2), 1)
    tl.store(out + t * s_o + rows, total.to(out.dtype.element_ty), mask=row_ok)


def check_fp8_experts(op: str, x: torch.Tensor, w13: BlockFp8Weight, w2: BlockFp8Weight) -> None:
    """Refuse (ValueError naming the op) what the FP8 expert kernels cannot take."""
    check(isinstance(w13, BlockFp8Weight) and isinstance(w2, BlockFp8Weight), op,
          f"w13 and w2 must both be block-FP8 or both dense, got {type(w13).__name__}, {type(w2).__name__}")
    q13, q2 = w13.qweight, w2.qweight
    check(x.dim() == 2 and x.dtype in ACTIVATION_DTYPES, op,
          f"x must be [T, H] in one of {ACTIVATION_DTYPES}, got {tuple(x.shape)} {x.dtype}")
    H = x.shape[1]
    check(q13.dim() == 3 and q13.shape[2] == H and q13.shape[1] % 2 == 0, op,
          f"w13 must be [E, 2I, {H}], got {tuple(q13.shape)}")
    E, inter = q13.shape[0], q13.shape[1] // 2
    check(q2.shape == (E, H, inter), op, f"w2 must be [{E}, {H}, {inter}], got {tuple(q2.shape)}")
    check(q13.dtype == FP8_DTYPE and q2.dtype == FP8_DTYPE, op,
          f"FP8 experts must be float8_e4m3fn, got {q13.dtype}, {q2.dtype}")
    check(E <= 4096, op, f"{E} experts: at most 4096 supported")
    for name, w, rows, cols in (("w13", w13, 2 * inter, H), ("w2", w2, H, inter)):
        c = w.col_group
        check(c >= 16 and c & (c - 1) == 0, op, f"{name}'s column group {c} must be a power of two >= 16")
        want = (E, triton.cdiv(rows, w.row_group), triton.cdiv(cols, c))
        check(tuple(w.scale.shape) == want and w.scale.dtype == torch.float32, op,
              f"{name}'s scales must be fp32 {list(want)}, got {w.scale.dtype} {list(w.scale.shape)}")
        check(w.qweight.is_contiguous() and w.scale.is_contiguous(), op, f"{name} and its scales must be contiguous")
    check_last_contiguous(op, x=x)
    check_same_device(op, x, q13, q2, w13.scale, w2.scale)


def fp8_fused_moe(x: torch.Tensor, w13: BlockFp8Weight, w2: BlockFp8Weight, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """reference.fused_moe with FP8 experts (module docstring)."""
    op = "fused_moe"
    check_fp8_experts(op, x, w13, w2)
    T, H = x.shape
    E, inter = w13.shape[0], w2.shape[-1]
    check(topk_ids.dim() == 2 and topk_ids.shape[0] == T and topk_weights.shape == topk_ids.shape, op,
          f"topk_ids and topk_weights must be [{T}, top_k], got {tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}")
    check(topk_ids.dtype in (torch.int32, torch.int64) and topk_ids.is_contiguous(), op,
          f"topk_ids must be contiguous int32/int64, got {topk_ids.dtype}")
    check(topk_weights.dtype.is_floating_point, op, f"topk_weights must be floating point, got {topk_weights.dtype}")
    check_last_contiguous(op, topk_weights=topk_weights)
    check_same_device(op, x, topk_weights, topk_ids)
    top_k = topk_ids.shape[1]
    A = T * top_k
    if A == 0:
        return torch.zeros((T, H), dtype=x.dtype, device=x.device)
    if A <= GEMV_MAX_ASSIGNMENTS:
        (q13, s13), (q2, s2) = (w13.qweight.view(torch.uint8), w13.scale), (w2.qweight.view(torch.uint8), w2.scale)
        out = torch.empty((T, H), dtype=x.dtype, device=x.device)
        cfg = Fp8GemvMoeConfig()
        h = torch.empty((A, inter), dtype=torch.float32, device=x.device)
        kg1, kg2 = triton.cdiv(H, w13.col_group), triton.cdiv(inter, w2.col_group)
        gs2 = max(cfg.k_groups2, min(8, triton.next_power_of_2(kg2)))
        _fp8_gemv_w13_kernel[(A, triton.cdiv(inter, cfg.block_n1))](
            x, q13, s13, topk_ids, h, H, inter, kg1, x.stride(0), q13.stride(0), q13.stride(1), s13.stride(0),
            s13.stride(1), TOP_K=top_k, RG=w13.row_group, BN=cfg.block_n1, G=w13.col_group,
            GS=min(cfg.k_groups1, triton.next_power_of_2(kg1)), num_warps=cfg.warps, num_stages=cfg.stages)
        _fp8_gemv_w2_kernel[(T, triton.cdiv(H, cfg.block_n2))](
            h, q2, s2, topk_ids, topk_weights, out, H, inter, kg2, q2.stride(0), q2.stride(1), s2.stride(0),
            s2.stride(1), topk_weights.stride(0), out.stride(0), TOP_K=top_k, RG=w2.row_group, BN=cfg.block_n2,
            G=w2.col_group, GS=min(gs2, triton.next_power_of_2(kg2)), num_warps=cfg.warps, num_stages=cfg.stages)
        return out
    cfg = default_moe_config(T, top_k, E, H, inter)
    if not isinstance(cfg, MoeConfig):       # the bf16 rules' GEMV choice past our GEMV limit: smallest tiles
        cfg = MoeConfig()
    if x.dtype == torch.float32:             # fp32 tiles: fewer rows and stages fit shared memory
        cfg = dataclasses.replace(cfg, block_m=min(cfg.block_m, 64), stages=min(cfg.stages, 2))
    return grouped_moe(x, w13, w2, topk_weights, topk_ids, cfg)


def fused_moe(x: torch.Tensor, w13, w2, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """See reference.fused_moe: FP8 experts by the kernels here, dense ones by triton.fused_moe."""
    if isinstance(w13, BlockFp8Weight) or isinstance(w2, BlockFp8Weight):
        return fp8_fused_moe(x, w13, w2, topk_weights, topk_ids)
    return dense.fused_moe(x, w13, w2, topk_weights, topk_ids)


def fused_moe_routed(x: torch.Tensor, w13, w2, router_logits: torch.Tensor, top_k: int, renormalize: bool, *,
                     shared_slices: int = 0) -> torch.Tensor:
    """See reference.fused_moe_routed: FP8 experts after triton_routing.topk_softmax, dense ones by
    triton.fused_moe_routed."""
    if not (isinstance(w13, BlockFp8Weight) or isinstance(w2, BlockFp8Weight)):
        return dense.fused_moe_routed(x, w13, w2, router_logits, top_k, renormalize, shared_slices=shared_slices)
    op = "fused_moe_routed"
    E = route_ops.check_routing(op, router_logits, top_k, shared_slices)
    check(x.dim() == 2 and router_logits.shape[0] == x.shape[0], op,
          f"router_logits {tuple(router_logits.shape)} and x {tuple(x.shape)} must have the same tokens")
    check(w13.qweight.dim() == 3 and w13.shape[0] >= E + shared_slices, op,
          f"w13 holds {w13.shape[0] if w13.qweight.dim() == 3 else '?'} experts, the routing needs "
          f"{E + shared_slices}")
    if x.shape[0] == 0:
        return torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    weights, ids = route_ops.topk_softmax(router_logits, top_k, renormalize, shared_slices=shared_slices)
    return fp8_fused_moe(x, w13, w2, weights, ids)


OPS = {"fused_moe": fused_moe, "fused_moe_routed": fused_moe_routed}
