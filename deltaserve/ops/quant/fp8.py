"""Block-FP8 weights (the format of Qwen's and DeepSeek's FP8 checkpoints) and their conversions.

A checkpoint linear stores `weight` float8_e4m3fn [N, K] and `weight_scale_inv` fp32 [ceil(N/BN), ceil(K/BK)]
(BN = BK = 128): the dequantisation multiplier, W[n, k] = weight[n, k] * weight_scale_inv[n // BN, k // BK].

In memory a `BlockFp8Weight` holds the fp8 values and one scale per (row group, column group) with groups of
`row_group` x `col_group` elements that divide the checkpoint's blocks (128 x 128 for every published shape; a
fused projection whose pieces are not 128-aligned, as in tiny test models, has smaller groups holding the
same scale repeated). That keeps every row permutation the layers apply on load exact: it moves whole groups.
Shard rule (tensor parallelism): a row range [a, b) of the weight is a BlockFp8Weight again when a and b are
multiples of row_group (b may be N): qweight[a:b] with scale[a // row_group : ceil(b / row_group)]; the same
on columns with col_group (row-parallel layers). A shard narrower than a checkpoint block (Qwen3-Next's experts,
I = 512, at TP8: 64 rows) needs no refusal: build the holder with row_group = gcd(128, shard width) (64), whose
groups repeat their block's multiplier, and every shard is exact.

Checkpoint pieces travel through the layers' loaders as "packed rows": fp32 [..., rows, K + ceil(K/BK)] holding
the fp8 values (exact in fp32) and, per row, its block row's scales, so any row permutation moves values and
scales together (pack_rows / unpack_rows).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0                 # largest finite e4m3fn value
BLOCK = 128                     # the published weight_block_size, both dims
_DEQUANT_CHUNK = 1 << 24        # elements per fp32 intermediate of BlockFp8Weight.dequantize


class BlockFp8Weight(NamedTuple):
    """qweight fp8 [..., N, K]; scale fp32 [..., ceil(N / row_group), ceil(K / col_group)] (multipliers)."""

    qweight: torch.Tensor
    scale: torch.Tensor
    row_group: int
    col_group: int

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the checkpoint describes, computed in fp32 (exact: an fp8 value times an fp32 scale),
        then cast to dtype; in chunks of rows, so the fp32 intermediate stays small for stacked experts."""
        q, s, g, c = self.qweight, self.scale, self.row_group, self.col_group
        N, K = q.shape[-2:]
        out = torch.empty(q.shape, dtype=dtype, device=q.device)
        if N % g or K % c:
            return dequantize_grouped(q, s, g, c).to(dtype)
        rows = q.reshape(-1, g, K // c, c)                                   # [(lead * N/g), g, K/c, c]
        scales = s.reshape(-1, 1, K // c, 1)
        flat = out.view(-1, g, K // c, c)
        step = max(1, _DEQUANT_CHUNK // (g * K))
        for i in range(0, rows.shape[0], step):
            flat[i : i + step] = rows[i : i + step].float() * scales[i : i + step]
        return out

    def expert(self, e: int) -> BlockFp8Weight:
        """Expert e of a stacked [E, N, K] weight."""
        return BlockFp8Weight(self.qweight[e], self.scale[e], self.row_group, self.col_group)


def is_fp8(weight) -> bool:
    return isinstance(weight, BlockFp8Weight)


def dequantize_grouped(q: torch.Tensor, scale: torch.Tensor, row_group: int, col_group: int) -> torch.Tensor:
    N, K = q.shape[-2:]
    s = scale.repeat_interleave(row_group, dim=-2)[..., :N, :].repeat_interleave(col_group, dim=-1)[..., :K]
    return q.float() * s


def quantize_blocks(w: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK)) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (fp8 [..., N, K], scale_inv fp32 [..., ceil(N/BN), ceil(K/BK)]) with each block's
    amax mapped to FP8_MAX (an all-zero block gets scale 1). Online FP8 and the tests' FP8 checkpoints."""
    bn, bk = block
    *lead, N, K = w.shape
    nb, kb = math.ceil(N / bn), math.ceil(K / bk)
    padded = torch.zeros(*lead, nb * bn, kb * bk, dtype=torch.float32, device=w.device)
    padded[..., :N, :K] = w.float()
    blocks = padded.view(*lead, nb, bn, kb, bk)
    amax = blocks.abs().amax(dim=(-3, -1))                                   # [..., nb, kb]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(*lead, nb * bn, kb * bk)[..., :N, :K].contiguous(), scale.contiguous()


def dequantize_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK)
                      ) -> torch.Tensor:
    """The checkpoint's dequantised weight in fp32."""
    return dequantize_grouped(q, scale_inv, block[0], block[1])


ACT_SCALE_FLOOR = 1e-10         # amax floor of an activation group (an all-zero group gets a tiny, finite scale)


def quantize_activations(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token-group activation quantisation (the W8A8 GEMM's left operand, DeepSeek-V3 / vLLM's
    per_token_group_quant_fp8): x [M, K] -> (e4m3 [M, K], scales fp32 [M, ceil(K/group)]) with each group's
    amax (floored at ACT_SCALE_FLOOR) mapped to FP8_MAX: scale = amax / FP8_MAX, q = clamp(x / scale), both
    in fp32 (round to nearest even). The reference of the Triton quant kernel, computed the same way."""
    M, K = x.shape
    kb = math.ceil(K / group)
    padded = torch.zeros(M, kb * group, dtype=torch.float32, device=x.device)
    padded[:, :K] = x.float()
    groups = padded.view(M, kb, group)
    amax = groups.abs().amax(dim=-1).clamp(min=ACT_SCALE_FLOOR)                           # [M, kb]
    # a tensor divisor: CUDA torch divides by a Python scalar as a product with its reciprocal (not correctly
    # rounded), the Triton kernel divides with div_rn
    scale = amax / torch.full_like(amax, FP8_MAX)
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(M, kb * group)[:, :K].contiguous(), scale


def w8a8_linear_reference(x: torch.Tensor, weight: BlockFp8Weight) -> torch.Tensor:
    """The W8A8 product's oracle: x quantised per token group of weight.col_group (quantize_activations),
    both operands dequantised, fp32 matmul, rounded once to x's dtype. x [..., K]."""
    K = weight.shape[-1]
    x2 = x.reshape(-1, K)
    q, s = quantize_activations(x2, weight.col_group)
    xd = q.float() * s.repeat_interleave(weight.col_group, dim=-1)[:, :K]
    return (xd @ weight.dequantize(torch.float32).t()).to(x.dtype).reshape(*x.shape[:-1], weight.shape[-2])


def packed_width(K: int, block_k: int = BLOCK) -> int:
    return K + math.ceil(K / block_k)


def pack_rows(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK)) -> torch.Tensor:
    """fp8 [..., N, K] + block scales -> fp32 [..., N, K + ceil(K/BK)]: the values, then the row's block scales."""
    N = q.shape[-2]
    row_scales = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :N, :]
    return torch.cat([q.float(), row_scales], dim=-1)


