"""Compile the Gluon chain for sm_90 and print its resources as JSON (run in a subprocess by
test_gdn_gluon_chain.py: Gluon kernels cannot be compiled once the Triton interpreter is on, which the op
tests switch on for CPU machines).

    python tests/ops/_gluon_compile.py BV [KR(0|1)]

KR 1: whole chunks' K rows from k (the op's form wherever the prep reads k by TMA).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type

from deltaserve.ops.gdn import gluon_chain as gc

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def sass_and_registers(compiled) -> tuple[str, int]:
    """The SASS of a compiled kernel and its registers per thread (-1 if cuobjdump does not say), by cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
        res = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    regs = re.search(r"REG:(\d+)", res)
    return sass, int(regs.group(1)) if regs else -1


def wgmma_serialized(compiled) -> bool:
    """Whether ptxas serialises the kernel's wgmma (advisory C7512: each product waited for before the next issues,
    e.g. for "insufficient register resources"): nothing in the compiled kernel shows it but the SASS's one
    WARPGROUP.DEPBAR per HGMMA, and it cost the transposed chain up to 1.4x."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    try:
        log = subprocess.run([os.path.join(BIN, "ptxas"), "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True)
    finally:
        os.unlink(f.name)
    return "C7512" in log.stdout + log.stderr


def main() -> int:
    bv, kr = int(sys.argv[1]), len(sys.argv) > 2 and sys.argv[2] == "1"
    K = V = 128
    HK, HV, C, T = 16, 32, 8, 256
    bf, f32 = torch.bfloat16, torch.float32
    bufs = dict(Wb=torch.zeros(C * HV * 64, K, dtype=bf), Ub=torch.zeros(C * HV * 64, 128, dtype=bf),
                Kb=torch.zeros(C * HK * 64, K, dtype=bf), Pb=torch.zeros(C * HV * 64, 64, dtype=bf),
                Cb=torch.zeros(C, HV, 2, 64, dtype=f32), Lb=torch.zeros(C, HV, dtype=f32),
                v=torch.zeros(T, HV, V, dtype=bf))
    if kr:
        bufs.update(k=torch.zeros(T, HK, K, dtype=bf))
    bvc = bv // 2
    descs = gc.chain_descriptors(torch.zeros(T, HK, K, dtype=bf), bufs, bvc)
    ot = gc.output_tiles(bv)
    descs += (gc._rows_desc(torch.zeros(T, HV, V, dtype=bf), bvc),)
    fn = gc._chain_kernel
    sig = dict(zip(["w_desc", "u_desc", "k_desc", "q_desc", "p_desc", "c_desc", "l_desc", "v_desc", "kr_desc",
                    "o_desc"], map(mangle_type, descs)))
    sig.update(o="*bf16", ssm="*fp32", cu="*i32", coff="*i32", idx="*i32", has_init="*u8", HK="i32", HV="i32")
    consts = dict(R=HV // HK, K=K, V=V, BT=64, STAGES=gc.STAGES, CONSUMER_REGS=gc.CONSUMER_REGS, K_FROM_INPUT=kr,
                  O_TILES=ot, num_warps=4)
    sig.update({a: "constexpr" for a in consts})
    # the launch-time specialisation: pointers 16-byte aligned, head counts multiples of 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if sig[a] == "i32" or "*" in sig[a]}
    c = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": 168})
    sass, regs = sass_and_registers(c)
    if os.environ.get("SASS_OUT"):  # the SASS for inspection (e.g. where the MEMBARs are)
        with open(os.environ["SASS_OUT"], "w") as f:
            f.write(sass)
    print(json.dumps(dict(smem=c.metadata.shared, warps=c.metadata.num_warps, spills=sass.count("STL"),
                          hgmma=sass.count("HGMMA"), tma=sass.count("UTMALDG"), setmaxnreg=sass.count("USETMAXREG"),
                          regs=regs, o_tiles=ot, tma_stores=sass.count("UTMASTG"),
                          membar=sass.count("MEMBAR"), est_smem=gc.smem_bytes(bv, ot),
                          serialized=wgmma_serialized(c))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
