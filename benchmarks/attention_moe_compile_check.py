"""Compile the paged-attention and MoE Triton kernels for sm_90 (H100/H200) on a machine without a GPU and
print registers, spills and shared memory per kernel and launch config (reuses gdn_compile_check's helper).
The MoE decode GEMV kernels are compiled with the launch-time alignment of the real shapes.

    PYTHONPATH=. python benchmarks/attention_moe_compile_check.py
    PYTHONPATH=. python benchmarks/attention_moe_compile_check.py --fp32-attention   # the fp32 default tiles only
    PYTHONPATH=. python benchmarks/attention_moe_compile_check.py --moe-gemv     # the MoE decode GEMV kernels
        (exits 1 if one fails to compile or needs more shared memory than an sm_90 block has)
"""

from __future__ import annotations

import argparse
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

from deltaserve.ops.attention import config as attn_config
from deltaserve.ops.attention import triton_merge as attn_merge
from deltaserve.ops.attention import triton_paged as attn_paged
from deltaserve.ops.attention import triton_prologue as attn_prologue
from deltaserve.ops.moe import config as moe_config
from deltaserve.ops.moe import triton_align as moe_align
from deltaserve.ops.moe import triton_gemv as moe_gemv
from deltaserve.ops.moe import triton_grouped as moe_grouped
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


def gemv_kernels() -> list[dict]:
    """The decode GEMV kernels of the default configurations at T = 1 and T = 2, at the 35B-A3B shape
    (top-8 + 1 shared slot, H 2048, I 512, bf16), with their programs per SM: fused_moe's (the shared slot
    with the routed ones) and fused_moe_routed's on Hopper (the shared slot set apart from the routing)."""
    bf, f32, i64 = "*bf16", "*fp32", "*i64"
    out = []
    for T in (1, 2):
        c = moe_config.default_moe_config(T, 9, 257, 2048, 512, pdl=True)
        out.append(compile_aligned(f"gemv_w13 T={T} default", moe_gemv._gemv_w13_kernel,
                                   dict(x=bf, w13=bf, ids=i64, inter=bf),
                                   dict(TOP_K=9, BN=c.block_n1, BK=c.block_k1, PDL=c.pdl, WAIT=c.pdl_w13),
                                   c.warps1, c.stages, aligned=("H", "I", "s_x", "s_we", "s_wn")))
        out += _w2_kernels(f"T={T} default", c, run=9)
        c = moe_config.default_moe_config(T, 9, 257, 2048, 512, pdl=True, shared_slices=1)
        out.append(compile_aligned(f"route_shared T={T}", moe_route._route_shared_kernel,
                                   dict(logits=bf, weights=f32, ids=i64, x=bf, w13=bf, h=bf),
                                   dict(K=8, M=1, KP=16, EP=256, BT=1, RENORM=True, PDL=True, WAIT=True,
                                        R=moe_route.SHARED_W13_ROWS, HB=2048),
                                   1, aligned=("H", "I", "s_x", "s_we", "s_wn")))
        out.append(compile_aligned(f"gemv_w13_routed_slots T={T} shared default",
                                   moe_gemv._gemv_w13_routed_slots_kernel,
                                   dict(x=bf, w13=bf, ids=i64, inter=bf, w2=bf, weights=f32, part=f32),
                                   dict(SLOTS=9, K=8, M=1, BN=c.block_n1, BK=c.block_k1, PDL=c.pdl, WAIT=c.pdl_w13,
                                        W2S=c.shared_w2, R2=moe_gemv.SHARED_W2_ROWS, IB=512),
                                   c.warps1, c.stages, aligned=("H", "I", "s_x", "s_we", "s_wn", "s_w2e", "s_w2n")))
        out += _w2_kernels(f"T={T} shared default", c, run=8 if c.shared_w2 else 9)
    return out


def _w2_kernels(label: str, c, run: int) -> list[dict]:
    """The w2 + combine kernel of GEMV config `c` over `run` of 9 slots (the rest: shared-slot partials)."""
    bf, f32, i64 = "*bf16", "*fp32", "*i64"
    types = dict(inter=bf, w2=bf, ids=i64, weights=f32, out=bf)
    aligned = ("H", "I", "s_we", "s_wn", "s_w", "s_o")
    if c.all_experts:
        return [compile_aligned(f"gemv_w2_all {label}", moe_gemv._gemv_w2_all_kernel, {**types, "part": f32},
                                dict(TOP_K=run, KP=triton.next_power_of_2(run), BN=c.block_n2, BK=c.block_k2,
                                     PDL=c.pdl, SLOTS=9, MP=9 - run), c.warps2, c.stages, aligned=aligned)]
    return [compile_aligned(f"gemv_w2_combine {label}", moe_gemv._gemv_w2_combine_kernel, types,
                            dict(TOP_K=run, BN=c.block_n2, BK=c.block_k2, ONE_STEP=c.block_k2 >= 512, TRIGGER=True),
                            c.warps2, c.stages, aligned=aligned)]


