"""Command line: `deltaserve generate`, `deltaserve serve`, `deltaserve --version`. Thin: parse flags, check
them, build configs, dispatch. Nothing heavy (torch, the model) is imported before the flags are checked."""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from pathlib import Path

from . import __version__
from .env import settings
from .spec.config import SpeculativeConfig

DESCRIPTION = """\
deltaserve runs hybrid Gated-DeltaNet language models (Qwen3-Next, Qwen3.5 / 3.6): offline generation from the
command line, or an OpenAI-compatible HTTP server. Without a model directory it uses the small model that ships
inside the package."""

EPILOG = """\
examples:
  deltaserve generate "The history of the city" --max-tokens 32
  deltaserve generate "Hello" "Bonjour" --temperature 0.7 --n 2 --json
  deltaserve serve /path/to/Qwen3-Next-80B-A3B-Instruct --port 8000

`deltaserve COMMAND --help` lists every flag of a command with its default."""

DTYPES = ("auto", "bfloat16", "float16", "float32", "bf16", "fp16", "half", "fp32")
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")
PREVIEW_CHARS = 60


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's line breaks and appends "(default: X)" to a flag's help, except where the help
    already says what the default is, or there is nothing to show (None, a store_true flag's False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or not action.option_strings or isinstance(action, argparse.BooleanOptionalAction)
                or any(action.default is nothing for nothing in (None, False, argparse.SUPPRESS))):
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose help shows defaults (subcommands' parsers too: add_subparsers uses this class)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def _open_fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {value}")
    return value


def _speculative_config(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="Hugging Face checkpoint directory (default: the embedded model shipped in the package)")
    p.add_argument("--device", default="auto", help="auto (a CUDA GPU when there is one, else the CPU) | cpu | cuda | "
                                                    "cuda:N")
    p.add_argument("--dtype", default="auto", choices=DTYPES, metavar="DTYPE",
                   help="auto (float32 on CPU, the checkpoint's dtype on GPU) | bfloat16 | float16 | float32")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context limit in tokens (default: the model's max_position_embeddings)")
    p.add_argument("--seed", type=int, default=0, help="seed of the shared generator, for requests without their own")
    p.add_argument("--load-format", default="auto", choices=("auto", "safetensors", "dummy"),
                   help="dummy: random weights from the model directory's config.json alone (benchmarks; "
                        "token-id prompts unless the directory has a tokenizer.json)")
    p.add_argument("--quantization", "-q", default=None, choices=("fp8",),
                   help="fp8: quantise a bf16 checkpoint's weights at load into block-FP8 (128 x 128 blocks); "
                        "an FP8 checkpoint is read as FP8 without it")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "fp8_e4m3"),
                   help="fp8: e4m3 K/V cache with per-layer scales (checkpoint k_scale / v_scale, else calibrated "
                        "at start-up), read by the reference and the Triton attention kernels")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run every step eagerly (no CUDA graphs for decode steps, no compiled CPU decode step)")
    p.add_argument("--prefill-cuda-graphs", default=True, action=argparse.BooleanOptionalAction,
                   help="prefill and mixed steps as piecewise CUDA graphs per token bucket (CUDA only; "
                        "--no-prefill-cuda-graphs runs them eagerly, decode steps keep their graphs)")
    p.add_argument("--async-scheduling", default=None, action=argparse.BooleanOptionalAction,
                   help="launch each step before reading the previous step's tokens, so host work overlaps the "
                        "GPU (default: on for CUDA devices, off on CPU)")
    p.add_argument("--enable-prefix-caching", default=True, action=argparse.BooleanOptionalAction,
                   help="resume requests from the cached KV blocks and GDN state snapshots of earlier ones (exact, "
                        "token-granular)")
    p.add_argument("--prefix-cache-state-fraction", type=_open_fraction, default=0.1, metavar="FRACTION",
                   help="share of the cache budget for the prefix cache's GDN state snapshots")
    p.add_argument("--scheduling-policy", default="fcfs", choices=("fcfs", "priority"),
                   help="waiting-queue order: fcfs (arrival) or priority (the request's `priority`, lower first)")
    p.add_argument("--warm-up", default=None, action=argparse.BooleanOptionalAction,
                   help="run throw-away requests of several batch packings at startup so kernels are built before "
                        "serving (default: serve: on for CUDA devices; generate: off)")
    p.add_argument("--compile", default=None, choices=("auto", "on", "off"),
                   help="compiled CPU decode step (torch.compile): auto = compile in the background, eager until "
                        "ready; on = compile first; off = never (default: $DELTASERVE_COMPILE, else off: on a small "
                        "CPU the eager step is the faster one, see the README's speed notes)")
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                   help="shard the model over this many devices, one worker process each (under torchrun: the "
                        "WORLD_SIZE; the README shows the multi-node command)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE layers: whole experts per rank instead of every expert's width split over the ranks")
    p.add_argument("--speculative-config", type=_speculative_config, default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s keys as a JSON object, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 3}\' (output unchanged; K is the most '
                        'drafts per step, adaptive K picks fewer or none)')


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to generate per completion at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of tokens "
                                                            "whose probability mass reaches this, in (0, 1]")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 or -1: all)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens whose probability is below this fraction of the most likely one's")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 1 discourages tokens already in the prompt or the output (1: off)")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtracted from the logit of every token already generated")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted from a token's logit once per time it was already generated")
    g.add_argument("--sample-seed", type=int, default=None,
                   help="per-request sampling seed (default: none, draw from the shared generator)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable; default: none)")
    g.add_argument("--stop-token-id", type=int, action="append", default=None, dest="stop_token_ids",
                   help="stop token id (repeatable; default: none besides the model's EOS)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the EOS token")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="print each generated token's logprob and the N most likely alternatives (default: none)")
    g.add_argument("--n", type=int, default=1, help="completions per prompt")


