"""Paged attention and fused MoE (Triton) at real model shapes: correctness against the references and
timings against peers run in the same process on the same GPU and inputs.

  attention  Qwen3.5-35B-A3B (16 query / 2 KV heads) and Qwen3.5-27B (24 / 4), head_dim 256, bf16, block 16:
             decode B=1 x 65536, B=64 x 4096, B=256 x 2048 (GB/s of KV read, fraction of copy bandwidth);
             prefill 1 x 4096 from empty and a mixed step (2048-token chunk on 2048 cached + 64 decodes)
             (TFLOP/s of the causal QK^T and PV products). Peer: torch SDPA (flash backend, enable_gqa) on
             the same K/V already gathered into contiguous [B, NKV, ctx, 256] tensors (gather not timed),
             for the shapes SDPA can express (equal-length decodes, prefill from empty).
  moe        Qwen3.5-35B-A3B experts (E 256, top-8, H 2048, I 512), T = 1, 8, 16, 64, 256, 4096 tokens:
             topk_softmax + fused_moe; GB/s of expert weights touched (fraction of copy bandwidth) and
             TFLOP/s. At T <= 8 (the GEMV path) also the grouped-GEMM path forced, for comparison. Peers:
             torch._grouped_mm (CUTLASS grouped GEMM) with torch sort/gather/index_add around it, and the
             reference's per-expert torch loop (eager: it syncs, so no graph).
  ceilings   device-to-device copy bandwidth and bf16 matmul rate, measured in the same run.
  moe decode (--moe-decode, alone): the batch-1..8 decode step's MoE block at the Qwen3.5-35B-A3B shape
             as the layer runs it (257 stored experts: the shared expert folded in as expert 256; top-8 +
             its slot; H 2048, I 512, bf16), per call and per kernel, for T = 1, 2, 4, 8: routing +
             fused_moe, the router GEMV alone, and the block as the decoder layer runs it (pre-norm folded
             into the router GEMV, fused_moe_routed) by default and with the shared slots forced kept with
             the routing or set apart (the rule in ops/moe/config.py), checked against the fp32 reference
             on the same router output; the torch._grouped_mm pipeline as the peer. Each call in a graph
             has its own weight copy and the L2 is flushed by a 256 MB read before each replay (as in a
             decode step, every layer reads its own experts). Bytes = distinct experts x 6.29 MB.

Every time is `triton.testing.do_bench` (median, L2 flushed before each replay) around the replay of a
CUDA graph holding `calls` invocations on distinct inputs, divided by `calls` (the per-expert torch loop
is timed eagerly). A warm-up phase compiles every kernel variant in parallel worker processes (shared
Triton cache) and runs the GPU tests, so the timed phase only replays.

Run (GPU):  PYTHONPATH=. python benchmarks/attention_moe_ops.py --out DIR [--sweep] [--workers 8]
            PYTHONPATH=. python benchmarks/attention_moe_ops.py --out DIR --moe-decode [--gpu-tests]
                [--decode-t 1,2,4,8] [--test-k EXPR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.nn.functional as F
import triton
from gpu_common import RunLog, ceilings, device_env, graph_of, graph_seconds  # noqa: I001  (benchmarks/ is on sys.path when run)

from deltaserve.ops.activation import reference as act_ref
from deltaserve.ops.activation import triton as act_t
from deltaserve.ops.attention import reference as attn_ref
from deltaserve.ops.attention import triton as attn_t
from deltaserve.ops.linear import triton as lin_t
from deltaserve.ops.moe import config as moe_config
from deltaserve.ops.moe import reference as moe_ref
from deltaserve.ops.moe import triton as moe_t
from deltaserve.ops.moe import triton_routing as moe_route

DEV = "cuda"
BF = torch.bfloat16
D, BS = 256, 16
ATTN_SHAPES = {"35B-A3B": (16, 2), "27B": (24, 4)}
DECODE = {"B=1x65536": (1, 65536), "B=64x4096": (64, 4096), "B=256x2048": (256, 2048)}
E, TOP_K, H, INTER = 256, 8, 2048, 512
MOE_T = [1, 8, 16, 64, 256, 4096]


# ---- inputs -------------------------------------------------------------------------------------

def _gen(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


@dataclass
class AttnBatch:
    q: torch.Tensor
    cache: torch.Tensor
    kw: dict
    kv_bytes: int            # K/V bytes a kernel must read (each token once per KV head)
    flops: float             # QK^T + PV multiply-adds x 2 over the visible (query, key) pairs
    q_lens: list
    ctx: list


def attn_batch(nh, nkv, q_lens, ctx, seed=0) -> AttnBatch:
    """Sequences with contiguous-but-shuffled blocks; block ids from a random permutation."""
    g = _gen(seed)
    need = [-(-c // BS) for c in ctx]
    nblocks = sum(need)
    cache = torch.randn(2, nblocks, BS, nkv, D, device=DEV, dtype=BF, generator=g)
    perm = torch.randperm(nblocks, device=DEV, generator=g).to(torch.int32)
    tables = torch.zeros(len(ctx), max(need), dtype=torch.int32, device=DEV)
    used = 0
    for n, k in enumerate(need):
        tables[n, :k] = perm[used:used + k]
        used += k
    cu = [0]
    for L in q_lens:
        cu.append(cu[-1] + L)
    q = torch.randn(cu[-1], nh, D, device=DEV, dtype=BF, generator=g)
    kw = dict(cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=DEV),
              seq_lens=torch.tensor(ctx, dtype=torch.int32, device=DEV), block_tables=tables, scale=D ** -0.5)
    pairs = sum(L * (c - L) + L * (L + 1) // 2 for L, c in zip(q_lens, ctx))
    return AttnBatch(q, cache, kw, kv_bytes=sum(ctx) * 2 * nkv * D * 2, flops=4.0 * pairs * nh * D,
                     q_lens=q_lens, ctx=ctx)


def gathered_kv(b: AttnBatch, nkv):
    """K, V of equal-length sequences as contiguous [B, NKV, ctx, D] tensors (the SDPA peer's input)."""
    ctx = b.ctx[0]
    assert all(c == ctx for c in b.ctx)
    blocks = b.kw["block_tables"][:, : -(-ctx // BS)].long()
    k = b.cache[0][blocks].reshape(len(b.ctx), -1, nkv, D)[:, :ctx].transpose(1, 2).contiguous()
    v = b.cache[1][blocks].reshape(len(b.ctx), -1, nkv, D)[:, :ctx].transpose(1, 2).contiguous()
    return k, v


@dataclass
class MoeInputs:
    x: list
    logits: list
    w13: torch.Tensor
    w2: torch.Tensor
    weight_bytes: float      # mean bytes per call: expert weights touched + x read + output written
    flops: float


def moe_routing(T, calls, seed=0):
    """Router logits of each call and the bytes / flops they imply (drawn apart from the weights)."""
    g = _gen(seed + 1)
    logits = [torch.randn(T, E, device=DEV, dtype=BF, generator=g) for _ in range(calls)]
    active = sum(int(torch.unique(moe_ref.topk_softmax(lg, TOP_K, True)[1]).numel()) for lg in logits) / calls
    weight_bytes = active * 3 * INTER * H * 2 + 2 * T * H * 2
    return logits, weight_bytes, 2.0 * T * TOP_K * 3 * INTER * H


def moe_inputs(T, calls, seed=0) -> MoeInputs:
    g = _gen(seed)
    w13 = torch.randn(E, 2 * INTER, H, device=DEV, dtype=BF, generator=g) * H ** -0.5
    w2 = torch.randn(E, H, INTER, device=DEV, dtype=BF, generator=g) * INTER ** -0.5
    xs = [torch.randn(T, H, device=DEV, dtype=BF, generator=g) for _ in range(calls)]
    logits, weight_bytes, flops = moe_routing(T, calls, seed)
    return MoeInputs(xs, logits, w13, w2, weight_bytes=weight_bytes, flops=flops)


# ---- peers --------------------------------------------------------------------------------------

def sdpa_peer(q4, k, v, causal):
    """torch SDPA: the flash backend with native GQA if this build has it, else the flash backend on K/V
    expanded to every query head (reads G times the bytes). Returns (run, which)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def flash_gqa():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q4, k, v, is_causal=causal, enable_gqa=True)

    try:
        flash_gqa()
        return flash_gqa, "flash, enable_gqa"
    except RuntimeError:
        pass
    g = q4.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)

    def flash_expanded():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q4, ke, ve, is_causal=causal)

    flash_expanded()
    return flash_expanded, "flash, K/V expanded to all heads"


def grouped_mm_moe(x, w13, w2, weights, ids):
    """A MoE forward built on torch._grouped_mm: sort assignments by expert, two grouped GEMMs, index_add."""
    T = x.shape[0]
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int32, device=DEV).index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    tok = order // TOP_K
    h = torch._grouped_mm(x[tok], w13.transpose(1, 2), offs=offs)
    h = F.silu(h[:, :INTER]) * h[:, INTER:]
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
    out = torch.zeros(T, H, dtype=torch.float32, device=DEV)
    out.index_add_(0, tok, y.float() * weights.flatten()[order, None])
    return out.to(x.dtype)


# ---- cases --------------------------------------------------------------------------------------

@dataclass
class Case:
    group: str
    name: str
    impl: str
    calls: int
    setup: Callable                    # (calls) -> (fn(i), check() -> rel err or None)
    bytes: float = 0.0
    flops: float = 0.0
    graph: bool = True
    sweep: bool = False
    meta: dict = field(default_factory=dict)


def rel_err(got, want):
    got, want = got.float(), want.float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


ATTN_DECODE_CFGS = [(16, 32, 4, 3), (16, 64, 4, 3), (16, 64, 4, 2), (16, 128, 8, 2)]  # (bm, bn, warps, stages)
ATTN_PREFILL_CFGS = [(64, 32, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 2)]
MOE_CFGS = {
    "small": [moe_t.MoeConfig(16, 32, 256, 64, 256, 4, 4, 3), moe_t.MoeConfig(16, 64, 128, 64, 128, 4, 4, 3),
              moe_t.MoeConfig(16, 32, 128, 32, 128, 2, 2, 4)],
    "gemv": [moe_t.GemvMoeConfig(16, 256, 16, 256, 4, 4, 3), moe_t.GemvMoeConfig(4, 512, 4, 512, 2, 2, 2),
             moe_t.GemvMoeConfig(8, 1024, 4, 512, 4, 2, 3), moe_t.GemvMoeConfig(4, 1024, 2, 512, 4, 2, 3),
             moe_t.GemvMoeConfig(8, 512, 2, 256, 2, 4, 3, all_experts=True),
             moe_t.GemvMoeConfig(8, 512, 4, 128, 2, 4, 3, all_experts=True),
             moe_t.GemvMoeConfig(8, 512, 2, 256, 2, 4, 3, all_experts=True, pdl=True),
             moe_t.GemvMoeConfig(8, 512, 4, 128, 2, 4, 3, all_experts=True, pdl=True)],
    "large": [moe_t.MoeConfig(64, 64, 64, 128, 64, 4, 8, 3), moe_t.MoeConfig(64, 128, 64, 128, 64, 8, 8, 3),
              moe_t.MoeConfig(128, 64, 64, 128, 64, 8, 8, 3), moe_t.MoeConfig(128, 128, 64, 256, 64, 8, 8, 3)],
}


def attention_cases(sweep: bool) -> list[Case]:
    cases = []
    for model, (nh, nkv) in ATTN_SHAPES.items():
        shapes = {f"decode {k}": ([1] * B, [c] * B) for k, (B, c) in DECODE.items()}
        shapes["prefill 1x4096"] = ([4096], [4096])
        shapes["mixed 2048+2048ctx, 64x4096 dec"] = ([2048] + [1] * 64, [4096] + [4096] * 64)
        for name, (q_lens, ctx) in shapes.items():
            decode = name.startswith("decode")
            calls = 4 if name == "decode B=1x65536" else 1
            meta = dict(model=model, nh=nh, nkv=nkv)
            pairs = sum(L * (c - L) + L * (L + 1) // 2 for L, c in zip(q_lens, ctx))
            kvb, fl = sum(ctx) * 2 * nkv * D * 2, 4.0 * pairs * nh * D

            def ours(c, q_lens=q_lens, ctx=ctx, nh=nh, nkv=nkv, cfg=None):
                bs = [attn_batch(nh, nkv, q_lens, ctx, seed=i) for i in range(c)]

                def fn(i):
                    return attn_t.paged_attention(bs[i].q, bs[i].cache, config=cfg, **bs[i].kw)

                def check():
                    return rel_err(fn(0), attn_ref.paged_attention(bs[0].q, bs[0].cache, **bs[0].kw))
                return fn, check

            cases.append(Case("attention", f"{model} {name}", "ours", calls, ours, bytes=kvb, flops=fl, meta=meta))
            if sweep:
                for bm, bn, w, st in (ATTN_DECODE_CFGS if decode else ATTN_PREFILL_CFGS):
                    base = attn_t.default_attention_config(len(q_lens) if decode else sum(q_lens), len(q_lens),
                                                           nh, nkv, D, torch.device(DEV))
                    cfg = replace(base, block_m=max(bm, triton.next_power_of_2(nh // nkv)), block_n=bn,
                                  num_warps=w, num_stages=st)
                    cases.append(Case("attention", f"{model} {name}", f"bm={cfg.block_m} bn={bn} w{w} s{st} "
                                      f"splits={cfg.num_splits}", calls,
                                      lambda c, f=ours, cfg=cfg: f(c, cfg=cfg), bytes=kvb, flops=fl, sweep=True,
                                      meta=meta))
            if decode or name.startswith("prefill"):
                def peer(c, q_lens=q_lens, ctx=ctx, nh=nh, nkv=nkv, decode=decode):
                    bs = [attn_batch(nh, nkv, q_lens, ctx, seed=i) for i in range(c)]
                    runs = []
                    for b in bs:
                        k, v = gathered_kv(b, nkv)
                        q4 = b.q.view(len(ctx), -1, nh, D).transpose(1, 2)
                        runs.append(sdpa_peer(q4, k, v, causal=not decode))

                    def check():
                        o = runs[0][0]().transpose(1, 2).reshape(bs[0].q.shape)
                        return rel_err(o, attn_ref.paged_attention(bs[0].q, bs[0].cache, **bs[0].kw))

                    def fn(i):
                        return runs[i][0]()
                    fn.note = runs[0][1]
                    return fn, check

                cases.append(Case("attention", f"{model} {name}", "torch sdpa flash (gathered KV)", calls, peer,
                                  bytes=kvb, flops=fl, meta=meta))
    return cases


def moe_cases(sweep: bool) -> list[Case]:
    cases = []
    for T in MOE_T:
        calls = 4 if T <= 64 else 1

        def ours(c, T=T, cfg=None, route=True):
            d = moe_inputs(T, c)
            routed = [moe_route.topk_softmax(lg, TOP_K, True) for lg in d.logits]

            def fn(i):
                if route:
                    w, ids = moe_route.topk_softmax(d.logits[i], TOP_K, True)
                else:
                    w, ids = routed[i]
                return moe_t.fused_moe(d.x[i], d.w13, d.w2, w, ids, config=cfg)

            def check():
                w, ids = moe_ref.topk_softmax(d.logits[0], TOP_K, True)
                return rel_err(fn(0), moe_ref.fused_moe(d.x[0], d.w13, d.w2, w, ids))
            return fn, check

        def gmm(c, T=T):
            d = moe_inputs(T, c)
            routed = [moe_ref.topk_softmax(lg, TOP_K, True) for lg in d.logits]

            def fn(i):
                return grouped_mm_moe(d.x[i], d.w13, d.w2, *routed[i])

            def check():
                return rel_err(fn(0), moe_ref.fused_moe(d.x[0], d.w13, d.w2, *routed[0]))
            return fn, check

        def loop(c, T=T):
            d = moe_inputs(T, c)
            routed = [moe_ref.topk_softmax(lg, TOP_K, True) for lg in d.logits]
            return (lambda i: moe_ref.fused_moe(d.x[i], d.w13, d.w2, *routed[i])), (lambda: None)

        name = f"T={T}"
        kw = dict(bytes=-1.0, meta=dict(T=T))           # bytes / flops filled from the routing when timed
        cases.append(Case("moe", name, "ours (topk_softmax + fused_moe)", calls, ours, **kw))
        cases.append(Case("moe", name, "ours fused_moe only", calls, lambda c, f=ours: f(c, route=False), **kw))
        if T * TOP_K <= moe_config.GEMV_MAX_ASSIGNMENTS:
            small = moe_t.MoeConfig(16, 32, 256, 64, 256, 4, 4, 3)      # the grouped path's decode tiles
            cases.append(Case("moe", name, "ours grouped-GEMM path forced (topk_softmax + fused_moe)", calls,
                              lambda c, f=ours, cfg=small: f(c, cfg=cfg), **kw))
        cases.append(Case("moe", name, "torch._grouped_mm pipeline", calls, gmm, **kw))
        cases.append(Case("moe", name, "reference per-expert torch loop (eager)", calls, loop, graph=False, **kw))
        if sweep:
            gemv = T * TOP_K <= moe_config.GEMV_MAX_ASSIGNMENTS
            for cfg in MOE_CFGS["gemv" if gemv else "small" if T * TOP_K / E <= 16 else "large"]:
                label = ("bm=gemv" if gemv else f"bm={cfg.block_m}") + (
                    f" n1={cfg.block_n1} k1={cfg.block_k1} n2={cfg.block_n2} k2={cfg.block_k2} "
                    f"w{cfg.warps1}/{cfg.warps2} s{cfg.stages}") + (
                    (" all-experts" if cfg.all_experts else "") + (" pdl" if cfg.pdl else "") if gemv else "")
                cases.append(Case("moe", name, label, calls, lambda c, f=ours, cfg=cfg: f(c, cfg=cfg, route=False),
                                  sweep=True, **kw))
    return cases


def activation_cases() -> list[Case]:
    """silu_and_mul on the 27B dense MLP (I = 17408) and sigmoid_mul on the 35B attention gate (16 x 256)."""
    cases = []
    for T in (64, 2048):
        for name, shape, ours_fn, ref_fn, nin in (
                (f"silu_and_mul T={T} x 2*17408", (T, 2 * 17408), act_t.silu_and_mul, act_ref.silu_and_mul, 1),
                (f"sigmoid_mul T={T} x 4096", (T, 4096), act_t.sigmoid_mul, act_ref.sigmoid_mul, 2)):
            numel = shape[0] * shape[1]
            moved = (numel * 2 + numel // 2 * 2) if nin == 1 else numel * 3 * 2

            def setup(c, shape=shape, fn=None, nin=nin, ref_fn=ref_fn):
                g = _gen(0)
                xs = [[torch.randn(shape, device=DEV, dtype=BF, generator=g) for _ in range(nin)] for _ in range(c)]
                return (lambda i: fn(*xs[i])), (lambda: rel_err(fn(*xs[0]), ref_fn(*xs[0])))

            for impl, fn in (("ours", ours_fn), ("torch eager (F.silu / torch.sigmoid, *)", ref_fn)):
                cases.append(Case("activation", name, impl, 4, lambda c, setup=setup, fn=fn: setup(c, fn=fn),
                                  bytes=float(moved)))
    return cases


def all_cases(sweep: bool) -> list[Case]:
    """Main comparisons first, launch-config variants last (they are the first to go if time runs out)."""
    cases = attention_cases(sweep) + moe_cases(sweep) + activation_cases()
    return [c for c in cases if not c.sweep] + [c for c in cases if c.sweep]


# ---- timing -------------------------------------------------------------------------------------

def graph_time(fn: Callable, calls: int) -> float:
    return graph_seconds(fn, calls, warmup=10, rep=60)


def eager_time(fn: Callable, calls: int) -> float:
    ms = triton.testing.do_bench(lambda: [fn(i) for i in range(calls)], warmup=3, rep=40, return_mode="median")
    return ms * 1e-3 / calls


# ---- warm-up --------------------------------------------------------------------------------------

def selected(only: str, label: str) -> bool:
    return not only or any(part in label for part in only.split(","))


def worker(index: int, count: int, sweep: bool, only: str = "") -> None:
    cases = [c for c in all_cases(sweep) if selected(only, f"{c.group} {c.name} {c.impl}")]
    for j, case in enumerate(cases):
        if j % count != index or not case.impl.startswith(("ours", "bm=")):
            continue
        try:
            fn, _ = case.setup(1)
            fn(0)
            torch.cuda.synchronize()
        except Exception as exc:  # reported again by the timed phase
            print(f"[warm {index}] {case.group} {case.name} {case.impl}: {type(exc).__name__}: {exc}", flush=True)
        torch.cuda.empty_cache()


def warm_up(args, log) -> None:
    t0 = time.time()
    base = [sys.executable, os.path.abspath(__file__), "--worker-of", str(args.workers)]
    flags = (["--sweep"] if args.sweep else []) + (["--moe-decode", "--decode-t", args.decode_t]
                                                   if args.moe_decode else [])
    procs = [subprocess.Popen(base + ["--worker", str(i), "--only", args.only] + flags) for i in range(args.workers)]
    if args.gpu_tests:
        # decode: the MoE op files whole (their CPU tests too, compiled; two processes), else the gpu-marked
        # attention / MoE tests
        moe_files = ["tests/ops/test_moe_triton.py", "tests/ops/test_moe_routing.py"]
        runs = {"gpu_tests.log": ["-m", "gpu", *moe_files], "cuda_tests.log": ["-m", "not gpu", *moe_files]} \
            if args.moe_decode else {"gpu_tests.log": ["-m", "gpu", "tests/ops/test_attention_triton.py",
                                                       "tests/ops/test_moe_triton.py"]}
        for name, tests in runs.items():
            with open(os.path.join(args.out, name), "w") as f:
                procs.append(subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                               "--durations=5", *(["-k", args.test_k] if args.test_k else []),
                                               *tests], stdout=f, stderr=subprocess.STDOUT))
    for p in procs:
        try:
            p.wait(timeout=max(1.0, args.warmup_s - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            log(f"warm-up process {p.pid} killed after {args.warmup_s:.0f} s")
    log(f"warm-up (parallel compile, GPU tests) {time.time() - t0:.0f} s")


# ---- MoE decode: T = 1..8 as the layer runs it, per kernel ---------------------------------------

DECODE_T = [1, 2, 4, 8]
DECODE_CALLS = 4
E_STORED, SLOTS = E + 1, TOP_K + 1          # the shared expert as expert 256, in every token's 9th slot
EXPERT_BYTES = 3 * INTER * H * 2


@dataclass
class DecodeInputs:
    w13: list          # one weight copy per call
    w2: list
    x: list
    logits: list       # [T, E + 1]: the routed experts' logits and the shared expert's gate
    routed: list       # (weights, ids) of each call, from the reference routing
    distinct: float    # mean distinct experts per call (the shared one included)
    router: list = field(default_factory=list)      # [E + 1, H] router + shared gate rows, one per weight copy
    resid: list = field(default_factory=list)       # the residual added before the pre-norm, per call
    norm_w: torch.Tensor | None = None


def decode_inputs(T: int, calls: int, copies: int | None = None, seed: int = 0) -> DecodeInputs:
    g = _gen(seed)
    w13, w2 = [], []
    for _ in range(copies or calls):
        w13.append((torch.randn(E_STORED, 2 * INTER, H, device=DEV, generator=g) * H ** -0.5).to(BF))
        w2.append((torch.randn(E_STORED, H, INTER, device=DEV, generator=g) * INTER ** -0.5).to(BF))
    xs = [torch.randn(T, H, device=DEV, generator=g).to(BF) for _ in range(calls)]
    logits = [torch.randn(T, E_STORED, device=DEV, generator=g).to(BF) for _ in range(calls)]
    routed = [moe_ref.topk_softmax(lg, TOP_K, True, shared_slices=1) for lg in logits]
    distinct = sum(int(torch.unique(ids).numel()) for _, ids in routed) / calls
    router = [(torch.randn(E_STORED, H, device=DEV, generator=g) * H ** -0.5).to(BF) for _ in range(copies or calls)]
    resid = [torch.randn(T, H, device=DEV, generator=g).to(BF) for _ in range(calls)]
    norm_w = (torch.randn(H, device=DEV, generator=g) * 0.1).to(BF)
    return DecodeInputs(w13, w2, xs, logits, routed, distinct, router, resid, norm_w)


def grouped_mm_decode(x, w13, w2, weights, ids):
    """grouped_mm_moe over the 257 stored experts and the 9 slots."""
    T = x.shape[0]
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E_STORED, dtype=torch.int32, device=DEV).index_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    tok = order // SLOTS
    h = torch._grouped_mm(x[tok], w13.transpose(1, 2), offs=offs)
    h = F.silu(h[:, :INTER]) * h[:, INTER:]
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
    out = torch.zeros(T, H, dtype=torch.float32, device=DEV)
    out.index_add_(0, tok, y.float() * weights.flatten()[order, None])
    return out.to(x.dtype)


# the block as the layer calls it (fused_moe_routed), by default and with the shared slots forced to one side
# of the SHARED_IN_ROUTE_MAX_TOKENS rule (moe/config.py): label suffix -> config by T
LAYER = "layer: norm + router GEMV + fused_moe_routed, "
LAYER_CONFIGS = {
    "default": lambda T: None,
    "shared slots kept with the routing":
        lambda T: moe_config.GEMV_T1 if T == 1 else moe_t.GemvMoeConfig(pdl_w13=True),
    "shared slots apart": lambda T: moe_config.GEMV_T1_SHARED if T == 1
    else moe_t.GemvMoeConfig(pdl_w13=True, shared_in_route=True),
}
# rows also profiled per kernel (the profiler costs ~1 s a row)
PROFILED = {"default: route + fused_moe", "default: fused_moe only", *(LAYER + k for k in LAYER_CONFIGS)}


def decode_impls(T: int, d: DecodeInputs) -> dict:
    """label -> fn(i) for call i (its own weight copy); fn.want, where set, is its fp32 reference."""
    def ours(route: bool):
        def fn(i):
            w, ids = moe_route.topk_softmax(d.logits[i], TOP_K, True, shared_slices=1) if route else d.routed[i]
            return moe_t.fused_moe(d.x[i], d.w13[i], d.w2[i], w, ids)
        return fn

    def want():
        """fp32 reference of call 0 on the same router output and normed rows."""
        logits, normed, _ = lin_t.rms_norm_linear(d.x[0], d.resid[0], d.norm_w, 1e-6, d.router[0])
        w, ids = moe_ref.topk_softmax(logits, TOP_K, True, shared_slices=1)
        return moe_ref.fused_moe(normed.float(), d.w13[0].float(), d.w2[0].float(), w, ids)

    def layer(cfg):
        """The block as the decoder layer runs it: pre-norm folded into the router GEMV (rms_norm_linear,
        released early), then fused_moe_routed on the normed rows."""
        def fn(i):
            logits, normed, _ = lin_t.rms_norm_linear(d.x[i], d.resid[i], d.norm_w, 1e-6, d.router[i])
            return moe_t.fused_moe_routed(normed, d.w13[i], d.w2[i], logits, TOP_K, True, shared_slices=1,
                                          config=cfg)
        fn.want = want
        return fn

    impls = {
        "default: route + fused_moe": ours(True),
        "default: fused_moe only": ours(False),
        "route only, default": lambda i: moe_route.topk_softmax(d.logits[i], TOP_K, True, shared_slices=1),
        "layer: norm + router GEMV only":
            lambda i: lin_t.rms_norm_linear(d.x[i], d.resid[i], d.norm_w, 1e-6, d.router[i])[0],
        "peer: torch._grouped_mm pipeline (routing excluded)":
            lambda i: grouped_mm_decode(d.x[i], d.w13[i], d.w2[i], *d.routed[i]),
    }
    for label, cfg in LAYER_CONFIGS.items():
        impls[LAYER + label] = layer(cfg(T))
    return impls


class FlushTimer:
    """Graph replays with the L2 flushed by a 256 MB read before each one (clean lines, as in a decode
    step after the previous layer's reads); median per call, and per-kernel durations from torch.profiler."""

    def __init__(self):
        self.buf = torch.zeros(64 << 20, dtype=torch.float32, device=DEV)

    def flush(self):
        torch.sum(self.buf)

    def time(self, graph, calls: int, reps: int = 60) -> float:
        evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for a, b in evs:
            self.flush()
            a.record()
            graph.replay()
            b.record()
        torch.cuda.synchronize()
        ts = sorted(a.elapsed_time(b) for a, b in evs)
        return ts[len(ts) // 2] * 1e-3 / calls

    def kernels(self, graph, calls: int, reps: int = 10) -> dict:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                self.flush()
                graph.replay()
            torch.cuda.synchronize()
        tot: dict = {}
        for e in prof.events():
            if e.device_type == DeviceType.CUDA and "reduce" not in e.name and "sum" not in e.name.lower():
                name = e.name.split("(")[0][-40:]
                tot[name] = tot.get(name, 0.0) + (e.time_range.end - e.time_range.start)
        return {k: v / (reps * calls) for k, v in tot.items()}


def decode_worker(index: int, count: int, only: str = "") -> None:
    """Compile every decode variant (T = 1 and 2 cover every specialisation) on one weight copy (those
    `only` selects, as the timed phase does)."""
    n = 0
    for T in sorted({min(T, 2) for T in DECODE_T}):
        impls = decode_impls(T, decode_inputs(T, 1))
        for label, fn in impls.items():
            if not selected(only, f"T={T} {label}"):
                continue
            n += 1
            if n % count != index:
                continue
            try:
                fn(0)
                torch.cuda.synchronize()
            except Exception as exc:  # reported again by the timed phase
                print(f"[warm {index}] T={T} {label}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        del impls
        torch.cuda.empty_cache()


def run_moe_decode(args, log, ceil, t_start: float) -> list:
    """Every row of every T, with per-kernel durations for the PROFILED rows."""
    timer = FlushTimer()
    inputs, wants, rows = {}, {}, []
    for T in DECODE_T:
        d = inputs[T] = decode_inputs(T, DECODE_CALLS)
        wants[T] = moe_ref.fused_moe(d.x[0].float(), d.w13[0].float(), d.w2[0].float(), *d.routed[0])
        torch.cuda.empty_cache()
    for T in DECODE_T:
        d = inputs[T]
        moved = d.distinct * EXPERT_BYTES + 2 * T * H * 2
        for label, fn in decode_impls(T, d).items():
            if not selected(args.only, f"T={T} {label}"):
                continue
            if time.time() - t_start > args.budget_s:
                log(f"SKIPPED (budget): T={T} {label}")
                continue
            try:
                got = fn(0)
                if hasattr(fn, "want"):
                    err = rel_err(got, fn.want())
                    torch.cuda.empty_cache()
                else:
                    err = None if label.startswith(("route only", "layer")) else rel_err(got, wants[T])
                graph = graph_of(fn, DECODE_CALLS)
                sec = timer.time(graph, DECODE_CALLS)
                kern = timer.kernels(graph, DECODE_CALLS) if label in PROFILED else {}
                del graph
            except Exception as exc:
                log(f"FAILED T={T} {label}: {type(exc).__name__}: {str(exc)[:300]}")
                log.file.write(traceback.format_exc())
                continue
            row = dict(T=T, impl=label, us=sec * 1e6, rel_err_fp32=err, kernels_us=kern, distinct_experts=d.distinct)
            if not label.startswith("route only") and "only" not in label:
                row["TBps"] = moved / sec / 1e12
                row["frac_copy"] = row["TBps"] / ceil["copy_TBps"]
            rows.append(row)
            log(json.dumps(row))
    return rows


def decode_summary(rows, ceil) -> str:
    lines = ["", f"MoE decode (copy {ceil['copy_TBps']:.2f} TB/s): us per call (graph, L2 read-flushed), "
             "TB/s (frac copy), per-kernel us per call", "",
             "| T | impl | us | TB/s (frac copy) | kernels (us) | rel err vs fp32 |", "|---|---|---|---|---|---|"]
    for r in rows:
        tb = f"{r['TBps']:.2f} ({r['frac_copy']:.0%})" if "TBps" in r else "-"
        ks = ", ".join(f"{k.lstrip('_')} {v:.1f}" for k, v in sorted(r["kernels_us"].items(), key=lambda kv: -kv[1]))
        err = f"{r['rel_err_fp32']:.1e}" if r.get("rel_err_fp32") is not None else "-"
        lines.append(f"| {r['T']} | {r['impl']} | {r['us']:.1f} | {tb} | {ks} | {err} |")
    return "\n".join(lines)


# ---- main ---------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--sweep", action="store_true", help="also time launch-config variants of our kernels")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--gpu-tests", action="store_true", help="run the gpu-marked op tests during the warm-up")
    ap.add_argument("--budget-s", type=float, default=200.0, help="skip remaining cases after this wall time")
    ap.add_argument("--warmup-s", type=float, default=90.0, help="stop warm-up workers after this wall time")
    ap.add_argument("--only", default="", help="substring filter on 'group name impl' (comma: any of several)")
    ap.add_argument("--moe-decode", action="store_true", help="only the MoE decode comparison (T = 1..8)")
    ap.add_argument("--decode-t", default="1,2,4,8", help="--moe-decode: the token counts")
    ap.add_argument("--test-k", default="", help="--gpu-tests: a pytest -k expression")
    ap.add_argument("--worker", default=None)
    ap.add_argument("--worker-of", type=int, default=1)
    args = ap.parse_args()
    DECODE_T[:] = [int(t) for t in args.decode_t.split(",")]
    if args.worker is not None:
        if args.moe_decode:
            decode_worker(int(args.worker), args.worker_of, args.only)
        else:
            worker(int(args.worker), args.worker_of, args.sweep, args.only)
        return 0

    t_start = time.time()
    log = RunLog(args.out, "attention_moe_bench.log")
    env = device_env()
    log(json.dumps(env))
    if args.workers > 0:
        warm_up(args, log)
    ceil = ceilings()
    log(json.dumps(ceil))
    if args.moe_decode:
        rows = run_moe_decode(args, log, ceil, t_start)
        with open(os.path.join(args.out, "moe_decode.json"), "w") as f:
            json.dump(dict(env=env, ceilings=ceil, results=rows), f, indent=1)
        log(decode_summary(rows, ceil))
        log(f"total {time.time() - t_start:.0f} s")
        return 0

    results = []
    for case in all_cases(args.sweep):
        label = f"{case.group} {case.name} {case.impl}"
        if not selected(args.only, label):
            continue
        if time.time() - t_start > args.budget_s:
            log(f"SKIPPED (budget): {label}")
            continue
        note = None
        try:
            fn, check = case.setup(case.calls)
            err = None if case.sweep else check()
            note = getattr(fn, "note", None)
            try:
                sec = graph_time(fn, case.calls) if case.graph else eager_time(fn, case.calls)
            except RuntimeError as exc:  # not capturable: time it eagerly and say so
                if not case.graph:
                    raise
                torch.cuda.synchronize()
                sec = eager_time(fn, case.calls)
                note = f"eager (graph capture failed: {str(exc)[:80]})"
            if case.bytes < 0:
                _, case.bytes, case.flops = moe_routing(case.meta["T"], case.calls)
        except Exception as exc:
            log(f"FAILED {label}: {type(exc).__name__}: {str(exc)[:300]}")
            log.file.write(traceback.format_exc())
            continue
        finally:
            torch.cuda.empty_cache()
        row = dict(group=case.group, name=case.name, impl=case.impl, us=sec * 1e6, rel_err=err, sweep=case.sweep,
                   note=note)
        if case.bytes:
            row["TBps"] = case.bytes / sec / 1e12
            row["frac_copy"] = row["TBps"] / ceil["copy_TBps"]
        if case.flops:
            row["TFLOPs"] = case.flops / sec / 1e12
            row["frac_mm"] = row["TFLOPs"] / ceil["bf16_TFLOPs"]
        results.append(row)
        log(json.dumps(row))

    with open(os.path.join(args.out, "attention_moe_bench.json"), "w") as f:
        json.dump(dict(env=env, ceilings=ceil, results=results), f, indent=1)
    log(summary(results, ceil))
    log(f"total {time.time() - t_start:.0f} s")
    return 0


def summary(results, ceil) -> str:
    lines = ["", f"ceilings: copy {ceil['copy_TBps']:.2f} TB/s, bf16 matmul {ceil['bf16_TFLOPs']:.0f} TFLOP/s", "",
             "| case | impl | us | TB/s (frac copy) | TFLOP/s (frac mm) | vs ours | rel err |", "|---|---|---|---|---|---|---|"]
    ours = {r["name"]: r for r in results if r["impl"].startswith("ours") and "only" not in r["impl"]}
    for r in results:
        if r["sweep"]:
            continue
        o = ours.get(r["name"])
        ratio = f"{r['us'] / o['us']:.2f}x" if o else "-"
        tb = f"{r['TBps']:.2f} ({r['frac_copy']:.0%})" if "TBps" in r else "-"
        tf = f"{r['TFLOPs']:.0f} ({r['frac_mm']:.0%})" if "TFLOPs" in r else "-"
        err = f"{r['rel_err']:.1e}" if r.get("rel_err") is not None else "-"
        impl = r["impl"] + (f" ({r['note']})" if r.get("note") else "")
        lines.append(f"| {r['group']} {r['name']} | {impl} | {r['us']:.1f} | {tb} | {tf} | {ratio} | {err} |")
    sweeps = [r for r in results if r["sweep"]]
    if sweeps:
        lines += ["", "sweep (launch-config variants):"]
        lines += [f"  {r['group']:9s} {r['name']:40s} {r['impl']:52s} {r['us']:10.1f} us" for r in sweeps]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