def fp32_attention_defaults() -> int:
    """Compile the default fp32 tiles (decode and prefill, 35B-A3B heads, head_dim 256) and check their
    shared memory: the bf16 tiles in fp32 need more than a block has."""
    f32, i32 = "*fp32", "*i32"
    types = dict(q=f32, cache=f32, cu=i32, seq_lens=i32, tables=i32, out=f32, part_ml=f32, part_acc=f32,
                 qk_scale="fp32")
    bad = []
    for label, T, N in (("decode", 4, 4), ("prefill", 4096, 2)):
        cfg = attn_config.default_attention_config(T, N, 16, 2, 256, torch.device("cpu"), dtype=torch.float32)
        r = compile_one(f"attention fp32 {label} {cfg}", attn_paged._attention_kernel, types,
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
    args = ap.parse_args()
    if args.fp32_attention:
        return fp32_attention_defaults()
    if args.moe_gemv:
        results = gemv_kernels()
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
                f"attention {nh}/{nkv} {label} bm={bm} bn={bn} w{warps} s{stages}", attn_paged._attention_kernel,
                attn_types, dict(NH=nh, NKV=nkv, D=256, G=g, BLOCK_M=bm, BLOCK_N=bn, SPLIT=splits > 1, MIN_SPLIT=256,
                                 IEEE=False), warps, stages))
    results.append(compile_one("merge_splits", attn_merge._merge_splits_kernel, dict(part_ml=f32, part_acc=f32, out=bf),
                               dict(NH=16, SP=16, BD=256, D=256), 4))
    results.append(compile_one("store_kv", attn_prologue._store_kv_kernel, dict(k=bf, v=bf, cache=bf, slots=i64),
                               dict(NKV=2, D=256, BH=2), 4))
    # MoE, Qwen3.5-35B-A3B: E 256, top-8, H 2048, I 512
    for wait in (False, True):
        results.append(compile_one(f"route wait={int(wait)}", moe_route._route_kernel,
                                   dict(logits=bf, weights=f32, ids=i64),
                                   dict(K=8, M=1, KP=16, EP=256, BT=1, RENORM=True, PDL=True, WAIT=wait), 1))
    results += gemv_kernels()
    for fused in (True, False):
        results.append(compile_one(
            f"moe_offsets fused={int(fused)}", moe_align._moe_offsets_kernel,
            dict(topk_ids=i64, chunk_counts=i32, chunk_base=i32, sorted_ids=i32, block_expert=i32),
            dict(C=1024 if not fused else 512, EB=512, BM=16, BB=16, FUSED=fused), 4))
    results.append(compile_one("moe_count", moe_align._moe_count_kernel, dict(topk_ids=i64, chunk_counts=i32),
                               dict(C=1024, EB=512), 4))
    results.append(compile_one("moe_scatter", moe_align._moe_scatter_kernel,
                               dict(topk_ids=i64, chunk_base=i32, sorted_ids=i32), dict(C=1024, EB=512), 4))
    # the dense variant (FP8=False): the scale pointers are not read
    gemm_types = dict(x=bf, w13=bf, s13=bf, inter=bf, sorted_ids=i32, block_expert=i32, w2=bf, s2=bf, y=bf)
    for bm, bn1, bk1, bn2, bk2, w1, w2, st in (
            (16, 32, 256, 64, 256, 4, 4, 3), (16, 64, 128, 64, 128, 4, 4, 3), (16, 64, 256, 128, 128, 4, 4, 4),
            (32, 64, 128, 64, 128, 4, 4, 3), (64, 64, 64, 128, 64, 4, 8, 3), (64, 128, 64, 128, 64, 8, 8, 3),
            (128, 64, 64, 128, 64, 8, 8, 3)):
        results.append(compile_one(f"moe_w13 bm={bm} bn={bn1} bk={bk1} w{w1} s{st}", moe_grouped._w13_kernel,
                                   gemm_types,
                                   dict(TOP_K=8, BM=bm, BN=bn1, BK=bk1, IEEE=False, FP8=False, RG=1), w1, st))
        results.append(compile_one(f"moe_w2 bm={bm} bn={bn2} bk={bk2} w{w2} s{st}", moe_grouped._w2_kernel, gemm_types,
                                   dict(BM=bm, BN=bn2, BK=bk2, IEEE=False, FP8=False, RG=1), w2, st))
    results.append(compile_one("moe_combine", moe_grouped._combine_kernel, dict(y=bf, weights=f32, out=bf),
                               dict(TOP_K=8, BH=1024), 4))
    failed = [r["label"] for r in results if not r["ok"]]
    spills = [r["label"] for r in results if r["ok"] and r["local"] > 0]
    print(f"\n{len(results)} kernels, {len(failed)} failed, {len(spills)} with local memory (spills): {spills}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
