"""Launch choices of the Triton attention kernels, from the batch shape and the device (host-side only:
no device data, CUDA-graph capturable): paged_attention's tiles and split-K (AttentionConfig), and the
one-launch decode's splits (DecodeAttentionConfig)."""

from __future__ import annotations

import dataclasses

import torch
import triton

MAX_SPLITS = 64
SPLIT_SCRATCH_BYTES = 64 << 20   # cap on the fp32 partial results of split-K


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Launch choices. block_m: query rows (token x head pairs) per program; block_n: keys per step;
    num_splits: key-range segments per tile (1 = no split-K); min_split: smallest segment in keys."""

    block_m: int = 16
    block_n: int = 64
    num_splits: int = 1
    min_split: int = 256
    num_warps: int = 4
    num_stages: int = 2


def device_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def default_attention_config(T: int, N: int, nh: int, nkv: int, d: int, device: torch.device,
                             max_query_len: int | None = None, dtype: torch.dtype = torch.bfloat16) -> AttentionConfig:
    """Decode-shaped batches (every sequence one token) get small query tiles and split-K when the
    (tile, KV head) programs cannot fill the GPU; batches with prefill chunks get wide tiles."""
    g = nh // nkv
    decode = max_query_len == 1 if max_query_len is not None else T <= N
    # tile choices measured on an H200 at head_dim 256 (PYTHONPATH=. python benchmarks/attention_moe_ops.py
    # --out DIR --sweep)
    if decode:
        block_m = max(16, triton.next_power_of_2(g))
        block_n, warps, stages = 64, 4, 2
    else:
        block_m = max(128, triton.next_power_of_2(g))
        block_n, warps, stages = 64, (8 if d > 128 else 4), 2
    if dtype.itemsize >= 4:
        # fp32 operands are twice the bytes: the bf16 prefill tile (128 x 64, 2 stages) in fp32 needs 295 KB of
        # shared memory at head_dim 256 on sm_90 (a block has 227 KB) and fails to launch; 64 x 32 in one
        # stage needs 107 KB (`attention_moe_compile_check.py --fp32-attention` compiles them without a GPU)
        block_m = block_m if decode else max(64, triton.next_power_of_2(g))
        block_n, stages = 32, 1
    bq = block_m // g
    programs = (T // bq + N + 1) * nkv
    target = 4 * device_sms(device)
    splits = 1
    if programs < target:
        splits = min(MAX_SPLITS, triton.cdiv(target, programs))
        cap = SPLIT_SCRATCH_BYTES // max(1, T * nh * (d + 2) * 4)
        splits = max(1, min(splits, cap))
    # decode segments may be one key tile long: at batch 1 with a short context the work is a few tiles,
    # and spreading them over programs beats walking them in a chain (prefill keeps 256-key segments)
    min_split = block_n if decode else AttentionConfig.min_split
    return AttentionConfig(block_m=block_m, block_n=block_n, num_splits=splits, min_split=min_split,
                           num_warps=warps, num_stages=stages)


@dataclasses.dataclass(frozen=True)
class DecodeAttentionConfig:
    """Launch choices of the one-launch decode path. max_splits: programs per (token, KV head) in the
    grid; min_tiles: key tiles a split takes at least (a sequence of `tiles` key tiles uses
    min(max_splits, cdiv(tiles, min_tiles)) of them, the rest exit at once); block_n: keys per step."""

    block_n: int = 64
    max_splits: int = 1
    min_tiles: int = 1
    num_warps: int = 4
    num_stages: int = 2
    prefetch_tiles: int = 0      # with PDL: key tiles per program asked of L2 before the wait (a hint)
    last_split_merges: bool = True   # False: the splits' results merged by the merge kernel (2 launches)


# Decode batches of at least this many (token, KV head) pairs merge their splits in the last split to finish
# (one launch); smaller ones take one key tile per split and merge in _merge_splits_kernel (two launches),
# since there the in-kernel merge and multi-tile splits put dependent memory round trips on the critical
# path (H200, 35B-A3B shape, 1-256 sequences: PYTHONPATH=. python benchmarks/attention_decode.py --out DIR).
FUSED_DECODE_MIN_PAIRS = 128


def default_decode_config(N: int, nkv: int, d: int, sms: int,
                          dtype: torch.dtype = torch.bfloat16) -> DecodeAttentionConfig:
    """For N decode tokens on a device of `sms` multiprocessors: split-K while the (token, KV head)
    programs cannot fill the GPU; each split takes at least `min_tiles` key tiles (the last program to
    finish merges the splits: fewer, longer splits there)."""
    pairs = N * nkv
    splits = max(1, min(MAX_SPLITS, 4 * sms // pairs))
    cap = SPLIT_SCRATCH_BYTES // max(1, pairs * 16 * (d + 2) * 4)
    splits = max(1, min(splits, cap))
    block_n, stages = (64, 2) if dtype.itemsize < 4 else (32, 1)
    if pairs < FUSED_DECODE_MIN_PAIRS:
        # one tile per split, merged by the merge kernel; the L2 prefetch before the wait helps at batch 1
        # only (11.7 against 12.1 us at ctx 1152, benchmarks/attention_decode.py)
        return DecodeAttentionConfig(block_n=block_n, max_splits=splits, min_tiles=1, num_warps=4,
                                     num_stages=stages, prefetch_tiles=1 if N == 1 else 0, last_split_merges=False)
    return DecodeAttentionConfig(block_n=block_n, max_splits=splits, min_tiles=2, num_warps=4, num_stages=stages)
