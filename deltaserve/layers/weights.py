"""How checkpoint tensors land in parameters: each module lists the tensors it expects (name relative
to the module, expected shape, a function that copies the tensor in). The loader checks names and
shapes against these lists before calling anything, so a missing or mis-shaped tensor is reported by
name, and an unexpected one is listed. A target with fp8=True stores block-FP8: it takes FP8 checkpoint
tensors as packed rows (ops/quant/fp8.py); the others take dense tensors (FP8 ones dequantised by the loader)."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from ..ops.quant.fp8 import is_fp8, load_packed_rows
from .linear import Linear


@dataclasses.dataclass(frozen=True)
class Target:
    shape: tuple[int, ...]
    load: Callable[[torch.Tensor], None]
    fp8: bool = False


WeightMap = dict[str, Target]


def whole(param: torch.Tensor) -> Target:
    if is_fp8(param):  # an FP8 Linear's weight (a BlockFp8Weight)
        return Target(tuple(param.shape), lambda t: load_packed_rows(param, 0, t), fp8=True)
    return Target(tuple(param.shape), lambda t: param.data.copy_(t))


def rows(linear: Linear, offset: int, num_rows: int) -> Target:
    return Target((num_rows, linear.in_features), lambda t: linear.load_rows(offset, t), fp8=linear.is_fp8)


def prefixed(prefix: str, mapping: WeightMap) -> WeightMap:
    return {f"{prefix}.{name}": target for name, target in mapping.items()}
