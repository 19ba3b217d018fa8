"""CPU decode speed of the embedded default model: deltaserve vs transformers, batch 1 and 8.

Decode tokens/s = B * N / (time(prefill + 1 + N tokens) - time(prefill + 1 token)), so prompt processing is
excluded; the median of --repeats runs. Both engines run in this process, fp32, on the same prompts, with
--threads torch threads. The hardware limit printed is the memory-bandwidth roofline: fp32 weight bytes a
decode step must read (lm_head, every mixer, router, shared expert and the experts a batch of B is expected to
hit) over a copy bandwidth measured here. `--profile` prints where deltaserve's decode time goes, by op.

    python benchmarks/cpu_decode.py [--model DIR] [--batch 1 8] [--tokens 64] [--threads 2] [--profile]
"""

from __future__ import annotations

import argparse
import statistics
import sys
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


def decode_bytes(cfg: ModelConfig, batch: int, bytes_per: int = 4) -> float:
    """Weight bytes one decode step of `batch` tokens reads (tied lm_head counted once)."""
    h = cfg.hidden_size
    gdn = (cfg.gdn_conv_dim + cfg.gdn_value_dim + 2 * cfg.linear_num_value_heads) * h \
        + cfg.gdn_conv_dim * cfg.linear_conv_kernel_dim + cfg.gdn_value_dim * h
    attn = (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim * h \
        + cfg.num_attention_heads * cfg.head_dim * h
    hit = cfg.num_experts * (1 - (1 - cfg.num_experts_per_tok / cfg.num_experts) ** batch)  # expected experts hit
    moe = cfg.num_experts * h + h + 3 * h * cfg.shared_expert_intermediate_size \
        + hit * 3 * h * cfg.moe_intermediate_size
    total = len(cfg.gdn_layer_ids) * gdn + len(cfg.attention_layer_ids) * attn + cfg.num_hidden_layers * moe
    return (total + cfg.vocab_size * h) * bytes_per


def timed(fn, repeats: int) -> tuple[float, float]:
    """Median (wall seconds, process CPU seconds) of fn()."""
    walls, cpus = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return statistics.median(walls), statistics.median(cpus)


def deltaserve_decode(llm: LLM, prompts: list[str], n: int, repeats: int) -> tuple[float, float]:
    """(decode tok/s, CPU ms per decode step)."""
    def run(k):
        return lambda: llm.generate(prompts, SamplingParams(temperature=0, max_tokens=k, ignore_eos=True),
                                    use_tqdm=False)
    run(n + 1)()  # warm-up
    w1, c1 = timed(run(1), repeats)
    wn, cn = timed(run(n + 1), repeats)
    return len(prompts) * n / (wn - w1), (cn - c1) / n * 1e3


def transformers_decode(hf, tok, prompts: list[str], n: int, repeats: int) -> tuple[float, float]:
    enc = tok(prompts, return_tensors="pt", padding=True)

    def run(k):
        def go():
            with torch.no_grad():
                hf.generate(**enc, max_new_tokens=k, min_new_tokens=k, do_sample=False,
                            pad_token_id=tok.pad_token_id)
        return go
    run(n + 1)()
    w1, c1 = timed(run(1), repeats)
    wn, cn = timed(run(n + 1), repeats)
    return len(prompts) * n / (wn - w1), (cn - c1) / n * 1e3


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
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--tokens", type=int, default=64, help="decode steps timed")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-peer", action="store_true", help="skip transformers")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    llm = LLM(args.model, device="cpu", dtype="float32")
    cfg = llm.config
    bandwidth = copy_bandwidth()
    hf = tok = None
    if not args.no_peer:
        from transformers import AutoTokenizer, Qwen3NextForCausalLM

        hf = Qwen3NextForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    print(f"model {args.model}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, fp32; torch "
          f"{torch.__version__}, {args.threads} threads; copy bandwidth {bandwidth / 1e9:.1f} GB/s; "
          f"{args.tokens} decode steps, median of {args.repeats}")
    print("| batch | deltaserve tok/s | CPU ms/step | transformers tok/s | CPU ms/step | ratio | roofline tok/s | "
          "frac roofline |")
    print("|---|---|---|---|---|---|---|---|")
    for b in args.batch:
        prompts = (PROMPTS * (b // len(PROMPTS) + 1))[:b]
        ours, ours_cpu = deltaserve_decode(llm, prompts, args.tokens, args.repeats)
        roof = b * bandwidth / decode_bytes(cfg, b)
        peer = ("-", "-", "-")
        if hf is not None:
            theirs, theirs_cpu = transformers_decode(hf, tok, prompts, args.tokens, args.repeats)
            peer = (f"{theirs:.1f}", f"{theirs_cpu:.1f}", f"{ours / theirs:.2f}x")
        print(f"| {b} | {ours:.1f} | {ours_cpu:.1f} | {peer[0]} | {peer[1]} | {peer[2]} | {roof:.0f} | "
              f"{ours / roof:.1%} |", flush=True)
    if args.profile:
        profile(llm, args.tokens)


if __name__ == "__main__":
    main()
