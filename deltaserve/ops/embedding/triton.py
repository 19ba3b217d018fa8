"""Triton embed_rope (same signature as reference.embed_rope): one launch instead of the reference's ~11
small torch kernels (id resolution, gather, position cast, angle product, concatenation, cos, sin and two
casts), each a kernel boundary at the head of every decode step's graph.

One program per token: it resolves the id, copies the embedding row, and writes the token's cos / sin
rows. cos / sin use libdevice's cosf / sinf, the functions torch's CUDA kernels call, on the same fp32
angle (one fp32 product), so the tables have the reference's bits (not tl.cos / tl.sin: those lower to
the approximate PTX instructions, whose error grows with the angle, and angles reach 1e5 rad here).
Triton's interpreter has no libdevice; there numpy's cos / sin stand in (within an ulp or two of torch's).
On Hopper the program lets the next kernel (a programmatic dependent, the first layer's projection)
become resident at once: it prefetches its weights while this runs, and waits for this kernel's writes
itself.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.language.extra.cuda import gdc_launch_dependents

from ..triton_common import check, check_same_device, next_pow2, pdl_launch

BLOCK_H = 1024
_LIBDEVICE = os.environ.get("TRITON_INTERPRET", "0") != "1"


@triton.jit(do_not_specialize=["V"])
def _embed_rope_kernel(ids, embed, pos, inv_freq, last, slots, x, cos, sin, V, H, s_e, s_x, s_c,
                       HALF: tl.constexpr, HP: tl.constexpr, BH: tl.constexpr, PENDING: tl.constexpr,
                       RELEASE: tl.constexpr, LIBDEVICE: tl.constexpr):
    if RELEASE:
        gdc_launch_dependents()          # the next kernel waits for our writes itself (griddepcontrol.wait)
    t = tl.program_id(0).to(tl.int64)
    tok = tl.load(ids + t)
    if PENDING:
        if tok < 0:
            tok = tl.load(last + tl.maximum(tl.load(slots + t), 0))
    tok = tok.to(tl.int64)
    for h0 in range(0, H, BH):
        offs = h0 + tl.arange(0, BH)
        m = offs < H
        tl.store(x + t * s_x + offs, tl.load(embed + tok * s_e + offs, mask=m), mask=m)
    j = tl.arange(0, HP)
    jm = j < HALF
    angle = tl.load(pos + t).to(tl.float32) * tl.load(inv_freq + j, mask=jm, other=0.0)
    if LIBDEVICE:
        c = libdevice.cos(angle).to(cos.dtype.element_ty)
        s = libdevice.sin(angle).to(sin.dtype.element_ty)
    else:
        c = tl.cos(angle).to(cos.dtype.element_ty)
        s = tl.sin(angle).to(sin.dtype.element_ty)
    tl.store(cos + t * s_c + j, c, mask=jm)
    tl.store(cos + t * s_c + HALF + j, c, mask=jm)
    tl.store(sin + t * s_c + j, s, mask=jm)
    tl.store(sin + t * s_c + HALF + j, s, mask=jm)


def embed_rope(input_ids: torch.Tensor, embed: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, *,
               last_tokens: torch.Tensor | None = None, slots: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    op = "embed_rope"
    check((last_tokens is None) == (slots is None), op, "last_tokens and slots go together")
    T = input_ids.shape[0]
    check(input_ids.dim() == 1 and positions.shape == (T,), op,
          f"input_ids and positions must be [T], got {tuple(input_ids.shape)} and {tuple(positions.shape)}")
    check(embed.dim() == 2 and embed.stride(1) == 1, op, f"embed must be [V, H] with unit stride in H, "
          f"got shape {tuple(embed.shape)} strides {tuple(embed.stride())}")
    check(inv_freq.dim() == 1 and inv_freq.dtype == torch.float32, op, "inv_freq must be 1-D float32")
    check(input_ids.dtype in (torch.int32, torch.int64) and positions.dtype in (torch.int32, torch.int64), op,
          "input_ids and positions must be int32 / int64")
    pending = last_tokens is not None
    if pending:
        check(slots.shape == (T,) and last_tokens.dim() == 1, op, "slots must be [T] and last_tokens 1-D")
        check_same_device(op, input_ids, embed, positions, inv_freq, last_tokens, slots)
    else:
        check_same_device(op, input_ids, embed, positions, inv_freq)
    V, H = embed.shape
    half = inv_freq.shape[0]
    x = torch.empty(T, H, dtype=embed.dtype, device=embed.device)
    cos = torch.empty(T, 2 * half, dtype=embed.dtype, device=embed.device)
    sin = torch.empty_like(cos)
    if T == 0:
        return x, cos, sin
    ids, pos = input_ids.contiguous(), positions.contiguous()
    last = last_tokens if pending else ids
    sl = slots.contiguous() if pending else ids
    _embed_rope_kernel[(T,)](ids, embed, pos, inv_freq, last, sl, x, cos, sin, V, H, embed.stride(0), x.stride(0),
                             cos.stride(0), HALF=half, HP=next_pow2(half), BH=min(BLOCK_H, next_pow2(H)),
                             PENDING=pending, RELEASE=pdl_launch(embed.device), LIBDEVICE=_LIBDEVICE,
                             num_warps=4)
    return x, cos, sin
