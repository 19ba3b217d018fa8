"""Compile the one-row gated output projection (`_gemv_gated_kernel`) and the GDN one-launch decode with and
without its gated norm for sm_90 on a machine without a GPU, at the 35B-A3B and 27B shapes' tiles: registers,
spills, shared memory (see gdn_compile_check.py, whose compile_one this uses).
    PYTHONPATH=.:benchmarks python benchmarks/gated_linear_compile_check.py
"""

from __future__ import annotations

import sys

from gdn_compile_check import compile_one  # noqa: I001  (benchmarks/ is on sys.path when run)
from deltaserve.ops.gdn import triton_recurrent as rec_t
from deltaserve.ops.linear import triton as lin_t
from deltaserve.ops.linear import triton_gated


def main() -> int:
    bf, f32, i32 = "*bf16", "*fp32", "*i32"
    results = []
    gemv_types = dict(x=bf, g=bf, nw=bf, w=bf, y=bf, eps="fp32")
    variants = [("35B", 2048, 4096, lin_t.default_gated_config(1, 2048, 4096, 128)),
                ("27B", 5120, 6144, lin_t.default_gated_config(1, 5120, 6144, 128))]
    # the tile variants benchmarks/gdn_decode_latency.py --fold times (the gate without norm on them too)
    variants += [("35B", 2048, 4096, lin_t.LinearConfig(block_n=bn, block_k=bk, warps=4, stages=st))
                 for bn, bk, st in ((1, 4096, 1), (2, 2048, 2), (8, 512, 3))]
    for shape, N, K, cfg in variants:
        for norm, sigmoid in ((True, False), (True, True), (False, True)):
            hd = 128
            results.append(compile_one(
                f"gemv_gated {shape} n{cfg.block_n} k{cfg.block_k} s{cfg.stages} norm={int(norm)} "
                f"sigmoid={int(sigmoid)}", triton_gated._gemv_gated_kernel, gemv_types,
                dict(BN=cfg.block_n, HB=max(cfg.block_k, hd) // hd, HD=hd, NORM=norm, SIGMOID=sigmoid, PDL=True,
                     PF=512), cfg.warps, cfg.stages))
    dec_types = dict(x=bf, z=bf, a=bf, b=bf, conv_w=bf, A_log=f32, dt_bias=f32, norm_w=bf, conv_state=bf, ssm=f32,
                     idx=i32, o_tmp=bf, out=bf, counters=i32, scale="fp32", eps="fp32", SLOTS="i32")
    for r, label in ((2, "35B"), (3, "27B")):
        for norm in (True, False):
            results.append(compile_one(
                f"decode_fused {label} bv16 w1 pdl norm={int(norm)}", rec_t._decode_fused_kernel, dec_types,
                dict(R=r, RP=4 if r == 3 else r, K=128, V=128, BV=16, W=4, WP=4, SIGMOID=False, PDL=True,
                     TRIGGER=True, NORM=norm), 1))
    results.append(compile_one(
        "decode_fused 35B bv32 w2 pdl norm=0", rec_t._decode_fused_kernel, dec_types,
        dict(R=2, RP=2, K=128, V=128, BV=32, W=4, WP=4, SIGMOID=False, PDL=True, TRIGGER=True, NORM=False), 2))
    failed = [r["label"] for r in results if not r["ok"]]
    spilling = [f"{r['label']} ({r['spills']})" for r in results if r["ok"] and r["spills"]]
    print(f"\n{len(results)} kernels compiled; failed: {failed or 'none'}; spilling: {spilling or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
