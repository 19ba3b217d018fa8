"""CPU decode speed of the embedded default model: deltaserve eager and compiled vs transformers, batch 1 and 16.

Decode tokens/s = B * N / (time(prefill + 1 + N tokens) - time(prefill + 1 token)), so prompt processing is
excluded; each of --repeats runs gives one figure, printed as median (min-max), with the median process CPU ms per
step (with --threads 1 the figure least disturbed by other work on the machine). fp32 models, the same prompts,
--threads torch threads. deltaserve runs eagerly and then with the compiled decode step (runner/cpu_compile.py,
compiled before timing; its compile time is printed, --cold-cache measures it without inductor's on-disk cache).
transformers runs in a subprocess (loading it into this process was seen to slow our decode ~20 %). The hardware
limit printed is the memory-bandwidth roofline: the weight bytes a decode step must read (lm_head, every mixer,
router, shared expert and the experts a batch of B is expected to hit; fp32, or bf16 where the compiled step reads
bf16) over a copy bandwidth measured here. `--profile` prints where deltaserve's eager decode time goes, by op.

    python benchmarks/cpu_decode.py [--model DIR] [--batch 1 16] [--tokens 64] [--threads 2] [--cold-cache] [--profile]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deltaserve import DEFAULT_MODEL_PATH, LLM, SamplingParams  # noqa: E402
from deltaserve.config import ModelConfig  # noqa: E402

PROMPTS = ["The meaning of life is", "Once upon a time, there was", "The President said on Tuesday that",
           "In the morning, the old man", "Scientists have discovered that", "The jury said it did find that",
           "She opened the door and", "It was the best of times,"]


def copy_bandwidth(mib: int = 256) -> float:
    """Bytes/s of a large tensor copy (read + write), best of 5: the CPU's streaming bandwidth."""
    src = torch.empty(mib << 18, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best


def decode_bytes(cfg: ModelConfig, batch: int, bytes_per: int = 4, expert_bytes: int | None = None) -> float:
    """Weight bytes one decode step of `batch` tokens reads (tied lm_head counted once); experts at
    expert_bytes per weight (default bytes_per)."""
    h = cfg.hidden_size
    gdn = (cfg.gdn_conv_dim + cfg.gdn_value_dim + 2 * cfg.linear_num_value_heads) * h \
        + cfg.gdn_conv_dim * cfg.linear_conv_kernel_dim + cfg.gdn_value_dim * h
    attn = (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim * h \
        + cfg.num_attention_heads * cfg.head_dim * h
    hit = cfg.num_experts * (1 - (1 - cfg.num_experts_per_tok / cfg.num_experts) ** batch)  # expected experts hit
    moe = cfg.num_experts * h + h + 3 * h * cfg.shared_expert_intermediate_size
    experts = cfg.num_hidden_layers * hit * 3 * h * cfg.moe_intermediate_size
    total = len(cfg.gdn_layer_ids) * gdn + len(cfg.attention_layer_ids) * attn + cfg.num_hidden_layers * moe
    return (total + cfg.vocab_size * h) * bytes_per + experts * (expert_bytes or bytes_per)


def timed(fn, repeats: int) -> tuple[list[float], list[float]]:
    """(wall seconds, process CPU seconds) of each of `repeats` calls of fn()."""
    walls, cpus = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return walls, cpus


@dataclasses.dataclass(frozen=True)
class Speed:
    """Decode tok/s of each repetition (the short run's median subtracted from each long run), and the median
    process CPU ms per decode step."""
    runs: tuple[float, ...]
    cpu_ms: float

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    def __str__(self) -> str:
        return f"{self.median:.1f} ({min(self.runs):.1f}-{max(self.runs):.1f})"


def decode_speed(run, batch: int, n: int, repeats: int) -> Speed:
    """run(k) -> a callable generating k tokens per prompt; decode tok/s over the n tokens after the first."""
    run(n + 1)()  # warm-up
    w1, c1 = timed(run(1), repeats)
    wn, cn = timed(run(n + 1), repeats)
    short = statistics.median(w1)
    return Speed(tuple(batch * n / (w - short) for w in wn),
                 (statistics.median(cn) - statistics.median(c1)) / n * 1e3)


def deltaserve_decode(llm: LLM, prompts: list[str], n: int, repeats: int) -> Speed:
    def run(k):
        return lambda: llm.generate(prompts, SamplingParams(temperature=0, max_tokens=k, ignore_eos=True),
                                    use_tqdm=False)
    return decode_speed(run, len(prompts), n, repeats)


def transformers_decode(hf, tok, prompts: list[str], n: int, repeats: int) -> Speed:
    enc = tok(prompts, return_tensors="pt", padding=True)

    def run(k):
        def go():
            with torch.no_grad():
                hf.generate(**enc, max_new_tokens=k, min_new_tokens=k, do_sample=False,
                            pad_token_id=tok.pad_token_id)
        return go
    return decode_speed(run, len(prompts), n, repeats)


def peer_main(args) -> None:
    """--peer: transformers alone in this (sub)process; one JSON line {batch: [[tok/s of each run], CPU ms/step]}."""
    from transformers import AutoTokenizer, Qwen3NextForCausalLM

    hf = Qwen3NextForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    speeds = {b: transformers_decode(hf, tok, prompts_for(b), args.tokens, args.repeats) for b in args.batch}
    print(json.dumps({b: [list(s.runs), s.cpu_ms] for b, s in speeds.items()}))


def run_peer(args) -> dict[int, Speed]:
    cmd = [sys.executable, __file__, "--peer", "--model", args.model, "--tokens", str(args.tokens),
           "--repeats", str(args.repeats), "--threads", str(args.threads), "--batch", *map(str, args.batch)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    return {int(b): Speed(tuple(runs), cpu_ms) for b, (runs, cpu_ms) in json.loads(out).items()}


def prompts_for(b: int) -> list[str]:
    return (PROMPTS * (b // len(PROMPTS) + 1))[:b]


def profile(llm: LLM, n: int, rows: int = 25) -> None:
    """Self CPU time by op over n decode steps at batch 1 (prefill excluded by subtraction is not possible
    here, so the prompt is one token), and the share of wall time not spent inside torch ops."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    prompt = [{"prompt_token_ids": [llm.tokenizer.encode("The")[0]]}]
    llm.generate(prompt, params, use_tqdm=False)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        wall = time.perf_counter() - t
    events = prof.key_averages()
    top_level = sum(e.self_cpu_time_total for e in events) / 1e6
    print(f"\nprofile, batch 1, {n} steps: {wall / n * 1e3:.2f} ms/step wall (profiler on), "
          f"{top_level / n * 1e3:.2f} ms/step inside torch ops, rest is Python")
    print(events.table(sort_by="self_cpu_time_total", row_limit=rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL_PATH))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--tokens", type=int, default=64, help="decode steps timed")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (2: torch's default here)")
    p.add_argument("--no-peer", action="store_true", help="skip transformers")
    p.add_argument("--no-compile", action="store_true", help="eager only")
    p.add_argument("--cold-cache", action="store_true", help="compile without inductor's on-disk cache")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.peer:
        return peer_main(args)
    peer = None if args.no_peer else run_peer(args)   # first, alone: nothing of ours running beside it

    from deltaserve.runner.cpu_compile import CompiledDecode

    llm = LLM(args.model, device="cpu", dtype="float32", compile="off")
    cfg = llm.config
    bandwidth = copy_bandwidth()
    print(f"model {args.model}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, fp32; torch "
          f"{torch.__version__}, {args.threads} threads; copy bandwidth {bandwidth / 1e9:.1f} GB/s; "
          f"{args.tokens} decode steps, {args.repeats} runs: median (min-max)", flush=True)
    eager = {}
    for b in args.batch:
        eager[b] = deltaserve_decode(llm, prompts_for(b), args.tokens, args.repeats)
        print(f"eager, batch {b}: {eager[b]} tok/s, {eager[b].cpu_ms:.1f} CPU ms/step", flush=True)
    compiled = {}
    if not args.no_compile:
        runner = llm.engine.runner
        if args.cold_cache:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-cold-")
        start = time.perf_counter()
        runner.compiled_decode = CompiledDecode(runner.model, runner.cache, background=False)
        print(f"compiled decode step: {time.perf_counter() - start:.1f} s "
              f"({', '.join(f'{k} {v:.1f} s' for k, v in runner.compiled_decode.compile_seconds.items())}; inductor "
              f"cache {'cold' if args.cold_cache else 'as found'})", flush=True)
        for b in args.batch:
            compiled[b] = deltaserve_decode(llm, prompts_for(b), args.tokens, args.repeats)
            print(f"compiled, batch {b}: {compiled[b]} tok/s, {compiled[b].cpu_ms:.1f} CPU ms/step", flush=True)
    print("| batch | eager tok/s (spread) | compiled tok/s (spread) | compiled CPU ms/step | transformers tok/s | "
          "ours / transformers | roofline tok/s (bytes read) | frac roofline |")
    print("|---|---|---|---|---|---|---|---|")
    for b in args.batch:
        ours = compiled.get(b, eager[b])
        # the compiled step reads bf16 copies of exact-bf16 weights: all of them at B = 1, the experts at B > 1
        nbytes = decode_bytes(cfg, b, 2 if compiled and b == 1 else 4, 2 if compiled else 4)
        roof = b * bandwidth / nbytes
        theirs = str(peer[b]) if peer else "-"
        ratio = f"{ours.median / peer[b].median:.2f}x" if peer else "-"
        cpu = f"{compiled[b].cpu_ms:.1f}" if compiled else f"{eager[b].cpu_ms:.1f} (eager)"
        print(f"| {b} | {eager[b]} | {compiled.get(b, '-')} | {cpu} | {theirs} | {ratio} | {roof:.0f} "
              f"({nbytes / 1e6:.1f} MB) | {ours.median / roof:.1%} |", flush=True)
    if args.profile:
        runner = llm.engine.runner
        runner.compiled_decode = None
        profile(llm, args.tokens)


if __name__ == "__main__":
    main()
