"""The HTTP serving path on CPU with the engine in its own process (the default) against the engine in a thread of
the server process (--no-engine-process): a closed-loop client keeps `--concurrency` streamed completions in flight
(token-id prompts of seeded random lengths, ignore_eos, fixed output length) and reports, per layout, total and
output tok/s, TTFT and TPOT percentiles. Each layout gets its own fresh server (`deltaserve serve`, started and
stopped here); the layouts alternate over `--rounds` so a machine whose load drifts affects both alike.

  python benchmarks/serve_cpu_split.py [--model DIR] [--concurrency 16] [--num-prompts 64] [--output-len 32]
      [--layouts process,thread,dp2] [--rounds 1]

dp2: two engine core replicas (--data-parallel-size 2) sharing the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
LAYOUTS = {"process": [], "thread": ["--no-engine-process"], "dp2": ["--data-parallel-size", "2"]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, layout: str, threads: int, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "deltaserve", "serve", "--device", "cpu", "--port", str(port),
           "--uvicorn-log-level", "warning", "--max-num-seqs", "64", *LAYOUTS[layout]]
    if model:
        cmd += ["--model", model]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}: {log_path.read_text()[-2000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("server did not become healthy")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def make_prompts(n: int, vocab: int, seed: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


async def run_load(base: str, prompts: list[list[int]], output_len: int, concurrency: int) -> dict[str, float]:
    queue = list(enumerate(prompts))
    ttfts, tpots, out_tokens = [], [], []

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            _, ids = queue.pop()
            body = {"prompt": ids, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            t0 = time.perf_counter()
            first = last = None
            tokens = 0
            async with client.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
                    elif event["choices"] and (event["choices"][0]["text"] or event["choices"][0].get("token_ids")):
                        now = time.perf_counter()
                        first = first or now
                        last = now
            ttfts.append(first - t0)
            if tokens > 1:
                tpots.append((last - first) / (tokens - 1))
            out_tokens.append(tokens)

    async with httpx.AsyncClient(base_url=base, timeout=600, limits=httpx.Limits(max_connections=concurrency)) as c:
        await run_warm(c)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(c) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    total = sum(len(p) for p in prompts) + sum(out_tokens)
    q = lambda xs, p: statistics.quantiles(xs, n=100)[p - 1] * 1e3
    return {"wall_s": wall, "total_tok_s": total / wall, "output_tok_s": sum(out_tokens) / wall,
            "ttft_p50_ms": q(ttfts, 50), "ttft_p99_ms": q(ttfts, 99), "tpot_p50_ms": q(tpots, 50),
            "tpot_p99_ms": q(tpots, 99)}


async def run_warm(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"prompt": [11, 12, 13], "max_tokens": 4})
    r.raise_for_status()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", default="16,64", help="prompt lengths: LO,HI (uniform)")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--layouts", default="process,thread", help=f"comma-separated: {', '.join(LAYOUTS)}")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of the servers")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    layouts = args.layouts.split(",")
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        p.error(f"--layouts: unknown {unknown}; choose from {list(LAYOUTS)}")
    from deltaserve.config import ModelConfig
    from deltaserve.engine.llm_engine import DEFAULT_MODEL_PATH

    vocab = ModelConfig.from_hf(Path(args.model) if args.model else DEFAULT_MODEL_PATH).vocab_size
    lo, hi = map(int, args.input_len.split(","))
    prompts = make_prompts(args.num_prompts, vocab, args.seed, lo, hi)
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    results: dict[str, list[dict[str, float]]] = {name: [] for name in layouts}
    for _ in range(args.rounds):
        for name in layouts:
            proc, base = start_server(args.model, name, args.threads, logs / f"serve_cpu_split_{name}.log")
            try:
                results[name].append(asyncio.run(run_load(base, prompts, args.output_len, args.concurrency)))
            finally:
                stop_server(proc)
    print(f"concurrency {args.concurrency}, {args.num_prompts} requests, prompts {lo}-{hi} tokens, "
          f"{args.output_len} output tokens, OMP_NUM_THREADS={args.threads}, {os.cpu_count()} CPUs")
    print(f"{'layout':8} {'round':>5} {'total tok/s':>11} {'out tok/s':>9} {'TTFT p50/p99 ms':>16} "
          f"{'TPOT p50/p99 ms':>16}")
    for name, runs in results.items():
        for i, r in enumerate(runs):
            print(f"{name:8} {i:>5} {r['total_tok_s']:>11.0f} {r['output_tok_s']:>9.0f} "
                  f"{r['ttft_p50_ms']:>7.0f} / {r['ttft_p99_ms']:<6.0f} {r['tpot_p50_ms']:>7.1f} / {r['tpot_p99_ms']:<6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