def sampling_params(args: argparse.Namespace):
    """SamplingParams from the flags; raises ValueError naming the field (checked before any model loads)."""
    from .sampling_params import SamplingParams

    return SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        seed=args.sample_seed, max_tokens=args.max_tokens, stop=args.stop, stop_token_ids=args.stop_token_ids,
        ignore_eos=args.ignore_eos, logprobs=args.logprobs, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty)


def check_model_arguments(args: argparse.Namespace) -> None:
    """The model flags that can be checked without loading anything; ValueError / FileNotFoundError if not."""
    if not DEVICE_PATTERN.fullmatch(args.device):
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {args.device!r}")
    if args.model is not None:
        path = Path(args.model)
        if not path.is_dir():
            raise FileNotFoundError(f"--model {args.model}: not a directory (deltaserve loads a local Hugging Face "
                                    f"checkpoint directory; it downloads nothing)")
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"--model {args.model}: no config.json in it")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise ValueError(f"--max-model-len must be >= 2 (a prompt token and a generated one), got "
                         f"{args.max_model_len}")
    if args.device.startswith("cuda"):
        from .engine.config import resolve_device

        resolve_device(args.device)           # no CUDA: a clear error now rather than after loading


def check_in_vocabulary(flag: str, ids: list[int], model: str | None) -> None:
    """Token ids against the model's vocabulary, read from its config.json (no weights load)."""
    from .config import ModelConfig
    from .llm import DEFAULT_MODEL_PATH

    vocab = ModelConfig.from_hf(Path(model) if model else DEFAULT_MODEL_PATH).vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ValueError(f"{flag}: {bad[:5]} out of the model's vocabulary [0, {vocab})")


def prompts_from(args: argparse.Namespace) -> list:
    """The prompts: the texts, then --prompt-token-ids (checked against the model's vocabulary)."""
    prompts: list = list(args.prompt)
    if args.prompt_token_ids is not None:
        try:
            ids = json.loads(args.prompt_token_ids)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--prompt-token-ids must be a JSON list of token ids: {exc}") from None
        if not isinstance(ids, list) or not ids or not all(type(i) is int for i in ids):
            raise ValueError(f"--prompt-token-ids must be a non-empty JSON list of integers, got "
                             f"{args.prompt_token_ids!r}")
        check_in_vocabulary("--prompt-token-ids", ids, args.model)
        prompts.append({"prompt_token_ids": ids})
    if not prompts:
        raise ValueError("give a prompt (or --prompt-token-ids '[1, 2, 3]')")
    return prompts


# ---- output ------------------------------------------------------------------------------------------

def _preview(out) -> str:
    if out.prompt is None:
        ids = out.prompt_token_ids
        return f"token ids {ids[:8]}" if len(ids) <= 8 else f"token ids {str(ids[:8])[:-1]}, ...] ({len(ids)})"
    text = out.prompt if len(out.prompt) <= PREVIEW_CHARS else out.prompt[:PREVIEW_CHARS] + "..."
    return repr(text)


