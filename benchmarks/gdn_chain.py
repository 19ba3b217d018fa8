"""The chunked prefill's state kernel: the Gluon chain (deltaserve/ops/gdn/gluon_chain.py) against the Triton
TMA state kernel on the same prep buffers (H200). Checks outputs and final states against each other (and the
fp32 reference on a mixed batch), then times each state kernel alone and the prep, in CUDA-graph replay.

    PYTHONPATH=. python benchmarks/gdn_chain.py [--shapes 1x32768,4x8192] [--impls g32,ws32,ws64]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gdn_kernels as gk

from deltaserve.ops.gdn import gluon_chain as gc
from deltaserve.ops.gdn import reference as ref
from deltaserve.ops.gdn import triton_chunk as tc


def prep(d, cfg):
    return tc._launch_prep(d["q"], d["k"], d["v"], d["g"], d["beta"], False, None, None, gk.SCALE, d["cu"],
                           d["idx"].shape[0], True, cfg)


def state_tma(d, bufs, o, pool, cfg):
    tc._launch_state_tma(d["q"], o, bufs, d["cu"], pool, d["idx"], d["has_init"].view(torch.uint8), cfg)


def state_gluon(d, bufs, o, pool, impl, stages):
    """impl: "g<bv>" (one warpgroup) or "ws<bv>" (warp-specialised, bv / 2 columns per consumer); a trailing "r":
    W and K^T as register operands."""
    gc.launch_chain(d["q"], o, bufs, d["cu"], pool, d["idx"], d["has_init"].view(torch.uint8),
                    int(impl.strip("gwsr")), stages, ws=impl.startswith("ws"), a_regs=impl.endswith("r"))


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def graph_us(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            fn()
    torch.cuda.synchronize()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        e0.record()
        for _ in range(reps):
            g.replay()
        e1.record()
        torch.cuda.synchronize()
        best = min(best, e0.elapsed_time(e1) * 1e3 / reps)
    return best


def check_mixed(bvs, stages):
    """Mixed lengths (one empty), slots out of order, one padded row, initial states on some: Gluon vs TMA vs
    reference; the padded row's outputs are zeros and the slots of the padded / empty sequences untouched."""
    lengths = [1, 63, 64, 0, 65, 1000, 300, 129]
    d = gk.prefill_inputs(lengths, seed=3)
    N = len(lengths)
    d["idx"] = torch.tensor([4, 0, -1, 7, 6, 2, 1, 3], dtype=torch.int32, device="cuda")
    d["pool"] = torch.randn(9, gk.HV, gk.DK, gk.DV, device="cuda") * 0.1
    d["has_init"] = torch.tensor([1, 0, 1, 1, 1, 0, 1, 1], dtype=torch.bool, device="cuda")
    T = sum(lengths)
    cfg = tc.default_chunk_config(N, gk.HV, gk.DV, torch.bfloat16, k=gk.DK, tokens=T)
    cfg = dataclasses.replace(cfg, layout="chunk")
    bufs = prep(d, cfg)
    o_t = torch.full((T, gk.HV, gk.DV), 7.0, device="cuda", dtype=torch.bfloat16)
    p_t = d["pool"].clone()
    state_tma(d, bufs, o_t, p_t, cfg)
    o_r = torch.zeros_like(o_t).float()
    p_r = d["pool"].clone()
    o_r = ref.chunk_gated_delta_rule(d["q"].float(), d["k"].float(), d["v"].float(), d["g"], d["beta"],
                                     scale=gk.SCALE, cu_seqlens=d["cu"], ssm_state=p_r, state_indices=d["idx"],
                                     has_initial_state=d["has_init"], use_qk_l2norm_in_kernel=True)
    live = [i for i in range(N) if d["idx"][i] >= 0]
    slots = d["idx"][live].long()
    ok = True
    for bv in bvs:
        o_g = torch.full_like(o_t, 7.0)
        p_g = d["pool"].clone()
        state_gluon(d, bufs, o_g, p_g, bv, stages)
        torch.cuda.synchronize()
        pad = slice(int(d["cu"][2]), int(d["cu"][3]))
        res = dict(out_vs_tma=rel(o_g, o_t), state_vs_tma=rel(p_g[slots], p_t[slots]),
                   out_vs_ref=rel(o_g, o_r), state_vs_ref=rel(p_g[slots], p_r[slots]),
                   tma_out_vs_ref=rel(o_t, o_r), tma_state_vs_ref=rel(p_t[slots], p_r[slots]),
                   padded_rows_zero=bool((o_g[pad] == 0).all()),
                   untouched_slots=bool(torch.equal(p_g[[5, 7, 8]], d["pool"][[5, 7, 8]])),
                   finite=bool(torch.isfinite(o_g).all() and torch.isfinite(p_g).all()))
        good = (res["out_vs_tma"] < 1e-2 and res["state_vs_tma"] < 1e-4 and res["padded_rows_zero"]
                and res["untouched_slots"] and res["finite"])
        ok &= good
        print(f"mixed {bv} s{stages}: {'OK' if good else 'FAIL'} " + " ".join(
            f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()), flush=True)
    return ok


