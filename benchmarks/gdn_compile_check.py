"""Compile every GDN Triton kernel for sm_90 (H100/H200) on a machine without a GPU and print each
kernel's registers, spills and shared memory (from the cubin, via the cuobjdump Triton ships).

Catches compile failures and register spills before any device time is spent. Every pointer, stride
and head count gets the launch-time divisibility-by-16 specialisation it gets on the device (tensors
16-byte aligned, strides and head counts multiples of 16), so loads become the same vectorised,
multi-buffered async copies and registers / shared memory match the H200 (e.g. the tensor-core prep:
239 registers, 64 KB). Spills are the STL stores in the SASS (ptxas reports them as a stack frame,
cuobjdump's LOCAL column stays 0).
    PYTHONPATH=. python benchmarks/gdn_compile_check.py [--sweep]
"""

from __future__ import annotations

import argparse
import inspect
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
from deltaserve.ops.gdn import triton_chain as chain_t
from deltaserve.ops.gdn import triton_chunk as chunk_t
from deltaserve.ops.gdn import triton_prep as prep_t
from deltaserve.ops.gdn import triton_recurrent as rec_t
from deltaserve.ops.gdn import triton_steps as steps_t
from deltaserve.ops.gdn import triton_verify as ver_t
from deltaserve.ops.norm import triton as norm_t

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def _sig(fn, types: dict[str, str], constexprs: dict[str, object]) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        sig[name] = "constexpr" if name in constexprs else types.get(name, "i32")
    return sig


# runtime values: never specialised (do_not_specialize, or floats)
UNSPECIALISED = ("N", "scale", "eps", "M", "s_ys", "SLOTS")


def info_serialized(ptx: str) -> bool:
    """Whether ptxas serialises the kernel's wgmma (advisory C7512: every product waited for before the next issues;
    it cost the transposed chain 1.06-1.38x of its time)."""
    if "wgmma" not in ptx:
        return False
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        log = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    return "C7512" in log.stdout + log.stderr


