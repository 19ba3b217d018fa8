"""The FP8 kernels on the GPU against their bf16 counterparts in the same process, at the shapes of
Qwen3.5-35B-A3B and Qwen3-Next-80B-A3B (hidden 2048 both):

  gemv   decode projections, M = 1, 2, 4, 8, 16: ops.linear.triton_fp8.linear (the FP8 GEMV, weight-only)
         against bf16 F.linear (cuBLAS) and our bf16 GEMV (ops.linear.triton.linear). GB/s counts weight bytes
         (fp8: N K + scales; bf16: 2 N K) + x + y; "frac" divides by the device-to-device copy rate measured
         in the same run; "x bf16" is cuBLAS bf16 time / FP8 time (the target: ~2, half the bytes).
  gemm   prefill projections, M = 512, 2048, 8192: the W8A8 block GEMM (activation quant included) against
         bf16 F.linear; TFLOP/s and the fraction of 2x the measured bf16 matmul rate (the FP8 tensor-core
         peak is twice bf16's on Hopper).
  moe    fused_moe_routed with FP8 experts (ops.moe.triton_fp8) against the bf16 Triton MoE, routing included,
         shared expert folded as the 257th / 513th expert: 35B-A3B (256 experts, top-8, I 512) and 80B
         (512 experts, top-10, I 512), T = 1, 8, 64, 512, 4096. Decode bytes = distinct experts touched x
         3 H I (fp8) or 6 H I (bf16).

Times: the median replay of a CUDA graph of `calls` invocations on distinct weight copies (the weights come
from HBM, not L2; triton.testing.do_bench flushes the L2 before each replay) divided by `calls`. Every FP8
output is checked against its dequantising reference (relative error printed).

Run (GPU):  PYTHONPATH=. python benchmarks/fp8_ops.py --out DIR [--gemv] [--gemm] [--moe]   (none: all three)
            [--sweep]: also alternative tiles of the FP8 GEMV and the W8A8 GEMM, the fastest printed per shape
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from gpu_common import RunLog, ceilings, device_env, graph_seconds

from deltaserve.ops.linear import reference as lin_ref
from deltaserve.ops.linear import triton as lin_bf16
from deltaserve.ops.linear import triton_fp8 as lin_fp8
from deltaserve.ops.linear.triton_fp8_gemm import W8A8Config, w8a8_gemm
from deltaserve.ops.linear.triton_fp8_gemv import Fp8GemvConfig, fp8_gemv
from deltaserve.ops.moe import reference as moe_ref
from deltaserve.ops.moe import triton as moe_bf16
from deltaserve.ops.moe import triton_fp8 as moe_fp8
from deltaserve.ops.quant.fp8 import BlockFp8Weight, quantize_blocks

DEV = "cuda"
BF = torch.bfloat16
# (name, N, K) of the decode-step projections (both models: hidden 2048, attention 16 q heads / 2 kv of 256)
DENSE_SHAPES = [
    ("80B gdn in_proj_qkvz", 12288, 2048),
    ("35B gdn in_proj_qkv", 8192, 2048),
    ("35B gdn in_proj_z", 4096, 2048),
    ("gdn out_proj / attn o_proj", 2048, 4096),
    ("attn qkv (gated q)", 9216, 2048),
    ("shared expert gate_up", 1024, 2048),
]
MOE_MODELS = [("35B-A3B", 256, 8), ("80B-A3B", 512, 10)]        # (name, routed experts, top_k)
MOE_H, MOE_I = 2048, 512
GEMV_M, GEMM_M, MOE_T = (1, 2, 4, 8, 16), (512, 2048, 8192), (1, 8, 64, 512, 4096)


def copies_for(nbytes: int) -> int:
    """Distinct weight copies per graph: >= ~4x the L2 (60 MB) in total, 2..16."""
    return max(2, min(16, -(-240_000_000 // nbytes)))


def rel_err(got, want) -> float:
    got, want = got.float(), want.float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def fp8_weight(shape, seed=0) -> BlockFp8Weight:
    g = torch.Generator(device=DEV).manual_seed(seed)
    w = torch.randn(*shape, device=DEV, generator=g) * shape[-1] ** -0.5
    q, s = quantize_blocks(w)
    return BlockFp8Weight(q, s, 128, 128)


def time_per_call(fn, calls: int) -> float:
    return graph_seconds(fn, calls, warmup=5, rep=40)


def gemv_sweep(M: int) -> list:
    """Alternative FP8 GEMV tiles for M rows (--sweep)."""
    if M == 1:
        return [Fp8GemvConfig(block_n=bn, warps=w, stages=3, k_groups=kg)
                for bn in (4, 8, 16) for kg in (1, 4, 16) for w in (4, 8) if bn * kg <= 64]
    return [Fp8GemvConfig(block_n=bn, warps=4, stages=4, dot=True, split_k=sk) for bn in (16, 32, 64)
            for sk in (1, 2, 4, 8)]


GEMM_SWEEP = [W8A8Config(block_m=bm, block_n=bn, group_m=8, warps=w, stages=3)
              for bm in (64, 128) for bn in (128, 256) for w in (4, 8)]


def best_of(configs, fn, calls) -> tuple:
    """(seconds, config) of the fastest config (fn(i, cfg)); configs that fail to compile are skipped."""
    best = (float("inf"), None)
    for cfg in configs:
        try:
            t = time_per_call(lambda i, cfg=cfg: fn(i, cfg), calls)
        except Exception as exc:  # noqa: BLE001  (out of resources: not a candidate)
            print(f"  skip {cfg}: {type(exc).__name__}", flush=True)
            continue
        best = min(best, (t, cfg), key=lambda p: p[0])
    return best


def run_gemv(ceil, log, sweep: bool = False) -> list:
    rows = []
    for name, N, K in DENSE_SHAPES:
        fbytes = N * K + 4 * N * math.ceil(K / 128) / 128
        calls = copies_for(int(fbytes))
        ws8 = [fp8_weight((N, K), i) for i in range(calls)]
        ws16 = [w.dequantize(BF) for w in ws8]
        for M in GEMV_M:
            x = torch.randn(M, K, device=DEV, dtype=BF)
            err = rel_err(lin_fp8.linear(x, ws8[0]), lin_ref.linear(x, ws8[0]))
            t8 = time_per_call(lambda i, x=x, ws=ws8: lin_fp8.linear(x, ws[i]), calls)
            t_cublas = time_per_call(lambda i, x=x, ws=ws16: F.linear(x, ws[i]), calls)
            t_ours = time_per_call(lambda i, x=x, ws=ws16: lin_bf16.linear(x, ws[i]), calls)
            io = 2 * M * (K + N)
            gbs8, gbs16 = (fbytes + io) / t8 / 1e9, (2 * N * K + io) / t_cublas / 1e9
            row = {"shape": name, "M": M, "N": N, "K": K, "fp8_us": t8 * 1e6, "cublas_bf16_us": t_cublas * 1e6,
                   "triton_bf16_us": t_ours * 1e6, "fp8_GBps": gbs8, "fp8_frac_copy": gbs8 / (ceil["copy_TBps"] * 1e3),
                   "bf16_frac_copy": gbs16 / (ceil["copy_TBps"] * 1e3), "x_bf16": t_cublas / t8, "rel_err": err}
            rows.append(row)
            log(f"gemv {name:28s} M={M:2d}  fp8 {t8 * 1e6:7.2f} us ({row['fp8_frac_copy']:.0%} copy)  cuBLAS bf16 "
                f"{t_cublas * 1e6:7.2f} us ({row['bf16_frac_copy']:.0%})  triton bf16 {t_ours * 1e6:7.2f} us  "
                f"x{row['x_bf16']:.2f}  err {err:.1e}")
            if sweep:
                tb, cb = best_of(gemv_sweep(M), lambda i, cfg, x=x, ws=ws8: fp8_gemv(x, ws[i], cfg), calls)
                row.update(best_us=tb * 1e6, best_config=str(cb))
                log(f"     best {tb * 1e6:7.2f} us ({(fbytes + io) / tb / 1e12 / ceil['copy_TBps']:.0%} copy): {cb}")
        del ws8, ws16
        torch.cuda.empty_cache()
    return rows


def run_gemm(ceil, log, sweep: bool = False) -> list:
    rows = []
    peak8 = 2 * ceil["bf16_TFLOPs"]
    for name, N, K in DENSE_SHAPES[:5]:
        w8 = fp8_weight((N, K))
        w16 = w8.dequantize(BF)
        for M in GEMM_M:
            x = torch.randn(M, K, device=DEV, dtype=BF)
            err = rel_err(lin_fp8.linear(x, w8), lin_ref.linear(x, w8))
            t8 = time_per_call(lambda i, x=x, w=w8: lin_fp8.linear(x, w), 2)
            t16 = time_per_call(lambda i, x=x, w=w16: F.linear(x, w), 2)
            fl = 2 * M * N * K
            row = {"shape": name, "M": M, "N": N, "K": K, "w8a8_us": t8 * 1e6, "cublas_bf16_us": t16 * 1e6,
                   "w8a8_TFLOPs": fl / t8 / 1e12, "bf16_TFLOPs": fl / t16 / 1e12, "x_bf16": t16 / t8,
                   "frac_fp8_peak": fl / t8 / 1e12 / peak8, "rel_err_vs_dequantised": err}
            if sweep:
                tb, cb = best_of(GEMM_SWEEP, lambda i, cfg, x=x, w=w8: w8a8_gemm(x, w, cfg), 2)
                row.update(best_us=tb * 1e6, best_config=str(cb), best_TFLOPs=fl / tb / 1e12)
            rows.append(row)
            log(f"gemm {name:28s} M={M:5d}  w8a8 {t8 * 1e6:8.1f} us {row['w8a8_TFLOPs']:6.0f} TF/s "
                f"({row['frac_fp8_peak']:.0%} of 2x bf16)  cuBLAS bf16 {t16 * 1e6:8.1f} us "
                f"{row['bf16_TFLOPs']:6.0f} TF/s  x{row['x_bf16']:.2f}  err {err:.1e}"
                + (f"\n     best {row['best_us']:8.1f} us {row['best_TFLOPs']:6.0f} TF/s: {row['best_config']}"
                   if sweep else ""))
    return rows


def moe_inputs(E, top_k, T, copies, seed=0):
    H, inter = MOE_H, MOE_I
    w13s = [fp8_weight((E + 1, 2 * inter, H), seed + 2 * i) for i in range(copies)]
    w2s = [fp8_weight((E + 1, H, inter), seed + 2 * i + 1) for i in range(copies)]
    x = torch.randn(T, H, device=DEV, dtype=BF)
    logits = torch.randn(T, E + 1, device=DEV, dtype=BF)
    return x, logits, w13s, w2s


def run_moe(ceil, log) -> list:
    rows = []
    for name, E, top_k in MOE_MODELS:
        for T in MOE_T:
            per_expert = 3 * MOE_H * MOE_I
            copies = 2 if T >= 64 else copies_for(min(E + 1, T * (top_k + 1)) * per_expert)
            x, logits, w13s, w2s = moe_inputs(E, top_k, T, copies)
            d13s, d2s = [w.dequantize(BF) for w in w13s], [w.dequantize(BF) for w in w2s]

            def run8(i, x=x, w13s=w13s, w2s=w2s, logits=logits, top_k=top_k):
                return moe_fp8.fused_moe_routed(x, w13s[i], w2s[i], logits, top_k, True, shared_slices=1)

            def run16(i, x=x, w13s=d13s, w2s=d2s, logits=logits, top_k=top_k):
                return moe_bf16.fused_moe_routed(x, w13s[i], w2s[i], logits, top_k, True, shared_slices=1)

            err = rel_err(run8(0), moe_ref.fused_moe_routed(x, w13s[0], w2s[0], logits, top_k, True,
                                                            shared_slices=1)) if T <= 512 else float("nan")
            t8, t16 = time_per_call(run8, copies), time_per_call(run16, copies)
            touched = min(E, T * top_k) + 1
            row = {"model": name, "T": T, "fp8_us": t8 * 1e6, "bf16_us": t16 * 1e6, "x_bf16": t16 / t8, "rel_err": err,
                   "fp8_frac_copy": touched * per_expert / t8 / (ceil["copy_TBps"] * 1e12),
                   "bf16_frac_copy": 2 * touched * per_expert / t16 / (ceil["copy_TBps"] * 1e12)}
            rows.append(row)
            log(f"moe {name} T={T:5d}  fp8 {t8 * 1e6:8.1f} us ({row['fp8_frac_copy']:.0%} copy at <= {touched} "
                f"experts)  bf16 {t16 * 1e6:8.1f} us ({row['bf16_frac_copy']:.0%})  x{row['x_bf16']:.2f}  "
                f"err {err:.1e}")
            del w13s, w2s, d13s, d2s
            torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--gemv", action="store_true")
    ap.add_argument("--gemm", action="store_true")
    ap.add_argument("--moe", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time alternative GEMV / GEMM tiles (best printed)")
    args = ap.parse_args()
    every = not (args.gemv or args.gemm or args.moe)
    t0 = time.time()
    log = RunLog(args.out, "fp8_ops.log")
    env = device_env()
    log(json.dumps(env))
    ceil = ceilings(matmul=every or args.gemm)
    log(json.dumps(ceil))
    out = {"env": env, "ceilings": ceil}
    if every or args.gemv:
        out["gemv"] = run_gemv(ceil, log, args.sweep)
    if every or args.gemm:
        out["gemm"] = run_gemm(ceil, log, args.sweep)
    if every or args.moe:
        out["moe"] = run_moe(ceil, log)
    with open(os.path.join(args.out, "fp8_ops.json"), "w") as f:
        json.dump(out, f, indent=1)
    log(f"total {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
