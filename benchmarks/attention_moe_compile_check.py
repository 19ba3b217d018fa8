"""Compile the paged-attention and MoE Triton kernels for sm_90 (H100/H200) on a machine without a GPU and
print registers, spills and shared memory per kernel and launch config (reuses gdn_compile_check's helper).
The one-pass MoE kernels are compiled with the launch-time alignment of the real shapes, and each
configuration's programs per SM are checked against its registers (its grid must be resident at once).

    PYTHONPATH=. python benchmarks/attention_moe_compile_check.py
    PYTHONPATH=. python benchmarks/attention_moe_compile_check.py --fp32-attention   # the fp32 default tiles only
    PYTHONPATH=. python benchmarks/attention_moe_compile_check.py --moe-router   # the router GEMV + routing tail
        (exits 1 if one fails to compile or needs more shared memory than an sm_90 block has)
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from gdn_compile_check import CUOBJDUMP, TARGET, _sig, compile_one, info_serialized
from triton.compiler import ASTSource

from deltaserve.ops.attention import triton as attn_t
from deltaserve.ops.linear import triton as lin_t
from deltaserve.ops.moe import triton as moe_t
from deltaserve.ops.moe import triton_routing as moe_route

SM90_SMEM_BYTES = 232448      # the most shared memory one block may use on sm_90


def compile_aligned(label: str, fn, types: dict[str, str], constexprs: dict, num_warps: int, num_stages: int = 3,
                    aligned: tuple[str, ...] = ()) -> dict:
    """compile_one with the launch-time specialisation of the real shapes: every pointer and the integer
    arguments in `aligned` marked divisible by 16 (vector loads; without it the registers come out ~2x). Constexpr
    parameters left out take their defaults, as a launch does (compile_one's rule: `gemv_fma NORM router` failed to
    compile once the kernel gained CONV / CONV_PF, passed as runtime values)."""
    constexprs = {**{p.name: p.default for p in fn.params
                     if p.is_constexpr and p.default is not inspect.Parameter.empty}, **constexprs}
    sig = _sig(fn, types, constexprs)
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in fn.arg_names
             if sig[n].startswith("*") or n in aligned}
    try:
        c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs), target=TARGET,
                           options={"num_warps": num_warps, "num_stages": num_stages})
    except Exception as exc:  # report and continue with the other kernels
        print(f"{label:58s} FAILED: {type(exc).__name__}: {str(exc)[:400]}")
        return {"label": label, "ok": False}
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(c.asm["cubin"])
        path = f.name
    res = subprocess.run([CUOBJDUMP, "-res-usage", path], capture_output=True, text=True).stdout
    os.unlink(path)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res)
    regs, local = (int(m.group(1)), int(m.group(4))) if m else (-1, -1)
    # resident programs per SM from registers alone (65536 per SM, 64 warps)
    per_sm = min(64 // num_warps, 65536 // max(1, regs * 32 * num_warps))
    serialized = info_serialized(c.asm["ptx"])
    print(f"{label:58s} regs {regs:3d} local {local:5d} smem {c.metadata.shared:6d} -> {per_sm} per SM by registers"
          f"{' (wgmma SERIALISED by ptxas)' if serialized else ''}")
    return dict(label=label, ok=True, regs=regs, local=local, smem=c.metadata.shared, per_sm=per_sm,
                serialized=serialized)


def one_pass_kernels() -> list[dict]:
    """The one-pass decode kernels for every configuration the benchmark times, at the 35B-A3B shape
    (9 slots): the programs a config asks per SM must fit by registers, or the grid runs in two waves."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from attention_moe_ops import ONE_PASS_SWEEP

    bf, f32, i64 = "*bf16", "*fp32", "*i64"
    out = []
    cfgs = {"default (ONE_PASS_T1)": moe_t.ONE_PASS_T1, **ONE_PASS_SWEEP}
    for label, c in cfgs.items():
        r = compile_aligned(f"one_pass {label}", moe_t._one_pass_kernel, dict(x=bf, w13=bf, w2=bf, ids=i64, part=f32),
                            dict(TOP_K=9, CPA=512 // c.granule, G=c.granule, LP=c.rows, BK=c.block_k, BN=c.block_n,
                                 PDL=c.pdl), c.warps, c.stages,
                            aligned=("H", "I", "s_x", "s_we", "s_wn", "s_w2e", "s_w2n"))
        if r["ok"] and r["per_sm"] < c.programs_per_sm:
            print(f"  ^ asks {c.programs_per_sm} programs per SM")
            r["ok"] = False
        out.append(r)
        out.append(compile_aligned(
            f"one_pass_combine {c.combine_cols} cols w{c.combine_warps}", moe_t._one_pass_combine_kernel,
            dict(part=f32, weights=f32, out=bf), dict(TOP_K=9, CPA=512 // c.granule,
                                                       CPAP=triton.next_power_of_2(512 // c.granule),
                                                       LPG=c.rows // c.granule, BH=c.combine_cols, PDL=c.pdl),
            c.combine_warps, aligned=("H", "s_w", "s_o")))
    return out


def gemv_kernels() -> list[dict]:
    """The decode GEMV kernels (w13, w2 + combine) of the default configurations at T = 1 and T >= 2, at the
    35B-A3B shape (9 slots, H 2048, I 512, bf16), with their programs per SM."""
    bf, f32, i64 = "*bf16", "*fp32", "*i64"
    out = []
    for T in (1, 2):
        c = moe_t.default_moe_config(T, 9, 257, 2048, 512, pdl=True)
        out.append(compile_aligned(f"gemv_w13 T={T} default", moe_t._gemv_w13_kernel,
                                   dict(x=bf, w13=bf, ids=i64, inter=bf),
                                   dict(TOP_K=9, BN=c.block_n1, BK=c.block_k1, PDL=c.pdl, WAIT=c.pdl_w13),
                                   c.warps1, c.stages, aligned=("H", "I", "s_x", "s_we", "s_wn")))
        out.append(compile_aligned(f"gemv_w13_routed T={T} default", moe_t._gemv_w13_routed_kernel,
                                   dict(x=bf, logits=bf, w13=bf, ids=i64, weights=f32, inter=bf),
                                   dict(K=8, M=1, EP=256, RENORM=True, BN=c.block_n1, BK=c.block_k1, PDL=c.pdl,
                                        WAIT=c.pdl_w13),
                                   c.warps1, c.stages, aligned=("H", "I", "s_x", "s_we", "s_wn")))
        types = dict(inter=bf, w2=bf, ids=i64, weights=f32, out=bf)
        if c.all_experts:
            out.append(compile_aligned(f"gemv_w2_all T={T} default", moe_t._gemv_w2_all_kernel, {**types, "part": f32},
                                       dict(TOP_K=9, KP=16, BN=c.block_n2, BK=c.block_k2, PDL=c.pdl, SLOTS=9, MP=0),
                                       c.warps2,
                                       c.stages, aligned=("H", "I", "s_we", "s_wn", "s_w", "s_o")))
        else:
            out.append(compile_aligned(f"gemv_w2_combine T={T} default", moe_t._gemv_w2_combine_kernel, types,
                                       dict(TOP_K=9, BN=c.block_n2, BK=c.block_k2, ONE_STEP=c.block_k2 >= 512,
                                            TRIGGER=True), c.warps2, c.stages,
                                       aligned=("H", "I", "s_we", "s_wn", "s_w", "s_o")))
    out += shared_variant_kernels()
    return out


def shared_variant_kernels() -> list[dict]:
    """The kernels of the shared-slot variants at the 35B-A3B shape (top-8 + 1 shared slice, H 2048, I 512)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from attention_moe_ops import SHARED_T1, SHARED_TN

    bf, f32, i64 = "*bf16", "*fp32", "*i64"
    out = []
    variants = {**{f"T=1 {k}": c for k, c in SHARED_T1.items()}, **{f"T>=2 {k}": c for k, c in SHARED_TN.items()}}
    for rows in sorted({c.shared_rows for c in variants.values()}):
        out.append(compile_aligned(f"route_shared rows={rows}", moe_route._route_shared_kernel,
                                   dict(logits=bf, weights=f32, ids=i64, x=bf, w13=bf, h=bf),
                                   dict(K=8, M=1, KP=16, EP=256, BT=1, RENORM=True, PDL=True, WAIT=True, R=rows,
                                        HB=2048), 1, aligned=("H", "I", "s_x", "s_we", "s_wn")))
    for label, c in variants.items():
        out.append(compile_aligned(f"gemv_w13_split {label}", moe_t._gemv_w13_split_kernel,
                                   dict(x=bf, w13=bf, ids=i64, inter=bf, w2=bf, weights=f32, part=f32),
                                   dict(SLOTS=9, K=8, M=1, BN=c.block_n1, BK=c.block_k1, PDL=c.pdl, WAIT=c.pdl_w13,
                                        PRE=c.shared_first, W2S=c.shared_w2, R2=c.shared_w2_rows, IB=512),
                                   c.warps1, c.stages, aligned=("H", "I", "s_x", "s_we", "s_wn", "s_w2e", "s_w2n")))
    for label, c in variants.items():
        if c.shared_w2:
            out.append(compile_aligned(f"gemv_w2_all routed slots + shared partial {label}", moe_t._gemv_w2_all_kernel,
                                       dict(inter=bf, w2=bf, ids=i64, weights=f32, out=bf, part=f32),
                                       dict(TOP_K=8, KP=8, BN=c.block_n2, BK=c.block_k2, PDL=c.pdl, SLOTS=9, MP=1),
                                       c.warps2, c.stages, aligned=("H", "I", "s_we", "s_wn", "s_w", "s_o")))
    return out


# the router-with-routing GEMV's variants the benchmark times: label -> (LinearConfig, route_keys)
_ROUTER = lin_t.default_prenorm_config(1, 257, 2048)
ROUTER_ROUTE_CONFIGS = {"default tiles, keys": (_ROUTER, True), "default tiles, two reductions": (_ROUTER, False),
                        "4 warps, keys": (dataclasses.replace(_ROUTER, warps=4), True)}


def router_route_kernels() -> list[dict]:
    """The pre-norm router GEMV at one token (35B-A3B: 257 rows incl. the shared gate, K 2048, bf16): the
    plain kernel rms_norm_linear runs, and rms_norm_route's kernel with the routing tail (top-8 + 1 shared
    slice) for each launch variant the benchmark times."""
    bf, f32, i32, i64 = "*bf16", "*fp32", "*i32", "*i64"
    out = []
    c = _ROUTER
    out.append(compile_aligned(f"gemv_fma NORM router {c.block_n}x{c.block_k} w{c.warps}", lin_t._gemv_fma_kernel,
                               dict(x=bf, w=bf, y=bf, r=bf, nw=bf, h=bf, s=bf, eps="fp32", cw=bf, cst=bf, cidx=i32),
                               dict(BM=1, BN=c.block_n, BK=c.block_k, NORM=True, HAS_RES=True, ZC=True, PK=2048,
                                    PDL=True, PF=512), c.warps, c.stages,
                               aligned=("K", "s_xm", "s_wn", "s_ym", "s_rm")))
    for label, (c, keys) in ROUTER_ROUTE_CONFIGS.items():
        out.append(compile_aligned(
            f"gemv_norm_route {label} {c.block_n}x{c.block_k} w{c.warps}", lin_t._gemv_norm_route_kernel,
            dict(x=bf, w=bf, y=bf, r=bf, nw=bf, h=bf, s=bf, counter=i32, weights=f32, ids=i64),
            dict(BN=c.block_n, BK=c.block_k, HAS_RES=True, ZC=True, PK=2048, TOP_K=8, SLICES=1, KP=16, EP=256,
                 RENORM=True, KEYS=keys, PDL=True, PF=512), c.warps, c.stages, aligned=("K", "s_wn")))
    return out


def fp32_attention_defaults() -> int:
    """Compile the default fp32 tiles (decode and prefill, 35B-A3B heads, head_dim 256) and check their
    shared memory: the bf16 tiles in fp32 need more than a block has."""
    f32, i32 = "*fp32", "*i32"
    types = dict(q=f32, cache=f32, cu=i32, seq_lens=i32, tables=i32, out=f32, part_ml=f32, part_acc=f32,
                 qk_scale="fp32")
    bad = []
    for label, T, N in (("decode", 4, 4), ("prefill", 4096, 2)):
        cfg = attn_t.default_attention_config(T, N, 16, 2, 256, torch.device("cpu"), dtype=torch.float32)
        r = compile_one(f"attention fp32 {label} {cfg}", attn_t._attention_kernel, types,
                        dict(NH=16, NKV=2, D=256, G=8, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                             SPLIT=cfg.num_splits > 1, MIN_SPLIT=cfg.min_split, IEEE=True),
                        cfg.num_warps, cfg.num_stages)
        if not r["ok"] or r["smem"] > SM90_SMEM_BYTES:
            bad.append(label)
    print(f"fp32 default tiles over the sm_90 limit or failing: {bad}")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fp32-attention", action="store_true", help="only the fp32 default attention tiles")
    ap.add_argument("--moe-gemv", action="store_true", help="only the MoE decode GEMV kernels")
    ap.add_argument("--moe-router", action="store_true", help="only the router GEMV (with the routing tail)")
    args = ap.parse_args()
    if args.fp32_attention:
        return fp32_attention_defaults()
    if args.moe_gemv or args.moe_router:
        results = gemv_kernels() if args.moe_gemv else router_route_kernels()
        failed = [r["label"] for r in results if not r["ok"]]
        print(f"\n{len(results)} kernels, {len(failed)} failed: {failed}")
        return 1 if failed else 0
    bf, f32, i32, i64 = "*bf16", "*fp32", "*i32", "*i64"
    results = []
    # Qwen3.5-35B-A3B attention: 16 query heads, 2 KV heads, head_dim 256 (G = 8); 27B: 24 / 4 (G = 6)
    attn_types = dict(q=bf, cache=bf, cu=i32, seq_lens=i32, tables=i32, out=bf, part_ml=f32, part_acc=f32,
                      qk_scale="fp32")
    for nh, nkv in ((16, 2), (24, 4)):
        g = nh // nkv
        for label, bm, bn, splits, warps, stages in (
                ("decode", 16, 32, 8, 4, 3), ("decode", 16, 64, 8, 4, 3), ("decode", 16, 64, 8, 4, 2),
                ("decode", 16, 128, 8, 8, 2),
                ("prefill", 64, 32, 1, 4, 2), ("prefill", 64, 32, 1, 8, 2), ("prefill", 64, 64, 1, 8, 2),
                ("prefill", 128, 32, 1, 8, 2), ("prefill", 128, 64, 1, 8, 2)):
            results.append(compile_one(
                f"attention {nh}/{nkv} {label} bm={bm} bn={bn} w{warps} s{stages}", attn_t._attention_kernel,
                attn_types, dict(NH=nh, NKV=nkv, D=256, G=g, BLOCK_M=bm, BLOCK_N=bn, SPLIT=splits > 1, MIN_SPLIT=256,
                                 IEEE=False), warps, stages))
    results.append(compile_one("merge_splits", attn_t._merge_splits_kernel, dict(part_ml=f32, part_acc=f32, out=bf),
                               dict(NH=16, SP=16, BD=256, D=256), 4))
    results.append(compile_one("store_kv", attn_t._store_kv_kernel, dict(k=bf, v=bf, cache=bf, slots=i64),
                               dict(NKV=2, D=256, BH=2), 4))
    # MoE, Qwen3.5-35B-A3B: E 256, top-8, H 2048, I 512
    for wait in (False, True):
        results.append(compile_one(f"route wait={int(wait)}", moe_route._route_kernel,
                                   dict(logits=bf, weights=f32, ids=i64),
                                   dict(K=8, M=1, KP=16, EP=256, BT=1, RENORM=True, PDL=True, WAIT=wait), 1))
    results += one_pass_kernels()
    results += gemv_kernels()
    results += router_route_kernels()
    for fused in (True, False):
        results.append(compile_one(
            f"moe_offsets fused={int(fused)}", moe_t._moe_offsets_kernel,
            dict(topk_ids=i64, chunk_counts=i32, chunk_base=i32, sorted_ids=i32, block_expert=i32),
            dict(C=1024 if not fused else 512, EB=512, BM=16, BB=16, FUSED=fused), 4))
    results.append(compile_one("moe_count", moe_t._moe_count_kernel, dict(topk_ids=i64, chunk_counts=i32),
                               dict(C=1024, EB=512), 4))
    results.append(compile_one("moe_scatter", moe_t._moe_scatter_kernel,
                               dict(topk_ids=i64, chunk_base=i32, sorted_ids=i32), dict(C=1024, EB=512), 4))
    gemm_types = dict(x=bf, w13=bf, inter=bf, sorted_ids=i32, block_expert=i32, w2=bf, y=bf)
    for bm, bn1, bk1, bn2, bk2, w1, w2, st in (
            (16, 32, 256, 64, 256, 4, 4, 3), (16, 64, 128, 64, 128, 4, 4, 3), (16, 64, 256, 128, 128, 4, 4, 4),
            (32, 64, 128, 64, 128, 4, 4, 3), (64, 64, 64, 128, 64, 4, 8, 3), (64, 128, 64, 128, 64, 8, 8, 3),
            (128, 64, 64, 128, 64, 8, 8, 3)):
        results.append(compile_one(f"moe_w13 bm={bm} bn={bn1} bk={bk1} w{w1} s{st}", moe_t._w13_kernel, gemm_types,
                                   dict(TOP_K=8, BM=bm, BN=bn1, BK=bk1, IEEE=False), w1, st))
        results.append(compile_one(f"moe_w2 bm={bm} bn={bn2} bk={bk2} w{w2} s{st}", moe_t._w2_kernel, gemm_types,
                                   dict(BM=bm, BN=bn2, BK=bk2, IEEE=False), w2, st))
    results.append(compile_one("moe_combine", moe_t._combine_kernel, dict(y=bf, weights=f32, out=bf),
                               dict(TOP_K=8, BH=1024), 4))
    failed = [r["label"] for r in results if not r["ok"]]
    spills = [r["label"] for r in results if r["ok"] and r["local"] > 0]
    print(f"\n{len(results)} kernels, {len(failed)} failed, {len(spills)} with local memory (spills): {spills}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
