"""What the GPU op benchmarks share: the run log, the device description and the hardware ceilings
measured in the same run (the denominators of every "fraction of the limit")."""

from __future__ import annotations

import importlib.metadata
import os

import torch
import triton


class RunLog:
    """Prints a line and appends it to out_dir/name, flushed at once, so a run cut short keeps its log."""

    def __init__(self, out_dir: str, name: str):
        os.makedirs(out_dir, exist_ok=True)
        self.file = open(os.path.join(out_dir, name), "a")

    def __call__(self, msg: str) -> None:
        print(msg, flush=True)
        self.file.write(msg + "\n")
        self.file.flush()


def device_env(*, fla: bool = False) -> dict:
    """GPU, SM count and versions; with fla, flash-linear-attention's version (None when not installed)
    and the FLA_FLASH_QLA setting it runs under."""
    props = torch.cuda.get_device_properties(0)
    env = dict(gpu=props.name, sms=props.multi_processor_count, torch=torch.__version__,
               triton=triton.__version__, cuda=torch.version.cuda)
    if fla:
        env["flash_qla_env"] = os.environ.get("FLA_FLASH_QLA")
        try:
            env["fla"] = importlib.metadata.version("fla-core")
        except importlib.metadata.PackageNotFoundError:
            env["fla"] = None
    return env


def _copy_ms(n: int, warmup: int, rep: int) -> float:
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    return triton.testing.do_bench(lambda: dst.copy_(src), warmup=warmup, rep=rep, return_mode="median")


def _matmul_ms(n: int, warmup: int, rep: int) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return triton.testing.do_bench(lambda: a @ b, warmup=warmup, rep=rep, return_mode="median")


def ceilings(*, matmul: bool = True, warmup: int = 10, rep: int = 100) -> dict:
    """Device-to-device copy rate of 1 GiB (bytes read + written per second, `copy_TBps`) and, with matmul,
    the bf16 8192^3 matmul rate (`bf16_TFLOPs`), both medians of triton.testing.do_bench."""
    n = 1 << 30
    out = dict(copy_TBps=2 * n / (_copy_ms(n, warmup, rep) * 1e-3) / 1e12)
    if matmul:
        out["bf16_TFLOPs"] = 2 * 8192 ** 3 / (_matmul_ms(8192, warmup, rep) * 1e-3) / 1e12
    torch.cuda.empty_cache()
    return out


def graph_of(fn, calls: int) -> torch.cuda.CUDAGraph:
    """fn(0) .. fn(calls - 1) run once eagerly (compiles, allocations) and then captured in one CUDA graph."""
    for i in range(calls):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    torch.cuda.synchronize()
    return graph


def graph_seconds(fn, calls: int, *, warmup: int = 10, rep: int = 100) -> float:
    """Seconds per call: `calls` invocations on distinct inputs captured in one CUDA graph, the median replay
    time (triton.testing.do_bench, L2 flushed before each replay) divided by `calls`."""
    graph = graph_of(fn, calls)
    ms = triton.testing.do_bench(graph.replay, warmup=warmup, rep=rep, return_mode="median")
    return ms * 1e-3 / calls
