"""Decode of the gated attention layer's core at the Qwen3.5-35B-A3B shape (16 query / 2 KV heads, head_dim
256, rotary 64, paged KV of block 16, bf16): q/k RMSNorm + RoPE + KV store + paged attention (+ split-K
merge). The three-launch path (`attention_prologue` + `paged_attention`: prologue, attention, merge) against
the one-launch `fused_paged_attention`, both with programmatic dependent launch on Hopper.

The op picks the one launch by itself only for decode batches of >= FUSED_DECODE_MIN_PAIRS (token, KV
head) pairs; the "new" rows here force it (default_decode_config) at every size, the sweep rows with other
launch choices. Each implementation is timed as a CUDA graph of 10 calls on 10 layers' caches and inputs (the 10 attention
layers of a step; the PDL chain links consecutive calls), `triton.testing.do_bench` median with L2 flushed
before each replay, divided by 10: microseconds per layer. Every new row is checked against the old path
(output and cache). Batch sizes 1 (contexts 512 .. 32768), 8, 64, 256.

    PYTHONPATH=. python benchmarks/attention_decode.py --out DIR [--sweep] [--only new,mk] [--gpu-tests] [--workers 8]
    PYTHONPATH=. python benchmarks/attention_decode.py --compile-check   # sm_90 compile on CPU, no GPU needed
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import triton

from deltaserve.ops.attention import triton as attn_t
from deltaserve.ops.attention import triton_decode as attn_decode

NH, NKV, D, RD, BS = 16, 2, 256, 64, 16
LAYERS = 10
H200_SMS = 132
CASES = [(1, 1152), (1, 512), (1, 4096), (8, 1152), (64, 1152), (256, 1152), (1, 32768)]
DC = attn_t.DecodeAttentionConfig
SWEEP = {  # label -> config, timed at batch 1 (block_n, max_splits, min_tiles, warps, stages)
    "bn64 S64 t1 w4": DC(64, 64, 1, 4, 2), "bn64 S64 t2 w4": DC(64, 64, 2, 4, 2),
    "bn64 S64 t4 w4": DC(64, 64, 4, 4, 2), "bn64 S32 t2 w4": DC(64, 32, 2, 4, 2),
    "bn64 S16 t2 w4": DC(64, 16, 2, 4, 2), "bn32 S64 t2 w4": DC(32, 64, 2, 4, 2),
    "bn64 S64 t2 w8": DC(64, 64, 2, 8, 2), "bn64 S64 t2 w4 s3": DC(64, 64, 2, 4, 3),
    "bn64 S64 t1 w4 pf1": DC(64, 64, 1, 4, 2, 1), "bn64 S64 t2 w4 pf2": DC(64, 64, 2, 4, 2, 2),
    "bn64 S64 t4 w4 pf2": DC(64, 64, 4, 4, 2, 2), "bn64 S64 t2 w8 pf2": DC(64, 64, 2, 8, 2, 2),
    # two launches: the splits' results merged by the merge kernel
    "bn64 S64 t1 w4 mk": DC(64, 64, 1, 4, 2, 0, False), "bn64 S64 t1 w4 pf1 mk": DC(64, 64, 1, 4, 2, 1, False),
    "bn64 S64 t1 w8 pf1 mk": DC(64, 64, 1, 8, 2, 1, False),
}
SWEEP_B8 = {"bn64 S33 t1 w4": DC(64, 33, 1, 4, 2), "bn64 S33 t4 w4": DC(64, 33, 4, 4, 2),
            "bn64 S33 t2 w8": DC(64, 33, 2, 8, 2), "bn64 S33 t2 w4 pf2": DC(64, 33, 2, 4, 2, 2),
            "bn64 S33 t1 w4 mk": DC(64, 33, 1, 4, 2, 0, False), "bn64 S33 t1 w4 pf1 mk": DC(64, 33, 1, 4, 2, 1, False)}


class Layers:
    """LAYERS independent decode batches of B sequences at context ctx: a projection output [B, q|gate|k|v]
    viewed as q, k, v, norm weights, RoPE tables, a paged cache with shuffled blocks and its tables."""

    def __init__(self, B: int, ctx: int, layers: int = LAYERS, seed: int = 0):
        dev = torch.device("cuda")
        self.B = B
        g = torch.Generator(device=dev).manual_seed(seed)
        need = -(-ctx // BS)
        self.items = []
        for _ in range(layers):
            blocks = B * need
            cache = torch.randn(2, blocks, BS, NKV, D, device=dev, dtype=torch.bfloat16, generator=g)
            tables = torch.randperm(blocks, device=dev, generator=g).to(torch.int32).view(B, need)
            proj = torch.randn(B, (2 * NH + 2 * NKV) * D, device=dev, dtype=torch.bfloat16, generator=g)
            q = proj[:, : NH * D].view(B, NH, D)
            k = proj[:, 2 * NH * D: (2 * NH + NKV) * D].view(B, NKV, D)
            v = proj[:, (2 * NH + NKV) * D:].view(B, NKV, D)
            qw = torch.randn(D, device=dev, generator=g).mul(0.1).to(torch.bfloat16)
            kw = torch.randn(D, device=dev, generator=g).mul(0.1).to(torch.bfloat16)
            ang = torch.rand(B, RD // 2, device=dev, generator=g) * 6.28
            cos = torch.cat([ang.cos()] * 2, -1).to(torch.bfloat16)
            sin = torch.cat([ang.sin()] * 2, -1).to(torch.bfloat16)
            pos = ctx - 1
            slots = (tables[:, pos // BS].long() * BS + pos % BS).contiguous()
            kw_args = dict(cu_seqlens=torch.arange(B + 1, dtype=torch.int32, device=dev),
                           seq_lens=torch.full((B,), ctx, dtype=torch.int32, device=dev), block_tables=tables,
                           scale=D ** -0.5)
            self.items.append((q, k, v, qw, kw, cos, sin, cache, slots, kw_args))

    def old(self, i: int) -> torch.Tensor:
        q, k, v, qw, kw, cos, sin, cache, slots, a = self.items[i]
        qr = attn_t.attention_prologue(q, k, v, qw, kw, 1e-6, cos, sin, cache, slots)
        return attn_t.paged_attention(qr, cache, **a, max_query_len=1)

    def new(self, i: int, config=None) -> torch.Tensor:
        q, k, v, qw, kw, cos, sin, cache, slots, a = self.items[i]
        return attn_t.fused_paged_attention(q, k, v, qw, kw, 1e-6, cos, sin, cache, slots, **a, max_query_len=1,
                                            config=config)


def impls(sweep: bool, only: str = "") -> list[tuple[int, int, str, object]]:
    """(B, ctx, label, config) of every timed row: "old" = the three launches (prologue, attention, merge),
    "new" = the one launch with default_decode_config (whichever path the op would pick by itself)."""
    rows = []
    for B, ctx in CASES:
        rows.append((B, ctx, "old", "old"))
        rows.append((B, ctx, "new", None))
        if sweep and B in (1, 8):
            rows += [(B, ctx, label, cfg) for label, cfg in (SWEEP if B == 1 else SWEEP_B8).items()]
    # --only "old,mk": rows whose label contains one of the parts (the old rows are the check's reference)
    return [r for r in rows if not only or r[2] == "old" or any(p in r[2] for p in only.split(","))]


def run_fn(layers: Layers, cfg):
    if cfg == "old":
        return layers.old
    cfg = cfg or attn_t.default_decode_config(layers.B, NKV, D, torch.cuda.get_device_properties(0).multi_processor_count)
    return lambda i: layers.new(i, cfg)


def time_us(fn) -> float:
    for i in range(LAYERS):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(LAYERS):
            fn(i)
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=100, return_mode="median")
    return ms * 1e3 / LAYERS


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def worker(index: int, count: int, sweep: bool, only: str) -> None:
    """Compile (one call of) every row this worker is dealt; the Triton cache on disk keeps the binaries."""
    for j, (B, ctx, label, cfg) in enumerate(impls(sweep, only)):
        if j % count == index:
            try:
                run_fn(Layers(B, ctx, layers=1), cfg)(0)
                torch.cuda.synchronize()
            except Exception as exc:  # reported again when timed
                print(f"[warm {index}] B={B} ctx={ctx} {label}: {type(exc).__name__}: {exc}", flush=True)


def main_gpu(args) -> None:
    os.makedirs(args.out, exist_ok=True)
    log_path = os.path.join(args.out, "attention_decode.log")

    def log(msg):
        print(msg, flush=True)
        with open(log_path, "a") as f:
            f.write(msg + "\n")

    props = torch.cuda.get_device_properties(0)
    log(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}")
    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", str(i), "--workers",
                               str(args.workers), "--only", args.only] + (["--sweep"] if args.sweep else []))
             for i in range(args.workers)]
    if args.gpu_tests:  # the gpu-marked tests, and the small-shape fused tests compiled (races show only here)
        for name, sel in (("gpu_tests.log", ["-m", "gpu"]), ("fused_tests_cuda.log", ["-m", "not gpu", "-k", "fused"])):
            with open(os.path.join(args.out, name), "w") as f:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=5", *sel,
                     "tests/ops/test_attention_triton.py"], stdout=f, stderr=subprocess.STDOUT))
    for p in procs:
        try:
            p.wait(timeout=max(1.0, args.warmup_s - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            log(f"warm-up process {p.pid} killed")
    log(f"warm-up (parallel compile, GPU tests) {time.time() - t0:.0f} s")
    results = []
    current = None
    for B, ctx, label, cfg in impls(args.sweep, args.only):
        if current is None or current[0] != (B, ctx):
            current = ((B, ctx), Layers(B, ctx))
            ref_out = [current[1].old(i).clone() for i in range(LAYERS)]
        layers = current[1]
        try:
            us = time_us(run_fn(layers, cfg))
            err = max(rel(run_fn(layers, cfg)(i), ref_out[i]) for i in range(LAYERS))
            shown = attn_t.default_decode_config(B, NKV, D, props.multi_processor_count) if cfg is None else cfg
            kv_mb = B * ctx * NKV * D * 2 * 2 / 1e6
            log(f"B={B:4d} ctx={ctx:6d} {label:20s} {us:7.2f} us/layer  KV {kv_mb:7.1f} MB "
                f"({kv_mb / us:5.2f} TB/s)  rel err vs old {err:.2e}  {shown}")
            results.append(dict(B=B, ctx=ctx, label=label, us=us, err=err, config=str(shown)))
        except Exception as exc:
            log(f"B={B} ctx={ctx} {label}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "attention_decode.json"), "w") as f:
        json.dump(results, f, indent=1)


def compile_check() -> int:
    """Compile the one-launch kernel for sm_90 (the sweep's and the defaults' constexprs) without a GPU."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gdn_compile_check import compile_one

    bf, f32, i32, i64 = "*bf16", "*fp32", "*i32", "*i64"
    types = dict(q=bf, k=bf, v=bf, q_w=bf, k_w=bf, cos=bf, sin=bf, cache=bf, slots=i64, seq_lens=i32, tables=i32,
                 out=bf, part_ml=f32, part_acc=f32, counters=i32, eps="fp32", qk_scale="fp32")
    # compile_one marks every integer divisible by 16; these vary at run time (do_not_specialize)
    import gdn_compile_check
    gdn_compile_check.UNSPECIALISED = (*gdn_compile_check.UNSPECIALISED, "s_bt_n", "table_w", "num_blocks")
    cfgs = {f"default B={B}": attn_t.default_decode_config(B, NKV, D, H200_SMS) for B in (1, 8, 64, 256)}
    cfgs.update(SWEEP)
    cfgs.update(SWEEP_B8)
    bad = []
    for label, c in cfgs.items():
        sp = triton.next_power_of_2(c.max_splits)
        ms = min(sp, 8)
        gm = NH // NKV
        r = compile_one(f"decode_attention {label} {c}", attn_decode._decode_attention_kernel, types,
                        dict(NH=NH, NKV=NKV, D=D, RD=RD, G=gm, GM=gm, BLOCK_M=16, BLOCK_N=c.block_n,
                             SPLITS=c.max_splits, SP=sp, MIN_TILES=c.min_tiles, MS=ms,
                             BD=min(D, max(16, 64 * 32 * c.num_warps // (ms * gm))), IEEE=False, PDL=True,
                             PREFETCH_TILES=c.prefetch_tiles, LINE=64,
                             LAST_MERGES=c.max_splits == 1 or c.last_split_merges),
                        c.num_warps, c.num_stages)
        if not r["ok"] or r["spills"]:
            bad.append(label)
    print(f"failed or spilling: {bad}")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="attention_decode_out")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--only", default="", help='comma-separated label parts, e.g. "new,mk" (old rows always run)')
    ap.add_argument("--gpu-tests", action="store_true")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--warmup-s", type=float, default=120.0)
    ap.add_argument("--worker", type=int, default=-1)
    ap.add_argument("--compile-check", action="store_true")
    args = ap.parse_args()
    if args.compile_check:
        return compile_check()
    if args.worker >= 0:
        worker(args.worker, args.workers, args.sweep, args.only)
        return 0
    main_gpu(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
