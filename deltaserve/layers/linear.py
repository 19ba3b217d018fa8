"""Linear layers whose weights may be assembled from several checkpoint tensors (row shards), dense or block-FP8.

Each layer owns how a checkpoint tensor lands in it (`load_rows`). The sublayers pass its `weight` to the
projection ops (kernels.linear, rms_norm_linear, gated_linear, ...), which decide how it is read: a dense
Linear's `weight` is its [out, in] Parameter; an FP8 Linear's `weight` is an ops.quant BlockFp8Weight over its
two Parameters, `weight` (float8_e4m3fn [out, in]) and `weight_scale_inv` (fp32, one multiplier per scale
group: ops/quant/fp8.py, which also states the row-range shard rule).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from ..distributed.parallel import ShardingError
from ..ops import Kernels
from ..ops.quant.fp8 import BLOCK, FP8_DTYPE, BlockFp8Weight, dequantize_packed, load_packed_rows, packed_width


@dataclasses.dataclass(frozen=True)
class Fp8Layout:
    """Scale groups of an FP8 weight: row_group x col_group elements share a multiplier (both divide 128)."""

    row_group: int = BLOCK
    col_group: int = BLOCK


def fp8_layout(quantization, names: tuple[str, ...], *, rows: tuple[int, ...] = (), cols: tuple[int, ...] = ()
               ) -> Fp8Layout | None:
    """The layout of a weight filled from the checkpoint modules `names` (relative to a decoder layer), or None
    (dense) when there is no quantization or a not-convert entry covers one of them. rows / cols: the sizes and
    offsets at which pieces land or are regrouped (head sizes, shard widths), so that a scale group never spans
    two pieces."""
    if quantization is None or not quantization.converts(*names):
        return None
    return Fp8Layout(math.gcd(BLOCK, *rows) if rows else BLOCK, math.gcd(BLOCK, *cols) if cols else BLOCK)


def load_fp8_rows(dst: BlockFp8Weight, offset: int, packed: torch.Tensor, *, columns: tuple[int, int] | None = None,
                  block_k: int = BLOCK) -> None:
    """ops/quant/fp8.py load_packed_rows, after checking that the rows of each of dst's row groups carry one
    multiplier: a group takes its first row's, so rows from two checkpoint blocks with different multipliers
    in one group (a tensor-parallel shard that does not start on the group) would be computed wrong."""
    g, rows = dst.row_group, packed.shape[-2]
    if g > 1 and rows > 1:
        scales = packed[..., _packed_k(packed.shape[-1], block_k):]
        pad = -rows % g
        if pad:                                  # a last partial group: repeat its last row
            scales = torch.cat([scales, scales[..., -1:, :].expand(*scales.shape[:-2], pad, scales.shape[-1])], -2)
        grouped = scales.reshape(*scales.shape[:-2], -1, g, scales.shape[-1])
        if not torch.equal(grouped, grouped[..., :1, :].expand_as(grouped)):
            raise ShardingError(f"FP8 rows {offset}..{offset + rows} put values of checkpoint blocks with different "
                                f"multipliers in one {g}-row scale group (a shard that does not start on the "
                                "weight's scale groups)")
    load_packed_rows(dst, offset, packed, columns=columns, block_k=block_k)


def _packed_k(width: int, block_k: int) -> int:
    """The value columns K of packed rows `width` = K + ceil(K / block_k) wide."""
    guess = width * block_k // (block_k + 1)
    for k in (guess, guess + 1, guess - 1, guess + 2):
        if packed_width(k, block_k) == width:
            return k
    raise ValueError(f"{width} is not the width of packed FP8 rows with {block_k}-column groups")


def fp8_scale_shape(shape: tuple[int, ...], layout: Fp8Layout) -> tuple[int, ...]:
    *lead, n, k = shape
    return (*lead, math.ceil(n / layout.row_group), math.ceil(k / layout.col_group))


class Linear(nn.Module):
    """y = x W^T, no bias. W is [out_features, in_features], possibly filled from several row shards; with an
    Fp8Layout it is stored block-FP8 (`weight` then reads as a BlockFp8Weight)."""

    def __init__(self, in_features: int, out_features: int, kernels: Kernels, *, dtype: torch.dtype,
                 device: torch.device | str, fp8: Fp8Layout | None = None):
        super().__init__()
        self.kernels = kernels
        self.in_features, self.out_features = in_features, out_features
        self.fp8 = fp8
        if fp8 is None:
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device),
                                       requires_grad=False)
        else:
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                       requires_grad=False)
            self.weight_scale_inv = nn.Parameter(
                torch.ones(fp8_scale_shape((out_features, in_features), fp8), dtype=torch.float32, device=device),
                requires_grad=False)

    def __getattr__(self, name: str):
        # An FP8 Linear's weight operand carries its scales (the Parameters stay registered as weight /
        # weight_scale_inv, the checkpoint's names).
        p = self.__dict__.get("_parameters", {})
        if name == "weight" and self.__dict__.get("fp8") is not None and "weight_scale_inv" in p:
            return BlockFp8Weight(p["weight"], p["weight_scale_inv"], self.fp8.row_group, self.fp8.col_group)
        return super().__getattr__(name)

    @property
    def is_fp8(self) -> bool:
        return self.fp8 is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear(x, self.weight)

    def load_rows(self, offset: int, tensor: torch.Tensor) -> None:
        """Copy a [rows, in_features] checkpoint tensor into rows offset..offset+rows. FP8 checkpoint rows come
        packed (ops/quant/fp8.py pack_rows: values + their block scales): an FP8 Linear stores them as they are,
        a dense one dequantises them (exact in fp32)."""
        if self.fp8 is not None:
            if tensor.shape[-1] != packed_width(self.in_features):
                raise ValueError(f"an FP8 Linear takes packed FP8 rows, got a {tensor.dtype} tensor "
                                 f"{list(tensor.shape)}")
            load_fp8_rows(self.weight, offset, tensor)
            return
        if tensor.shape[-1] == packed_width(self.in_features) != self.in_features:
            tensor = dequantize_packed(tensor, self.in_features)
        self._parameters["weight"].data[offset : offset + tensor.shape[0]].copy_(tensor)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}" + (", fp8" if self.fp8 else "")
