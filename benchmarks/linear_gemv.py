"""Small-M dense projections and the MoE GEMV path (Triton) on the GPU, against cuBLAS in the same process
on the same inputs.

  dense  y = x W^T, bf16, the decode-step shapes of Qwen3.5-35B-A3B (GDN in_proj 2048->12352, GDN out_proj /
         attention o_proj 4096->2048, attention qkv 2048->9216, router + shared-expert gate 2048->257,
         lm_head 2048->248320) and Qwen3.5-27B (GDN in_proj 5120->16480, MLP gate/up 5120->34816, MLP down
         17408->5120), M = 1, 2, 4, 8, 16, 32 rows. `linear` (our default tiles; F.linear above the
         crossover) against torch F.linear (cuBLAS); with --sweep also other tile configs. GB/s counts the
         weight bytes + x + y; "frac copy" divides by the device-to-device copy rate of the same run.
  moe    fused_moe's GEMV path at the 35B-A3B experts (E 256 + the shared expert as a 257th, top-8 + 1
         shared slot, H 2048, I 512), T = 1 and 8: whole-op time (graph) and each kernel's duration
         (torch.profiler over graph replays); bytes = distinct experts touched x 6.29 MB (w13: 2/3, w2: 1/3).

  prenorm the pre-norm input projections of a decoder layer (--prenorm): RMSNorm(x + residual) then the
         projection as two launches (the norm kernel, then `linear`) against rms_norm_linear (its default:
         the norm folded into the GEMV at M = 1) and with the norm folded in whatever M ("folded": the
         default tiles without split K), at the 35B-A3B shapes that take a pre-norm (GDN in_proj,
         attention qkv, MoE router), M = 1 and 8; also the GEMV and the norm alone, and the per-step
         totals (30 + 10 + 40 layers).

Every time is the median over replays of a CUDA graph of `calls` invocations, each on its own copy of the
weights (so weights come from HBM, not L2), divided by `calls`; the per-call time includes the launch gap
between consecutive kernels of a graph. Before each replay the L2 is flushed (Timer): by default by
reading 256 MB (clean lines, as in a decode step after another layer's weights), with --flush write by
writing them as triton's do_bench does (the first ~60 MB a kernel reads then also pay the
write-back of dirty lines, which penalises ~10-50 MB reads).
Every timed configuration's output is checked against cuBLAS (rel. error printed). A warm-up phase
compiles every kernel variant in parallel worker processes (shared Triton cache) and runs the GPU tests.

Run (GPU):  PYTHONPATH=. python benchmarks/linear_gemv.py --out DIR [--sweep] [--gpu-tests] [--workers 12]
            PYTHONPATH=. python benchmarks/linear_gemv.py --out DIR --prenorm [--gpu-tests] [--workers 12]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import replace

import torch
import torch.nn.functional as F
import triton

from gpu_common import RunLog, ceilings, device_env, graph_of  # noqa: I001  (benchmarks/ is on sys.path when run)
from deltaserve.ops.linear import triton as lin
from deltaserve.ops.norm import triton as norm_t
from deltaserve.ops.moe import triton as moe_t
from deltaserve.ops.moe import triton_routing as moe_route

DEV = "cuda"
BF = torch.bfloat16
SHAPES = [  # (name, K, N)
    ("35B gdn in_proj", 2048, 12352), ("35B out_proj/o_proj", 4096, 2048), ("35B attn qkv", 2048, 9216),
    ("35B router+gate", 2048, 257), ("35B lm_head", 2048, 248320),
    ("27B gdn in_proj", 5120, 16480), ("27B mlp gate_up", 5120, 34816), ("27B mlp down", 17408, 5120),
]
MS = [1, 2, 4, 8, 16, 32]
C = lin.LinearConfig
FMA_CFGS = [C(4, 1024, 4, 3), C(2, 2048, 4, 1), C(1, 4096, 4, 1), C(8, 512, 4, 3), C(2, 1024, 2, 3),
            C(4, 2048, 8, 1)]
DOT_CFGS = [C(64, 128, 4, 4, True), C(32, 256, 4, 4, True), C(64, 256, 4, 3, True), C(128, 128, 8, 3, True),
            C(16, 512, 4, 3, True), C(32, 128, 2, 6, True)]
SMALL_N = 5120          # shapes with N up to this also try split K
PRENORM_SHAPES = [  # (name, K, N, layers per step of the 35B-A3B): the projections a pre-norm feeds
    ("35B gdn in_proj", 2048, 12352, 30), ("35B attn qkv", 2048, 9216, 10), ("35B router+gate", 2048, 257, 40)]
PRENORM_MS = [1, 8]
E, TOP_K, H, INTER = 256, 8, 2048, 512
G = moe_t.GemvMoeConfig
MOE_CFGS = [  # (n1, k1, n2, k2, warps1, warps2, stages[, all_experts, pdl]): w13 and w2 tiles
    G(8, 512, 4, 512, 2, 2, 3), G(4, 1024, 1, 512, 4, 4, 3, all_experts=True),
    G(2, 2048, 2, 512, 4, 8, 3, all_experts=True), G(4, 2048, 2, 256, 8, 4, 3, all_experts=True),
    G(8, 1024, 1, 512, 4, 4, 3, all_experts=True, pdl=True), G(2, 1024, 2, 512, 2, 8, 3, all_experts=True, pdl=True),
    G(1, 2048, 1, 256, 4, 2, 3, all_experts=True, pdl=True), G(16, 512, 4, 128, 4, 4, 3, all_experts=True, pdl=True),
    G(4, 1024, 2, 256, 4, 4, 3, all_experts=True, pdl=True), G(4, 2048, 1, 512, 8, 4, 3),
]


M1_EXTRA = [C(16, 512, 4, 3), C(8, 256, 4, 4), C(8, 512, 4, 4), C(16, 256, 4, 4), C(8, 1024, 4, 2),
            C(8, 512, 8, 3), C(4, 512, 4, 3)]
MOE_T1_EXTRA = [  # around GEMV_T1: other w13 tiles with its w2
    G(4, 512, 1, 512, 4, 4, 3, all_experts=True, pdl=True), G(16, 512, 1, 512, 4, 4, 3, all_experts=True, pdl=True),
    G(8, 2048, 1, 512, 8, 4, 3, all_experts=True, pdl=True), G(8, 512, 1, 512, 4, 4, 4, all_experts=True, pdl=True),
    G(8, 1024, 1, 512, 4, 4, 3, all_experts=True, pdl=False), G(8, 1024, 2, 512, 4, 8, 3, all_experts=True, pdl=True),
]


def configs_for(M: int, N: int, K: int, sweep: bool, m1_extra: bool = False) -> list:
    """(label, config) pairs to time: our default first, then (with sweep) the variants for this M."""
    out = [("default", None)]
    if m1_extra and M == 1:
        kp2 = triton.next_power_of_2(K)
        out += [(label(c), replace(c, block_k=min(c.block_k, kp2))) for c in M1_EXTRA]
    if not sweep or M > 32:
        return out
    fma = FMA_CFGS if M <= 2 else FMA_CFGS[:4] if M == 4 else FMA_CFGS[:1] if M == 8 else []
    dot = DOT_CFGS if 8 <= M <= 16 else DOT_CFGS[:3] if M >= 2 else []
    kp2 = triton.next_power_of_2(K)
    cfgs = [replace(c, block_k=min(c.block_k, kp2)) for c in fma + dot]
    if N <= SMALL_N:
        cfgs += [replace(c, split_k=4) for c in cfgs[:2] + cfgs[len(fma):len(fma) + 2]]
    seen = set()
    for c in cfgs:
        if c not in seen:
            seen.add(c)
            out.append((label(c), c))
    return out


def label(c) -> str:
    return (f"{'dot' if c.dot else 'fma'} n{c.block_n} k{c.block_k} w{c.warps} s{c.stages}"
            + (f" split{c.split_k}" if c.split_k > 1 else ""))


def moe_label(c) -> str:
    return (f"w13 n{c.block_n1} k{c.block_k1} w{c.warps1} | w2 n{c.block_n2} k{c.block_k2} w{c.warps2}"
            + (" all" if c.all_experts else "") + (" pdl" if c.pdl else ""))


def copies_for(nbytes: int) -> int:
    """Distinct weight copies per graph: >= ~4x the L2 (60 MB) in total, 2..16."""
    return max(2, min(16, -(-240_000_000 // nbytes)))


def rel_err(got, want) -> float:
    got, want = got.float(), want.float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


# ---- timing -----------------------------------------------------------------------------------------

class Timer:
    """Graph-replay timing with the L2 flushed before every replay, by reading 256 MB ("read": the L2 then
    holds clean lines, as after the previous layer's weight reads in a decode step) or by writing them
    ("write", what triton's do_bench does: the kernel's first ~60 MB of reads also pay the write-back of
    the dirty lines). Median of the replays, divided by the calls per graph."""

    def __init__(self, mode: str):
        self.mode = mode
        self.buf = torch.zeros(256 << 20, dtype=torch.uint8, device=DEV)
        self.buf_f = self.buf.view(torch.float32)

    def flush(self, mode: str | None = None) -> None:
        if (mode or self.mode) == "write":
            self.buf.zero_()
        else:
            torch.sum(self.buf_f)

    def graph_time(self, fn, calls, rep_ms=15.0, mode: str | None = None) -> float:
        graph = graph_of(fn, calls)
        graph.replay()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        torch.cuda.synchronize()
        n = int(min(300, max(10, rep_ms / max(s.elapsed_time(e), 1e-3))))
        evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for a, b in evs:
            self.flush(mode)
            a.record()
            graph.replay()
            b.record()
        torch.cuda.synchronize()
        ts = sorted(a.elapsed_time(b) for a, b in evs)
        del graph
        return ts[len(ts) // 2] * 1e-3 / calls


def kernel_durations(timer, fn, calls, replays=10) -> dict:
    """Mean duration (us) per kernel name and call, from torch.profiler over graph replays (L2 flushed
    between replays as the timer does; the flush kernels are excluded)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    graph = graph_of(fn, calls)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            timer.flush()
            graph.replay()
        torch.cuda.synchronize()
    tot: dict = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and ("gemv" in e.name or "topk" in e.name):
            tot[e.name] = tot.get(e.name, 0.0) + (e.time_range.end - e.time_range.start)
    del graph
    return {k: v / (replays * calls) for k, v in tot.items()}


# ---- cases ------------------------------------------------------------------------------------------

def dense_jobs(sweep: bool, m1_extra: bool = False):
    for name, K, N in SHAPES:
        for M in MS:
            for lab, cfg in configs_for(M, N, K, sweep, m1_extra):
                yield name, K, N, M, lab, cfg


def dense_weights(K, N, copies, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return [(torch.randn(N, K, device=DEV, generator=g) * K ** -0.5).to(BF) for _ in range(copies)]


def moe_setup(T, calls, seed=0):
    """Weights with the shared expert as expert E, and `calls` routings (top-8 + the shared slot)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    w13 = (torch.randn(E + 1, 2 * INTER, H, device=DEV, generator=g) * H ** -0.5).to(BF)
    w2 = (torch.randn(E + 1, H, INTER, device=DEV, generator=g) * INTER ** -0.5).to(BF)
    xs, routes, distinct = [], [], []
    for _ in range(calls):
        xs.append(torch.randn(T, H, device=DEV, generator=g).to(BF))
        w, i = moe_route.topk_softmax(torch.randn(T, E, device=DEV, generator=g).to(BF), TOP_K, True)
        sw = torch.sigmoid(torch.randn(T, 1, device=DEV, generator=g))
        ids = torch.cat([i, torch.full((T, 1), E, dtype=i.dtype, device=DEV)], 1)
        routes.append((torch.cat([w, sw], 1).contiguous(), ids.contiguous()))
        distinct.append(int(torch.unique(ids).numel()))
    return w13, w2, xs, routes, sum(distinct) / calls


def moe_reference(x, w13, w2, weights, ids):
    from deltaserve.ops.moe import reference as moe_ref

    return moe_ref.fused_moe(x.float(), w13.float(), w2.float(), weights, ids)


# ---- warm-up ------------------------------------------------------------------------------------

def prenorm_inputs(M, K, calls, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    xs = [(torch.randn(M, K, device=DEV, generator=g) * 2).to(BF) for _ in range(calls)]
    rs = [(torch.randn(M, K, device=DEV, generator=g) * 2).to(BF) for _ in range(calls)]
    nw = (torch.randn(K, device=DEV, generator=g) * 0.2).to(BF)
    return xs, rs, nw


def prenorm_fns(xs, rs, nw, ws):
    """impl -> fn(i): the pre-norm projection on inputs/weights copy i, as two launches or fused; the
    GEMV and the norm alone."""
    eps = 1e-6

    def separate(i):
        h, s = norm_t.rms_norm(xs[i], nw, eps, residual=rs[i])
        return lin.linear(h, ws[i]), h, s

    M, K = xs[0].shape
    cfg = lin.default_linear_config(M, ws[0].shape[0], K)
    folded = cfg and replace(cfg, split_k=1)     # the norm folded in whatever the default does
    return {"separate": separate,
            "rms_norm_linear": lambda i: lin.rms_norm_linear(xs[i], rs[i], nw, eps, ws[i]),
            "folded": lambda i: lin.rms_norm_linear(xs[i], rs[i], nw, eps, ws[i], config=folded),
            "gemv alone": lambda i: lin.linear(xs[i], ws[i]),
            "norm alone": lambda i: norm_t.rms_norm(xs[i], nw, eps, residual=rs[i])}


def prenorm_worker(index: int, count: int) -> None:
    jobs = [(K, N, M) for _, K, N, _ in PRENORM_SHAPES for M in PRENORM_MS]
    for n, (K, N, M) in enumerate(jobs):
        if n % count == index:
            xs, rs, nw = prenorm_inputs(M, K, 1)
            for fn in prenorm_fns(xs, rs, nw, dense_weights(K, N, 1)).values():
                fn(0)
    torch.cuda.synchronize()


def worker(index: int, count: int, sweep: bool, m1_extra: bool) -> None:
    jobs = [j for n, j in enumerate(dense_jobs(sweep, m1_extra)) if n % count == index]
    weights = {}
    for name, K, N, M, lab, cfg in jobs:
        try:
            if (K, N) not in weights:
                weights.clear()
                torch.cuda.empty_cache()
                weights[(K, N)] = dense_weights(K, N, 1)[0]
            x = torch.randn(M, K, device=DEV).to(BF)
            lin.linear(x, weights[(K, N)], config=cfg)
        except Exception as exc:  # reported again by the timed phase
            print(f"[warm {index}] {name} M={M} {lab}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    moe_cfgs = [None] + (MOE_CFGS if sweep else []) + (MOE_T1_EXTRA if m1_extra else [])
    for n, cfg in enumerate(moe_cfgs):
        if n % count != index:
            continue
        for T in (1, 8):
            w13, w2, xs, routes, _ = moe_setup(T, 1)
            moe_t.fused_moe(xs[0], w13, w2, *routes[0], config=cfg)
    torch.cuda.synchronize()


def warm_up(args, log) -> subprocess.Popen | None:
    """Compile in parallel workers and run the GPU tests; with --prenorm the tests run on while the
    benchmark times (returned, for the caller to wait on), else they are waited for here."""
    t0 = time.time()
    base = [sys.executable, os.path.abspath(__file__), "--worker-of", str(args.workers)]
    flags = (["--sweep"] if args.sweep else []) + (["--sweep-m1"] if args.sweep_m1 else []) + \
        (["--prenorm"] if args.prenorm else [])
    procs = [subprocess.Popen(base + ["--worker", str(i)] + flags) for i in range(args.workers)]
    if args.gpu_tests:
        files = ["tests/ops/test_rms_norm_linear.py"] if args.prenorm else \
            ["tests/ops/test_linear_triton.py", "tests/ops/test_moe_triton.py"]
        with open(os.path.join(args.out, "gpu_tests.log"), "w") as f:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", *files]
                + shlex.split(args.test_args), stdout=f, stderr=subprocess.STDOUT))
    tests = procs.pop() if args.gpu_tests and args.prenorm else None
    for n, p in enumerate(procs):
        limit = args.warmup_s + (40.0 if n == args.workers else 0.0)     # the GPU tests get 40 s more
        try:
            p.wait(timeout=max(1.0, limit - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            log(f"warm-up process {p.pid} killed after {args.warmup_s:.0f} s")
    log(f"warm-up (parallel compile, GPU tests) {time.time() - t0:.0f} s")
    return tests


# ---- main ---------------------------------------------------------------------------------------

def run_dense(args, ceil, log, t_start, timer) -> list:
    rows, extra = [], []
    for name, K, N in SHAPES:
        if args.only and not any(p in name for p in args.only.split(",")):
            continue
        if time.time() - t_start > args.budget_s:
            log(f"SKIPPED (budget): {name}")
            continue
        wbytes = N * K * 2
        calls = copies_for(wbytes)
        ws = dense_weights(K, N, calls)
        for M in MS:
            xs = [torch.randn(M, K, device=DEV).to(BF) for _ in range(calls)]
            moved = wbytes + 2 * M * (K + N)
            want = F.linear(xs[0].float(), ws[0].float())
            cublas = F.linear(xs[0], ws[0])
            base = dict(shape=name, K=K, N=N, M=M)
            t_cublas = timer.graph_time(lambda i: F.linear(xs[i], ws[i]), calls)
            rows.append(dict(base, impl="cublas", us=t_cublas * 1e6, err_fp32=rel_err(cublas, want)))
            if args.both_flush:   # the other flush, for cuBLAS and our default (own rows, ratio to cuBLAS's)
                other = "write" if timer.mode == "read" else "read"
                tc = timer.graph_time(lambda i: F.linear(xs[i], ws[i]), calls, mode=other)
                to = timer.graph_time(lambda i: lin.linear(xs[i], ws[i]), calls, mode=other)
                extra.append(dict(base, impl=f"cublas ({other} flush)", us=tc * 1e6))
                extra.append(dict(base, impl=f"default ({other} flush)", us=to * 1e6, vs_cublas=tc / to))
            for lab, cfg in configs_for(M, N, K, args.sweep, args.sweep_m1):
                if time.time() - t_start > args.budget_s:
                    break
                try:
                    got = lin.linear(xs[0], ws[0], config=cfg)
                    err = rel_err(got, cublas)
                    t = timer.graph_time(lambda i, cfg=cfg: lin.linear(xs[i], ws[i], config=cfg), calls)
                except Exception as exc:
                    log(f"FAILED {name} M={M} {lab}: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                row = dict(base, impl=lab, us=t * 1e6, err_cublas=err)
                if cfg is None:
                    row["err_fp32"] = rel_err(got, want)
                    row["cfg"] = str(lin.default_linear_config(M, N, K))
                rows.append(row)
            for r in rows:
                if r["shape"] == name and r["M"] == M:
                    r["TBps"] = moved / (r["us"] * 1e-6) / 1e12
                    r["frac_copy"] = r["TBps"] / ceil["copy_TBps"]
                    r["vs_cublas"] = t_cublas * 1e6 / r["us"]
            for r in extra:
                r["TBps"] = moved / (r["us"] * 1e-6) / 1e12
                r["frac_copy"] = r["TBps"] / ceil["copy_TBps"]
            rows += extra
            extra.clear()
            for r in rows:
                if r["shape"] == name and r["M"] == M:
                    log(json.dumps(r))
        ws = xs = None
        torch.cuda.empty_cache()
    return rows


def run_moe(args, ceil, log, timer) -> list:
    rows = []
    expert_bytes = 3 * INTER * H * 2
    for T in (1, 8):
        calls = 4
        w13, w2, xs, routes, distinct = moe_setup(T, calls)
        want = moe_reference(xs[0], w13, w2, *routes[0])
        extra = MOE_T1_EXTRA if args.sweep_m1 and T == 1 else []
        for cfg in [None] + (MOE_CFGS if args.sweep else []) + extra:
            lab = "default " + moe_label(cfg or moe_t.default_moe_config(T, TOP_K + 1, E + 1, H, INTER, pdl=True))
            try:
                got = moe_t.fused_moe(xs[0], w13, w2, *routes[0], config=cfg)
                err = rel_err(got, want)
                fn = (lambda i, cfg=cfg: moe_t.fused_moe(xs[i], w13, w2, *routes[i], config=cfg))
                t = timer.graph_time(fn, calls)
                kd = kernel_durations(timer, fn, calls)
            except Exception as exc:
                log(f"FAILED moe T={T} {lab}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            byts = distinct * expert_bytes
            row = dict(T=T, impl=lab if cfg is None else moe_label(cfg), us=t * 1e6, err_fp32=err,
                       distinct=distinct, TBps=byts / t / 1e12, frac_copy=byts / t / 1e12 / ceil["copy_TBps"],
                       kernels_us=kd)
            for k, v in kd.items():
                part = 2 / 3 if "w13" in k else 1 / 3 if "w2" in k else 0
                if part:
                    row[f"frac_copy {k}"] = byts * part / (v * 1e-6) / 1e12 / ceil["copy_TBps"]
            rows.append(row)
            log(json.dumps(row))
        w13 = w2 = xs = routes = None
        torch.cuda.empty_cache()
    return rows


def run_prenorm(ceil, log, timer) -> list:
    """Per shape and M: each impl's time per call (graphs of `calls` calls on distinct weight copies, L2
    flushed per replay), the fused op's error against the two-launch path, and the per-step totals."""
    rows = []
    for name, K, N, layers in PRENORM_SHAPES:
        wbytes = N * K * 2
        calls = copies_for(wbytes)
        ws = dense_weights(K, N, calls)
        for M in PRENORM_MS:
            xs, rs, nw = prenorm_inputs(M, K, calls, seed=M)
            fns = prenorm_fns(xs, rs, nw, ws)
            (y_s, h_s, s_s), (y_f, h_f, s_f) = fns["separate"](0), fns["folded"](0)
            row = dict(shape=name, K=K, N=N, M=M, layers=layers, err_y=rel_err(y_f, y_s), err_normed=rel_err(h_f, h_s),
                       sum_equal=bool(torch.equal(s_f, s_s)), cfg=str(lin.default_linear_config(M, N, K)))
            for impl, fn in fns.items():
                row[f"{impl} us"] = timer.graph_time(fn, calls) * 1e6
            row["saved us"] = row["separate us"] - row["rms_norm_linear us"]
            row["folded frac copy"] = (wbytes + 2 * M * (3 * K + N)) / (row["folded us"] * 1e-6) / 1e12 / ceil["copy_TBps"]
            rows.append(row)
            log(json.dumps(row))
        ws = None
        torch.cuda.empty_cache()
    lines = ["| shape (K->N) | M | norm + GEMV us | rms_norm_linear us | saved us | folded us | GEMV alone us | "
             "norm alone us | folded frac copy | folded err y / normed vs two launches |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} ({r['K']}->{r['N']}) | {r['M']} | {r['separate us']:.2f} | "
                     f"{r['rms_norm_linear us']:.2f} | {r['saved us']:.2f} | {r['folded us']:.2f} | "
                     f"{r['gemv alone us']:.2f} | {r['norm alone us']:.2f} | "
                     f"{r['folded frac copy']:.0%} | {r['err_y']:.1e} / {r['err_normed']:.1e} |")
    for M in PRENORM_MS:
        rs_ = [r for r in rows if r["M"] == M]
        sep, op, fold = (sum(r["layers"] * r[f"{impl} us"] for r in rs_)
                         for impl in ("separate", "rms_norm_linear", "folded"))
        lines.append(f"per 35B step, M={M}: 80 pre-norm projections {sep:.0f} us as two launches, {op:.0f} us by "
                     f"rms_norm_linear ({sep - op:.0f} us saved; {fold:.0f} us with the norm folded in)")
    log("\n".join(lines))
    return rows


def summary(dense, moe, ceil) -> str:
    lines = [f"copy {ceil['copy_TBps']:.2f} TB/s", "",
             ("| shape (K->N) | M | cuBLAS us | ours us (default) | TB/s | frac copy | cuBLAS/ours | best sweep | "
              "other flush: cuBLAS / ours us |"), "|---|---|---|---|---|---|---|---|---|"]
    keys = []
    for r in dense:
        if (r["shape"], r["M"]) not in keys:
            keys.append((r["shape"], r["M"]))
    for shape, M in keys:
        rs = [r for r in dense if r["shape"] == shape and r["M"] == M]
        cb = next((r for r in rs if r["impl"] == "cublas"), None)
        df = next((r for r in rs if r["impl"] == "default"), None)
        sw = [r for r in rs if r["impl"] not in ("cublas", "default") and "flush" not in r["impl"]]
        oc = next((r for r in rs if r["impl"].startswith("cublas (")), None)
        od = next((r for r in rs if r["impl"].startswith("default (")), None)
        best = min(sw, key=lambda r: r["us"]) if sw else None
        if not cb or not df:
            continue
        b = f"{best['impl']} {best['us']:.1f} ({best['frac_copy']:.0%})" if best else "-"
        o = f"{oc['us']:.1f} / {od['us']:.1f} ({od['frac_copy']:.0%}, {od['vs_cublas']:.2f}x)" if oc and od else "-"
        lines.append(f"| {shape} ({df['K']}->{df['N']}) | {M} | {cb['us']:.1f} ({cb['frac_copy']:.0%}) | "
                     f"{df['us']:.1f} | {df['TBps']:.2f} | {df['frac_copy']:.0%} | {df['vs_cublas']:.2f}x | {b} | {o} |")
    lines += ["", "| MoE T | config | us | TB/s | frac copy | kernels us |", "|---|---|---|---|---|---|"]
    for r in moe:
        ks = ", ".join(f"{k.split('_kernel')[0].lstrip('_')} {v:.1f}" for k, v in r["kernels_us"].items())
        lines.append(f"| {r['T']} | {r['impl']} | {r['us']:.1f} | {r['TBps']:.2f} | {r['frac_copy']:.0%} | {ks} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--sweep", action="store_true", help="also time other tile configs")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--gpu-tests", action="store_true", help="run the gpu-marked linear/MoE tests in the warm-up")
    ap.add_argument("--budget-s", type=float, default=200.0, help="skip remaining dense shapes after this")
    ap.add_argument("--warmup-s", type=float, default=90.0)
    ap.add_argument("--only", default="", help="substrings of dense shape names to run (comma: any)")
    ap.add_argument("--no-moe", action="store_true")
    ap.add_argument("--sweep-m1", action="store_true", help="extra M = 1 tiles and MoE T = 1 tiles")
    ap.add_argument("--flush", choices=("read", "write"), default="read", help="how the L2 is flushed (Timer)")
    ap.add_argument("--both-flush", action="store_true", help="also time cuBLAS and our default with the other")
    ap.add_argument("--test-args", default="", help="extra pytest arguments for --gpu-tests (e.g. -k ...)")
    ap.add_argument("--prenorm", action="store_true", help="only the pre-norm projections: fused vs two launches")
    ap.add_argument("--worker", default=None)
    ap.add_argument("--worker-of", type=int, default=1)
    args = ap.parse_args()
    if args.worker is not None:
        if args.prenorm:
            prenorm_worker(int(args.worker), args.worker_of)
        else:
            worker(int(args.worker), args.worker_of, args.sweep, args.sweep_m1)
        return 0
    t_start = time.time()
    log = RunLog(args.out, "linear_gemv.log")
    env = device_env()
    log(json.dumps(env))
    tests = warm_up(args, log) if args.workers > 0 else None
    ceil = ceilings(matmul=False)
    log(json.dumps(ceil))
    timer = Timer(args.flush)
    log(f"L2 flush before each replay: {args.flush}")
    if args.prenorm:
        rows = run_prenorm(ceil, log, timer)
        with open(os.path.join(args.out, "linear_prenorm.json"), "w") as f:
            json.dump(dict(env=env, ceilings=ceil, prenorm=rows), f, indent=1)
        if tests is not None:
            try:
                log(f"GPU tests exit code {tests.wait(timeout=max(1.0, args.budget_s - (time.time() - t_start)))}")
            except subprocess.TimeoutExpired:
                tests.kill()
                log("GPU tests killed at the budget")
        log(f"total {time.time() - t_start:.0f} s")
        return 0
    moe = [] if args.no_moe else run_moe(args, ceil, log, timer)
    dense = run_dense(args, ceil, log, t_start, timer)
    with open(os.path.join(args.out, "linear_gemv.json"), "w") as f:
        json.dump(dict(env=env, ceilings=ceil, dense=dense, moe=moe), f, indent=1)
    log(summary(dense, moe, ceil))
    log(f"total {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