def bench(shape, bvs, stages):
    lengths = gk.PREFILL[shape]
    d = gk.prefill_inputs(lengths)
    T, N = sum(lengths), len(lengths)
    cfg = tc.default_chunk_config(N, gk.HV, gk.DV, torch.bfloat16, k=gk.DK, tokens=T)
    bufs = prep(d, cfg)
    o = torch.empty((T, gk.HV, gk.DV), device="cuda", dtype=torch.bfloat16)
    pool0 = d["pool"].clone()
    p_t = pool0.clone()
    state_tma(d, bufs, o, p_t, cfg)
    o_t = o.clone()
    us_prep = graph_us(lambda: prep(d, cfg))
    pool = pool0.clone()
    us_tma = graph_us(lambda: state_tma(d, bufs, o, pool, cfg))
    print(f"{shape}: prep {us_prep * 1e3 / T:.1f} ns/token; TMA state (bv{cfg.bv}) {us_tma * 1e3 / T:.1f} ns/token "
          f"({us_tma:.0f} us)", flush=True)
    for label, cfg_w in (("default", None), ("triton chain", dataclasses.replace(cfg, chain="triton", o_tma=False))):
        pool = pool0.clone()
        us_w = graph_us(lambda: tc.chunk_gated_delta_rule(
            d["q"], d["k"], d["v"], d["g"], d["beta"], scale=gk.SCALE, cu_seqlens=d["cu"], ssm_state=pool,
            state_indices=d["idx"], has_initial_state=d["has_init"], config=cfg_w))
        print(f"{shape}: whole op, {label}: {us_w * 1e3 / T:.1f} ns/token ({us_w:.0f} us)", flush=True)
    for bv in bvs:
        p_g = pool0.clone()
        o.zero_()
        state_gluon(d, bufs, o, p_g, bv, stages)
        torch.cuda.synchronize()
        err_o, err_s = rel(o, o_t), rel(p_g, p_t)
        pool = pool0.clone()
        us = graph_us(lambda: state_gluon(d, bufs, o, pool, bv, stages))
        print(f"{shape}: gluon chain {bv} s{stages} {us * 1e3 / T:.1f} ns/token ({us:.0f} us), "
              f"TMA / gluon {us_tma / us:.2f}x, whole op ~{(us + us_prep) * 1e3 / T:.1f} ns/token; "
              f"out vs TMA {err_o:.1e}, state vs TMA {err_s:.1e}", flush=True)


def profile(shape, bvs, stages):
    lengths = gk.PREFILL[shape]
    d = gk.prefill_inputs(lengths)
    T, N = sum(lengths), len(lengths)
    cfg = tc.default_chunk_config(N, gk.HV, gk.DV, torch.bfloat16, k=gk.DK, tokens=T)
    o = torch.empty((T, gk.HV, gk.DV), device="cuda", dtype=torch.bfloat16)
    bufs = prep(d, cfg)
    for bv in bvs:
        state_gluon(d, bufs, o, d["pool"], bv, stages)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    bufs = prep(d, cfg)
    for bv in bvs:
        state_gluon(d, bufs, o, d["pool"], bv, stages)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1x32768,4x8192")
    ap.add_argument("--impls", default="ws32r,ws64r,g32r", help="g<bv> (one warpgroup), ws<bv> (warp-specialised)")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="one prep + Gluon chain per bv on the first shape inside a profiler window (ncu)")
    args = ap.parse_args()
    bvs = args.impls.split(",")
    if args.profile:
        return profile(args.shapes.split(",")[0], bvs, args.stages)
    ok = True if args.no_check else check_mixed(bvs, args.stages)
    for shape in args.shapes.split(","):
        bench(shape, bvs, args.stages)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
