"""GDN kernels against flash-linear-attention (FLA) in the same process, on the same GPU and inputs.

Qwen3-Next shape per layer: 16 key heads, 32 value heads, dk = dv = 128, bf16 activations, fp32 state.
Every time is `triton.testing.do_bench` (median, L2 flushed before each replay) around the replay of a
CUDA graph holding `calls` invocations, divided by `calls`. Decode/verify invocations inside one graph
use disjoint state slots, so no call finds its state in L2.

  prefill  1x32768, 2x16384, 4x8192, 8x1024, 32x1024, 32x1000, 8192+3x128: ns/token, ours (default), FLA
           chunk_gated_delta_rule (use_qk_l2norm_in_kernel, fp32 beta and initial state already gathered per
           sequence), our two launches alone, gdn_prefill (gates fused) and, with --sweep prefill, every Gluon chain
           the dispatcher chooses between (dispatch.CHAIN_STEP_US); the I/O floor as the fraction of the limit
  decode   B = 1, 16, 64, 256, 512: TB/s of state traffic (read + write of B fp32 states), ours vs FLA
           fused_recurrent_gated_delta_rule; plus our whole fused layer decode (gdn_decode)
  verify   T = 2, 4 tokens at B = 1, 64: gdn_verify (+ gdn_commit) vs gdn_decode at the same B
  ceilings device-to-device copy bandwidth and bf16 matmul rate, measured in the same run

Run (GPU):  PYTHONPATH=.:$FLA python benchmarks/gdn_kernels.py --out DIR [--sweep [prefill,verify]] [--workers 8]
It exits non-zero when FLA cannot be imported, unless --no-peer (our kernels alone). The warm-up phase compiles
every kernel in parallel worker processes (shared Triton cache), lets FLA autotune (cached on disk for the timed
phase) and runs the GPU tests (--gpu-tests, in --gpu-tests-groups processes, each 8k test alone); --warmup-s kills
what still runs after that many seconds, --budget-s bounds the timed phase (a timed case takes ~1 s).
"""


from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from gpu_common import RunLog, ceilings, device_env, graph_seconds  # noqa: I001  (benchmarks/ is on sys.path when run)
from deltaserve.ops.conv1d import triton as conv_t
from deltaserve.ops.gdn import dispatch, gluon_chain
from deltaserve.ops.gdn import reference as ref
from deltaserve.ops.gdn import triton_chunk as tc
from deltaserve.ops.gdn import triton_recurrent as tr
from deltaserve.ops.gdn import triton_verify as tv
from deltaserve.ops.norm import triton as norm_t

HK, HV, DK, DV = 16, 32, 128, 128
D_CONV = 2 * HK * DK + HV * DV
STATE_BYTES = HV * DK * DV * 4
SCALE = DK ** -0.5
# 32x1000: lengths off the 64-token chunk, so every sequence ends in a partial chunk (the wide prep's pointer-load
# body); 8192+3x128: one long sequence beside short prompts (a skewed batch: the transposed chain is not taken)
PREFILL = {"1x32768": [32768], "2x16384": [16384] * 2, "4x8192": [8192] * 4, "8x1024": [1024] * 8,
           "32x1024": [1024] * 32, "32x1000": [1000] * 32, "8192+3x128": [8192, 128, 128, 128]}
DECODE_B = [1, 16, 64, 256, 512]
VERIFY = [(2, 1), (2, 64), (4, 1), (4, 64)]
DEV = "cuda"
# SMs of the device the op runs on (what its default configuration reads; 132 without CUDA, as its default)
SMS = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132


