"""Triton split-K merge: the fp32 partial results of key-range segments (max, sum, unnormalised output per
query row), as paged_attention's split-K and the small-batch decode write them, merged into the output.
NEG_BIG is the running maximum of a segment that saw no keys."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..triton_common import pdl_launch_args

NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity" for running maxima: exp2(NEG_BIG - NEG_BIG) = 1, no NaN


@triton.jit(do_not_specialize=["splits"])
def _merge_splits_kernel(part_ml, part_acc, out, splits, NH: tl.constexpr, SP: tl.constexpr,
                         BD: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr = False):
    """out[t, h, dims] = sum_s w_s acc_s / sum_s w_s l_s with w_s = exp2(m_s - max_s m_s), for one token,
    one head and BD dims per program, every segment loaded at once (a loop over segments would be a
    chain of dependent loads: ~20 us at 64 segments). Segments with l == 0 (no visible keys) carry no
    weight and are not read."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    row = t * NH + tl.program_id(1)
    s = tl.arange(0, SP)
    ok = s < splits
    part = row * splits + s
    m = tl.load(part_ml + part * 2, mask=ok, other=NEG_BIG)
    lsum = tl.load(part_ml + part * 2 + 1, mask=ok, other=0.0)
    w = tl.where(lsum > 0, tl.exp2(m - tl.max(m, 0)), 0.0)
    l_all = tl.sum(w * lsum, 0)
    w = w / tl.where(l_all > 0, l_all, 1.0)
    dims = tl.program_id(2) * BD + tl.arange(0, BD)
    a = tl.load(part_acc + part[:, None] * D + dims[None, :], mask=(w > 0)[:, None], other=0.0)
    tl.store(out + row * D + dims, tl.sum(a * w[:, None], 0).to(out.dtype.element_ty))


def merge_splits(part_ml: torch.Tensor, part_acc: torch.Tensor, out: torch.Tensor) -> None:
    """out [T, NH, D] from the split-K partial results part_ml [T, NH, S, 2], part_acc [T, NH, S, D]."""
    T, nh, splits, d = part_acc.shape
    sp = triton.next_power_of_2(splits)
    bd = min(d, max(16, 4096 // sp))
    _merge_splits_kernel[(T, nh, d // bd)](part_ml, part_acc, out, splits, NH=nh, SP=sp, BD=bd, D=d,
                                           num_warps=4, **pdl_launch_args(out.device))
