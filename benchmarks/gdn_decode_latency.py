"""gdn_decode latency at small and large batch: our one-launch and two-launch paths vs flash-linear-attention's
fused_recurrent_gated_delta_rule, in the same process on the same GPU.

Shapes per GDN layer (bf16 activations, fp32 state, dk = dv = 128, conv width 4):
  35B-A3B  16 key heads / 32 value heads   (Qwen3.5-35B-A3B; Qwen3-Next-80B has the same GDN dims)
  27B      16 key heads / 48 value heads   (Qwen3.5-27B: value heads 3 per key head)
B = 1, 2, 4, 8, 16, 64, 256 sequences, one token each.

Each time is `triton.testing.do_bench` (median, L2 flushed before each replay) around the replay of a CUDA
graph holding `calls` invocations on disjoint state slots (so every call reads its state from HBM), divided
by `calls`. Ours is the whole fused op (conv update, gates, q/k L2 norm, delta rule, gated RMSNorm); FLA is
its recurrence alone (q/k/v, log-decay and beta given, states already gathered per sequence), as in
benchmarks/gdn_kernels.py. State traffic = read + write of B fp32 states; "frac copy" = that / time / the
device-to-device copy rate measured in the same run.

Run (GPU): PYTHONPATH=.:$FLA FLA_FLASH_QLA=0 python benchmarks/gdn_decode_latency.py --out DIR
  [--workers 8] [--wait-for FILE]   (compile every variant in parallel workers first; --wait-for: start
  timing only once FILE exists, e.g. when GPU tests running beside the warm-up are done)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_common import RunLog, ceilings, device_env, graph_seconds  # noqa: I001  (benchmarks/ is on sys.path when run)
from deltaserve.ops.gdn import triton_recurrent as tr

DK = DV = 128
HK = 16
W = 4
SHAPES = {"35B-A3B": 32, "27B": 48}          # value heads
BATCHES = [1, 2, 4, 8, 16, 64, 256]
SWEEP = [(8, 1), (16, 1), (32, 1), (32, 2), (64, 4), (128, 4)]   # one-launch (bv, num_warps) candidates
SWEEP_27B = [(16, 1), (32, 2)]
SWEEP_B = [1, 2, 4, 8, 16, 64]
DEV = "cuda"


def fla_recurrent():
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    return fused_recurrent_gated_delta_rule


@dataclass
class Case:
    shape: str
    B: int
    impl: str                              # default | two-launch | one-launch bvX/wY | fla
    config: tr.RecurrentConfig | None = None

    @property
    def hv(self) -> int:
        return SHAPES[self.shape]


def cases() -> list[Case]:
    out = []
    for shape in SHAPES:
        for B in BATCHES:
            out += [Case(shape, B, "default"), Case(shape, B, "fla"),
                    Case(shape, B, "two-launch", tr.default_tokens_config(B * SHAPES[shape] * (DV // 32), DV))]
            sweep = SWEEP if shape == "35B-A3B" else SWEEP_27B
            if B in SWEEP_B:
                out += [Case(shape, B, f"one-launch bv{bv}/w{w}", tr.RecurrentConfig(bv, w, one_launch=True))
                        for bv, w in sweep]
    return out


def calls_for(B: int) -> int:
    return max(8, min(32, 2048 // B))


def inputs(hv: int, B: int, calls: int, seed: int = 1) -> dict:
    """One token for each of B sequences; pools of B * calls slots (call i uses slots i*B .. i*B + B - 1)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    bf = torch.bfloat16
    dc = 2 * HK * DK + hv * DV
    S = B * calls

    def rn(*shape, dtype=bf, scale=1.0):
        return torch.randn(*shape, device=DEV, dtype=dtype, generator=g) * scale

    return dict(
        mixed=rn(B, dc), z=rn(B, hv, DV), a=rn(B, hv), b=rn(B, hv),
        q=rn(B, HK, DK), k=rn(B, HK, DK), v=rn(B, hv, DV),
        g=F.logsigmoid(rn(B, hv, dtype=torch.float32)) / 16, beta=torch.rand(B, hv, device=DEV, generator=g),
        conv_w=rn(dc, W, scale=0.5), A_log=torch.linspace(-3.0, 1.0, hv, device=DEV),
        dt_bias=torch.zeros(hv, device=DEV), norm_w=torch.ones(DV, device=DEV, dtype=bf),
        pool=rn(S, hv, DK, DV, dtype=torch.float32, scale=0.1), conv_pool=rn(S, W - 1, dc),
        idx=[torch.arange(i * B, (i + 1) * B, dtype=torch.int32, device=DEV) for i in range(calls)],
    )


def make_call(case: Case, d: dict) -> Callable[[int], object]:
    if case.impl == "fla":
        rec = fla_recurrent()
        B = case.B
        return lambda i: rec(q=d["q"][:, None], k=d["k"][:, None], v=d["v"][:, None], g=d["g"][:, None],
                             beta=d["beta"][:, None], scale=DK ** -0.5, initial_state=d["pool"][i * B:(i + 1) * B],
                             output_final_state=True, use_qk_l2norm_in_kernel=True)
    kw = dict(conv_weight=d["conv_w"], A_log=d["A_log"], dt_bias=d["dt_bias"], norm_weight=d["norm_w"], eps=1e-6,
              scale=DK ** -0.5, conv_state=d["conv_pool"], ssm_state=d["pool"])
    extra = {} if case.config is None else {"config": case.config}
    return lambda i: tr.gdn_decode(d["mixed"], d["z"], d["a"], d["b"], state_indices=d["idx"][i], **kw, **extra)


