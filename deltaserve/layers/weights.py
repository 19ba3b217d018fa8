"""How checkpoint tensors land in parameters: each module lists the tensors it expects (name relative
to the module, expected shape, a function that copies the tensor in). The loader checks names and
shapes against these lists before calling anything, so a missing or mis-shaped tensor is reported by
name, and an unexpected one is listed."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from .linear import Linear


@dataclasses.dataclass(frozen=True)
class Target:
    shape: tuple[int, ...]
    load: Callable[[torch.Tensor], None]


WeightMap = dict[str, Target]


def whole(param: torch.Tensor) -> Target:
    return Target(tuple(param.shape), lambda t: param.data.copy_(t))


def rows(linear: Linear, offset: int, num_rows: int) -> Target:
    return Target((num_rows, linear.in_features), lambda t: linear.load_rows(offset, t))


def prefixed(prefix: str, mapping: WeightMap) -> WeightMap:
    return {f"{prefix}.{name}": target for name, target in mapping.items()}