def fla():
    """FLA's two ops (imported lazily: the import takes ~10 s)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


# ---- inputs -------------------------------------------------------------------------------------

def _gen(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


def prefill_inputs(lengths, seed=0):
    g = _gen(seed)
    T, N = sum(lengths), len(lengths)
    bf = torch.bfloat16
    d = dict(
        q=torch.randn(T, HK, DK, device=DEV, dtype=bf, generator=g),
        k=torch.randn(T, HK, DK, device=DEV, dtype=bf, generator=g),
        v=torch.randn(T, HV, DV, device=DEV, dtype=bf, generator=g),
        g=F.logsigmoid(torch.randn(T, HV, device=DEV, generator=g)) / 16,
        beta=torch.rand(T, HV, device=DEV, generator=g),
        a=torch.randn(T, HV, device=DEV, dtype=bf, generator=g),
        b=torch.randn(T, HV, device=DEV, dtype=bf, generator=g),
        A_log=torch.linspace(-3.0, 1.0, HV, device=DEV),
        dt_bias=torch.zeros(HV, device=DEV),
        pool=torch.randn(N, HV, DK, DV, device=DEV, generator=g) * 0.1,
        idx=torch.arange(N, dtype=torch.int32, device=DEV),
        has_init=torch.ones(N, dtype=torch.bool, device=DEV),
    )
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    d["cu"] = torch.tensor(cu, dtype=torch.int32, device=DEV)
    d["cu64"] = d["cu"].long()
    d["init"] = d["pool"].clone()
    return d


def token_inputs(B, calls, T=1, seed=1):
    """B sequences x T tokens; pools with B * calls slots (call i uses slots i*B .. i*B + B - 1)."""
    g = _gen(seed)
    bf = torch.bfloat16
    n = B * T
    S = B * calls
    d = dict(
        q=torch.randn(n, HK, DK, device=DEV, dtype=bf, generator=g),
        k=torch.randn(n, HK, DK, device=DEV, dtype=bf, generator=g),
        v=torch.randn(n, HV, DV, device=DEV, dtype=bf, generator=g),
        g=F.logsigmoid(torch.randn(n, HV, device=DEV, generator=g)) / 16,
        beta=torch.rand(n, HV, device=DEV, generator=g),
        mixed=torch.randn(n, D_CONV, device=DEV, dtype=bf, generator=g),
        z=torch.randn(n, HV, DV, device=DEV, dtype=bf, generator=g),
        a=torch.randn(n, HV, device=DEV, dtype=bf, generator=g),
        b=torch.randn(n, HV, device=DEV, dtype=bf, generator=g),
        conv_w=torch.randn(D_CONV, 4, device=DEV, dtype=bf, generator=g) * 0.5,
        A_log=torch.linspace(-3.0, 1.0, HV, device=DEV),
        dt_bias=torch.zeros(HV, device=DEV),
        norm_w=torch.ones(DV, device=DEV, dtype=bf),
        pool=torch.randn(S, HV, DK, DV, device=DEV, generator=g) * 0.1,
        conv_pool=torch.randn(S, 3, D_CONV, device=DEV, dtype=bf, generator=g),
        idx=[torch.arange(i * B, (i + 1) * B, dtype=torch.int32, device=DEV) for i in range(calls)],
        cu=torch.arange(0, n + 1, T, dtype=torch.int32, device=DEV),
    )
    d["stash"] = ref.VerifyStash.empty(n, conv_dim=D_CONV, num_k_heads=HK, head_k_dim=DK, num_v_heads=HV,
                                       head_v_dim=DV, dtype=bf, device=DEV)
    d["accepted"] = torch.full((B,), T, dtype=torch.int32, device=DEV)
    return d


def layer_kw(d):
    return dict(conv_weight=d["conv_w"], A_log=d["A_log"], dt_bias=d["dt_bias"], norm_weight=d["norm_w"],
                eps=1e-6, scale=SCALE)


# ---- measurements -------------------------------------------------------------------------------

@dataclass
class Case:
    group: str                 # prefill | decode | verify
    name: str                  # shape, e.g. "4x8192" or "B=64"
    impl: str                  # ours | fla | variant label
    calls: int
    setup: Callable            # (calls) -> fn(i)
    tokens: int = 0            # prefill tokens per call
    state_bytes: int = 0       # state bytes moved per call
    sweep: bool = False


def prefill_cases(sweep: bool) -> list[Case]:
    """Per shape ours (default) and FLA first, then our two launches alone (where the time goes), then (sweep) the
    Gluon chains the dispatcher did not pick, then gdn_prefill, so a run cut short by its time budget loses
    variants, not the main table."""
    first, parts, chains, gates = [], [], [], []
    gluon = torch.cuda.is_available() and gluon_chain.supported(torch.device(DEV))
    for name, lengths in PREFILL.items():
        T, N = sum(lengths), len(lengths)
        # the configuration `ours` runs (the Gluon chain where the device has it), so "ours: chain kernel" is its
        # chain (with the longest length, as the engine passes it: max_seqlen; SMS: the device's)
        base = tc.default_chunk_config(N, HV, DV, torch.bfloat16, k=DK, tokens=T, max_seqlen=max(lengths), sms=SMS,
                                       gluon=gluon)

        def ours(calls, lengths=lengths, cfg=None):
            d = prefill_inputs(lengths)
            return lambda i: tc.chunk_gated_delta_rule(
                d["q"], d["k"], d["v"], d["g"], d["beta"], scale=SCALE, cu_seqlens=d["cu"], ssm_state=d["pool"],
                state_indices=d["idx"], has_initial_state=d["has_init"], config=cfg, max_seqlen=max(lengths))

        def ours_gates(calls, lengths=lengths):
            d = prefill_inputs(lengths)
            return lambda i: tc.gdn_prefill(
                d["q"], d["k"], d["v"], d["a"], d["b"], A_log=d["A_log"], dt_bias=d["dt_bias"], scale=SCALE,
                cu_seqlens=d["cu"], ssm_state=d["pool"], state_indices=d["idx"], has_initial_state=d["has_init"])

        def part(calls, lengths=lengths, which="prep", cfg=base, N=N):  # N bound now, not the loop's last
            d = prefill_inputs(lengths)
            args = (d["q"], d["k"], d["v"], d["g"], d["beta"], False, None, None, SCALE, d["cu"], N, True, cfg)
            bufs = tc.launch_prep(*args)
            o = torch.empty_like(d["v"])
            if which == "prep":
                return lambda i: tc.launch_prep(*args)
            return lambda i: tc.launch_chain(d["q"], d["k"], d["v"], o, bufs, d["cu"], d["pool"], d["idx"],
                                             d["has_init"], cfg)

        def fla_chunk(calls, lengths=lengths):
            chunk, _ = fla()
            d = prefill_inputs(lengths)
            return lambda i: chunk(d["q"][None], d["k"][None], d["v"][None], d["g"][None], d["beta"][None],
                                   scale=SCALE, initial_state=d["init"], output_final_state=True,
                                   use_qk_l2norm_in_kernel=True, cu_seqlens=d["cu64"])

        first.append(Case("prefill", name, "ours", 3, ours, tokens=T))
        first.append(Case("prefill", name, "fla", 3, fla_chunk, tokens=T))
        parts.append(Case("prefill", name, "ours: prep kernel", 3, lambda c, f=part: f(c, which="prep"), tokens=T))
        parts.append(Case("prefill", name, "ours: chain kernel", 3, lambda c, f=part: f(c, which="chain"), tokens=T))
        for chain, bv in dispatch.CHAIN_STEP_US if sweep and base.gluon else ():
            if (chain, bv) != (base.chain, base.bv):
                cfg = dataclasses.replace(base, chain=chain, bv=bv)
                chains.append(Case("prefill", name, f"ours chain={chain} bv={bv}", 3,
                                   lambda c, cfg=cfg, f=ours: f(c, cfg=cfg), tokens=T, sweep=True))
        gates.append(Case("prefill", name, "ours gdn_prefill (gates fused)", 3, ours_gates, tokens=T))
    return first + parts + chains + gates


def _calls_for(B):
    return max(4, min(20, 2048 // B))


def decode_cases(sweep: bool) -> list[Case]:
    cases = []
    cfgs = [("ours", None)]
    if sweep:
        cfgs += [(f"bv{bv}/w{w}", tr.RecurrentConfig(bv=bv, num_warps=w))
                 for bv, w in [(8, 1), (16, 1), (16, 2), (32, 4), (64, 4)]]
    for B in DECODE_B:
        calls = _calls_for(B)
        sb = 2 * B * STATE_BYTES

        def ours(c, B=B, cfg=None):
            d = token_inputs(B, c)
            return lambda i: tr.fused_recurrent_gated_delta_rule(
                d["q"], d["k"], d["v"], d["g"], d["beta"], scale=SCALE, ssm_state=d["pool"], state_indices=d["idx"][i],
                config=cfg)

        def layer(c, B=B, cfg=None, norm=True):
            d = token_inputs(B, c)
            return lambda i: tr.gdn_decode(d["mixed"], d["z"], d["a"], d["b"], conv_state=d["conv_pool"],
                                           ssm_state=d["pool"], state_indices=d["idx"][i], config=cfg,
                                           gated_norm=norm, **layer_kw(d))

        def layer_unfused(c, B=B):
            d = token_inputs(B, c)

            def run(i):
                x = conv_t.causal_conv1d_update(d["mixed"], d["conv_w"], conv_state=d["conv_pool"],
                                                state_indices=d["idx"][i])
                q, k, v = x.split([HK * DK, HK * DK, HV * DV], dim=-1)
                g, beta = tr.gdn_gating(d["A_log"], d["a"], d["dt_bias"], d["b"])
                o = tr.fused_recurrent_gated_delta_rule(q.view(B, HK, DK), k.view(B, HK, DK), v.view(B, HV, DV), g,
                                                        beta, scale=SCALE, ssm_state=d["pool"],
                                                        state_indices=d["idx"][i])
                return norm_t.rms_norm_gated(o, d["z"], d["norm_w"], 1e-6)
            return run

        def fla_rec(c, B=B):
            _, rec = fla()
            d = token_inputs(B, c)
            return lambda i: rec(q=d["q"][:, None], k=d["k"][:, None], v=d["v"][:, None], g=d["g"][:, None],
                                 beta=d["beta"][:, None], scale=SCALE, initial_state=d["pool"][i * B:(i + 1) * B],
                                 output_final_state=True, use_qk_l2norm_in_kernel=True)

        for label, cfg in cfgs:
            cases.append(Case("decode", f"B={B}", label, calls, lambda c, cfg=cfg, f=ours: f(c, cfg=cfg),
                              state_bytes=sb, sweep=label != "ours"))
        cases.append(Case("decode", f"B={B}", "fla", calls, fla_rec, state_bytes=sb))
        cases.append(Case("decode", f"B={B}", "ours gdn_decode (whole layer, 2 launches)", calls, layer,
                          state_bytes=sb))
        if B <= dispatch.ONE_LAUNCH_MAX_ROWS:  # the model's small-batch form: out_proj folds the gated norm
            cases.append(Case("decode", f"B={B}", DECODE_NO_NORM, calls, lambda c, f=layer: f(c, norm=False),
                              state_bytes=sb))
        for label, cfg in TOKEN_CONFIGS if sweep else []:
            cases.append(Case("decode", f"B={B}", f"gdn_decode {label}", calls,
                              lambda c, cfg=cfg, f=layer: f(c, cfg=cfg), state_bytes=sb, sweep=True))
        cases.append(Case("decode", f"B={B}", "ours unfused layer (conv, gates, rec, norm: 4 launches)", calls,
                          layer_unfused, state_bytes=sb))
    return cases


DECODE_NO_NORM = "ours gdn_decode gated_norm=False"
VERIFY_NO_NORM = "ours gdn_verify gated_norm=False"
TOKEN_CONFIGS = [(f"bv{bv}/w{w}", tr.RecurrentConfig(bv=bv, num_warps=w))
                 for bv, w in [(8, 1), (32, 2), (64, 4)]]
VERIFY_CONFIGS = [(f"bv{bv}/w{w}", tr.RecurrentConfig(bv=bv, num_warps=w))
                  for bv, w in [(8, 1), (16, 1), (16, 2), (32, 2), (32, 4), (64, 4)]]


def verify_path_variants(B: int) -> list[tuple[str, "tr.RecurrentConfig"]]:
    """Labelled gdn_verify paths timed beside the default at small B (the one-launch regime, B * HV <= 64):
    the three-launch path and one-launch launch shapes other than the default's."""
    if B * HV > 64:
        return []
    default = dispatch.default_verify_config(B, 4 * B, HK, HV, DV, pdl=True)
    one = [(f"1-launch bv{bv}/w{w} pdl", tr.RecurrentConfig(bv=bv, num_warps=w, one_launch=True, pdl=True))
           for bv, w in [(16, 1), (8, 1), (16, 2), (32, 2), (16, 4), (32, 4)]]
    return [("3 launches", dispatch.default_tokens_config(B * HV * max(DV // 32, 1), DV))] + [
        (label, cfg) for label, cfg in one if cfg != default] + [
        ("1-launch default no pdl", dataclasses.replace(default, pdl=False, qk_prepass=False))] + [
        (f"1-launch default {'without' if default.qk_prepass else 'with'} q/k pre-kernel",
         dataclasses.replace(default, qk_prepass=not default.qk_prepass)),
        ("1-launch bv8/w1 pdl gram form", tr.RecurrentConfig(bv=8, num_warps=1, one_launch=True, pdl=True, gram=True)),
        (f"1-launch default {'without' if default.gram else 'with'} gram form",
         dataclasses.replace(default, gram=not default.gram))]


def verify_cases(sweep: bool = False) -> list[Case]:
    cases = []
    for T, B in VERIFY:
        calls = _calls_for(B)

        def verify(c, T=T, B=B, cfg=None, norm=True):
            d = token_inputs(B, c, T=T)
            return lambda i: tv.gdn_verify(d["mixed"], d["z"], d["a"], d["b"], cu_seqlens=d["cu"],
                                           conv_state=d["conv_pool"], ssm_state=d["pool"], state_indices=d["idx"][i],
                                           stash=d["stash"], config=cfg, gated_norm=norm, **layer_kw(d))

        def commit(c, T=T, B=B):
            d = token_inputs(B, c, T=T)
            tv.gdn_verify(d["mixed"], d["z"], d["a"], d["b"], cu_seqlens=d["cu"], conv_state=d["conv_pool"],
                          ssm_state=d["pool"], state_indices=d["idx"][0], stash=d["stash"], **layer_kw(d))
            return lambda i: tv.gdn_commit(d["accepted"], cu_seqlens=d["cu"], state_indices=d["idx"][i],
                                           conv_state=d["conv_pool"], ssm_state=d["pool"], stash=d["stash"])

        def fla_rec(c, T=T, B=B):
            _, rec = fla()
            d = token_inputs(B, c, T=T)
            cu = d["cu"].long()
            return lambda i: rec(q=d["q"][None], k=d["k"][None], v=d["v"][None], g=d["g"][None],
                                 beta=d["beta"][None], scale=SCALE, initial_state=d["pool"][i * B:(i + 1) * B],
                                 output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)

        name = f"T={T} B={B}"
        cases.append(Case("verify", name, "ours gdn_verify", calls, verify, state_bytes=B * STATE_BYTES))
        if B <= dispatch.ONE_LAUNCH_MAX_ROWS:  # against DECODE_NO_NORM (out_proj folds the gated norm)
            cases.append(Case("verify", name, VERIFY_NO_NORM, calls, lambda c, f=verify: f(c, norm=False),
                              state_bytes=B * STATE_BYTES))
        for label, cfg in verify_path_variants(B):  # the one-launch verify's alternatives
            cases.append(Case("verify", name, f"gdn_verify {label}", calls, lambda c, cfg=cfg, f=verify: f(c, cfg=cfg),
                              state_bytes=B * STATE_BYTES))
        for label, cfg in VERIFY_CONFIGS if sweep else []:
            cases.append(Case("verify", name, f"gdn_verify {label}", calls, lambda c, cfg=cfg, f=verify: f(c, cfg=cfg),
                              state_bytes=B * STATE_BYTES, sweep=True))
        cases.append(Case("verify", name, "ours gdn_commit (all accepted)", calls, commit,
                          state_bytes=2 * B * STATE_BYTES))
        cases.append(Case("verify", name, "fla fused_recurrent T tokens (no per-step states)", calls, fla_rec,
                          state_bytes=2 * B * STATE_BYTES))
    return cases


def all_cases(sweep: str, only: str = "", skip: str = "") -> list[Case]:
    """Every case, or those whose "group impl" contains one of the comma-separated `only` words; config
    variants for the comma-separated groups in `sweep`. Verify before decode: a run cut short by its
    time budget loses the decode rows, which earlier runs already have. `skip`: comma-separated words whose
    cases are left out."""
    groups = sweep.split(",")
    cases = prefill_cases("prefill" in groups) + verify_cases("verify" in groups) + decode_cases("decode" in groups)
    words = [w for w in only.split(",") if w]
    drop = [w for w in skip.split(",") if w]
    return [c for c in cases if (not words or any(w in f"{c.group} {c.name} {c.impl}" for w in words))
            and not any(w in f"{c.group} {c.name} {c.impl}" for w in drop)]


# ---- timing -------------------------------------------------------------------------------------

def graph_time(fn: Callable, calls: int) -> float:
    """Seconds per call: `calls` invocations captured in one CUDA graph, median replay time / calls."""
    return graph_seconds(fn, calls, warmup=25, rep=150)


# ---- warm-up workers ----------------------------------------------------------------------------

def worker(index: int, count: int, sweep: str, with_fla: bool, only: str = "", skip: str = "") -> None:
    """Compile the kernels of every count-th case (or let FLA autotune) by calling each once."""
    cases = all_cases(sweep, only, skip)
    for j, case in enumerate(cases):
        is_fla = case.impl.startswith("fla")
        if is_fla != with_fla or (not with_fla and j % count != index):
            continue
        try:
            fn = case.setup(1)
            fn(0)
            torch.cuda.synchronize()
        except Exception as exc:  # reported again (with a traceback) by the timed phase
            print(f"[warm {index}] {case.group} {case.name} {case.impl}: {type(exc).__name__}: {exc}", flush=True)
        torch.cuda.empty_cache()


def _test_groups(tests: list[str], groups: int) -> list[list[str]]:
    """Test ids in process groups: each 8k accuracy test alone (the longest), the rest dealt round-robin into
    `groups` processes (one process per test when groups is 0: a CUDA fault cannot take others down)."""
    long = [[t] for t in tests if "8k" in t]
    rest = [t for t in tests if "8k" not in t]
    if groups <= 0:
        return long + [[t] for t in rest]
    return long + [g for g in (rest[i::groups] for i in range(groups)) if g]


def warm_up(args, log, stop_at: float) -> None:
    """Compile workers, FLA's autotune and the GPU tests in parallel processes; those still running at
    `stop_at` (epoch seconds) are killed and reported."""
    t0 = time.time()
    procs = []
    base = [sys.executable, os.path.abspath(__file__), "--worker-of", str(args.workers)]
    sweep = ["--sweep", args.sweep, "--only", args.only, "--skip", args.skip]
    for i in range(args.workers):
        procs.append(("compile worker", subprocess.Popen(base + ["--worker", str(i)] + sweep)))
    if not (args.no_fla or args.no_fla_worker):
        procs.append(("fla worker", subprocess.Popen(base + ["--worker", "fla"] + sweep)))
    logs = []
    if args.gpu_tests:
        env = dict(os.environ, DELTASERVE_GPU_REPORT=os.path.join(args.out, "gpu_tests.jsonl"))
        tests = subprocess.run([sys.executable, "-m", "pytest", *args.gpu_tests_files.split(","), "--co", "-q",
                                "-p", "no:cacheprovider", "-k", args.gpu_tests_k], capture_output=True, text=True,
                               env=env).stdout.splitlines()  # one id per line (ids may hold spaces)
        log_path = os.path.join(args.out, "gpu_tests.log")
        for group in _test_groups([t for t in tests if "::" in t], args.gpu_tests_groups):
            f = open(log_path + "." + str(len(logs)), "w")
            logs.append(f)
            procs.append((" ".join(group), subprocess.Popen(
                [sys.executable, "-m", "pytest", *group, "-s", "-q", "-p", "no:cacheprovider"],
                stdout=f, stderr=subprocess.STDOUT, env=env)))
    for what, p in procs:
        try:
            p.wait(timeout=max(0.0, stop_at - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            log(f"warm-up: killed at its time limit: {what[:300]}")
    if logs:
        with open(os.path.join(args.out, "gpu_tests.log"), "w") as out:
            for f in logs:
                f.close()
                with open(f.name) as src:
                    out.write(src.read())
                os.unlink(f.name)
    log(f"warm-up (parallel compile, FLA autotune, GPU tests) {time.time() - t0:.0f} s")


# ---- timed phase: resumable child processes -----------------------------------------------------

def timed_child(args, ceil) -> int:
    """Time cases from --first on, appending one JSON line per case; exit 3 at the first failure (a CUDA
    fault poisons the context), after writing the failed index to the progress file."""
    cases = all_cases(args.sweep, args.only, args.skip)
    with_fla = not args.no_fla
    for j in range(args.first, len(cases)):
        case = cases[j]
        if case.impl.startswith("fla") and not with_fla:
            continue
        if time.time() > args.deadline:
            with open(args.results, "a") as f:
                f.write(json.dumps(dict(skipped=j, group=case.group, name=case.name, impl=case.impl)) + "\n")
            continue
        with open(args.progress, "w") as f:
            f.write(str(j))
        try:
            fn = case.setup(case.calls)
            sec = graph_time(fn, case.calls)
        except Exception as exc:
            with open(args.results, "a") as f:
                f.write(json.dumps(dict(failed=j, group=case.group, name=case.name, impl=case.impl,
                                        error=f"{type(exc).__name__}: {str(exc)[:300]}")) + "\n")
            traceback.print_exc()
            return 3
        row = dict(group=case.group, name=case.name, impl=case.impl, us=sec * 1e6)
        if case.tokens:
            row["ns_per_token"] = sec * 1e9 / case.tokens
        if case.state_bytes:
            row["state_TBps"] = case.state_bytes / sec / 1e12
            row["frac_copy"] = row["state_TBps"] / ceil["copy_TBps"]
        with open(args.results, "a") as f:
            f.write(json.dumps(row) + "\n")
        del fn
        torch.cuda.empty_cache()
    with open(args.progress, "w") as f:
        f.write(str(len(cases)))
    return 0


def timed_phase(args, env, ceil, log) -> list[dict]:
    results_path = os.path.join(args.out, "gdn_bench.jsonl")
    progress = os.path.join(tempfile.gettempdir(), f"gdn_bench_progress_{os.getpid()}.txt")
    open(results_path, "w").close()
    n_cases = len(all_cases(args.sweep, args.only, args.skip))
    first = 0
    deadline = time.time() + args.budget_s  # from the end of the warm-up: a long warm-up cannot starve it
    while first < n_cases:
        cmd = [sys.executable, os.path.abspath(__file__), "--timed-child", "--first", str(first), "--results",
               results_path, "--progress", progress, "--deadline", str(deadline), "--ceil", json.dumps(ceil)]
        cmd += ["--sweep", args.sweep, "--only", args.only, "--skip", args.skip]
        cmd += ["--no-fla"] if (args.no_fla or env["fla"] is None) else []
        with open(progress, "w") as f:
            f.write(str(first))
        lines_before = sum(1 for _ in open(results_path))
        rc = subprocess.run(cmd).returncode
        with open(progress) as f:
            reached = int(f.read().strip() or first)
        if rc == 0:
            break
        if sum(1 for _ in open(results_path)) == lines_before:
            log(f"timed child exited {rc} before finishing any case; giving up")
            break
        log(f"case {reached} failed (child exit {rc}); resuming at {reached + 1}")
        first = reached + 1
    rows = []
    with open(results_path) as f:
        for line in f:
            row = json.loads(line)
            if "failed" in row or "skipped" in row:
                log(("FAILED " if "failed" in row else "SKIPPED (budget) ") + json.dumps(row))
                continue
            rows.append(row)
            log(json.dumps(row))
    return rows


# ---- main ---------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--sweep", nargs="?", const="prefill,decode,verify", default="",
                    help="also time launch-config variants of our kernels (optionally only for these groups)")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--no-peer", "--no-fla", dest="no_fla", action="store_true",
                    help="time our kernels alone (without it a missing FLA is an error)")
    ap.add_argument("--gpu-tests", action="store_true", help="run the GPU tests (--gpu-tests-files) during the warm-up")
    ap.add_argument("--gpu-tests-k", default="", help="pytest -k expression selecting those tests")
    ap.add_argument("--gpu-tests-files", default="tests/ops/test_gpu.py",
                    help="comma-separated test files for --gpu-tests")
    ap.add_argument("--gpu-tests-groups", type=int, default=0,
                    help="pytest processes for the GPU tests besides one per 8k test (0: one per test)")
    ap.add_argument("--no-fla-worker", action="store_true",
                    help="no FLA warm-up process: a GPU test calling FLA (the 8k test) does its autotune, whose "
                         "results the timed phase then reads from the disk cache")
    ap.add_argument("--warmup-s", type=float, default=1e9,
                    help="kill warm-up processes (compiles, FLA autotune, GPU tests) still running after this")
    ap.add_argument("--budget-s", type=float, default=400.0,
                    help="seconds for the timed phase (from its start); later cases are skipped. Bound the whole "
                         "run with an outer `timeout`: every finished case is already in gdn_bench.jsonl")
    ap.add_argument("--only", default="", help="comma-separated words; keep cases whose 'group name impl' has one")
    ap.add_argument("--skip", default="", help="comma-separated words; drop cases whose 'group name impl' has one")
    ap.add_argument("--worker", default=None)
    ap.add_argument("--worker-of", type=int, default=1)
    ap.add_argument("--timed-child", action="store_true")
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--results", default="")
    ap.add_argument("--progress", default="")
    ap.add_argument("--deadline", type=float, default=0.0)
    ap.add_argument("--ceil", default="{}")
    args = ap.parse_args()
    if args.timed_child:
        return timed_child(args, json.loads(args.ceil))
    if args.worker is not None:
        if args.worker == "fla":
            worker(0, 1, args.sweep, with_fla=True, only=args.only, skip=args.skip)
        else:
            worker(int(args.worker), args.worker_of, args.sweep, with_fla=False, only=args.only, skip=args.skip)
        return 0

    t_start = time.time()
    log = RunLog(args.out, "gdn_bench.log")
    env = device_env(fla=True)
    log(json.dumps(env))
    if env["fla"] is None and not args.no_fla:
        log("flash-linear-attention is not installed (pip package fla-core): the comparison needs it; "
            "pass --no-peer to time our kernels alone")
        return 2
    warm_up(args, log, t_start + args.warmup_s)
    ceil = ceilings(warmup=25, rep=200)
    log(json.dumps(ceil))

    results = timed_phase(args, env, ceil, log)

    with open(os.path.join(args.out, "gdn_bench.json"), "w") as f:
        json.dump(dict(env=env, ceilings=ceil, results=results), f, indent=1)
    log(summary(results, ceil))
    log(f"total {time.time() - t_start:.0f} s")
    return 0


def prefill_io_bytes(lengths: list[int]) -> int:
    """Bytes a prefill must move at least: bf16 q, k, v read and o written, fp32 g and beta read, and every
    sequence's fp32 state read and written once."""
    T = sum(lengths)
    return T * (2 * (2 * HK * DK + 2 * HV * DV) + 8 * HV) + 2 * len(lengths) * STATE_BYTES


def _us_tbps(r: dict | None) -> str:
    """A timed case's cell: microseconds and, where the case has state bytes, the state traffic's TB/s."""
    if not r:
        return "-"
    return f"{r['us']:.2f} ({r['state_TBps']:.2f})" if "state_TBps" in r else f"{r['us']:.2f}"


def summary(results, ceil) -> str:
    """Markdown tables: ours vs FLA per case, with ratios and fractions of the copy ceiling."""
    by = {(r["group"], r["name"], r["impl"]): r for r in results}
    lines = ["", "I/O floor: q, k, v, gates read, o written, states read + written once, at the copy rate "
             f"({ceil['copy_TBps']:.2f} TB/s)", "",
             "| prefill | impl | ns/token | us | default / this | FLA / this | I/O floor / this |",
             "|---|---|---|---|---|---|---|"]
    for name, lengths in PREFILL.items():
        o, f = by.get(("prefill", name, "ours")), by.get(("prefill", name, "fla"))
        floor_us = prefill_io_bytes(lengths) / (ceil["copy_TBps"] * 1e12) * 1e6
        for r in [r for r in results if r["group"] == "prefill" and r["name"] == name]:
            lines.append(f"| {name} | {r['impl']} | {r['ns_per_token']:.1f} | {r['us']:.0f} | "
                         + (f"{o['us'] / r['us']:.2f}x" if o else "-") + " | "
                         + (f"{f['us'] / r['us']:.2f}x" if f else "-") + f" | {floor_us / r['us']:.1%} |")
    lines += ["", f"| decode | ours us | ours TB/s (of {ceil['copy_TBps']:.2f} copy) | FLA us | FLA TB/s | FLA / ours |"
              " gdn_decode us | unfused layer us |", "|---|---|---|---|---|---|---|---|"]
    for B in DECODE_B:
        n = f"B={B}"
        o, f = by.get(("decode", n, "ours")), by.get(("decode", n, "fla"))
        lay = by.get(("decode", n, "ours gdn_decode (whole layer, 2 launches)"))
        unf = by.get(("decode", n, "ours unfused layer (conv, gates, rec, norm: 4 launches)"))
        cell = lambda r, k, fmt: format(r[k], fmt) if r else "-"  # noqa: E731
        ratio = f"{f['us'] / o['us']:.2f}x" if (o and f) else "-"
        frac = f" ({o['frac_copy']:.0%})" if o else ""
        lines.append(f"| {n} | {cell(o, 'us', '.2f')} | {cell(o, 'state_TBps', '.2f')}{frac} | {cell(f, 'us', '.2f')} "
                     f"| {cell(f, 'state_TBps', '.2f')} | {ratio} | {cell(lay, 'us', '.2f')} "
                     f"| {cell(unf, 'us', '.2f')} |")
    # state traffic (Case.state_bytes / time): verify reads each state once, commit reads and writes it, FLA's
    # recurrence over the T tokens reads and writes it
    lines += ["", "| verify | gdn_verify us (state TB/s) | / gdn_decode at same B | gdn_commit us (state TB/s) "
              "| verify+commit / decode | FLA recurrent T tokens us (state TB/s) | FLA / gdn_verify "
              "| gated_norm=False: verify us / decode us |", "|---|---|---|---|---|---|---|---|"]
    for T, B in VERIFY:
        n = f"T={T} B={B}"
        v, c = by.get(("verify", n, "ours gdn_verify")), by.get(("verify", n, "ours gdn_commit (all accepted)"))
        f = by.get(("verify", n, "fla fused_recurrent T tokens (no per-step states)"))
        dec = by.get(("decode", f"B={B}", "ours gdn_decode (whole layer, 2 launches)"))
        r1 = f"{v['us'] / dec['us']:.2f}x" if (v and dec) else "-"
        r2 = f"{(v['us'] + c['us']) / dec['us']:.2f}x" if (v and c and dec) else "-"
        rf = f"{f['us'] / v['us']:.2f}x" if (v and f) else "-"
        vn, dn = by.get(("verify", n, VERIFY_NO_NORM)), by.get(("decode", f"B={B}", DECODE_NO_NORM))
        r3 = f"{vn['us']:.2f} / {dn['us']:.2f} = {vn['us'] / dn['us']:.2f}x" if (vn and dn) else "-"
        lines.append(f"| {n} | {_us_tbps(v)} | {r1} | {_us_tbps(c)} | {r2} | {_us_tbps(f)} | {rf} | {r3} |")
    sweeps = [r for r in results if r["group"] != "prefill" and r["impl"] not in ("ours", "fla") and "/" in r["impl"]]
    if sweeps:
        lines += ["", "sweep (launch-config variants):"]
        lines += [f"  {r['group']:8s} {r['name']:8s} {r['impl']:40s} {r['us']:10.2f} us"
                  + (f" {r['ns_per_token']:7.1f} ns/token" if "ns_per_token" in r else "") for r in sweeps]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