def logprob_records(completion) -> list[dict] | None:
    """Per generated token: its id, text and logprob, and the alternatives by rank."""
    if completion.logprobs is None:
        return None
    records = []
    for tid, position in zip(completion.token_ids, completion.logprobs):
        chosen = position[tid]
        top = sorted(((i, lp) for i, lp in position.items() if lp.rank is not None), key=lambda x: x[1].rank)
        records.append({"token_id": tid, "token": chosen.decoded_token, "logprob": chosen.logprob,
                        "rank": chosen.rank,
                        "top_logprobs": [{"token_id": i, "token": lp.decoded_token, "logprob": lp.logprob,
                                          "rank": lp.rank} for i, lp in top]})
    return records


def json_record(prompt_index: int, out, completion) -> dict:
    return {"prompt_index": prompt_index, "prompt": out.prompt, "prompt_token_ids": out.prompt_token_ids,
            "index": completion.index, "text": completion.text, "token_ids": completion.token_ids,
            "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason,
            "logprobs": logprob_records(completion)}


def print_logprobs(completion, file) -> None:
    print(f"--- logprobs ({len(completion.token_ids)} tokens: token, logprob, then the most likely tokens) ---",
          file=file)
    for r in logprob_records(completion):
        top = ", ".join(f"{t['token']!r} {t['logprob']:.4f}" for t in r["top_logprobs"])
        print(f"{r['token']!r:>20} {r['logprob']:9.4f}   {top}", file=file)


def print_outputs(outputs: list, args: argparse.Namespace, file=None) -> None:
    """Text mode: the completion text (after the prompt with --echo); a "=== prompt i: ... ===" line before each
    prompt's outputs when there are several prompts, a "--- completion j ---" line when n > 1, the logprobs when
    asked. JSON mode (--json): one object per completion and line."""
    file = file or sys.stdout
    labelled = len(outputs) > 1
    for i, out in enumerate(outputs):
        if args.json:
            for c in out.outputs:
                print(json.dumps(json_record(i, out, c), ensure_ascii=False), file=file)
            continue
        if labelled:
            print(f"=== prompt {i + 1}: {_preview(out)} ===", file=file)
        for c in out.outputs:
            if len(out.outputs) > 1:
                print(f"--- completion {c.index + 1} (finish_reason: {c.finish_reason}) ---", file=file)
            print((out.prompt or "") + c.text if args.echo else c.text, file=file)
            if c.logprobs is not None:
                print_logprobs(c, file)
    file.flush()


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    check_model_arguments(args)
    if args.stop_token_ids:
        check_in_vocabulary("--stop-token-id", args.stop_token_ids, args.model)
    prompts = prompts_from(args)

    from .llm import LLM

    llm = LLM(args.model, device=args.device, dtype=args.dtype, seed=args.seed, max_model_len=args.max_model_len,
              load_format=args.load_format, enforce_eager=args.enforce_eager, compile=args.compile,
              prefill_cuda_graphs=args.prefill_cuda_graphs, async_scheduling=args.async_scheduling,
              tensor_parallel_size=args.tensor_parallel_size,
              enable_expert_parallel=args.enable_expert_parallel, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=args.enable_prefix_caching,
              prefix_cache_state_fraction=args.prefix_cache_state_fraction,
              speculative_config=args.speculative_config,
              warm_up=bool(args.warm_up))                 # one-off generation: only when asked
    print_outputs(llm.generate(prompts, params, use_tqdm=False), args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="deltaserve", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"deltaserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)

    gen = sub.add_parser("generate", help="generate text offline from one or more prompts",
                         description="Generate text from one or more prompts and print it (the model loads, runs "
                                     "the prompts as one batch, and exits).")
    gen.add_argument("prompt", nargs="*", help="prompt text(s)")
    gen.add_argument("--prompt-token-ids", default=None, metavar="JSON",
                     help="a JSON list of token ids, run as one more prompt (default: none)")
    gen.add_argument("--echo", action="store_true", help="print the prompt before the completion")
    gen.add_argument("--json", action="store_true",
                     help="one JSON object per completion and line: prompt_index, prompt, prompt_token_ids, index, "
                          "text, token_ids, finish_reason, stop_reason, logprobs")
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
    args = build_parser().parse_args(argv)
    try:
        logging.basicConfig(level=settings().log_level, format="%(levelname)s %(name)s: %(message)s")
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"deltaserve {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
