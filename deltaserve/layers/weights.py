"""How checkpoint tensors land in parameters: each module lists the tensors it expects (name relative
to the module, expected shape, a function that copies the tensor in). The loader checks names and
shapes against these lists before calling anything, so a missing or mis-shaped tensor is reported by
name, and an unexpected one is listed. A target with fp8=True stores block-FP8: it takes FP8 checkpoint
tensors as packed rows (ops/quant/fp8.py); the others take dense tensors (FP8 ones dequantised by the loader).

Under tensor parallelism a target's `shape` stays the checkpoint's full shape and `read` picks this rank's
rows / columns from the memory-mapped tensor (a safetensors slice, or a tensor: both index the same way),
so each rank reads only its slices; `read` None reads the whole tensor.

Block-FP8 shards (`fp8_shard_rows`): a rank's piece of an FP8 checkpoint tensor is its slice of the e4m3
values plus, per row, the multipliers of the checkpoint blocks its values came from (the scale tensor is
read whole: 1/16384 of the weight), so any row or column range is exact, also one that cuts a 128-block
(the block's multiplier then lives on both ranks). Column shards (row-parallel layers) travel as packed rows
with one multiplier per `block_k` columns, the holder's column group; a range that does not start and end on
the holder's groups is refused by name (distributed/parallel.py refuse_split_blocks)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ..distributed.parallel import refuse_split_blocks
from ..ops.quant.fp8 import BLOCK, is_fp8
from .linear import Linear, load_fp8_rows


@dataclasses.dataclass(frozen=True)
class Slices:
    """A `read`: along `dim` of the checkpoint tensor, the ranges (a, b), concatenated in order."""

    dim: int
    ranges: tuple[tuple[int, int], ...]

    def __call__(self, sl) -> torch.Tensor:
        lead = (slice(None),) * self.dim
        parts = [sl[(*lead, slice(a, b))] for a, b in self.ranges]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)

    def indices(self, device=None) -> torch.Tensor:
        return torch.cat([torch.arange(a, b, device=device) for a, b in self.ranges])


@dataclasses.dataclass(frozen=True)
class Target:
    """shape: the checkpoint's (full) shape; read: this rank's part (None: all of it); fp8: the target stores
    block-FP8 and takes packed rows, with one multiplier per `block_k` columns (128 unless its columns are
    sharded: then its holder's column group); row_group: its holder's rows per multiplier, when known, so that
    a row shard not starting on them is refused before any copy (1: checked at the copy, load_fp8_rows)."""

    shape: tuple[int, ...]
    load: Callable[[torch.Tensor], None]
    read: Callable[[Any], torch.Tensor] | None = None
    fp8: bool = False
    block_k: int = BLOCK
    row_group: int = 1


def read_ranges(ranges: list[tuple[int, int]], dim: int = 0) -> Slices:
    """A `read` taking rows (dim 0) or columns (dim 1) a..b of each range, concatenated."""
    return Slices(dim, tuple(ranges))


def _shard_scales(name: str, q: torch.Tensor, scale: torch.Tensor, read: Slices | None, block_k: int,
                  row_group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the scale tensor cut to the shard's leading dims, per shard row its checkpoint block row's index,
    per block_k shard columns their checkpoint block column's index)."""
    nd = q.dim()
    rows, cols = torch.arange(q.shape[-2]), torch.arange(q.shape[-1])
    if read is not None:
        dim = read.dim % nd
        if dim < nd - 2:                 # whole experts: their scales are the same slices
            scale = read(scale)
        elif dim == nd - 2:
            refuse_split_blocks(name, read.ranges, row_group, what="rows")
            rows = read.indices()
        else:
            refuse_split_blocks(name, read.ranges, block_k, what="columns")
            cols = read.indices()
    return scale.float(), rows // BLOCK, cols[::block_k] // BLOCK


def fp8_shard_rows(name: str, q: torch.Tensor, scale: torch.Tensor, read: Slices | None, *, block_k: int = BLOCK,
                   row_group: int = 1) -> torch.Tensor:
    """A rank's FP8 values q (already cut by `read` from the checkpoint tensor whose block multipliers are
    `scale`, read whole) -> packed rows [..., rows, K + ceil(K / block_k)] (ops/quant/fp8.py pack_rows)."""
    scale, row_blocks, col_blocks = _shard_scales(name, q, scale, read, block_k, row_group)
    per_row = scale.index_select(-2, row_blocks.to(scale.device)).index_select(-1, col_blocks.to(scale.device))
    return torch.cat([q.float(), per_row], dim=-1)


def fp8_shard_dense(name: str, q: torch.Tensor, scale: torch.Tensor, read: Slices | None) -> torch.Tensor:
    """A rank's FP8 values -> the dequantised shard in fp32 (for a dense target)."""
    scale, row_blocks, _ = _shard_scales(name, q, scale, read, 1, 1)
    cols = read.indices() if read is not None and read.dim % q.dim() == q.dim() - 1 else torch.arange(q.shape[-1])
    per = scale.index_select(-2, row_blocks.to(scale.device)).index_select(-1, (cols // BLOCK).to(scale.device))
    return q.float() * per


WeightMap = dict[str, Target]


def whole(param: torch.Tensor) -> Target:
    if is_fp8(param):  # an FP8 Linear's weight (a BlockFp8Weight)
        return Target(tuple(param.shape), lambda t: load_fp8_rows(param, 0, t), fp8=True,
                      row_group=param.row_group)
    return Target(tuple(param.shape), lambda t: param.data.copy_(t))


def rows(linear: Linear, offset: int, num_rows: int, ranges: list[tuple[int, int]] | None = None) -> Target:
    """Checkpoint rows into rows offset.. of `linear`; `ranges` (of the checkpoint's num_rows): only those rows
    (a tensor-parallel rank's)."""
    group = linear.fp8.row_group if linear.is_fp8 else 1
    return Target((num_rows, linear.in_features), lambda t: linear.load_rows(offset, t),
                  None if ranges is None else read_ranges(ranges), fp8=linear.is_fp8, row_group=group)


def sharded(param: torch.Tensor, split, parallel) -> Target:
    """A parameter holding this rank's part of a checkpoint tensor cut by `split` (distributed.parallel.Split;
    dim 0 or 1); unsharded (split None or one rank): `whole`."""
    if split is None or not parallel.sharded:
        return whole(param)
    read = read_ranges(split.ranges(parallel), split.dim)
    if is_fp8(param):   # packed rows: one multiplier per column group when the columns are the split dim
        block_k = param.col_group if split.dim == param.qweight.dim() - 1 else BLOCK
        return Target(split.full_shape(tuple(param.shape)), lambda t: load_fp8_rows(param, 0, t, block_k=block_k),
                      read, fp8=True, block_k=block_k, row_group=param.row_group)
    return Target(split.full_shape(tuple(param.shape)), lambda t: param.data.copy_(t), read)


def prefixed(prefix: str, mapping: WeightMap) -> WeightMap:
    return {f"{prefix}.{name}": target for name, target in mapping.items()}
