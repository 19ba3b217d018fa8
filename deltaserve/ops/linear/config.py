"""The dense projections' launch choice: whether our GEMV kernels or cuBLAS run a product, with which tiles,
and where a norm, a conv or a gate is folded into the GEMV. Chosen per call from host-side shapes only (no
device data: CUDA-graph capturable); no triton import, so the rules can be read and tested anywhere.

The rules come from the H200 sweeps of `PYTHONPATH=. python benchmarks/linear_gemv.py --out DIR --sweep`
(plain GEMV), `... --prenorm` (the folded norm) and `PYTHONPATH=. python benchmarks/gdn_decode_latency.py`
(the conv and gate folds at the 35B-A3B GDN layer).
"""

from __future__ import annotations

import dataclasses

GEMV_MAX_M = 32          # rows of x up to which our kernels can run (M > 16 only for N <= SMALL_N)
SMALL_N = 4096           # N up to which M = 17..32 still beats cuBLAS (its small-N tiles leave SMs idle)
NUM_SMS = 132            # H200; only sizes the split-K rule

# Decode batches of CONV_FOLD_ROWS[0]..[1] sequences run the conv in the input projection (ops.fusion.gdn_in_proj):
# faster at 1, 4 and 8, a tie at 2, not measured above 8 (`benchmarks/gdn_decode_latency.py --conv`).
CONV_FOLD_ROWS = (1, 8)
# Rows up to which the GDN layer's step hands its gated norm to gated_linear (ops.fusion.gdn_out_proj, gdn_decode
# returning o before the norm): the fold takes one row.
GATE_FOLD_MAX_ROWS = 1


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _next_power_of_2(n: int) -> int:
    """triton.next_power_of_2 (0 for 0)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


@dataclasses.dataclass(frozen=True)
class LinearConfig:
    """Launch parameters of one small-M product: `dot` picks the tensor-core kernel, `block_n` weight rows
    and `block_k` reduction columns per step, `split_k` programs per row block (1: no split)."""

    block_n: int = 8
    block_k: int = 512
    warps: int = 4
    stages: int = 3
    dot: bool = False
    split_k: int = 1
    pdl: bool = True            # programmatic dependent launch where the device has it (Hopper+)
    prefetch: int = 512         # with pdl: weight columns per row asked of L2 before the wait (0: none)


def default_linear_config(M: int, N: int, K: int) -> LinearConfig | None:
    """Tiles for an M x K by K x N product, or None where F.linear (cuBLAS) is used:

    - M = 1: CUDA cores, 16 rows x 256 columns per step at 4 stages for K <= 2048, 8 x 512 at 3 stages
      for longer K; where that gives under two programs per SM (N < 2112), whole-row steps (2048 columns
      x 4 rows, 8 warps; 4096 x 1 row for longer K).
    - M = 2..4 with N <= 1024: CUDA cores, 2 rows x 2048 columns (the router: 64-row blocks would leave
      the GPU idle).
    - otherwise tensor cores, 64 weight rows x 128 columns, 4 stages; K split in 4 where the 64-row
      blocks are fewer than the SMs (N < 8448), 256-column steps at 3 stages for K > 8192.
    - cuBLAS where it already reads at >= 96 % of the copy rate and ours did not beat it: M >= 2 with
      K >= 4096 and N >= 24576 (the 27B MLP gate/up), and above 16 rows unless N <= SMALL_N.
    """
    if M < 1 or M > GEMV_MAX_M or (M > 16 and N > SMALL_N):
        return None
    kp = _next_power_of_2(max(K, 16))
    if M == 1:
        if _cdiv(N, 8) >= 2 * NUM_SMS:
            if K <= 2048:
                return LinearConfig(block_n=16, block_k=min(256, kp), warps=4, stages=4)
            return LinearConfig(block_n=8, block_k=min(512, kp), warps=4, stages=3)
        if K <= 2048:
            return LinearConfig(block_n=4, block_k=min(2048, kp), warps=8, stages=1)
        return LinearConfig(block_n=1, block_k=min(4096, kp), warps=4, stages=1)
    if M <= 4 and N <= 1024:
        return LinearConfig(block_n=2, block_k=min(2048, kp), warps=4, stages=1)
    if K >= 4096 and N >= 24576:
        return None
    if K > 8192:
        return LinearConfig(block_n=64, block_k=256, warps=4, stages=3, dot=True)
    split = 4 if _cdiv(N, 64) < NUM_SMS else 1
    return LinearConfig(block_n=64, block_k=128, warps=4, stages=4, dot=True, split_k=split)


def default_prenorm_config(M: int, N: int, K: int) -> LinearConfig | None:
    """Tiles for rms_norm_linear with the norm folded into the GEMV, or None where the norm stays a launch
    of its own before `linear`. Folded at M = 1 only (the CUDA-core kernel, one program per row block); the
    tensor-core kernel's fold is slower than two launches (`PYTHONPATH=. python benchmarks/linear_gemv.py
    --out DIR --prenorm`: 1.4-1.7 us a call saved at M = 1 at the 35B-A3B shapes, ~2x slower at M = 8)."""
    return default_linear_config(M, N, K) if M == 1 else None


def default_conv_config(M: int, N: int, K: int) -> LinearConfig | None:
    """Tiles for rms_norm_linear_conv: the plain GEMV's (default_linear_config) without split K (the conv
    epilogue needs whole-K programs; the GDN input projections of the models have enough row blocks not to
    split: 35B-A3B 12352 rows), or None where F.linear runs (then the conv is a launch of its own)."""
    cfg = default_linear_config(M, N, K)
    return None if cfg is None else dataclasses.replace(cfg, split_k=1)


def default_gated_config(M: int, N: int, K: int, head_dim: int | None) -> LinearConfig | None:
    """Tiles for gated_linear with the gate folded into the GEMV (head_dim: the norm's head size, None for
    a gate without norm), or None where the gate op runs as a launch of its own before `linear`.

    Every program of the fold re-reads x and the gate from L2, so it wants wider row blocks than the plain
    GEMV: where the plain tiles hold fewer than 4 rows (N < 2112: the 35B-A3B out_proj 4096 -> 2048) the
    fold takes 4 rows x 1024 columns at 3 stages, with or without the norm; elsewhere (the 27B) the plain
    tiles with the norm, two launches without it. Only at M = 1, and for a power-of-two head size (a tile
    dimension). Timed with `PYTHONPATH=. python benchmarks/gdn_decode_latency.py --fold`."""
    if M != 1 or (head_dim is not None and head_dim & (head_dim - 1)):
        return None
    cfg = default_linear_config(M, N, K)
    if cfg.block_n < 4:
        return LinearConfig(block_n=4, block_k=min(1024, _next_power_of_2(K)), warps=4, stages=3)
    return None if head_dim is None else cfg