# ---- warm-up: compile every variant once, in parallel worker processes (shared Triton cache) -------

def compile_case(case: Case) -> Case:
    """A B = 1 case compiling the kernels `case` runs (they specialise on the launch config, not on B)."""
    if case.impl == "fla":
        return Case(case.shape, 1, "fla")
    cfg = case.config or tr.default_decode_config(case.B, HK, case.hv, DV)
    return Case(case.shape, 1, case.impl, cfg)


def worker(index: int, count: int) -> None:
    mine = list(dict.fromkeys((c.shape, c.impl if c.impl == "fla" else "", c.config)
                              for c in map(compile_case, cases())))
    for shape, impl, cfg in mine[index::count]:
        case = Case(shape, 1, impl or "ours", cfg)
        try:
            make_call(case, inputs(case.hv, 1, 1))(0)
            torch.cuda.synchronize()
        except Exception as exc:  # reported again by the timed phase
            print(f"[warm {index}] {case}: {type(exc).__name__}: {exc}", flush=True)


# ---- main -------------------------------------------------------------------------------------------

def summary(rows: list[dict], copy: float) -> str:
    by = {(r["shape"], r["B"], r["impl"]): r for r in rows}
    lines = []
    for shape, hv in SHAPES.items():
        lines += ["", f"{shape} (HK {HK}, HV {hv}, dk = dv = {DK}); copy {copy / 1e12:.2f} TB/s", "",
                  "| B | default path | ours us/layer | TB/s (frac copy) | two-launch us | FLA recurrence us | "
                  "FLA / ours | two-launch / ours |", "|---|---|---|---|---|---|---|---|"]
        for B in BATCHES:
            o, t, f = (by.get((shape, B, k)) for k in ("default", "two-launch", "fla"))
            if not o:
                continue
            cfg = tr.default_decode_config(B, HK, hv, DV)
            path = "one launch" if cfg.one_launch else "two launches"
            lines.append(
                f"| {B} | {path} bv{cfg.bv}/w{cfg.num_warps} | {o['us']:.2f} | {o['TBps']:.2f} ({o['frac_copy']:.0%}) | "
                f"{t['us'] if t else float('nan'):.2f} | {f['us'] if f else float('nan'):.2f} | "
                f"{f['us'] / o['us'] if f else float('nan'):.2f}x | {t['us'] / o['us'] if t else float('nan'):.2f}x |")
        sweep = [k for k in dict.fromkeys(r["impl"] for r in rows if r["shape"] == shape)
                 if k.startswith("one-launch")]
        if sweep:
            lines += ["", f"{shape} one-launch sweep, us/layer", "",
                      "| B | " + " | ".join(sweep) + " |", "|---|" + "---|" * len(sweep)]
            for B in SWEEP_B:
                vals = [by.get((shape, B, k)) for k in sweep]
                lines.append(f"| {B} | " + " | ".join(f"{v['us']:.2f}" if v else "-" for v in vals) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--wait-for", default="", help="start the timed phase once this file exists (max 300 s)")
    ap.add_argument("--rep-ms", type=int, default=40)
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--worker", type=int, default=None)
    args = ap.parse_args()
    if args.worker is not None:
        worker(args.worker, args.workers)
        return 0
    t0 = time.time()
    log = RunLog(args.out, "gdn_decode_latency.log")
    env = device_env(fla=not args.no_fla)
    env.setdefault("fla", None)
    log(json.dumps(env))
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", str(i), "--workers",
                               str(args.workers)]) for i in range(args.workers)]
    if env["fla"]:
        fla_recurrent()  # its import takes seconds: overlap it with the compiles
    for p in procs:
        p.wait()
    log(f"warm-up (parallel compile) {time.time() - t0:.0f} s")
    deadline = time.time() + 300
    while args.wait_for and not os.path.exists(args.wait_for) and time.time() < deadline:
        time.sleep(0.5)
    log(f"timed phase starts at {time.time() - t0:.0f} s")
    copy = ceilings(matmul=False, warmup=25)["copy_TBps"] * 1e12
    rows = []
    for case in cases():
        if case.impl == "fla" and not env["fla"]:
            continue
        calls = calls_for(case.B)
        try:
            d = inputs(case.hv, case.B, calls)
            sec = graph_seconds(make_call(case, d), calls, rep=args.rep_ms)
        except Exception as exc:
            log(f"FAILED {case}: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        del d
        state = 2 * case.B * case.hv * DK * DV * 4
        row = dict(shape=case.shape, B=case.B, impl=case.impl, us=sec * 1e6, TBps=state / sec / 1e12,
                   frac_copy=state / sec / copy)
        rows.append(row)
        log(json.dumps(row))
    torch.cuda.empty_cache()
    with open(os.path.join(args.out, "gdn_decode_latency.json"), "w") as f:
        json.dump(dict(env=env, copy_TBps=copy / 1e12, results=rows), f, indent=1)
    log(summary(rows, copy))
    log(f"total {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
