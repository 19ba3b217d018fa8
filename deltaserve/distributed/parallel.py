"""Which slice of each tensor a tensor-parallel rank holds (plain Python: no process group needed).

Every sharded dimension is a concatenation of segments (e.g. a GDN input projection's q | k | v | z | b | a
rows); each segment is cut into `parts` equal pieces and rank r holds piece r * parts // size of every
segment. parts = size is the ordinary split; parts < size (attention KV heads when size > num_key_value_heads)
gives a piece to several ranks: replication. `Split.take` cuts a full tensor into a rank's tensor, so the
same rule serves checkpoint loading and the dummy weights (whose per-rank values equal the slices of the
size-1 draw).
"""

from __future__ import annotations

import dataclasses

import torch


class ShardingError(ValueError):
    """A model shape that does not divide across the ranks: the message names the config field."""


@dataclasses.dataclass(frozen=True)
class Parallel:
    """This process's place: rank in a tensor-parallel group of `size`; expert_parallel splits the MoE
    experts across the ranks (whole experts) instead of every expert's intermediate dim."""

    rank: int = 0
    size: int = 1
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not in a group of size {self.size}")

    @property
    def sharded(self) -> bool:
        return self.size > 1

    def piece(self, full: int, parts: int | None = None) -> tuple[int, int]:
        """(start, stop) of this rank's piece of a segment of `full` rows cut into `parts` (default: size)."""
        parts = parts or self.size
        n = full // parts
        j = self.rank * parts // self.size
        return j * n, (j + 1) * n

    def local(self, full: int) -> int:
        return full // self.size


SINGLE = Parallel()


@dataclasses.dataclass(frozen=True)
class Split:
    """A sharded dimension: `dim` is the concatenation of `segments` (full size, parts) of the full tensor."""

    dim: int
    segments: tuple[tuple[int, int], ...]

    @property
    def full_size(self) -> int:
        return sum(full for full, _ in self.segments)

    def ranges(self, parallel: Parallel) -> list[tuple[int, int]]:
        """This rank's (start, stop) ranges in the full dimension, in local order."""
        out, offset = [], 0
        for full, parts in self.segments:
            a, b = parallel.piece(full, parts)
            out.append((offset + a, offset + b))
            offset += full
        return out

    def take(self, full: torch.Tensor, parallel: Parallel) -> torch.Tensor:
        return torch.cat([full.narrow(self.dim, a, b - a) for a, b in self.ranges(parallel)], dim=self.dim)

    def full_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        shape = list(local_shape)
        shape[self.dim] = self.full_size
        return tuple(shape)


def even(full: int, parallel: Parallel) -> Split:
    """One segment split evenly (dim set by the caller through dataclasses.replace, default 0)."""
    return Split(0, ((full, parallel.size),))


def require_divisible(field: str, value: int, parallel: Parallel, *, what: str = "tensor_parallel_size") -> None:
    if value % parallel.size:
        raise ShardingError(f"{field} = {value} is not divisible by {what} = {parallel.size}")


def kv_parts(num_kv_heads: int, parallel: Parallel) -> int:
    """Pieces the KV heads are cut into: one per rank, or (size > heads) one per head, each replicated on
    size / heads ranks."""
    if num_kv_heads >= parallel.size:
        require_divisible("num_key_value_heads", num_kv_heads, parallel)
        return parallel.size
    if parallel.size % num_kv_heads:
        raise ShardingError(f"tensor_parallel_size = {parallel.size} is neither a divisor nor a multiple of "
                            f"num_key_value_heads = {num_kv_heads}")
    return num_kv_heads


def refuse_split_blocks(field: str, ranges, group: int, *, what: str = "rows") -> None:
    """Block-FP8 weights shard with their block multipliers: each (start, stop) range of a rank's rows (or
    columns) of tensor `field` must start and end on the holder's scale groups of `group` (a divisor of the
    128-block chosen by the layer from its shard widths), so that no group takes values from two checkpoint
    blocks. A range that does not is refused, naming the tensor (not computed with a wrong multiplier)."""
    bad = [(a, b) for a, b in ranges if a % group or (b - a) % group]
    if bad:
        a, b = bad[0]
        raise ShardingError(f"{field}: this rank's {what} {a}..{b} do not start and end on the weight's "
                            f"{group}-{what[:-1]} FP8 scale groups, so a group would mix two 128 x 128 "
                            "checkpoint blocks (use a smaller tensor_parallel_size or enable_expert_parallel)")


def check_model_divides(config, parallel: Parallel) -> None:
    """Refuse, before any process starts, a model whose shapes do not split over `parallel` (the layers check
    the same when they are built); the error names the config field. `config`: a ModelConfig."""
    if not parallel.sharded:
        return
    require_divisible("linear_num_key_heads", config.linear_num_key_heads, parallel)
    require_divisible("num_attention_heads", config.num_attention_heads, parallel)
    kv_parts(config.num_key_value_heads, parallel)
    require_divisible("vocab_size", config.vocab_size, parallel)
    if any(not moe for moe in config.moe_layers):
        require_divisible("intermediate_size", config.intermediate_size, parallel)
    if config.num_experts > 0:
        if parallel.expert_parallel:
            require_divisible("num_experts", config.num_experts, parallel, what="tensor_parallel_size (experts)")
        else:
            require_divisible("moe_intermediate_size", config.moe_intermediate_size, parallel)
        s, i = config.shared_expert_intermediate_size, config.moe_intermediate_size
        if s > 0 and s % i:
            require_divisible("shared_expert_intermediate_size", s, parallel)