def compile_one(label: str, fn, types: dict[str, str], constexprs: dict[str, object], num_warps: int,
                num_stages: int = 3, maxnreg: int = 0) -> dict:
    # constexpr parameters left out take their defaults, as a launch does (ASTSource applies none: a missing one
    # compiled as a runtime value, and `if FLAG and ...` then failed or took the other branch)
    constexprs = {**{p.name: p.default for p in fn.params
                     if p.is_constexpr and p.default is not inspect.Parameter.empty}, **constexprs}
    sig = _sig(fn, types, constexprs)
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if sig[a] != "constexpr" and a not in UNSPECIALISED and not sig[a].startswith("tensordesc")}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    opts = {"num_warps": num_warps, "num_stages": num_stages, **({"maxnreg": maxnreg} if maxnreg else {})}
    t0 = time.time()
    try:
        c = triton.compile(src, target=TARGET, options=opts)
    except Exception as exc:  # report and continue with the other kernels
        print(f"{label:58s} FAILED: {type(exc).__name__}: {str(exc)[:400]}")
        return {"label": label, "ok": False}
    secs = time.time() - t0
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(c.asm["cubin"])
        path = f.name
    res = subprocess.run([CUOBJDUMP, "-res-usage", path], capture_output=True, text=True).stdout
    spills = subprocess.run([CUOBJDUMP, "-sass", path], capture_output=True, text=True).stdout.count("STL")
    os.unlink(path)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res)
    regs, stack, shared, local = (int(x) for x in m.groups()) if m else (-1, -1, -1, -1)
    ptx = c.asm["ptx"]
    info = dict(label=label, ok=True, regs=regs, stack=stack, local=local, spills=spills, smem=c.metadata.shared,
                wgmma="wgmma" in ptx, mma="mma.sync" in ptx, serialized=info_serialized(ptx), secs=secs)
    print(f"{label:66s} regs {regs:3d} spill stores {spills:4d} smem {c.metadata.shared:6d} "
          f"wgmma {int(info['wgmma'])}{' SERIALISED' if info['serialized'] else ''} mma {int(info['mma'])} "
          f"({secs:.1f}s)")
    return info


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also compile the benchmark's config variants")
    args = ap.parse_args()
    K = V = 128
    R = 2                                   # Qwen3-Next: 16 key heads, 32 value heads
    bf, f32, i32 = "*bf16", "*fp32", "*i32"
    results = []

    # chunked prefill: the two preps at the defaults' forms, the Triton chains
    desc = "tensordesc<{}[64,{}]>".format
    blocks_types = dict(q=bf, k=bf, v=bf, g=f32, beta=f32, A_log=f32, dt_bias=f32, coff=i32, cu=i32, Wb=bf, Ub=f32,
                        Pb=bf, Gb=f32, rq_b=f32, rk_b=f32, scale="fp32")
    for dims, dtype in ((128, "bf16"), (64, "bf16"), (128, "fp32")):
        exact = dtype == "fp32"
        t = dict(blocks_types, **(dict(q=f32, k=f32, v=f32, Wb=f32, Pb=f32) if exact else {}))
        results.append(compile_one(
            f"prep blocks K=V={dims} {dtype}", prep_t._prep_blocks_kernel, t,
            dict(R=R, K=dims, V=dims, BT=64, BLOCK_N=16, L2NORM=True, GATES=False,
                 QK_PREC="ieee" if exact else "native", MERGE_PREC="ieee" if exact else "tf32",
                 WU_PREC="ieee" if exact else "bf16x2"), 4))
    wide_types = dict(blocks_types, Kb=bf, Cb=f32, Lb=f32, k_desc=desc("bf16", K), q_desc=desc("bf16", K),
                      v_desc=desc("bf16", V), w_desc=desc("bf16", K), u_desc=desc("fp32", V), p_desc=desc("bf16", 64))
    # (layout, behind a Gluon chain): the Triton chain's chunk layout, the token layout, a Gluon chain's (U's factor
    # limbs, no K copy of whole chunks; where the Gluon prep does not cover the call)
    for chunked, gluon in ((True, False), (False, False), (True, True)):
        t = dict(wide_types, **(dict(Ub=bf, u_desc=desc("bf16", 64)) if gluon else {}),
                 **({} if chunked else dict(w_desc=f32, u_desc=f32, p_desc=f32)))
        results.append(compile_one(
            f"prep wide {'chunk' if chunked else 'token'} layout{' (Gluon chain)' * gluon}", prep_t._prep_wide_kernel,
            t, dict(R=R, K=K, V=V, BT=64, BLOCK_N=16, L2NORM=True, GATES=False, QK_PREC="native", WU_PREC="bf16x2",
                    CHUNKED=chunked, UT_PREC="fp16", HEADS_FIRST=True, TMA_LOAD=True, TMA_STORE=chunked,
                    U_FACTOR=gluon, K_FROM_INPUT=gluon), 4, maxnreg=prep_t.WIDE_PREP_MAXNREG))
    chain_types = dict(q=bf, k=bf, o=bf, Wb=bf, Ub=f32, Pb=bf, Gb=f32, rq_b=f32, rk_b=f32, ssm=f32, cu=i32, idx=i32,
                       has_init="*u8")
    for bv, prec in ((32, "bf16x2"), (64, "bf16x2"), (32, "ieee")):
        cfg = chunk_t.ChunkConfig(bv=bv, prec=prec)
        t = dict(chain_types, **({} if prec.startswith("bf16") else dict(q=f32, k=f32, o=f32, Wb=f32, Pb=f32)))
        results.append(compile_one(
            f"chain token layout bv={bv} prec={prec}", chain_t._chain_kernel, t,
            dict(R=R, K=K, V=V, BV=bv, BT=64, PREC=prec, STAGES=cfg.state_stages()), 4, cfg.state_stages()))
    for bv in (32, 64):
        cfg = chunk_t.ChunkConfig(bv=bv, prep="wide", layout="chunk")
        results.append(compile_one(
            f"chain chunk layout (TMA) bv={bv}", chain_t._chain_tma_kernel,
            dict(w_desc=desc("bf16", K), u_desc=desc("fp32", bv), k_desc=desc("bf16", K), q_desc=desc("bf16", K),
                 p_desc=desc("bf16", 64), Cb=f32, Lb=f32, o=bf, ssm=f32, cu=i32, coff=i32, idx=i32, has_init="*u8"),
            dict(R=R, K=K, V=V, BV=bv, BT=64, PREC="bf16x2", STAGES=cfg.state_stages()), 4, cfg.state_stages()))

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
            f"verify recurrence bv={bv} w{warps}", ver_t._verify_rec_kernel,
            dict(qn=f32, st_k=f32, vn=bf, st_g=f32, bn=f32, ssm=f32, idx=i32, cu=i32, o_tmp=bf, st_d=f32),
            dict(R=R, K=K, V=V, BV=bv), warps))
    prep_types = dict(x=bf, a=bf, b=bf, conv_w=bf, A_log=f32, dt_bias=f32, conv_state=bf, idx=i32, cu=i32, qn=f32,
                      vn=bf, st_k=f32, st_g=f32, bn=f32, st_x=bf, scale="fp32")
    results.append(compile_one("verify pre-pass", ver_t._verify_prep_kernel, prep_types,
                               dict(K=K, V=V, W=4, BLOCK_N=64), 1))
    results.append(compile_one("verify q/k pre-pass (qk_prepass) pdl", ver_t._verify_prep_kernel, prep_types,
                               dict(K=K, V=V, W=4, BLOCK_N=64, QK_ONLY=True, PDL=True, TRIGGER=True), 1))
    for verify in (False, True):
        results.append(compile_one(
            f"finish verify={int(verify)}", steps_t._finish_kernel,
            dict(o_tmp=bf, z=bf, norm_w=bf, out=bf, x=bf, conv_state=bf, idx=i32, st_x=bf, eps="fp32"),
            dict(V=V, HB=32, BD=1024, W=4, WP=4, VERIFY=verify, SIGMOID=False), 4))
    results.append(compile_one(
        "commit", ver_t._commit_kernel,
        dict(num_acc=i32, cu=i32, idx=i32, conv_state=bf, ssm=f32, st_x=bf, st_k=f32, st_g=f32, st_d=f32),
        dict(R=R, K=K, V=V, BV=32, W=4, WP=4, BD=1024), 4))
    # the one-launch decode: the layer's batch-1 forms (gated_norm=False), conv inside and conv applied
    # (rms_norm_linear_conv's output); PDL + prefetch as the default at B = 1
    dec_types = dict(x=bf, z=bf, a=bf, b=bf, conv_w=bf, A_log=f32, dt_bias=f32, norm_w=bf, conv_state=bf, ssm=f32,
                     idx=i32, o_tmp=bf, out=bf, counters=i32, scale="fp32", eps="fp32", SLOTS="i32")
    for conv, norm, bv, warps in [(True, False, 16, 1), (False, False, 16, 1), (False, True, 16, 1),
                                  (False, False, 16, 2), (False, False, 32, 2)]:
        results.append(compile_one(
            f"decode one launch conv={int(conv)} norm={int(norm)} bv={bv} w{warps} pdl", rec_t._decode_fused_kernel,
            dec_types, dict(R=R, RP=R, K=K, V=V, BV=bv, W=4, WP=4, SIGMOID=False, PDL=True, TRIGGER=True, NORM=norm,
                            CONV=conv), warps))
    # the one-launch verify (T = 2 / 4 / 8 per sequence: TB = 2 / 4 / 8), the benchmark's variants
    ver_types = dict(x=bf, z=bf, a=bf, b=bf, conv_w=bf, A_log=f32, dt_bias=f32, norm_w=bf, conv_state=bf, ssm=f32,
                     idx=i32, cu=i32, o_tmp=bf, out=bf, st_x=bf, st_k=f32, st_g=f32, st_d=f32, counters=i32,
                     scale="fp32", eps="fp32", SLOTS="i32", qn=f32)
    for tb, bv, warps, qk_in, gram in [(4, 16, 1, False, False), (2, 16, 1, False, False), (8, 16, 1, False, False),
                                       (4, 8, 1, False, False), (4, 16, 2, False, False), (4, 32, 2, False, False),
                                       (4, 128, 4, False, False), (4, 8, 1, True, False), (2, 8, 1, True, False),
                                       (8, 8, 1, True, False), (2, 8, 1, True, True), (4, 8, 1, True, True),
                                       (8, 8, 1, True, True), (4, 8, 1, False, True), (4, 16, 2, True, True)]:
        results.append(compile_one(
            f"verify one launch TB={tb} bv={bv} w{warps} pdl{' q/k in (qk_prepass)' * qk_in}{' gram' * gram}",
            ver_t._verify_fused_kernel, ver_types,
            dict(R=R, K=K, V=V, BV=bv, W=4, TB=tb, SIGMOID=False, PDL=True, TRIGGER=True, QK_IN=qk_in,
                 GRAM=gram, NORM=True), warps))
    # the input projection with the conv epilogue (rms_norm_linear_conv): 35B-A3B in_proj 2048 -> 12352 at
    # M = 1 (the norm folded, default tiles 16 x 256, 4 stages) and M = 8 (tensor cores, 64 x 128, 4 stages)
    from deltaserve.ops.linear import triton_gemv as lin_t
    gemv_types = dict(x=bf, w=bf, y=bf, r=bf, nw=bf, h=bf, s=bf, eps="fp32", cw=bf, cst=bf, cidx=i32)
    for conv, pf in ((False, False), (True, False), (True, True)):
        results.append(compile_one(
            f"gemv_fma NORM in_proj 16x256 w4 s4 conv={int(conv)} window_prefetch={int(pf)}", lin_t._gemv_fma_kernel,
            gemv_types, dict(BM=1, BN=16, BK=256, NORM=True, HAS_RES=True, ZC=True, PK=2048, PDL=True, PF=512,
                             CONV=conv, CW=4, CONV_PF=pf), 4, 4))
    for conv in (False, True):
        results.append(compile_one(
            f"gemv_dot in_proj M=8 64x128 w4 s4 conv={int(conv)}", lin_t._gemv_dot_kernel, gemv_types,
            dict(BM=16, BN=64, BK=128, IEEE=False, NORM=False, HAS_RES=False, ZC=False, PK=16, PDL=True, PF=128,
                 CONV=conv, CW=4), 4, 4))
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

    failed = [r["label"] for r in results if not r["ok"]]
    spilling = [f"{r['label']} ({r['spills']})" for r in results if r["ok"] and r["spills"]]
    print(f"\n{len(results)} kernels compiled; failed: {failed or 'none'}; "
          f"spilling (spill stores): {spilling or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
