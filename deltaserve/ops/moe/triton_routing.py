"""Triton MoE routing (same signature as reference.topk_softmax): softmax over the expert logits, top-k,
optional renormalisation, and the shared expert's slices appended with their sigmoid gate, in one launch.

One program takes BT tokens with all their logits in registers; the k choices are k max-reductions, each
taking the lowest index among equal maxima (torch.topk's order for distinct values; for exact ties the
reference's order is not defined either). The choice is made on the unnormalised exponentials
exp(x - max) (the softmax order; every value computed alone, so any launch layout gets the same bits),
and the renormalised weights are e_j / (e_0 + e_1 + ... + e_{k-1}), summed in choice order. (Without
renormalisation the weight is e_j over a tree sum of all exponentials.) No host sync, CUDA-graph
capturable.

On Hopper (compute capability >= 9.0) the kernel lets the next kernel start at once (griddepcontrol
.launch_dependents): fused_moe's w13 kernel, launched programmatically, then has its launch and set-up
done while the routing runs, and waits for the routing's output itself. Up to PDL_MAX_TOKENS tokens the
routing kernel is itself launched programmatically and waits (griddepcontrol.wait) before reading the
logits: the router GEMV before it (ops/linear's GEMV) releases its successor early, so the routing's
launch overlaps the GEMV. From 33 rows the router is cuBLAS, which does not release early, so larger
batches keep the ordinary launch.

route_and_shared_w13 is the same routing with extra programs computing the shared slots' w13 rows
(triton_gemv.gemv_moe_shared_apart).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..triton_common import ACTIVATION_DTYPES, check, check_last_contiguous, pdl_launch, silu

MAX_EXPERTS = 4096
SMALL_BATCH = 64     # up to this many tokens: one token per program


@triton.jit
def _route_tile(logits, weights, ids, rows, row_ok, E, s_l, K: tl.constexpr, M: tl.constexpr,
                KP: tl.constexpr, EP: tl.constexpr, RENORM: tl.constexpr):
    """The routing of the tokens `rows` (those with row_ok): logits [*, E (+ the shared gate)] at row
    stride s_l -> weights (fp32) / ids [*, K + M] contiguous (module docstring)."""
    cols = tl.arange(0, EP)
    row_ptr = logits + rows[:, None].to(tl.int64) * s_l
    lmask = row_ok[:, None] & (cols[None, :] < E)
    x = tl.load(row_ptr + cols[None, :], mask=lmask, other=float("-inf"))
    x = tl.where(row_ok[:, None], x.to(tl.float32), 0.0)        # rows past T: finite, never stored
    x = tl.exp(x - tl.max(x, 1)[:, None])                        # the softmax order, layout-free bits
    kcol = tl.arange(0, KP)
    w_sel = tl.zeros([rows.shape[0], KP], dtype=tl.float32)
    i_sel = tl.zeros([rows.shape[0], KP], dtype=tl.int32)
    total = tl.zeros([rows.shape[0]], dtype=tl.float32)
    avail = x
    for j in tl.static_range(K):
        best = tl.max(avail, 1)
        idx = tl.min(tl.where(avail == best[:, None], cols[None, :], EP), 1)
        w_sel = tl.where(kcol[None, :] == j, best[:, None], w_sel)
        i_sel = tl.where(kcol[None, :] == j, idx[:, None], i_sel)
        total += best                                              # in choice order (docstring)
        avail = tl.where(cols[None, :] == idx[:, None], -1.0, avail)   # taken (exponentials are >= 0)
    if RENORM:
        w_sel = w_sel / total[:, None]
    else:
        w_sel = w_sel / tl.sum(x, 1)[:, None]
    if M > 0:
        gate = tl.load(logits + rows.to(tl.int64) * s_l + E, mask=row_ok, other=0.0).to(tl.float32)
        shared_w = 1.0 / (1.0 + tl.exp(-gate))
        is_shared = (kcol[None, :] >= K) & (kcol[None, :] < K + M)
        w_sel = tl.where(is_shared, shared_w[:, None], w_sel)
        i_sel = tl.where(is_shared, E + kcol[None, :] - K, i_sel)
    out = rows[:, None] * (K + M) + kcol[None, :]
    m = row_ok[:, None] & (kcol[None, :] < K + M)
    tl.store(weights + out, w_sel, mask=m)
    tl.store(ids + out, i_sel.to(ids.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["T"])
def _route_kernel(logits, weights, ids, T, E, s_l, K: tl.constexpr, M: tl.constexpr, KP: tl.constexpr,
                  EP: tl.constexpr, BT: tl.constexpr, RENORM: tl.constexpr, PDL: tl.constexpr,
                  WAIT: tl.constexpr = False):
    if PDL:
        gdc_launch_dependents()      # the next kernel may start; it waits for our output itself
    if WAIT:
        gdc_wait()                   # launched programmatically: the logits come from the kernel before us
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    _route_tile(logits, weights, ids, rows, rows < T, E, s_l, K, M, KP, EP, RENORM)


@triton.jit
def _shared_w13_rows(x, w13, h, q, T, H, I, E, s_x, s_we, s_wn, K: tl.constexpr, M: tl.constexpr,
                     R: tl.constexpr, HB: tl.constexpr, WAIT: tl.constexpr):
    """Rows q*R .. q*R+R-1 of the shared slices' intermediate (M*I rows, slice s = row // I, expert E + s),
    for every token t: h[t * (K + M) + K + s, row % I] = SiLU(gate row . x_t) * (up row . x_t), rounded
    once. The weights are constant: loaded before the wait, so they stream while the kernel before us runs."""
    rr = q * R + tl.arange(0, R)
    r_ok = rr < M * I
    s = rr // I
    r = rr - s * I
    kk = tl.arange(0, HB)
    k_ok = kk < H
    m = r_ok[:, None] & k_ok[None, :]
    wg = w13 + (E + s).to(tl.int64)[:, None] * s_we + r.to(tl.int64)[:, None] * s_wn + kk[None, :]
    g = tl.load(wg, mask=m, other=0.0)
    u = tl.load(wg + I * s_wn, mask=m, other=0.0)
    if WAIT:
        gdc_wait()                   # x comes from the kernel before us (the router GEMV's normed rows)
    for t in range(T):
        xv = tl.load(x + t * s_x + kk, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        hv = silu(tl.sum(g.to(tl.float32) * xv, 1)) * tl.sum(u.to(tl.float32) * xv, 1)
        tl.store(h + (t * (K + M) + K + s).to(tl.int64) * I + r, hv.to(h.dtype.element_ty), mask=r_ok)


@triton.jit(do_not_specialize=["T"])
def _route_shared_kernel(logits, weights, ids, x, w13, h, T, E, H, I, NR, s_l, s_x, s_we, s_wn,
                         K: tl.constexpr, M: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr, BT: tl.constexpr,
                         RENORM: tl.constexpr, PDL: tl.constexpr, WAIT: tl.constexpr, R: tl.constexpr,
                         HB: tl.constexpr):
    """_route_kernel's NR programs, then programs that compute the shared slices' w13 rows
    (_shared_w13_rows, R rows each): route_and_shared_w13."""
    if PDL:
        gdc_launch_dependents()      # the next kernel may start; it waits for our output itself
    p = tl.program_id(0)
    if p < NR:
        if WAIT:
            gdc_wait()               # the logits come from the kernel before us
        rows = p * BT + tl.arange(0, BT)
        _route_tile(logits, weights, ids, rows, rows < T, E, s_l, K, M, KP, EP, RENORM)
    else:
        _shared_w13_rows(x, w13, h, p - NR, T, H, I, E, s_x, s_we, s_wn, K, M, R, HB, WAIT)


PDL_MAX_TOKENS = 8   # up to this many tokens the routing is launched programmatically (module docstring)
SHARED_W13_ROWS = 1  # shared-slot w13 rows per extra program of route_and_shared_w13


def check_routing(op: str, router_logits: torch.Tensor, top_k: int, shared_slices: int) -> int:
    """Validate topk_softmax's routing arguments (for `op`); the number of routed experts E."""
    check(router_logits.dim() == 2, op, f"router_logits must be [T, E], got {tuple(router_logits.shape)}")
    check(shared_slices >= 0, op, f"shared_slices must be >= 0, got {shared_slices}")
    E = router_logits.shape[1] - (1 if shared_slices else 0)
    check(E >= 1, op, f"router_logits {tuple(router_logits.shape)} leave no expert column besides the shared gate")
    check(1 <= top_k <= E, op, f"top_k = {top_k} must be in [1, {E}]")
    check(E <= MAX_EXPERTS, op, f"{E} experts: at most {MAX_EXPERTS} supported")
    check(router_logits.dtype in ACTIVATION_DTYPES, op, f"unsupported dtype {router_logits.dtype}")
    check_last_contiguous(op, router_logits=router_logits)
    return E


