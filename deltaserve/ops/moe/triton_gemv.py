"""Triton MoE GEMV path: small batches (T * top_k <= config.GEMV_MAX_ASSIGNMENTS, the decode case), two
launches and no alignment. The weights are the whole cost there; the grouped path's dependent launches
and 16-row tiles holding one real row left it at a third of the copy rate.

1. w13 GEMV: one program per (assignment, slice of I) reads its expert's gate and up rows once and writes
   SiLU(gate) * up, rounded once -> [A, I]. Programs of one slice are launched next to each other, so
   assignments that share an expert (T > 1) find its rows in L2 rather than DRAM.
2. w2 GEMV + combine: one program per (token, slice of H) runs the token's top_k experts in order, each
   expert output rounded to the activation dtype (as in the grouped path), weighted and summed in fp32,
   rounded once -> [T, H].

With programmatic dependent launch (Hopper, GemvMoeConfig.pdl / pdl_w13) a kernel starts while the one
before it drains and runs griddepcontrol.wait before reading anything an earlier kernel wrote; only
constant weights are loaded before the wait.

The shared expert's slots (fused_moe_routed with shared slices: experts E .. E+M-1 in every token's last M
slots) do not depend on the routing, so they may start before it is known (gemv_moe_shared_apart): their
w13 rows are computed by extra programs of the routing kernel (triton_routing.route_and_shared_w13), and
with GemvMoeConfig.shared_w2 their w2 rows by extra programs at the front of the w13 kernel, into an fp32
partial that the w2 kernel adds last.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..triton_common import pdl_launch, silu
from . import triton_routing as route_ops
from .config import GemvMoeConfig

SHARED_W2_ROWS = 32      # shared-slot w2 rows per program (GemvMoeConfig.shared_w2)


@triton.jit
def _gemv_w13_kernel(x, w13, ids, inter, H, I, s_x, s_we, s_wn,
                     TOP_K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr,
                     WAIT: tl.constexpr):
    if WAIT:
        gdc_wait()                   # ids / x come from the kernels before us
    if PDL:
        gdc_launch_dependents()      # the w2 kernel may start now; it waits for our output itself
    a = tl.program_id(0)
    e = tl.load(ids + a).to(tl.int64)
    t = (a // TOP_K).to(tl.int64)
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    row_ok = rows < I
    kk = tl.arange(0, BK)
    wg = w13 + e * s_we + rows[:, None].to(tl.int64) * s_wn + kk[None, :]
    wu = wg + I * s_wn
    xp = x + t * s_x + kk
    acc_g = tl.zeros([BN, BK], dtype=tl.float32)
    acc_u = tl.zeros([BN, BK], dtype=tl.float32)
    for k0 in range(0, H, BK):
        k_ok = kk + k0 < H
        xv = tl.load(xp + k0, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        m = row_ok[:, None] & k_ok[None, :]
        acc_g += tl.load(wg + k0, mask=m, other=0.0).to(tl.float32) * xv
        acc_u += tl.load(wu + k0, mask=m, other=0.0).to(tl.float32) * xv
    h = silu(tl.sum(acc_g, 1)) * tl.sum(acc_u, 1)
    tl.store(inter + a.to(tl.int64) * I + rows, h.to(inter.dtype.element_ty), mask=row_ok)


@triton.jit
def _shared_w2_rows(inter, w2, weights, part, q, T, H, I, E0, s_w2e, s_w2n, s_w, SLOTS: tl.constexpr,
                    K: tl.constexpr, M: tl.constexpr, R2: tl.constexpr, IB: tl.constexpr, WAIT: tl.constexpr,
                    PDL: tl.constexpr):
    """Rows q*R2 .. q*R2+R2-1 of the shared slices' stacked w2 rows (M*H rows: slice s = row // H, expert E0 + s) for
    every token: part[t, s, row % H] = weight[t, K + s] * round(w2 row . inter[t * SLOTS + K + s]) in fp32.
    The weights are constant: loaded before the wait (the intermediate comes from the kernel before us)."""
    rr = q * R2 + tl.arange(0, R2)
    r_ok = rr < M * H
    s = rr // H
    r = rr - s * H
    kk = tl.arange(0, IB)
    k_ok = kk < I
    m = r_ok[:, None] & k_ok[None, :]
    w = tl.load(w2 + (E0 + s).to(tl.int64)[:, None] * s_w2e + r.to(tl.int64)[:, None] * s_w2n + kk[None, :],
                mask=m, other=0.0)
    if WAIT:
        gdc_wait()
    if PDL:
        gdc_launch_dependents()
    for t in range(T):
        slot = t * SLOTS + K + s
        hv = tl.load(inter + slot.to(tl.int64)[:, None] * I + kk[None, :], mask=m, other=0.0).to(tl.float32)
        y = tl.sum(w.to(tl.float32) * hv, 1).to(inter.dtype.element_ty).to(tl.float32)   # rounded
        wt = tl.load(weights + t * s_w + K + s, mask=r_ok, other=0.0).to(tl.float32)
        tl.store(part + (t * M + s).to(tl.int64) * H + r, wt * y, mask=r_ok)


@triton.jit(do_not_specialize=["T", "NW2"])
def _gemv_w13_routed_slots_kernel(x, w13, ids, inter, w2, weights, part, T, H, I, E0, NW2, s_x, s_we, s_wn,
                                  s_w2e, s_w2n, s_w, SLOTS: tl.constexpr, K: tl.constexpr, M: tl.constexpr,
                                  BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr, WAIT: tl.constexpr,
                                  W2S: tl.constexpr, R2: tl.constexpr, IB: tl.constexpr):
    """_gemv_w13_kernel over the routed slots only (the first K of SLOTS per token; the last M, experts
    E0 .. E0+M-1, are the shared slots, whose w13 rows the routing kernel computed), on a 1-D grid: first
    NW2 programs of the shared slots' w2 (W2S, _shared_w2_rows), then the routed slots' w13 programs in
    _gemv_w13_kernel's order (slot, then row block), each with its arithmetic, operation for operation."""
    pid = tl.program_id(0)
    if pid < NW2:
        if W2S:
            _shared_w2_rows(inter, w2, weights, part, pid, T, H, I, E0, s_w2e, s_w2n, s_w, SLOTS, K, M, R2, IB,
                            WAIT, PDL)
    else:
        p = pid - NW2
        ra = p % (T * K)                       # (token, slot), then row block
        n = p // (T * K)
        t = (ra // K).to(tl.int64)
        a = t * SLOTS + ra % K
        rows = n * BN + tl.arange(0, BN)
        row_ok = rows < I
        kk = tl.arange(0, BK)
        off = rows[:, None].to(tl.int64) * s_wn + kk[None, :]
        m0 = row_ok[:, None] & (kk < H)[None, :]
        if WAIT:
            gdc_wait()                   # ids / x come from the kernels before us
        if PDL:
            gdc_launch_dependents()      # the w2 kernel may start now; it waits for our output itself
        e = tl.load(ids + a).to(tl.int64)
        wg = w13 + e * s_we + off
        wu = wg + I * s_wn
        xp = x + t * s_x + kk
        acc_g = tl.zeros([BN, BK], dtype=tl.float32)
        acc_u = tl.zeros([BN, BK], dtype=tl.float32)
        xv = tl.load(xp, mask=kk < H, other=0.0).to(tl.float32)[None, :]
        gt = tl.load(wg, mask=m0, other=0.0)
        ut = tl.load(wu, mask=m0, other=0.0)
        acc_g += gt.to(tl.float32) * xv
        acc_u += ut.to(tl.float32) * xv
        for k0 in range(BK, H, BK):
            k_ok = kk + k0 < H
            xv = tl.load(xp + k0, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            m = row_ok[:, None] & k_ok[None, :]
            acc_g += tl.load(wg + k0, mask=m, other=0.0).to(tl.float32) * xv
            acc_u += tl.load(wu + k0, mask=m, other=0.0).to(tl.float32) * xv
        h = silu(tl.sum(acc_g, 1)) * tl.sum(acc_u, 1)
        tl.store(inter + a.to(tl.int64) * I + rows, h.to(inter.dtype.element_ty), mask=row_ok)


@triton.jit
def _gemv_w2_combine_kernel(inter, w2, ids, weights, out, H, I, s_we, s_wn, s_w, s_o,
                            TOP_K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ONE_STEP: tl.constexpr,
                            TRIGGER: tl.constexpr = False):
    """ONE_STEP (BK >= I): no loop over I, so the unrolled experts are straight-line code and their
    weight loads can all be in flight at once instead of one DRAM round trip per expert. TRIGGER: let the
    next kernel launch at once (Hopper; it waits for our output itself)."""
    if TRIGGER:
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    row_ok = rows < H
    kk = tl.arange(0, BK)
    total = tl.zeros([BN], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        a = t * TOP_K + j
        e = tl.load(ids + a).to(tl.int64)
        wp = w2 + e * s_we + rows[:, None].to(tl.int64) * s_wn + kk[None, :]
        hp = inter + a * I + kk
        if ONE_STEP:
            k_ok = kk < I
            hv = tl.load(hp, mask=k_ok, other=0.0).to(tl.float32)
            acc = tl.load(wp, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32) * hv[None, :]
        else:
            acc = tl.zeros([BN, BK], dtype=tl.float32)
            for k0 in range(0, I, BK):
                k_ok = kk + k0 < I
                hv = tl.load(hp + k0, mask=k_ok, other=0.0).to(tl.float32)
                acc += tl.load(wp + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32) * hv[None, :]
        y = tl.sum(acc, 1).to(out.dtype.element_ty).to(tl.float32)    # the expert's output, rounded
        total += tl.load(weights + t * s_w + j).to(tl.float32) * y
    tl.store(out + t * s_o + rows, total.to(out.dtype.element_ty), mask=row_ok)


@triton.jit
def _gemv_w2_all_kernel(inter, w2, ids, weights, out, H, I, s_we, s_wn, s_w, s_o, TOP_K: tl.constexpr,
                        KP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr,
                        SLOTS: tl.constexpr, part=None, MP: tl.constexpr = 0):
    """As _gemv_w2_combine_kernel, the token's experts gathered into one [KP, BN, BK] tile per step.
    SLOTS: slots per token in ids / weights / inter, of which the first TOP_K run here; MP: the
    fp32 partials part[t, 0 .. MP-1, :] (the shared slots' weighted outputs, GemvMoeConfig.shared_w2) are
    added after them, in order."""
    t = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    j = tl.arange(0, KP)
    j_ok = j < TOP_K
    e = tl.load(ids + t * SLOTS + j, mask=j_ok, other=0).to(tl.int64)
    wt = tl.load(weights + t * s_w + j, mask=j_ok, other=0.0).to(tl.float32)
    kk = tl.arange(0, BK)
    wp = w2 + e[:, None, None] * s_we + rows[None, :, None].to(tl.int64) * s_wn + kk[None, None, :]
    hp = inter + (t * SLOTS + j)[:, None] * I + kk[None, :]
    m_w = j_ok[:, None, None] & (rows < H)[None, :, None]
    w_first = tl.load(wp, mask=m_w & (kk < I)[None, None, :], other=0.0)
    if PDL:
        gdc_wait()                   # inter is written by the w13 kernel
        gdc_launch_dependents()      # the next layer's projection may become resident; it waits for us
    h = tl.load(hp, mask=j_ok[:, None] & (kk < I)[None, :], other=0.0).to(tl.float32)
    acc = tl.sum(w_first.to(tl.float32) * h[:, None, :], 2)
    for k0 in range(BK, I, BK):
        k_ok = kk + k0 < I
        w = tl.load(wp + k0, mask=m_w & k_ok[None, None, :], other=0.0).to(tl.float32)
        h = tl.load(hp + k0, mask=j_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * h[:, None, :], 2)
    y = acc.to(out.dtype.element_ty).to(tl.float32)                 # each expert's output, rounded
    total = tl.sum(wt[:, None] * y, 0)
    for s in tl.static_range(MP):
        total += tl.load(part + (t * MP + s) * H + rows, mask=rows < H, other=0.0)
    tl.store(out + t * s_o + rows, total.to(out.dtype.element_ty), mask=rows < H)


def _w2(h, w2, topk_ids, topk_weights, out, cfg: GemvMoeConfig, slots: int, run: int, part=None, mp: int = 0):
    """The w2 + combine launch over the first `run` of every token's `slots` slots (part / mp:
    _gemv_w2_all_kernel's shared-slot partials)."""
    T, H = out.shape
    inter = w2.shape[-1]
    if cfg.all_experts:
        _gemv_w2_all_kernel[(T, triton.cdiv(H, cfg.block_n2))](
            h, w2, topk_ids, topk_weights, out, H, inter, w2.stride(0), w2.stride(1), topk_weights.stride(0),
            out.stride(0), TOP_K=run, KP=triton.next_power_of_2(run), BN=cfg.block_n2, BK=cfg.block_k2,
            PDL=cfg.pdl, SLOTS=slots, part=part, MP=mp, num_warps=cfg.warps2, num_stages=cfg.stages,
            **({"launch_pdl": True} if cfg.pdl else {}))
    else:
        _gemv_w2_combine_kernel[(T, triton.cdiv(H, cfg.block_n2))](
            h, w2, topk_ids, topk_weights, out, H, inter, w2.stride(0), w2.stride(1), topk_weights.stride(0),
            out.stride(0), TOP_K=run, BN=cfg.block_n2, BK=cfg.block_k2, ONE_STEP=cfg.block_k2 >= inter,
            TRIGGER=pdl_launch(out.device), num_warps=cfg.warps2, num_stages=cfg.stages)
    return out


def gemv_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor, cfg: GemvMoeConfig) -> torch.Tensor:
    """fused_moe on checked inputs (triton.fused_moe) by the GEMV path."""
    T, H = x.shape
    inter = w2.shape[-1]
    top_k = topk_ids.shape[1]
    A = T * top_k
    h = torch.empty((A, inter), dtype=x.dtype, device=x.device)
    _gemv_w13_kernel[(A, triton.cdiv(inter, cfg.block_n1))](
        x, w13, topk_ids, h, H, inter, x.stride(0), w13.stride(0), w13.stride(1), TOP_K=top_k,
        BN=cfg.block_n1, BK=cfg.block_k1, PDL=cfg.pdl, WAIT=cfg.pdl_w13, num_warps=cfg.warps1,
        num_stages=cfg.stages, **({"launch_pdl": True} if cfg.pdl_w13 else {}))
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    return _w2(h, w2, topk_ids, topk_weights, out, cfg, top_k, top_k)


def gemv_moe_shared_apart(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, router_logits: torch.Tensor,
                          top_k: int, renormalize: bool, shared_slices: int, cfg: GemvMoeConfig) -> torch.Tensor:
    """fused_moe_routed on checked inputs by the GEMV path with the shared slots set apart
    (cfg.shared_in_route): the routing kernel with the shared slots' w13 rows, the routed slots' w13
    (with the shared slots' w2 in front where cfg.shared_w2), the w2 + combine."""
    T, H = x.shape
    inter = w2.shape[-1]
    K, M = top_k, shared_slices
    width = K + M
    E = router_logits.shape[1] - 1
    h = torch.empty((T * width, inter), dtype=x.dtype, device=x.device)
    weights = torch.empty((T, width), dtype=torch.float32, device=x.device)
    ids = torch.empty((T, width), dtype=torch.int64, device=x.device)
    route_ops.route_and_shared_w13(router_logits, K, renormalize, M, x, w13, h, out=(weights, ids))
    nb = triton.cdiv(inter, cfg.block_n1)
    nw2 = triton.cdiv(M * H, SHARED_W2_ROWS) if cfg.shared_w2 else 0
    part = torch.empty((T, M, H), dtype=torch.float32, device=x.device) if cfg.shared_w2 else None
    _gemv_w13_routed_slots_kernel[(nw2 + T * K * nb,)](
        x, w13, ids, h, w2, weights, part if part is not None else h, T, H, inter, E, nw2,
        x.stride(0), w13.stride(0), w13.stride(1), w2.stride(0), w2.stride(1), weights.stride(0),
        SLOTS=width, K=K, M=M, BN=cfg.block_n1, BK=cfg.block_k1, PDL=cfg.pdl, WAIT=cfg.pdl_w13,
        W2S=cfg.shared_w2, R2=SHARED_W2_ROWS, IB=triton.next_power_of_2(inter),
        num_warps=cfg.warps1, num_stages=cfg.stages, **({"launch_pdl": True} if cfg.pdl_w13 else {}))
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    if cfg.all_experts:
        return _w2(h, w2, ids, weights, out, cfg, width, K if cfg.shared_w2 else width, part,
                   M if cfg.shared_w2 else 0)
    return _w2(h, w2, ids, weights, out, cfg, width, width)
