"""Triton GEMV with a gate in front, for gated_linear at one row of x: the attention output gate
x * sigmoid(gate) or the GDN output norm (per-head RMSNorm times silu / sigmoid of the gate), then the
projection, in one launch. Each program steps over K in whole heads, normalises and gates the x chunk in
registers (x and the gate re-read from L2 by every program, hence wider row blocks than the plain GEMV's:
config.default_gated_config), rounds it to x's dtype as the two ops do, and multiplies its weight rows by it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..triton_common import pdl_launch, sigmoid, silu
from .config import LinearConfig
from .triton_gemv import prefetch_weights


@triton.jit
def _gemv_gated_kernel(x, g, nw, w, y, N, K, s_wn, eps,
                       BN: tl.constexpr, HB: tl.constexpr, HD: tl.constexpr, NORM: tl.constexpr,
                       SIGMOID: tl.constexpr, PDL: tl.constexpr = False, PF: tl.constexpr = 0):
    """y[n] = sum_k h[k] w[n, k] for one row of x (fp32 accumulation), h = act(g) * x, with NORM each head
    of HD values of x first scaled by its rsqrt(mean square + eps) and by nw; h rounded to x's dtype.
    A program owns BN weight rows and steps over K by HB whole heads ([BN, HB, HD] tiles), so the norm's
    statistics of a head are in the step that uses them."""
    pid = tl.program_id(0)
    rows = pid * BN + tl.arange(0, BN)
    row_ok = rows < N
    d = tl.arange(0, HD)
    if NORM:
        wn = tl.load(nw + d).to(tl.float32)  # a weight: may be read before the wait
    if PDL:
        prefetch_weights(w, rows, row_ok, 0, K, s_wn, BN, PF)
        gdc_wait()                   # x and the gate belong to the kernels before us
        gdc_launch_dependents()
    kk = tl.arange(0, HB)[:, None] * HD + d[None, :]                      # [HB, HD]
    wp = w + rows[:, None, None].to(tl.int64) * s_wn + kk[None, :, :]
    acc = tl.zeros([BN, HB, HD], dtype=tl.float32)
    for k0 in range(0, K, HB * HD):
        k_ok = kk + k0 < K
        wt = tl.load(wp + k0, mask=row_ok[:, None, None] & k_ok[None, :, :], other=0.0).to(tl.float32)
        xv = tl.load(x + k0 + kk, mask=k_ok, other=0.0).to(tl.float32)
        gv = tl.load(g + k0 + kk, mask=k_ok, other=0.0).to(tl.float32)
        if NORM:
            xv = xv * tl.rsqrt(tl.sum(xv * xv, 1) / HD + eps)[:, None] * wn[None, :]
        if SIGMOID:
            xv = xv * sigmoid(gv)
        else:
            xv = xv * silu(gv)
        xv = xv.to(x.dtype.element_ty).to(tl.float32)   # the two-launch path's operand, rounded once
        acc += wt * xv[None, :, :]
    out = tl.sum(tl.sum(acc, 2), 1)
    tl.store(y + rows, out.to(y.dtype.element_ty), mask=row_ok)


def gated_gemv(x2: torch.Tensor, gate2: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None,
               eps: float, sigmoid_gate: bool, cfg: LinearConfig) -> torch.Tensor:
    """y [1, N] = act(gate2) * x2 (per-head normed first with norm_weight [D]) @ weight^T by
    _gemv_gated_kernel with tiles `cfg` (x2, gate2 [1, K]; checked by the caller)."""
    (M, K), N = x2.shape, weight.shape[0]
    if norm_weight is not None:
        hd = norm_weight.numel()
    else:
        hd = min(cfg.block_k, 128)           # no heads: any split of the step into rows of the tile
    block_k = max(cfg.block_k, hd)           # whole heads per step
    y = torch.empty((M, N), dtype=x2.dtype, device=x2.device)
    pf = 0 if cfg.prefetch <= 0 else max(64, triton.next_power_of_2(min(cfg.prefetch, K)))
    pdl = {"PDL": True, "PF": pf, "launch_pdl": True} if cfg.pdl and pdl_launch(x2.device) else {}
    _gemv_gated_kernel[(triton.cdiv(N, cfg.block_n),)](
        x2, gate2, x2 if norm_weight is None else norm_weight, weight, y, N, K,
        weight.stride(0), float(eps), BN=cfg.block_n, HB=block_k // hd, HD=hd, NORM=norm_weight is not None,
        SIGMOID=sigmoid_gate, num_warps=cfg.warps, num_stages=cfg.stages, **pdl)
    return y
