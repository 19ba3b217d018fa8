"""Compile the transposed Gluon chain for sm_90 and print its resources as JSON (run in a subprocess by
test_gdn_gluon_chain_t.py, as _gluon_compile.py is for the untransposed one).

    python tests/ops/_gluon_chain_t_compile.py CONSUMERS(1|2)
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

from deltaserve.ops.gdn import gluon_chain as gc
from deltaserve.ops.gdn import gluon_chain_t as gt

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _gluon_compile import sass_and_registers, wgmma_serialized  # noqa: E402


def main() -> int:
    nc = int(sys.argv[1])
    K = V = 128
    HK, HV, C, T = 16, 32, 8, 256
    bf, f32 = torch.bfloat16, torch.float32
    bufs = dict(Wb=torch.zeros(C * HV * 64, K, dtype=bf), Ub=torch.zeros(C * HV * 64, 128, dtype=bf),
                Kb=torch.zeros(C * HK * 64, K, dtype=bf), Pb=torch.zeros(C * HV * 64, 64, dtype=bf),
                Cb=torch.zeros(C, HV, 2, 64, dtype=f32), Lb=torch.zeros(C, HV, dtype=f32),
                v=torch.zeros(T, HV, V, dtype=bf), k=torch.zeros(T, HK, K, dtype=bf))
    descs = gc.chain_descriptors(torch.zeros(T, HK, K, dtype=bf), bufs, gt.COLS)
    descs += (gc._rows_desc(torch.zeros(T, HV, V, dtype=bf), gt.COLS),)
    fn = gt._chain_t_kernel
    sig = dict(zip(["w_desc", "u_desc", "k_desc", "q_desc", "p_desc", "c_desc", "l_desc", "v_desc", "kr_desc",
                    "o_desc"], map(mangle_type, descs)))
    sig.update(o="*bf16", ssm="*fp32", cu="*i32", coff="*i32", idx="*i32", has_init="*u8", HK="i32", HV="i32")
    consts = dict(R=HV // HK, K=K, V=V, BT=64, STAGES=2, NC=nc, K_FROM_INPUT=True, CONSUMER_REGS=gt.CONSUMER_REGS,
                  num_warps=4)
    sig.update({a: "constexpr" for a in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if sig[a] == "i32" or "*" in sig[a]}
    c = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": gt.maxnreg(nc)})
    sass, regs = sass_and_registers(c)
    if os.environ.get("SASS_OUT"):  # the SASS for inspection
        with open(os.environ["SASS_OUT"], "w") as f:
            f.write(sass)
    print(json.dumps(dict(smem=c.metadata.shared, spills=sass.count("STL"), hgmma=sass.count("HGMMA"),
                          hgmma_n128=sass.count("HGMMA.64x128x16"), tma=sass.count("UTMALDG"),
                          tma_stores=sass.count("UTMASTG"), setmaxnreg=sass.count("USETMAXREG"), regs=regs,
                          serialized=wgmma_serialized(c))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
