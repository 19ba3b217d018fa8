"""Run the chunked prefill once per implementation inside a profiler window, for Nsight Compute.

    ncu --clock-control none --profile-from-start off --set full --import-source yes -o prof \
        python benchmarks/gdn_chunk_profile.py --shape 1x32768 --impls default,fla

Each implementation is called twice before the window (compile, autotune, warm caches) and once inside
it (cudaProfilerStart / Stop), so the report holds exactly one launch of each of its kernels. Inputs are
`gdn_kernels.prefill_inputs` (Qwen3-Next shape, bf16, fp32 gates and states). Prints nothing but progress;
the numbers are in the report.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gdn_kernels as gk

from deltaserve.ops.gdn import triton_chunk as tc

# Named configurations besides the default (None) that `--impls` can name.
CONFIGS = {"default": None,
           "triton-chain": tc.ChunkConfig(prep="wide", layout="chunk"),
           "token-layout": tc.ChunkConfig(prep="wide"),
           "blocks": tc.ChunkConfig()}


def runner(impl: str, d: dict, N: int):
    if impl == "fla":
        chunk, _ = gk.fla()
        return lambda: chunk(d["q"][None], d["k"][None], d["v"][None], d["g"][None], d["beta"][None],
                             scale=gk.SCALE, initial_state=d["init"], output_final_state=True,
                             use_qk_l2norm_in_kernel=True, cu_seqlens=d["cu64"])
    cfg = CONFIGS[impl]
    return lambda: tc.chunk_gated_delta_rule(
        d["q"], d["k"], d["v"], d["g"], d["beta"], scale=gk.SCALE, cu_seqlens=d["cu"], ssm_state=d["pool"],
        state_indices=d["idx"], has_initial_state=d["has_init"], config=cfg)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1x32768", choices=sorted(gk.PREFILL))
    ap.add_argument("--impls", default="default,fla", help=f"comma list of fla and {', '.join(CONFIGS)}")
    args = ap.parse_args()
    lengths = gk.PREFILL[args.shape]
    d = gk.prefill_inputs(lengths)
    fns = [(impl, runner(impl, d, len(lengths))) for impl in args.impls.split(",")]
    for impl, fn in fns:
        fn()
        fn()
        print(f"warmed {impl}", flush=True)
    torch.cuda.synchronize()
    for impl, fn in fns:
        torch.cuda.cudart().cudaProfilerStart()
        fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print(f"profiled {impl}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
