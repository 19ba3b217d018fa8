"""Compile the Gluon prep (gluon_prep._prep_kernel) for sm_90 without a GPU and print its resources as JSON (run in
a subprocess by test_gdn_gluon_prep.py: Gluon kernels cannot be compiled once the Triton interpreter is on).

    python tests/ops/_gluon_prep_compile.py KR(0|1) GATES(0|1)   (KR: no K copy of whole chunks)

MAXNREG (env, default 168: the wide prep's cap, 0: none); SASS_OUT / PTX_OUT / TTGIR_OUT: write those there.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type

from deltaserve.ops.gdn import gluon_prep as gp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gluon_compile import sass_and_registers, wgmma_serialized  # noqa: E402 (after the path it needs)


def main() -> int:
    kr, gates = (sys.argv[i] == "1" for i in (1, 2))
    maxnreg = int(os.environ.get("MAXNREG", "168"))
    K = 128
    HK, HV, C, T = 16, 32, 8, 256
    bf = torch.bfloat16
    bufs = dict(Wb=torch.zeros(C * HV * 64, K, dtype=bf), Ub=torch.zeros(C * HV * 64, 128, dtype=bf),
                Pb=torch.zeros(C * HV * 64, 64, dtype=bf), Kb=torch.zeros(C * HK * 64, K, dtype=bf))
    q = torch.zeros(T, HK, K, dtype=bf)
    descs = gp.prep_descriptors(q, q, bufs)
    fn = gp._prep_kernel
    sig = dict(zip(["k_desc", "q_desc", "w_desc", "u_desc", "p_desc", "kb_desc"], map(mangle_type, descs)))
    sig.update(k="*bf16", q="*bf16", s_k_t="i32", s_k_h="i32", s_q_t="i32", s_q_h="i32",
               g="*bf16" if gates else "*fp32", beta="*bf16" if gates else "*fp32", s_g_t="i32", s_b_t="i32",
               A_log="*fp32", dt_bias="*fp32", coff="*i32", cu="*i32", N="i32", Cb="*fp32", Lb="*fp32",
               scale="fp32", HK="i32", HV="i32")
    consts = dict(R=HV // HK, K=K, BT=64, BLOCK_N=16, L2NORM=True, GATES=gates, HEADS_FIRST=True, K_FROM_INPUT=kr,
                  num_warps=4)
    sig.update({a: "constexpr" for a in consts})
    # the launch-time specialisation: pointers 16-byte aligned, strides / head counts multiples of 16 (N and the
    # float scale are never specialised)
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if a not in ("N", "scale") and (sig[a] == "i32" or sig[a].startswith("*"))}
    c = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, **({"maxnreg": maxnreg} if maxnreg else {})})
    sass, regs = sass_and_registers(c)
    for env, text in (("SASS_OUT", sass), ("PTX_OUT", c.asm["ptx"]), ("TTGIR_OUT", c.asm["ttgir"])):
        if os.environ.get(env):
            with open(os.environ[env], "w") as f:
                f.write(text)
    print(json.dumps(dict(kr=kr, gates=gates, maxnreg=maxnreg, regs=regs,
                          spills=sass.count("STL"), smem=c.metadata.shared, hgmma=sass.count("HGMMA"),
                          tma_loads=sass.count("UTMALDG"), tma_stores=sass.count("UTMASTG"),
                          serialized=wgmma_serialized(c))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
