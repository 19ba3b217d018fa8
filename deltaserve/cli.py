"""Command line: `deltaserve generate`, `deltaserve serve`. Thin: parse flags, build configs, dispatch."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from .env import settings


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="Hugging Face model directory (default: the embedded model)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", help="auto | bfloat16 | float16 | float32")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    p.add_argument("--seed", type=int, default=0, help="seed for requests without their own")
    p.add_argument("--load-format", default="auto", choices=("auto", "safetensors", "dummy"),
                   help="dummy: random weights from the model directory's config.json alone (benchmarks; "
                        "token-id prompts unless the directory has a tokenizer.json)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run every step eagerly (no CUDA graphs for decode steps, no compiled CPU decode step)")
    p.add_argument("--async-scheduling", default=None, action=argparse.BooleanOptionalAction,
                   help="launch each step before reading the previous step's tokens, so host work overlaps the "
                        "GPU (default: on for CUDA devices, off on CPU)")
    p.add_argument("--warm-up", default=None, action=argparse.BooleanOptionalAction,
                   help="run throw-away requests of several batch packings at startup so kernels are built before "
                        "serving (serve: on for CUDA devices by default; generate: off by default)")
    p.add_argument("--compile", default=None, choices=("auto", "on", "off"),
                   help="compiled CPU decode step: auto = compile in the background, eager until ready; on = compile "
                        "first; off = never (default: $DELTASERVE_COMPILE, else auto for serve and off for "
                        "generate, whose one-shot run ends before a compile could pay off)")


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--stop-token-id", type=int, action="append", default=None, dest="stop_token_ids")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", type=int, default=None, help="print top-N logprobs of each generated token")
    p.add_argument("--n", type=int, default=1, help="completions per prompt")


def _sampling_params(args: argparse.Namespace):
    from .sampling_params import SamplingParams

    return SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        seed=args.sample_seed, max_tokens=args.max_tokens, stop=args.stop, stop_token_ids=args.stop_token_ids,
        ignore_eos=args.ignore_eos, logprobs=args.logprobs, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty)


def cmd_generate(args: argparse.Namespace) -> int:
    from .llm import LLM

    params = _sampling_params(args)
    prompts: list = list(args.prompt)
    if args.prompt_token_ids:
        prompts.append({"prompt_token_ids": json.loads(args.prompt_token_ids)})
    if not prompts:
        print("deltaserve generate: give a prompt (or --prompt-token-ids '[1, 2, 3]')", file=sys.stderr)
        return 2
    llm = LLM(args.model, device=args.device, dtype=args.dtype, seed=args.seed, max_model_len=args.max_model_len,
              load_format=args.load_format, enforce_eager=args.enforce_eager,
              compile=args.compile or settings().compile or "off", async_scheduling=args.async_scheduling,
              warm_up=bool(args.warm_up))                 # one-off generation: only when asked
    for out in llm.generate(prompts, params, use_tqdm=False):
        for c in out.outputs:
            if args.json:
                print(json.dumps({"prompt": out.prompt, "text": c.text, "token_ids": c.token_ids,
                                  "finish_reason": c.finish_reason}))
            else:
                print((out.prompt or "") + c.text if args.echo else c.text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deltaserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text offline from one or more prompts")
    gen.add_argument("prompt", nargs="*", help="prompt text(s)")
    gen.add_argument("--prompt-token-ids", default=None, help="a JSON list of token ids as an extra prompt")
    gen.add_argument("--echo", action="store_true", help="print the prompt before the completion")
    gen.add_argument("--json", action="store_true", help="one JSON object per completion")
    add_model_arguments(gen)
    add_sampling_arguments(gen)
    gen.set_defaults(func=cmd_generate)

    try:
        from .server.cli_args import add_serve_parser
    except ImportError:
        add_serve_parser = None
    if add_serve_parser is not None:
        add_serve_parser(sub, add_model_arguments)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=settings().log_level, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"deltaserve {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
