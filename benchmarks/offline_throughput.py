"""Offline throughput of the engine: requests of seeded random lengths, ignore_eos, all submitted at once,
at several concurrency limits (max_num_seqs); prints output and total tok/s and their scaling with
concurrency, plus engine-side numbers (steps, mean batch, preemptions). With --peer hf it also runs
transformers' generate (batch 1, greedy, the same requests) in the same process and prints the ratio.

  python benchmarks/offline_throughput.py --model PATH [--num-prompts 64] [--concurrency 1,4,16,64]
  python benchmarks/offline_throughput.py --random-model default-shape --threads 1 --peer hf

--random-model builds a random checkpoint with transformers (tiny: 4 layers, hidden 64; default-shape: the
embedded default model's architecture, 8 layers, hidden 384, 8 experts, vocab 8192) in a temp directory.
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deltaserve import LLM, SamplingParams  # noqa: E402
from deltaserve.engine.llm_engine import DEFAULT_MODEL_PATH  # noqa: E402

RANDOM_SHAPES = {
    "tiny": dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, full_attention_interval=2,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=32, shared_expert_intermediate_size=32, intermediate_size=128),
    "default-shape": dict(vocab_size=8192, hidden_size=384, num_hidden_layers=8, full_attention_interval=4,
                          linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=48,
                          linear_value_head_dim=48, num_attention_heads=4, num_key_value_heads=2, head_dim=96,
                          num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96,
                          shared_expert_intermediate_size=192, intermediate_size=768, tie_word_embeddings=True),
}


def build_random_model(shape: str, path: Path) -> Path:
    import transformers as tf

    torch.manual_seed(0)
    fields = dict(RANDOM_SHAPES[shape])
    n, every = fields["num_hidden_layers"], fields.pop("full_attention_interval")
    cfg = tf.Qwen3NextConfig(**fields, linear_conv_kernel_dim=4, max_position_embeddings=4096,
                             layer_types=["full_attention" if (i + 1) % every == 0 else "linear_attention"
                                          for i in range(n)])
    tf.Qwen3NextForCausalLM(cfg).save_pretrained(path)
    return path


def workload(n: int, vocab: int, input_range: tuple[int, int], output_range: tuple[int, int], seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*input_range))] for _ in range(n)]
    outputs = [rng.randint(*output_range) for _ in range(n)]
    return prompts, outputs


def run_engine(llm: LLM, prompts, outputs) -> dict:
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in outputs]
    before = llm.engine.get_stats()
    start = time.perf_counter()
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    after = llm.engine.get_stats()
    generated = sum(len(r.outputs[0].token_ids) for r in results)
    assert generated == sum(outputs), "ignore_eos requests must run to max_tokens"
    steps = after.num_steps_total - before.num_steps_total
    return dict(elapsed=elapsed, out_tok_s=generated / elapsed,
                total_tok_s=(generated + sum(map(len, prompts))) / elapsed, steps=steps,
                mean_batch_tokens=(after.num_batched_tokens_total - before.num_batched_tokens_total) / max(steps, 1),
                preempted=after.num_preempted_total - before.num_preempted_total)


def run_hf(path: Path, prompts, outputs) -> float:
    """transformers generate, one request at a time (greedy, no EOS), output tok/s."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        model.generate(input_ids=torch.tensor([prompts[0]]), max_new_tokens=2, do_sample=False,
                       eos_token_id=None, pad_token_id=0)
        start = time.perf_counter()
        for p, m in zip(prompts, outputs):
            model.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=m, min_new_tokens=m, do_sample=False, eos_token_id=None, pad_token_id=0)
        elapsed = time.perf_counter() - start
    return sum(outputs) / elapsed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    ap.add_argument("--random-model", choices=sorted(RANDOM_SHAPES), default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    ap.add_argument("--concurrency", default="1,4,16,64", help="comma-separated max_num_seqs values")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peer", choices=["none", "hf"], default="none",
                    help="also time transformers generate (batch 1) on the first --peer-prompts requests")
    ap.add_argument("--peer-prompts", type=int, default=8)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.model) if args.model else DEFAULT_MODEL_PATH
        if args.random_model:
            path = build_random_model(args.random_model, Path(tmp) / args.random_model)
        levels = [int(c) for c in args.concurrency.split(",")]
        llm = None
        rows = []
        for c in levels:
            llm = LLM(path, device=args.device, dtype=args.dtype, max_num_seqs=c,
                      max_num_batched_tokens=args.max_num_batched_tokens)
            prompts, outputs = workload(args.num_prompts, llm.config.vocab_size, tuple(args.input_len),
                                        tuple(args.output_len), args.seed)
            run_engine(llm, prompts[: min(4, len(prompts))], [4] * min(4, len(prompts)))   # warm-up
            rows.append((c, run_engine(llm, prompts, outputs)))
        params = sum(p.numel() for p in llm.model.parameters())
        print(f"model {path.name} ({params / 1e6:.1f}M params, {llm.config.num_hidden_layers} layers), "
              f"device {llm.device}, dtype {next(llm.model.parameters()).dtype}, torch {torch.__version__}, "
              f"threads {torch.get_num_threads()}, {platform.processor() or platform.machine()}")
        print(f"workload: {args.num_prompts} requests, prompt {args.input_len[0]}-{args.input_len[1]} tokens, "
              f"output {args.output_len[0]}-{args.output_len[1]} tokens (uniform, seed {args.seed}), greedy, "
              f"ignore_eos; token budget {llm.engine.config.token_budget}")
        base = rows[0][1]["out_tok_s"]
        print(f"{'max_num_seqs':>12} {'output tok/s':>13} {'total tok/s':>12} {'scaling':>8} {'steps':>6} "
              f"{'tokens/step':>12} {'preempted':>9} {'seconds':>8}")
        for c, r in rows:
            print(f"{c:>12} {r['out_tok_s']:>13.1f} {r['total_tok_s']:>12.1f} {r['out_tok_s'] / base:>7.2f}x "
                  f"{r['steps']:>6} {r['mean_batch_tokens']:>12.1f} {r['preempted']:>9} {r['elapsed']:>8.1f}")
        if args.peer == "hf":
            k = min(args.peer_prompts, args.num_prompts)
            prompts, outputs = workload(args.num_prompts, llm.config.vocab_size, tuple(args.input_len),
                                        tuple(args.output_len), args.seed)
            one = LLM(path, device=args.device, dtype=args.dtype, max_num_seqs=1)
            run_engine(one, prompts[:2], [4, 4])
            ours = run_engine(one, prompts[:k], outputs[:k])["out_tok_s"]
            theirs = run_hf(path, prompts[:k], outputs[:k])
            print(f"peer (first {k} requests, one at a time, greedy): deltaserve {ours:.1f} tok/s, "
                  f"transformers {transformers_version()} {theirs:.1f} tok/s, ratio {ours / theirs:.2f}x")
    return 0


def transformers_version() -> str:
    import transformers

    return transformers.__version__


if __name__ == "__main__":
    sys.exit(main())
