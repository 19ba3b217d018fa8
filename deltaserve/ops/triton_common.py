"""Helpers shared by the Triton ops: small @triton.jit math functions and host-side input checks.

Only the Triton implementations import this module (it imports triton).

Kernels list the integers that change from batch to batch (token and sequence counts, the block table's
row stride) in `do_not_specialize`: Triton otherwise compiles a variant per value class (== 1, multiple of
16, other), seconds each, the first time a batch of that class shows up (mid-serving, for every request
in the step) and once per class during CUDA-graph capture. Strides fixed by the model stay specialised.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .chunks import PREFILL_CHUNK, chunk_offsets  # the ops import them from here

L2NORM_EPS: float = 1e-6
# Head sizes the kernels are built for (tile dimensions must be powers of two, tensor-core dots >= 16).
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
# libdevice's fast-math functions compile on devices; the interpreter has no implementation of them
# (decided at import, as the interpreter itself: tests/ops/_interpret.py sets it before any kernel module)
FAST_MATH = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def pdl_launch(device: torch.device) -> bool:
    """Whether kernels on `device` may be launched as programmatic dependents (PDL, griddepcontrol):
    CUDA devices of compute capability 9.0 and newer. A PDL-launched kernel may start while the kernel
    before it drains, so it must run griddepcontrol.wait (gdc_wait) before touching anything an earlier
    kernel writes or reads; what it loads before the wait must be constant (weights)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_launch_args(device: torch.device) -> dict:
    """Launch arguments of a programmatic dependent launch where the device has it (pdl_launch), for
    kernels with a PDL constexpr: the kernel becomes resident while its predecessor drains and waits for
    it (griddepcontrol.wait) before any load."""
    return dict(PDL=True, launch_pdl=True) if pdl_launch(device) else {}


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def check(cond: bool, op: str, msg: str) -> None:
    """Raise a ValueError naming the op when an input is outside what the kernel supports."""
    if not cond:
        raise ValueError(f"{op} (triton): {msg}")


def check_head_dim(op: str, name: str, d: int) -> None:
    check(d in SUPPORTED_HEAD_DIMS, op, f"{name} = {d} is not one of {SUPPORTED_HEAD_DIMS}")


def check_last_contiguous(op: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        check(t.stride(-1) == 1, op, f"{name} must be contiguous in its last dim (strides {tuple(t.stride())})")


def check_same_device(op: str, *tensors: torch.Tensor) -> None:
    devs = {t.device for t in tensors}
    check(len(devs) == 1, op, f"all tensors must be on one device, got {sorted(map(str, devs))}")


def check_pool(op: str, ssm_state: torch.Tensor, hv: int, k: int, v: int) -> None:
    check(ssm_state.dtype == torch.float32, op, f"ssm_state must be float32, got {ssm_state.dtype}")
    check(ssm_state.is_contiguous(), op, "ssm_state must be contiguous [S, HV, K, V]")
    check(tuple(ssm_state.shape[1:]) == (hv, k, v), op,
          f"ssm_state shape {tuple(ssm_state.shape)} does not match [S, {hv}, {k}, {v}]")


def check_index(op: str, name: str, t: torch.Tensor, n: int) -> None:
    check(t.dim() == 1 and t.shape[0] == n, op, f"{name} must be 1-D of length {n}, got {tuple(t.shape)}")
    check(t.dtype in (torch.int32, torch.int64), op, f"{name} must be int32/int64, got {t.dtype}")
    check(t.is_contiguous(), op, f"{name} must be contiguous")


# ---- device helpers -----------------------------------------------------------------------------

@triton.jit
def softplus(x):
    """torch.nn.functional.softplus (beta 1, threshold 20) with an accurate log1p for tiny exp(-|x|)."""
    y = tl.exp(-tl.abs(x))
    u = 1.0 + y
    log1p = tl.where(u == 1.0, y, tl.log(u) * (y / tl.where(u == 1.0, 1.0, u - 1.0)))
    return tl.where(x > 20.0, x, tl.maximum(x, 0.0) + log1p)


@triton.jit
def prefetch_l2(ptrs, mask):
    """Ask L2 for the lines under `ptrs` (where mask): no registers, no ordering, never a fault (the
    addresses must be in bounds). One request per line per warp instruction (the coalescer merges lanes)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }", "=r,l,r",
        [ptrs.to(tl.int64, bitcast=True), mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def silu(x):
    return x / (1.0 + tl.exp(-x))


@triton.jit
def silu_fast(x):
    """silu from libdevice's flush-to-zero approximations (fast_expf, fast_dividef): within a few fp32 ulp of
    silu, for values rounded to 16 bits next. On sm_90 silu's exp and division with their denormal and range
    handling were ~21 SASS instructions per element, a fifth of the one-launch verify (779 of 4056 at T = 4),
    ~9 with these (verify T = 4 9.24 -> 8.77 us: PYTHONPATH=. python benchmarks/gdn_kernels.py). The
    interpreter (no libdevice there) computes silu itself."""
    if FAST_MATH:
        return libdevice.fast_dividef(x, 1.0 + libdevice.fast_expf(-x))
    else:
        return x / (1.0 + tl.exp(-x))


def given_chunk_offsets(op: str, offsets: torch.Tensor | None, cu_seqlens: torch.Tensor, chunk: int) -> torch.Tensor:
    """The caller's chunk_offsets(cu_seqlens, PREFILL_CHUNK) (computed once per step), checked against what this
    kernel needs, or computed here (None)."""
    if offsets is None:
        return chunk_offsets(cu_seqlens, chunk)
    check(chunk == PREFILL_CHUNK, op, f"precomputed chunk offsets are for {PREFILL_CHUNK}-token chunks, the kernel's "
          f"are {chunk}")
    check(offsets.shape == cu_seqlens.shape and offsets.dtype == torch.int32 and offsets.device == cu_seqlens.device,
          op, f"chunk_offsets must be int32 like cu_seqlens {tuple(cu_seqlens.shape)}, got {offsets.dtype} "
          f"{tuple(offsets.shape)} on {offsets.device}")
    return offsets


@triton.jit
def locate_chunk(coff, cu_seqlens, N, p, BLOCK_N: tl.constexpr):
    """Map program p of a grid over 'chunks aligned to sequence starts' to (n, c, bos, eos): sequence n,
    chunk c inside it, and the sequence's token bounds. `coff` comes from chunk_offsets(). The grid is
    sized on the host with the bound cdiv(T, chunk) + N (no device->host sync); programs past the last
    chunk get n = N and bos = eos = 0, so every mask is false."""
    offs = tl.arange(0, BLOCK_N)
    m = offs < N
    cend = tl.load(coff + offs + 1, mask=m, other=0)
    n = tl.sum(((cend <= p) & m).to(tl.int32), 0)
    valid = n < N
    cstart = tl.load(coff + n, mask=valid, other=0)
    bos = tl.load(cu_seqlens + n, mask=valid, other=0).to(tl.int32)
    eos = tl.load(cu_seqlens + n + 1, mask=valid, other=0).to(tl.int32)
    return n, p - cstart, bos, eos
