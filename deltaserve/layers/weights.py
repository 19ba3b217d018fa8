"""How checkpoint tensors land in parameters: each module lists the tensors it expects (name relative
to the module, expected shape, a function that copies the tensor in). The loader checks names and
shapes against these lists before calling anything, so a missing or mis-shaped tensor is reported by
name, and an unexpected one is listed. A target with fp8=True stores block-FP8: it takes FP8 checkpoint
tensors as packed rows (ops/quant/fp8.py); the others take dense tensors (FP8 ones dequantised by the loader).

Under tensor parallelism a target's `shape` stays the checkpoint's full shape and `read` picks this rank's
rows / columns from the memory-mapped tensor (a safetensors slice, or a tensor: both index the same way),
so each rank reads only its slices; `read` None reads the whole tensor."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from ..ops.quant.fp8 import is_fp8, load_packed_rows
from .linear import Linear


@dataclasses.dataclass(frozen=True)
class Target:
    shape: tuple[int, ...]
    load: Callable[[torch.Tensor], None]
    read: Callable[[Any], torch.Tensor] | None = None
    fp8: bool = False


def read_ranges(ranges: list[tuple[int, int]], dim: int = 0) -> Callable[[Any], torch.Tensor]:
    """A `read` taking rows (dim 0) or columns (dim 1) a..b of each range, concatenated."""
    def read(sl) -> torch.Tensor:
        parts = [sl[a:b] if dim == 0 else sl[:, a:b] for a, b in ranges]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
    return read


WeightMap = dict[str, Target]


def whole(param: torch.Tensor) -> Target:
    if is_fp8(param):  # an FP8 Linear's weight (a BlockFp8Weight)
        return Target(tuple(param.shape), lambda t: load_packed_rows(param, 0, t), fp8=True)
    return Target(tuple(param.shape), lambda t: param.data.copy_(t))


def rows(linear: Linear, offset: int, num_rows: int, ranges: list[tuple[int, int]] | None = None) -> Target:
    """Checkpoint rows into rows offset.. of `linear`; `ranges` (of the checkpoint's num_rows): only those rows
    (a tensor-parallel rank's)."""
    if ranges is None:
        return Target((num_rows, linear.in_features), lambda t: linear.load_rows(offset, t), fp8=linear.is_fp8)
    return Target((num_rows, linear.in_features), lambda t: linear.load_rows(offset, t), read_ranges(ranges),
                  fp8=linear.is_fp8)


def sharded(param: torch.Tensor, split, parallel) -> Target:
    """A parameter holding this rank's part of a checkpoint tensor cut by `split` (distributed.parallel.Split;
    dim 0 or 1); unsharded (split None or one rank): `whole`."""
    if split is None or not parallel.sharded:
        return whole(param)
    if is_fp8(param):   # engine/llm_engine.py refuses tensor parallelism with FP8 weights before this
        raise NotImplementedError("tensor_parallel_size > 1 with FP8 weights is not supported")
    return Target(split.full_shape(tuple(param.shape)), lambda t: param.data.copy_(t),
                  read_ranges(split.ranges(parallel), split.dim))


def prefixed(prefix: str, mapping: WeightMap) -> WeightMap:
    return {f"{prefix}.{name}": target for name, target in mapping.items()}