def unpack_rows(packed: torch.Tensor, K: int, block_k: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of pack_rows: (fp8 values [..., rows, K], per-row block scales fp32 [..., rows, ceil(K/BK)])."""
    if packed.shape[-1] != packed_width(K, block_k):
        raise ValueError(f"packed FP8 rows have width {packed.shape[-1]}, expected {packed_width(K, block_k)}")
    return packed[..., :K].to(FP8_DTYPE), packed[..., K:]


def dequantize_packed(packed: torch.Tensor, K: int, block_k: int = BLOCK) -> torch.Tensor:
    """Packed rows -> the dequantised rows in fp32."""
    q, row_scales = unpack_rows(packed, K, block_k)
    return q.float() * row_scales.repeat_interleave(block_k, dim=-1)[..., :K]


def load_packed_rows(dst: BlockFp8Weight, offset: int, packed: torch.Tensor, *, columns: tuple[int, int] | None = None,
                     block_k: int = BLOCK) -> None:
    """Copy packed checkpoint rows [..., rows, K + ceil(K/BK)] of a K-column checkpoint tensor into dst rows
    offset..offset+rows; `columns` (start, stop): only those checkpoint columns, which fill all of dst's columns
    (the shared expert's down projection cut into slices). Offsets and counts must be multiples of dst's groups,
    so each group lies inside one checkpoint block (else ValueError)."""
    K = dst.qweight.shape[-1] if columns is None else None
    if K is None:  # recover the checkpoint width from the packed width
        K = next(k for k in range(packed.shape[-1] + 1) if packed_width(k, block_k) == packed.shape[-1])
    q, row_scales = unpack_rows(packed, K, block_k)
    start, stop = columns or (0, K)
    q = q[..., start:stop]
    rows, g, c = q.shape[-2], dst.row_group, dst.col_group
    N_dst, K_dst = dst.qweight.shape[-2:]
    if stop - start != K_dst:
        raise ValueError(f"FP8 piece has {stop - start} columns, the weight {K_dst}")
    if BLOCK % g or block_k % c or offset % g or (rows % g and offset + rows != N_dst) or start % c:
        raise ValueError(f"FP8 rows {offset}..{offset + rows} (columns {start}..{stop}) do not align with the "
                         f"weight's {g} x {c} scale groups")
    dst.qweight[..., offset : offset + rows, :].copy_(q)
    group_scales = row_scales[..., ::g, :]                                   # one row per row group
    col_blocks = torch.arange(start, stop, c, device=packed.device) // block_k  # checkpoint block per col group
    dst.scale[..., offset // g : offset // g + group_scales.shape[-2], :].copy_(group_scales[..., col_blocks])


class Fp8KvCache(NamedTuple):
    """An FP8 paged KV cache of one attention layer: cache float8_e4m3fn [2, B, BS, NKV, D] ([0] keys, [1]
    values) and its dequantisation multipliers, scale fp32 [2, H] (H = 1: per tensor, or NKV: per head)."""

    cache: torch.Tensor
    scale: torch.Tensor

    def quantize(self, x: torch.Tensor, which: int) -> torch.Tensor:
        """x [n, NKV, D] -> e4m3 values for cache[which] (saturating: values beyond the calibrated range clip)."""
        s = self.scale[which].view(1, -1, 1)
        return (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)

    def dequantize(self, kv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Stored values kv [2, n, NKV, D] -> the keys / values in dtype."""
        return (kv.float() * self.scale.view(2, 1, -1, 1)).to(dtype)