def _launch_shape(E: int, T: int) -> tuple[int, int]:
    """Tokens per program and warps of the routing kernel."""
    ep = triton.next_power_of_2(E)
    if T <= SMALL_BATCH:
        # decode: a token per one-warp program, so the 2k max-reductions are warp shuffles (block-wide
        # reductions of a 16-row, 4-warp tile cost most of an 18.6 us call at T = 1)
        return 1, 1 if ep <= 1024 else 4
    return max(1, min(16, 4096 // ep)), 4


def _pdl(router_logits: torch.Tensor, T: int) -> tuple[bool, bool]:
    """(release the next kernel early, wait for the kernel before us): module docstring."""
    pdl = pdl_launch(router_logits.device)
    return pdl, pdl and T <= PDL_MAX_TOKENS


def topk_softmax(router_logits: torch.Tensor, top_k: int, renormalize: bool, *,
                 shared_slices: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    E = check_routing("topk_softmax", router_logits, top_k, shared_slices)
    T = router_logits.shape[0]
    width = top_k + shared_slices
    weights = torch.empty((T, width), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((T, width), dtype=torch.int64, device=router_logits.device)
    if T == 0:
        return weights, ids
    bt, warps = _launch_shape(E, T)
    pdl, wait = _pdl(router_logits, T)
    _route_kernel[(triton.cdiv(T, bt),)](
        router_logits, weights, ids, T, E, router_logits.stride(0), K=top_k, M=shared_slices,
        KP=triton.next_power_of_2(width), EP=triton.next_power_of_2(E), BT=bt, RENORM=bool(renormalize),
        PDL=pdl, WAIT=wait, num_warps=warps, **({"launch_pdl": True} if wait else {}))
    return weights, ids


def route_and_shared_w13(router_logits: torch.Tensor, top_k: int, renormalize: bool, shared_slices: int,
                         x: torch.Tensor, w13: torch.Tensor, inter: torch.Tensor, *,
                         out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_softmax, and in the same launch the shared slices' w13 GEMV: inter [T * (top_k + M), I] gets, in
    the rows of every token's shared slots (K .. K + M - 1), SiLU(gate . x) * up . x of experts E .. E + M - 1
    of w13 [>= E + M, 2I, H] (the w13 kernel after it does the routed slots). The extra programs
    (SHARED_W13_ROWS weight rows each) load their rows before the kernel's wait: constant weights stream
    while the router GEMV before it runs. `out`: the (weights, ids) tensors to write (else new ones)."""
    op = "route_and_shared_w13"
    E = check_routing(op, router_logits, top_k, shared_slices)
    T, H = x.shape
    inter_rows = w13.shape[1] // 2
    width = top_k + shared_slices
    check(shared_slices >= 1, op, "needs shared_slices >= 1")
    check(x.dim() == 2 and T == router_logits.shape[0], op, f"x {tuple(x.shape)} must be [T, H] for the logits' T")
    check(w13.dim() == 3 and w13.shape[0] >= E + shared_slices and w13.shape[2] == H and w13.stride(1) == H, op,
          f"w13 must be dense [>= {E + shared_slices}, 2I, {H}], got {tuple(w13.shape)}")
    check(inter.shape == (T * width, inter_rows) and inter.is_contiguous() and inter.dtype == x.dtype, op,
          f"inter must be a contiguous [{T * width}, {inter_rows}] {x.dtype} tensor, got {tuple(inter.shape)}")
    check_last_contiguous(op, x=x, w13=w13)
    if out is None:
        out = (torch.empty((T, width), dtype=torch.float32, device=router_logits.device),
               torch.empty((T, width), dtype=torch.int64, device=router_logits.device))
    weights, ids = out
    check(weights.shape == ids.shape == (T, width) and weights.dtype == torch.float32 and weights.is_contiguous()
          and ids.is_contiguous(), op, f"out must be contiguous fp32 / integer [{T}, {width}] tensors")
    if T == 0:
        return weights, ids
    bt, warps = _launch_shape(E, T)
    pdl, wait = _pdl(router_logits, T)
    nr = triton.cdiv(T, bt)
    rows = SHARED_W13_ROWS
    _route_shared_kernel[(nr + triton.cdiv(shared_slices * inter_rows, rows),)](
        router_logits, weights, ids, x, w13, inter, T, E, H, inter_rows, nr, router_logits.stride(0), x.stride(0),
        w13.stride(0), w13.stride(1), K=top_k, M=shared_slices, KP=triton.next_power_of_2(width),
        EP=triton.next_power_of_2(E), BT=bt, RENORM=bool(renormalize), PDL=pdl, WAIT=wait, R=rows,
        HB=triton.next_power_of_2(H), num_warps=warps, **({"launch_pdl": True} if wait else {}))
    return weights, ids
