"""gdn_decode latency at small and large batch: our fused layer op (default path, its one-launch variants,
the two-launch path) and our bare recurrence vs flash-linear-attention's fused_recurrent_gated_delta_rule,
in the same process on the same GPU.

Shapes per GDN layer (bf16 activations, fp32 state, dk = dv = 128, conv width 4):
  35B-A3B  16 key heads / 32 value heads   (Qwen3.5-35B-A3B; Qwen3-Next-80B has the same GDN dims)
  27B      16 key heads / 48 value heads   (Qwen3.5-27B: value heads 3 per key head; --shapes 27B)
B = 1, 16, 64, 256 sequences by default (--batches), one token each.

Each time is `triton.testing.do_bench` (median, L2 flushed before each replay) around the replay of a CUDA
graph holding `calls` invocations on disjoint state slots (so every call reads its state from HBM), divided
by `calls`. The slot lists of the calls are slices of one index tensor (as the engine's one slot list,
read by every layer, it stays in L2 after the first call). "ours" is the whole fused op (conv update,
gates, q/k L2 norm, delta rule, gated RMSNorm); "ours rec" and FLA are the recurrence alone (q/k/v,
log-decay and beta given; FLA's states already gathered per sequence, ours read from the pool by slot).
State traffic = read + write of B fp32 states; "frac copy" = that / time / the device-to-device copy
rate measured in the same run. With programmatic launch (PDL) a call may start once every program of
the one before has exited (no kernel here triggers its dependents earlier), as in the engine, where the
kernel before gdn_decode is the input projection.

Run (GPU): PYTHONPATH=.:$FLA FLA_FLASH_QLA=0 python benchmarks/gdn_decode_latency.py --out DIR
  [--workers 8] [--wait-for FILE]   (compile every variant in parallel workers first; --wait-for: start
  timing only once FILE exists, e.g. when GPU tests running beside the warm-up are done)

--fold: the batch-1 output-projection folds instead (bf16, B = 1; --shapes: 35B-A3B out_proj / o_proj
4096 -> 2048, 27B 6144 -> 5120): (a) gdn_decode + out_proj (linear) against gdn_decode(gated_norm=False)
+ gated_linear (the GDN gated RMSNorm in the GEMV; default and 4 tile variants), each op also alone;
(b) sigmoid_mul + o_proj against gated_linear with the attention output gate in the GEMV (4 tile
variants; not folded by default). A graph holds 16 pairs on disjoint slots and distinct weight copies
(16.8 / 63 MB each, so the weights come from HBM), each kernel a programmatic dependent of the one before
as in the engine; time per pair.

--conv: the GDN layer's decode step from its input, B = 1, 2, 4, 8 (35B-A3B; --workers compile in parallel
first, --wait-for as above): norm + in_proj GEMV + gdn_decode + out_proj as the layer runs it ("old": the
conv in gdn_decode) against the conv of the q|k|v channels in the in_proj GEMV's epilogue
(rms_norm_linear_conv + gdn_decode(conv_applied=True)); gdn_decode alone both ways (at B = 1 the bare
recurrence: issue #3's 3.5 us), the in_proj alone both ways, launch shapes of gdn_decode(conv_applied) at
B = 1, and the GEMV's window_prefetch form at B = 1. A graph holds 16 calls on disjoint slots and distinct
weight copies (50.6 MB in_proj + 16.8 MB out_proj each); time per call.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from deltaserve.ops.gdn import dispatch
from deltaserve.ops.gdn import triton_recurrent as tr

DK = DV = 128
HK = 16
W = 4
SHAPES = {"35B-A3B": 32, "27B": 48}          # value heads
BATCHES = [1, 16, 64, 256]
ONE = tr.RecurrentConfig(bv=16, num_warps=1, one_launch=True, pdl=True)
# One-launch variants timed beside the default (name -> config); tests/ops/test_gdn_recurrent.py
# REAL_ONE_LAUNCH checks each of them on the GPU.
ONE_LAUNCH_VARIANTS = {
    1: {"no pdl": dataclasses.replace(ONE, pdl=False),
        "bv8/w1": dataclasses.replace(ONE, bv=8),
        "bv16/w2": dataclasses.replace(ONE, num_warps=2),
        "bv32/w2": dataclasses.replace(ONE, bv=32, num_warps=2)},
    16: {"pdl": tr.RecurrentConfig(bv=32, num_warps=2, one_launch=True, pdl=True)},
    64: {"one launch bv32/w2": tr.RecurrentConfig(bv=32, num_warps=2, one_launch=True)},
}
DEV = "cuda"


def fla_recurrent():
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    return fused_recurrent_gated_delta_rule


@dataclass
class Case:
    shape: str
    B: int
    impl: str                              # default | two-launch | ours rec | fla | a one-launch variant's name
    config: tr.RecurrentConfig | None = None

    @property
    def hv(self) -> int:
        return SHAPES[self.shape]


def cases(shapes: list[str], batches: list[int]) -> list[Case]:
    out = []
    for shape in shapes:
        hv = SHAPES[shape]
        for B in batches:
            out += [Case(shape, B, "default"), Case(shape, B, "fla"), Case(shape, B, "ours rec")]
            if tr.default_decode_config(B, HK, hv, DV).one_launch:
                out.append(Case(shape, B, "two-launch", dispatch.default_tokens_config(B * hv * (DV // 32), DV)))
            if shape == "35B-A3B":
                out += [Case(shape, B, name, cfg) for name, cfg in ONE_LAUNCH_VARIANTS.get(B, {}).items()]
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

    slots = torch.arange(S, dtype=torch.int32, device=DEV)
    return dict(
        mixed=rn(B, dc), z=rn(B, hv, DV), a=rn(B, hv), b=rn(B, hv),
        q=rn(B, HK, DK), k=rn(B, HK, DK), v=rn(B, hv, DV),
        g=F.logsigmoid(rn(B, hv, dtype=torch.float32)) / 16, beta=torch.rand(B, hv, device=DEV, generator=g),
        conv_w=rn(dc, W, scale=0.5), A_log=torch.linspace(-3.0, 1.0, hv, device=DEV),
        dt_bias=torch.zeros(hv, device=DEV), norm_w=torch.ones(DV, device=DEV, dtype=bf),
        pool=rn(S, hv, DK, DV, dtype=torch.float32, scale=0.1), conv_pool=rn(S, W - 1, dc),
        idx=[slots[i * B:(i + 1) * B] for i in range(calls)],
    )


def make_call(case: Case, d: dict) -> Callable[[int], object]:
    B = case.B
    if case.impl == "fla":
        rec = fla_recurrent()
        return lambda i: rec(q=d["q"][:, None], k=d["k"][:, None], v=d["v"][:, None], g=d["g"][:, None],
                             beta=d["beta"][:, None], scale=DK ** -0.5, initial_state=d["pool"][i * B:(i + 1) * B],
                             output_final_state=True, use_qk_l2norm_in_kernel=True)
    if case.impl == "ours rec":
        return lambda i: tr.fused_recurrent_gated_delta_rule(
            d["q"], d["k"], d["v"], d["g"], d["beta"], scale=DK ** -0.5, ssm_state=d["pool"], state_indices=d["idx"][i])
    kw = dict(conv_weight=d["conv_w"], A_log=d["A_log"], dt_bias=d["dt_bias"], norm_weight=d["norm_w"], eps=1e-6,
              scale=DK ** -0.5, conv_state=d["conv_pool"], ssm_state=d["pool"])
    extra = {} if case.config is None else {"config": case.config}
    return lambda i: tr.gdn_decode(d["mixed"], d["z"], d["a"], d["b"], state_indices=d["idx"][i], **kw, **extra)


# ---- warm-up: compile every variant once, in parallel worker processes (shared Triton cache) -------

def compile_key(case: Case) -> tuple:
    """What decides the kernels `case` compiles: our fused op's specialise on the launch config, not on
    B (so B = 1 compiles them); FLA's on whether B is 1; our recurrence's config is picked from B."""
    if case.impl == "fla":
        return (case.shape, "fla", min(case.B, 16), None)
    if case.impl == "ours rec":  # its config changes between B = 1 and 16, not above
        return (case.shape, "ours rec", min(case.B, 16), None)
    pdl = case.impl == "default"
    cfg = case.config or tr.default_decode_config(case.B, HK, case.hv, DV, pdl=pdl)
    return (case.shape, "ours", 1, cfg)


def worker(index: int, count: int, shapes: list[str], batches: list[int]) -> None:
    mine = list(dict.fromkeys(map(compile_key, cases(shapes, batches))))
    for shape, impl, B, cfg in mine[index::count]:
        case = Case(shape, B, impl, cfg if impl == "ours" else None)
        try:
            make_call(case, inputs(case.hv, B, 1))(0)
            torch.cuda.synchronize()
        except Exception as exc:  # reported again by the timed phase
            print(f"[warm {index}] {case}: {type(exc).__name__}: {exc}", flush=True)


# ---- main -------------------------------------------------------------------------------------------

def describe(case: Case) -> str:
    cfg = case.config or tr.default_decode_config(case.B, HK, case.hv, DV, pdl=tr.has_pdl(torch.device(DEV)))
    path = "one launch" if cfg.one_launch else "two launches"
    flags = [f for f, on in (("pdl + prefetch", cfg.pdl),) if on]
    return f"{path} bv{cfg.bv}/w{cfg.num_warps}" + (f" ({', '.join(flags)})" if flags else "")


def summary(rows: list[dict], copy: float, shapes: list[str], batches: list[int]) -> str:
    by = {(r["shape"], r["B"], r["impl"]): r for r in rows}
    nan = float("nan")
    lines = []
    for shape in shapes:
        hv = SHAPES[shape]
        lines += ["", f"{shape} (HK {HK}, HV {hv}, dk = dv = {DK}); copy {copy / 1e12:.2f} TB/s", "",
                  "| B | default path | ours us/layer | TB/s (frac copy) | two-launch us | ours rec us | "
                  "FLA rec us | FLA rec / ours | FLA rec / ours rec |", "|---|---|---|---|---|---|---|---|---|"]
        for B in batches:
            o, t, r, f = (by.get((shape, B, k)) for k in ("default", "two-launch", "ours rec", "fla"))
            if not o:
                continue
            us = lambda x: x["us"] if x else nan
            lines.append(
                f"| {B} | {describe(Case(shape, B, 'default'))} | {o['us']:.2f} | {o['TBps']:.2f} "
                f"({o['frac_copy']:.0%}) | {us(t):.2f} | {us(r):.2f} | {us(f):.2f} | {us(f) / o['us']:.2f}x | "
                f"{us(f) / us(r):.2f}x |")
        variants = [r for r in rows if r["shape"] == shape and r["impl"] not in ("default", "two-launch", "ours rec",
                                                                                  "fla")]
        if variants:
            lines += ["", f"{shape} one-launch variants, us/layer", "", "| B | variant | config | us | vs default |",
                      "|---|---|---|---|---|"]
            for r in variants:
                d = by.get((shape, r["B"], "default"))
                lines.append(f"| {r['B']} | {r['impl']} | {r['config']} | {r['us']:.2f} | "
                             f"{r['us'] / d['us'] if d else nan:.2f}x |")
    return "\n".join(lines)


# ---- --fold: the output-projection folds at B = 1 ------------------------------------------------------

FOLD_CALLS = 16
HIDDEN = {"35B-A3B": 2048, "27B": 5120}      # out_proj / o_proj: value heads * 128 (= attention heads * 256) -> H


def fold_cases(shape: str = "35B-A3B") -> dict[str, Callable[[dict], Callable[[int], object]]]:
    """name -> (inputs -> per-call function) for the --fold timings."""
    from deltaserve.ops.activation import triton as act_t
    from deltaserve.ops.linear import triton as lin_t

    def decode(d, i, **kw):
        return tr.gdn_decode(d["mixed"], d["z"], d["a"], d["b"], state_indices=d["idx"][i], conv_weight=d["conv_w"],
                             A_log=d["A_log"], dt_bias=d["dt_bias"], norm_weight=d["norm_w"], eps=1e-6,
                             scale=DK ** -0.5, conv_state=d["conv_pool"], ssm_state=d["pool"], **kw)

    wide = dataclasses.replace(tr.default_decode_config(1, HK, SHAPES[shape], DV, pdl=True), bv=32, num_warps=2)
    C = lin_t.LinearConfig
    tiles = {"n1 k4096 s1": C(block_n=1, block_k=4096, warps=4, stages=1),   # the plain GEMV's M = 1 tiles
             "n2 k2048 s2": C(block_n=2, block_k=2048, warps=4, stages=2),
             "n4 k1024 s3": C(block_n=4, block_k=1024, warps=4, stages=3),   # the norm fold's default here
             "n8 k512 s3": C(block_n=8, block_k=512, warps=4, stages=3)}
    z2 = lambda d: d["z"].view(1, -1)  # noqa: E731

    def folded(d, i, decode_kw=None, **kw):
        o = decode(d, i, gated_norm=False, **(decode_kw or {}))
        return lin_t.gated_linear(o.view(1, -1), z2(d), d["w"][i], norm_weight=d["norm_w"], activation="silu", **kw)

    cases = {
        "gdn_decode (normed)": lambda d: lambda i: decode(d, i),
        "gdn_decode (gated_norm=False)": lambda d: lambda i: decode(d, i, gated_norm=False),
        "out_proj alone (linear)": lambda d: lambda i: lin_t.linear(d["o"], d["w"][i]),
        "gated_linear alone (norm, default tiles)": lambda d: lambda i: lin_t.gated_linear(
            d["o"], z2(d), d["w"][i], norm_weight=d["norm_w"], activation="silu"),
        "(a) unfolded: gdn_decode + linear": lambda d: lambda i: lin_t.linear(decode(d, i).view(1, -1), d["w"][i]),
        "(a) folded: gdn_decode(gated_norm=False) + gated_linear": lambda d: lambda i: folded(d, i),
        "(a) folded, decode bv32/w2": lambda d: lambda i: folded(d, i, {"config": wide}),
    }
    for name, cfg in tiles.items():
        cases[f"(a) folded, gated_linear {name}"] = lambda d, cfg=cfg: lambda i: folded(d, i, config=cfg)
    cases.update({
        "sigmoid_mul alone": lambda d: lambda i: act_t.sigmoid_mul(d["o"], d["gate"]),
        "(b) unfolded: sigmoid_mul + linear": lambda d: lambda i: lin_t.linear(
            act_t.sigmoid_mul(d["o"], d["gate"]), d["w"][i]),
        "(b) gated_linear, default (two launches)": lambda d: lambda i: lin_t.gated_linear(d["o"], d["gate"],
                                                                                          d["w"][i]),
    })
    for name, cfg in tiles.items():
        cases[f"(b) folded: gated_linear {name}"] = lambda d, cfg=cfg: lambda i: lin_t.gated_linear(
            d["o"], d["gate"], d["w"][i], config=cfg)
    return cases


def fold_main(args, log) -> int:
    for shape in args.shapes.split(","):
        fold_shape(args, log, shape)
    return 0


def fold_shape(args, log, shape: str) -> None:
    hv, OUT_N = SHAPES[shape], HIDDEN[shape]
    d = inputs(hv, 1, FOLD_CALLS)
    g = torch.Generator(device=DEV).manual_seed(3)
    K = hv * DV
    d["w"] = [(torch.randn(OUT_N, K, device=DEV, generator=g) * K ** -0.5).to(torch.bfloat16)
              for _ in range(FOLD_CALLS)]
    d["o"] = torch.randn(1, K, device=DEV, generator=g).to(torch.bfloat16)
    d["gate"] = torch.randn(1, 2 * K, device=DEV, generator=g).to(torch.bfloat16)[:, K:]   # a strided slice
    d["norm_w"] = (torch.rand(DV, device=DEV, generator=g) + 0.5).to(torch.bfloat16)
    copy = ceilings(matmul=False, warmup=25)["copy_TBps"] * 1e12
    log(f"copy {copy / 1e12:.3f} TB/s")
    rows = []
    for name, make in fold_cases(shape).items():
        try:
            sec = graph_seconds(make(d), FOLD_CALLS, rep=args.rep_ms)
        except Exception as exc:
            log(f"FAILED {name}: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        rows.append(dict(shape=shape, case=name, us=sec * 1e6))
        log(json.dumps(rows[-1]))
    by = {r["case"]: r["us"] for r in rows}
    w_bytes = OUT_N * K * 2
    lines = ["", f"{shape}, B = 1, bf16; out_proj / o_proj {K} -> {OUT_N} ({w_bytes / 1e6:.1f} MB, "
             f"{w_bytes / copy * 1e6:.2f} us at the copy rate {copy / 1e12:.2f} TB/s); us per call (pair) in a "
             f"graph of {FOLD_CALLS}", "",
             "| case | us |", "|---|---|"] + [f"| {r['case']} | {r['us']:.2f} |" for r in rows]
    pairs = [("(a) unfolded: gdn_decode + linear", k) for k in by if k.startswith("(a) folded")]
    pairs += [("(b) unfolded: sigmoid_mul + linear", k) for k in by if k.startswith("(b) folded")]
    for un, fo in pairs:
        if un in by:
            lines.append(f"{fo}: saves {by[un] - by[fo]:.2f} us per layer against {un} ({by[un] / by[fo]:.3f}x)")
    log("\n".join(lines))
    with open(os.path.join(args.out, f"gdn_fold_{shape}.json"), "w") as f:
        json.dump(dict(copy_TBps=copy / 1e12, results=rows), f, indent=1)


# ---- --conv: the conv of the q|k|v channels in the input projection's epilogue --------------------------

CONV_BATCHES = (1, 2, 4, 8)
CONV_CALLS = 16
# gdn_decode(conv_applied=True) launch shapes timed beside the default at B = 1 (bv16/w1, PDL + prefetch)
CONV_DECODE_VARIANTS = {"bv16/w2": dataclasses.replace(ONE, num_warps=2), "bv32/w2": dataclasses.replace(ONE, bv=32,
                                                                                                       num_warps=2),
                        "bv8/w1": dataclasses.replace(ONE, bv=8), "no pdl": dataclasses.replace(ONE, pdl=False)}


def conv_inputs(shape: str, B: int, calls: int) -> dict:
    """inputs() plus a pre-norm layer's operands: x, the residual and the norm weight [B, H], `calls` distinct
    in_proj [D + HV*V + 2 HV, H] and out_proj [H, HV*V] weights (the weights of a call come from HBM)."""
    hv, H = SHAPES[shape], HIDDEN[shape]
    d = inputs(hv, B, calls)
    g = torch.Generator(device=DEV).manual_seed(5)
    bf = torch.bfloat16
    N = 2 * HK * DK + 2 * hv * DV + 2 * hv
    d["w_in"] = [(torch.randn(N, H, device=DEV, generator=g) * H ** -0.5).to(bf) for _ in range(calls)]
    d["w_out"] = [(torch.randn(H, hv * DV, device=DEV, generator=g) * (hv * DV) ** -0.5).to(bf) for _ in range(calls)]
    d["x"], d["res"] = (torch.randn(2, B, H, device=DEV, generator=g) * 2).to(bf).unbind(0)
    d["ln"] = (torch.randn(H, device=DEV, generator=g) * 0.3).to(bf)
    d["norm_w"] = (torch.rand(DV, device=DEV, generator=g) + 0.5).to(bf)
    return d


def conv_layer(d: dict, i: int, B: int, hv: int, fold: bool, cfg: tr.RecurrentConfig | None = None,
               window_prefetch: bool = False):
    """The GDN layer's decode step from its input as the layer runs it: norm + in_proj (rms_norm_linear, or
    with the conv: rms_norm_linear_conv), gdn_decode (gated_norm=False at B = 1, conv_applied with the fold),
    out_proj (gated_linear with the norm folded at B = 1, else linear)."""
    from deltaserve.ops.linear import triton as lin_t

    dc = 2 * HK * DK + hv * DV
    idx = d["idx"][i]
    if fold:
        y = lin_t.rms_norm_linear_conv(d["x"], d["res"], d["ln"], 1e-6, d["w_in"][i], conv_weight=d["conv_w"],
                                       conv_state=d["conv_pool"], state_indices=idx,
                                       window_prefetch=window_prefetch)[0]
    else:
        y = lin_t.rms_norm_linear(d["x"], d["res"], d["ln"], 1e-6, d["w_in"][i])[0]
    mixed, z2, b, a = y.split([dc, hv * DV, hv, hv], dim=-1)
    o = tr.gdn_decode(mixed, z2.view(B, hv, DV), a, b, conv_weight=d["conv_w"], A_log=d["A_log"],
                      dt_bias=d["dt_bias"], norm_weight=d["norm_w"], eps=1e-6, scale=DK ** -0.5,
                      conv_state=d["conv_pool"], ssm_state=d["pool"], state_indices=idx, gated_norm=B > 1,
                      conv_applied=fold, **({} if cfg is None else {"config": cfg}))
    if B == 1:
        return lin_t.gated_linear(o.view(1, -1), z2, d["w_out"][i], norm_weight=d["norm_w"], activation="silu")
    return lin_t.linear(o.view(B, -1), d["w_out"][i])


def conv_cases(shape: str) -> list[tuple[int, str, Callable[[dict], Callable[[int], object]]]]:
    """(B, name, inputs -> per-call function) for the --conv timings."""
    from deltaserve.ops.linear import triton as lin_t

    hv = SHAPES[shape]

    def decode(d, i, B, conv_applied, gated_norm, cfg=None):
        return tr.gdn_decode(d["mixed"], d["z"], d["a"], d["b"], state_indices=d["idx"][i], conv_weight=d["conv_w"],
                             A_log=d["A_log"], dt_bias=d["dt_bias"], norm_weight=d["norm_w"], eps=1e-6,
                             scale=DK ** -0.5, conv_state=d["conv_pool"], ssm_state=d["pool"], gated_norm=gated_norm,
                             conv_applied=conv_applied, **({} if cfg is None else {"config": cfg}))

    out = []
    for B in CONV_BATCHES:
        out += [(B, "layer, old", lambda d, B=B: lambda i: conv_layer(d, i, B, hv, False)),
                (B, "layer, conv in in_proj", lambda d, B=B: lambda i: conv_layer(d, i, B, hv, True)),
                (B, "gdn_decode, old", lambda d, B=B: lambda i: decode(d, i, B, False, B > 1)),
                (B, "gdn_decode, conv_applied", lambda d, B=B: lambda i: decode(d, i, B, True, B > 1))]
    out += [(1, "in_proj alone: rms_norm_linear", lambda d: lambda i: lin_t.rms_norm_linear(
                d["x"], d["res"], d["ln"], 1e-6, d["w_in"][i])),
            (1, "in_proj + conv: rms_norm_linear_conv", lambda d: lambda i: lin_t.rms_norm_linear_conv(
                d["x"], d["res"], d["ln"], 1e-6, d["w_in"][i], conv_weight=d["conv_w"], conv_state=d["conv_pool"],
                state_indices=d["idx"][i]))]
    # the GEMV's window loads after its weight stream, prefetched to L2 before its wait (no registers held)
    out += [(1, "in_proj + conv, window prefetch", lambda d: lambda i: lin_t.rms_norm_linear_conv(
                d["x"], d["res"], d["ln"], 1e-6, d["w_in"][i], conv_weight=d["conv_w"], conv_state=d["conv_pool"],
                state_indices=d["idx"][i], window_prefetch=True)),
            (1, "layer, conv in in_proj, window prefetch",
             lambda d: lambda i: conv_layer(d, i, 1, hv, True, window_prefetch=True)),
            (1, "layer, conv in in_proj, window prefetch, decode bv32/w2",
             lambda d: lambda i: conv_layer(d, i, 1, hv, True, CONV_DECODE_VARIANTS["bv32/w2"], True))]
    for name, cfg in CONV_DECODE_VARIANTS.items():
        out += [(1, f"gdn_decode, conv_applied, {name}",
                 lambda d, cfg=cfg: lambda i: decode(d, i, 1, True, False, cfg)),
                (1, f"layer, conv in in_proj, decode {name}",
                 lambda d, cfg=cfg: lambda i: conv_layer(d, i, 1, hv, True, cfg))]
    return out


def conv_main(args) -> int:
    shape = args.shapes.split(",")[0]
    hv = SHAPES[shape]
    if args.worker is not None:   # warm-up: compile this worker's share of the cases once
        for B, name, make in conv_cases(shape)[args.worker::args.workers]:
            try:
                make(conv_inputs(shape, B, 1))(0)
                torch.cuda.synchronize()
            except Exception as exc:  # reported again by the timed phase
                print(f"[warm {args.worker}] B={B} {name}: {type(exc).__name__}: {exc}", flush=True)
        return 0
    t0 = time.time()
    log = RunLog(args.out, "gdn_conv.log")
    log(json.dumps(device_env()))
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--conv", "--worker", str(i), "--workers",
                               str(args.workers), "--shapes", shape]) for i in range(args.workers)]
    for p in procs:
        p.wait()
    log(f"warm-up (parallel compile) {time.time() - t0:.0f} s")
    deadline = time.time() + 300
    while args.wait_for and not os.path.exists(args.wait_for) and time.time() < deadline:
        time.sleep(0.5)
    log(f"timed phase starts at {time.time() - t0:.0f} s")
    copy = ceilings(matmul=False, warmup=25)["copy_TBps"] * 1e12
    log(f"copy {copy / 1e12:.3f} TB/s")
    rows, inputs_of = [], {}
    for B, name, make in conv_cases(shape):
        if B not in inputs_of:
            inputs_of.clear()
            torch.cuda.empty_cache()
            inputs_of[B] = conv_inputs(shape, B, CONV_CALLS)
        try:
            sec = graph_seconds(make(inputs_of[B]), CONV_CALLS, rep=args.rep_ms)
        except Exception as exc:
            log(f"FAILED B={B} {name}: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        rows.append(dict(shape=shape, B=B, case=name, us=sec * 1e6))
        log(json.dumps(rows[-1]))
    by = {(r["B"], r["case"]): r["us"] for r in rows}
    N = 2 * HK * DK + 2 * hv * DV + 2 * hv
    w_bytes = (N + hv * DV) * HIDDEN[shape] * 2
    lines = ["", f"{shape}, bf16, graph of {CONV_CALLS} calls on disjoint slots and weight copies, L2 flushed, PDL "
             f"chain; layer weights in_proj + out_proj {w_bytes / 1e6:.1f} MB = {w_bytes / copy * 1e6:.2f} us at "
             f"{copy / 1e12:.2f} TB/s; us per call", "", "| B | case | us |", "|---|---|---|"]
    lines += [f"| {r['B']} | {r['case']} | {r['us']:.2f} |" for r in rows]
    for B in CONV_BATCHES:
        for old, new in (("layer, old", "layer, conv in in_proj"), ("gdn_decode, old", "gdn_decode, conv_applied"),
                         ("layer, old", "layer, conv in in_proj, window prefetch")):
            if (B, old) in by and (B, new) in by:
                lines.append(f"B={B} {new}: {by[B, old] - by[B, new]:+.2f} us saved against {old} "
                             f"({by[B, old] / by[B, new]:.3f}x)")
    if (1, "gdn_decode, conv_applied") in by:
        lines.append(f"issue #3 (gdn_decode <= 3.5 us at B = 1): {by[1, 'gdn_decode, conv_applied']:.2f} us")
    log("\n".join(lines))
    with open(os.path.join(args.out, f"gdn_conv_{shape}.json"), "w") as f:
        json.dump(dict(copy_TBps=copy / 1e12, results=rows), f, indent=1)
    log(f"total {time.time() - t0:.0f} s")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--wait-for", default="", help="start the timed phase once this file exists (max 300 s)")
    ap.add_argument("--rep-ms", type=int, default=40)
    ap.add_argument("--shapes", default="35B-A3B", help="comma-separated: 35B-A3B,27B")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--no-peer", "--no-fla", dest="no_fla", action="store_true",
                    help="time our kernels alone (without it a missing FLA is an error)")
    ap.add_argument("--worker", type=int, default=None)
    ap.add_argument("--fold", action="store_true", help="time the B = 1 output-projection folds (module docstring)")
    ap.add_argument("--conv", action="store_true", help="time the conv in the input projection (module docstring)")
    args = ap.parse_args()
    if args.conv:
        return conv_main(args)
    if args.fold:
        log = RunLog(args.out, "gdn_fold.log")
        log(json.dumps(device_env()))
        return fold_main(args, log)
    shapes = args.shapes.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    if args.worker is not None:
        worker(args.worker, args.workers, shapes, batches)
        return 0
    t0 = time.time()
    log = RunLog(args.out, "gdn_decode_latency.log")
    env = device_env(fla=not args.no_fla)
    env.setdefault("fla", None)
    log(json.dumps(env))
    if env["fla"] is None and not args.no_fla:
        log("flash-linear-attention is not installed (pip package fla-core): the comparison needs it; "
            "pass --no-peer to time our kernels alone")
        return 2
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", str(i), "--workers",
                               str(args.workers), "--shapes", args.shapes, "--batches", args.batches])
             for i in range(args.workers)]
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
    log(f"copy {copy / 1e12:.3f} TB/s")
    rows = []
    for case in cases(shapes, batches):
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
                   frac_copy=state / sec / copy,
                   config=describe(case) if case.impl not in ("fla", "ours rec") else "")
        rows.append(row)
        log(json.dumps(row))
    torch.cuda.empty_cache()
    with open(os.path.join(args.out, "gdn_decode_latency.json"), "w") as f:
        json.dump(dict(env=env, copy_TBps=copy / 1e12, results=rows), f, indent=1)
    log(summary(rows, copy, shapes, batches))
    log(f"total {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
