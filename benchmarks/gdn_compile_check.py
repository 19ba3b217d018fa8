"""Compile every GDN Triton kernel for sm_90 (H100/H200) on a machine without a GPU and print each
kernel's registers, spills and shared memory (from the cubin, via the cuobjdump Triton ships).

Catches compile failures and register spills before any device time is spent. Shared memory printed
here is a lower bound: without the launch-time divisibility specialisation fewer loads become
multi-buffered async copies (the bv64 / 3-stage state kernel shows 124 KB here, 239 KB on the H200).
    PYTHONPATH=. python benchmarks/gdn_compile_check.py [--warps-sweep]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from deltaserve.ops.conv1d import triton as conv_t
from deltaserve.ops.gdn import triton_chunk as chunk_t
from deltaserve.ops.gdn import triton_recurrent as rec_t
from deltaserve.ops.norm import triton as norm_t

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def _sig(fn, types: dict[str, str], constexprs: dict[str, object]) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        sig[name] = "constexpr" if name in constexprs else types.get(name, "i32")
    return sig


def compile_one(label: str, fn, types: dict[str, str], constexprs: dict[str, object], num_warps: int,
                num_stages: int = 3) -> dict:
    src = ASTSource(fn=fn, signature=_sig(fn, types, constexprs), constexprs=constexprs)
    t0 = time.time()
    try:
        c = triton.compile(src, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages})
    except Exception as exc:  # report and continue with the other kernels
        print(f"{label:58s} FAILED: {type(exc).__name__}: {str(exc)[:400]}")
        return {"label": label, "ok": False}
    secs = time.time() - t0
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(c.asm["cubin"])
        path = f.name
    res = subprocess.run([CUOBJDUMP, "-res-usage", path], capture_output=True, text=True).stdout
    os.unlink(path)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res)
    regs, stack, shared, local = (int(x) for x in m.groups()) if m else (-1, -1, -1, -1)
    ptx = c.asm["ptx"]
    info = dict(label=label, ok=True, regs=regs, stack=stack, local=local, smem=c.metadata.shared,
                wgmma="wgmma" in ptx, mma="mma.sync" in ptx, secs=secs)
    print(f"{label:58s} regs {regs:3d} local {local:5d} smem {c.metadata.shared:6d} "
          f"wgmma {int(info['wgmma'])} mma {int(info['mma'])} ({secs:.1f}s)")
    return info


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also compile the benchmark's config variants")
    args = ap.parse_args()
    K = V = 128
    R = 2                                   # Qwen3-Next: 16 key heads, 32 value heads
    bf, f32, i32 = "*bf16", "*fp32", "*i32"
    results = []

    # chunked prefill
    prep_types = dict(q=bf, k=bf, v=bf, g=f32, beta=f32, A_log=f32, dt_bias=f32, coff=i32, cu=i32, Wb=bf, Ub=f32,
                      Pb=bf, Gb=f32, Tb=f32, Bb=f32, rq_b=f32, rk_b=f32, scale="fp32")
    for gates in (False, True):
        for warps in ([1, 2, 4] if args.sweep else [2]):
            for split in (True, False):
                t = dict(prep_types, **({"g": bf, "beta": bf} if gates else {}))
                results.append(compile_one(
                    f"chunk_prep gates={int(gates)} split={int(split)} w{warps}", chunk_t._chunk_prep_kernel, t,
                    dict(R=R, K=K, V=V, BT=64, BLOCK_N=16, L2NORM=True, GATES=gates, QK_PREC="native",
                         UT_PREC="tf32x3", WU_PREC="tf32", SPLIT=split, P_IN_WU=False), warps))
    for warps in ([2, 4, 8] if args.sweep else [4]):
        for p_in_wu in (False, True):
            results.append(compile_one(
                f"chunk_wu p_in_wu={int(p_in_wu)} w{warps}", chunk_t._chunk_wu_kernel,
                dict(q=bf, k=bf, v=bf, coff=i32, cu=i32, Wb=bf, Ub=f32, Pb=bf, Gb=f32, Tb=f32, Bb=f32, rq_b=f32,
                     rk_b=f32, scale="fp32"),
                dict(R=R, K=K, V=V, BT=64, BLOCK_N=16, WU_PREC="tf32", P_IN_WU=p_in_wu, L2NORM=True,
                     QK_PREC="native"), warps))
    state_types = dict(q=bf, k=bf, o=bf, Wb=bf, Ub=f32, Pb=bf, Gb=f32, rq_b=f32, rk_b=f32, ssm=f32,
                       cu=i32, idx=i32, has_init="*u8")
    variants = [(32, "bf16x2", 4, 3), (32, "bf16", 4, 3), (32, "tf32", 4, 2)]
    if args.sweep:
        variants += [(16, "bf16x2", 4, 2), (64, "bf16x2", 4, 2), (32, "bf16x2", 8, 2), (32, "bf16x2", 4, 3),
                     (64, "bf16x2", 8, 2)]
    for bv, prec, warps, stages in variants:
        t = dict(state_types, **({} if prec.startswith("bf16") else {"Wb": f32, "Pb": f32}))
        results.append(compile_one(
            f"chunk_state bv={bv} prec={prec} w{warps} s{stages}", chunk_t._chunk_state_kernel, t,
            dict(R=R, K=K, V=V, BV=bv, BT=64, PREC=prec, STAGES=stages), warps, stages))

    # token kernels
    for bv, warps in ([(8, 1), (16, 2), (32, 4), (64, 4)] if args.sweep else [(16, 2), (32, 4)]):
        results.append(compile_one(
            f"recurrent bv={bv} w{warps}", rec_t._recurrent_kernel,
            dict(q=bf, k=bf, v=bf, g=f32, beta=f32, o=bf, ssm=f32, idx=i32, scale="fp32"),
            dict(R=R, K=K, V=V, BV=bv, L2NORM=True), warps))
    tok_types = dict(x=bf, a=bf, b=bf, conv_w=bf, A_log=f32, dt_bias=f32, conv_state=bf, ssm=f32, idx=i32,
                     o_tmp=bf, scale="fp32")
    for bv, warps in [(8, 1), (16, 2), (32, 2), (32, 4)]:
        results.append(compile_one(f"decode tokens bv={bv} w{warps}", rec_t._tokens_kernel, tok_types,
                                   dict(R=R, K=K, V=V, BV=bv, W=4), warps))
        results.append(compile_one(
            f"verify recurrence bv={bv} w{warps}", rec_t._verify_rec_kernel,
            dict(qn=f32, st_k=f32, vn=bf, st_g=f32, bn=f32, ssm=f32, idx=i32, cu=i32, o_tmp=bf, st_d=f32),
            dict(R=R, K=K, V=V, BV=bv), warps))
    results.append(compile_one(
        "verify pre-pass", rec_t._verify_prep_kernel,
        dict(x=bf, a=bf, b=bf, conv_w=bf, A_log=f32, dt_bias=f32, conv_state=bf, idx=i32, cu=i32, qn=f32, vn=bf,
             st_k=f32, st_g=f32, bn=f32, scale="fp32"), dict(K=K, V=V, W=4, BLOCK_N=64), 1))
    for verify in (False, True):
        results.append(compile_one(
            f"finish verify={int(verify)}", rec_t._finish_kernel,
            dict(o_tmp=bf, z=bf, norm_w=bf, out=bf, x=bf, conv_state=bf, idx=i32, st_x=bf, eps="fp32"),
            dict(V=V, HB=32, BD=1024, W=4, WP=4, VERIFY=verify, SIGMOID=False), 4))
    results.append(compile_one(
        "commit", rec_t._commit_kernel,
        dict(num_acc=i32, cu=i32, idx=i32, conv_state=bf, ssm=f32, st_x=bf, st_k=f32, st_g=f32, st_d=f32),
        dict(R=R, K=K, V=V, BV=32, W=4, WP=4, BD=1024), 4))
    results.append(compile_one(
        "gating", rec_t._gating_kernel, dict(A_log=f32, a=bf, dt_bias=f32, b=bf, g=f32, beta=f32),
        dict(BH=32, BT=32), 4))

    # conv and norms
    results.append(compile_one(
        "conv1d_fwd", conv_t._conv_fwd_kernel,
        dict(x=bf, w=bf, y=bf, conv_state=bf, coff=i32, cu=i32, idx=i32, has_init="*u8"),
        dict(W=4, WP=4, BT=64, BD=128, BLOCK_N=16, SILU=True), 4))
    results.append(compile_one(
        "conv1d_update", conv_t._conv_update_kernel, dict(x=bf, w=bf, y=bf, conv_state=bf, idx=i32),
        dict(W=4, WP=4, BD=1024, SILU=True), 4))
    results.append(compile_one(
        "rms_norm_gated", norm_t._rms_norm_gated_kernel, dict(x=bf, z=bf, w=bf, y=bf, eps="fp32"),
        dict(BR=16, BN=128, SIGMOID=False), 4))
    results.append(compile_one(
        "rms_norm", norm_t._rms_norm_kernel, dict(x=bf, r=bf, w=bf, y=bf, xs=bf, eps="fp32"),
        dict(BN=2048, RESIDUAL=True, ZERO_CENTERED=True), 8))

    bad = [r["label"] for r in results if not r["ok"] or r.get("local", 0) > 0]
    print(f"\n{len(results)} kernels compiled; failed or spilling: {bad or 'none'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
