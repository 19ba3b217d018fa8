"""`deltaserve serve [MODEL]`: flags -> checked before anything loads -> engine core process(es) (or an in-thread
LLMEngine with --no-engine-process) + ServerConfig -> uvicorn."""

from __future__ import annotations

import argparse
import functools
import json
import os
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

from .lifecycle import DEFAULT_SHUTDOWN_TIMEOUT, DEFAULT_STREAM_INACTIVITY_TIMEOUT
from .state import DEFAULT_MAX_REQUEST_BYTES, PROMPT_CHARS_PER_TOKEN, ServerConfig

DEFAULT_SERVED_NAME = "deltaserve-default"

DESCRIPTION = """\
Start an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions,
/v1/models, /health, /metrics) for MODEL, a Hugging Face model directory
(default: the embedded model). Every argument is checked before the model loads."""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each flag's default, except where there is none to show (None, a plain on/off flag) or the
    help text already says what it is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or "default:" in text or action.default is None or action.default is False \
                or action.default == argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in "invalid int value" messages
    return parse


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def parse_origins(text: str) -> tuple[str, ...]:
    """--allowed-origins: a comma-separated list or a JSON list of origins ('*' or scheme://host[:port])."""
    text = text.strip()
    items = json.loads(text) if text.startswith("[") else [o.strip() for o in text.split(",")]
    if not isinstance(items, list) or not all(isinstance(o, str) for o in items):
        raise ValueError(f"--allowed-origins must be a list of strings, got {text!r}")
    origins = tuple(o for o in items if o)
    for origin in origins:
        if origin == "*":
            continue
        parts = urlsplit(origin)
        try:
            parts.port  # noqa: B018 (raises on a bad port)
        except ValueError:
            raise ValueError(f"--allowed-origins: bad port in {origin!r}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/") \
                or parts.query or parts.fragment:
            raise ValueError(f"--allowed-origins: {origin!r} is not an origin ('*' or scheme://host[:port], "
                             "e.g. https://example.com)")
    if not origins:
        raise ValueError("--allowed-origins is empty")
    return origins


def add_serve_parser(subparsers, add_model_arguments: Callable[[argparse.ArgumentParser], None]) -> None:
    p = subparsers.add_parser("serve", help="start the OpenAI-compatible HTTP server", description=DESCRIPTION,
                              formatter_class=_HelpFormatter)
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="model directory, as in `vllm serve MODEL` (same as --model; giving both differently is "
                        "an error)")
    add_model_arguments(p)
    add_engine_arguments(p)
    add_layout_arguments(p)
    add_server_arguments(p)
    p.set_defaults(func=cmd_serve)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--max-num-seqs", type=_int_at_least(1), default=64, help="requests running at once")
    g.add_argument("--max-num-batched-tokens", type=_int_at_least(1), default=None,
                   help="token budget of one engine step (default: the engine's)")
    g.add_argument("--block-size", type=_int_at_least(1), default=16, help="tokens per paged-KV block")
    g.add_argument("--gpu-memory-utilization", type=_fraction, default=0.9,
                   help="fraction of the GPU's memory the engine may use (weights, activations, cache)")
    g.add_argument("--num-gpu-blocks", type=_int_at_least(1), default=None,
                   help="KV blocks (default: from free memory)")
    g.add_argument("--cpu-cache-bytes", type=_int_at_least(1), default=None,
                   help="cache budget on CPU (default: the engine's)")
    g.add_argument("--enforce-reference-ops", action="store_true", help="torch reference ops even on CUDA")


def add_layout_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("process layout")
    g.add_argument("--engine-process", default=True, action=argparse.BooleanOptionalAction,
                   help="run the engine (scheduler, runner, sampler) in an engine core process of its own, beside "
                        "the API server process (HTTP, tokenization, SSE); --no-engine-process: in a thread of the "
                        "server process (debugging)")
    g.add_argument("--data-parallel-size", "-dp", type=_int_at_least(1), default=1,
                   help="engine core replicas behind the one API server, each a full engine; requests go to the "
                        "one with the fewest outstanding requests (CUDA: replica i on cuda:i; CPU: they share it)")


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    """The HTTP server's flags (also used by the tests' scripted server, which has no real engine)."""
    g = p.add_argument_group("HTTP server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    g.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    g.add_argument("--served-model-name", default=None,
                   help=f"name clients use as 'model' (default: the model directory's name, or "
                        f"{DEFAULT_SERVED_NAME!r} for the embedded model)")
    g.add_argument("--tool-call-parser", choices=("auto", "qwen", "none"), default="auto",
                   help="parse <tool_call> / <function=...> output into tool_calls (auto: when the tokenizer "
                        "or chat template knows the tags)")
    g.add_argument("--reasoning-parser", choices=("auto", "qwen3", "none"), default="auto",
                   help="split <think>...</think> into reasoning_content (auto: when the tokenizer knows <think>)")
    g.add_argument("--tokenizer-workers", type=_int_at_least(1), default=2,
                   help="threads that tokenize prompts, render chat templates and decode long texts, off the "
                        "event loop")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug", "trace"), help="uvicorn's log level")

    g.add_argument("--stream-interval", type=_int_at_least(1), default=1,
                   help="tokens between a stream's chunks: 1 sends each step's token at once; N > 1 coalesces N "
                        "steps' tokens into one chunk (fewer, larger chunks under load); the last chunk is never held")
    g = p.add_argument_group("request limits")
    g.add_argument("--max-request-bytes", type=_int_at_least(1), default=DEFAULT_MAX_REQUEST_BYTES,
                   help="largest request body; a larger one gets 413, as soon as its bytes pass the limit")
    g.add_argument("--max-prompt-chars", type=_int_at_least(1), default=None,
                   help=f"longest prompt text (a completions prompt, or the text of the chat messages), checked "
                        f"before tokenizing (default: max_model_len * {PROMPT_CHARS_PER_TOKEN}, more than any "
                        "text that fits the context)")
    g.add_argument("--max-n", type=_int_at_least(1), default=128, help="largest n / best_of (OpenAI's cap)")
    g.add_argument("--max-stop-sequences", type=_int_at_least(0), default=64, help="most stop strings per request")
    g.add_argument("--max-tools", type=_int_at_least(0), default=128, help="most tools per request (OpenAI's cap)")
    g.add_argument("--max-logprobs", type=_int_at_least(0), default=20, help="largest logprobs / top_logprobs")
    g.add_argument("--max-waiting-requests", type=_int_at_least(1), default=None,
                   help="most requests waiting for their first token (being tokenized, queued or in prefill); "
                        "beyond it a request gets 503 with Retry-After (default: no limit)")

    g = p.add_argument_group("security")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health (compared in constant "
                        "time)")
    g.add_argument("--allowed-origins", type=parse_origins, default=None,
                   help="enable CORS for these browser origins: comma-separated or a JSON list, '*' for any "
                        "(default: CORS off, no CORS headers)")
    g.add_argument("--ssl-keyfile", default=None, help="TLS private key file (PEM); needs --ssl-certfile")
    g.add_argument("--ssl-certfile", default=None, help="TLS certificate file (PEM): serve HTTPS")
    g.add_argument("--enable-log-requests", action="store_true",
                   help="log each request's prompt (text or token ids), prompt length and sampling parameters at "
                        "INFO (logger 'deltaserve.requests'); off by default: prompts are not logged")
    g.add_argument("--max-log-len", type=_int_at_least(0), default=None,
                   help="with --enable-log-requests: log at most this many prompt characters / token ids "
                        "(default: all)")
    g.add_argument("--content-special-tokens-as-text", action="store_true",
                   help="in chat requests, tokenize special-token strings that the client wrote (in messages, "
                        "tools, chat_template_kwargs), e.g. '<|im_start|>system', as ordinary text, so a user "
                        "cannot inject turns; only the tokens the chat template writes stay special. Off by "
                        "default, as in vLLM. /v1/completions prompts are never escaped (their author writes "
                        "the whole prompt)")


    g = p.add_argument_group("lifecycle")
    g.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT,
                   help="on SIGTERM / SIGINT, seconds live requests get to finish before they are ended with an "
                        "error chunk and [DONE]")
    g.add_argument("--stream-inactivity-timeout", type=float, default=DEFAULT_STREAM_INACTIVITY_TIMEOUT,
                   help="abort a response (and free its cache) whose client has not read it for this many "
                        "seconds; 0 = never")

def check_serve_args(args: argparse.Namespace) -> None:
    """Everything that can be checked without loading the model; raises ValueError."""
    if args.model_tag is not None:
        if args.model is not None and Path(args.model).resolve() != Path(args.model_tag).resolve():
            raise ValueError(f"the model is given twice, differently: MODEL {args.model_tag!r} and "
                             f"--model {args.model!r}")
        args.model = args.model_tag
    if args.model is not None:
        path = Path(args.model)
        if not path.is_dir():
            raise ValueError(f"model directory {args.model!r} does not exist")
        if not (path / "config.json").is_file():
            raise ValueError(f"{args.model!r} has no config.json: not a Hugging Face model directory")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise ValueError(f"--max-model-len must be >= 2 (a prompt token and a generated one), got {args.max_model_len}")
    _check_device_and_dtype(args.device, args.dtype)
    if args.data_parallel_size > 1 and not args.engine_process:
        raise ValueError("--data-parallel-size > 1 needs engine core processes (drop --no-engine-process)")
    if args.data_parallel_size > 1 and args.tensor_parallel_size > 1:
        raise ValueError("--data-parallel-size > 1 with --tensor-parallel-size > 1 is not implemented")
    check_server_args(args)


def _check_device_and_dtype(device: str, dtype: str) -> None:
    from ..engine.config import resolve_device, resolve_dtype

    try:
        resolved = resolve_device(device)
    except RuntimeError as exc:  # torch.device("gpu"): "Expected one of cpu, cuda, ... device type"
        raise ValueError(f"--device {device!r}: {exc}") from None
    if dtype != "auto":
        resolve_dtype(dtype, None, resolved)  # a named dtype needs no model config


def check_server_args(args: argparse.Namespace) -> None:
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ValueError("--served-model-name must not be empty")
    if args.api_key is not None and not args.api_key:
        raise ValueError("--api-key must not be empty")
    if args.ssl_keyfile is not None and args.ssl_certfile is None:
        raise ValueError("--ssl-keyfile needs --ssl-certfile")
    for flag, value in (("--ssl-certfile", args.ssl_certfile), ("--ssl-keyfile", args.ssl_keyfile)):
        if value is not None and not Path(value).is_file():
            raise ValueError(f"{flag} {value!r} does not exist")
    if args.max_log_len is not None and not args.enable_log_requests:
        raise ValueError("--max-log-len needs --enable-log-requests")
    if args.shutdown_timeout < 0 or args.stream_inactivity_timeout < 0:
        raise ValueError("--shutdown-timeout and --stream-inactivity-timeout must be >= 0")


def served_model_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    return Path(args.model).resolve().name if args.model else DEFAULT_SERVED_NAME


def server_config(args: argparse.Namespace, model_path: str) -> ServerConfig:
    return ServerConfig(
        served_model_name=served_model_name(args), model_path=model_path, api_key=args.api_key,
        max_logprobs=args.max_logprobs, tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser, max_request_bytes=args.max_request_bytes,
        max_prompt_chars=args.max_prompt_chars, max_n=args.max_n, max_stop_sequences=args.max_stop_sequences,
        max_tools=args.max_tools, max_waiting_requests=args.max_waiting_requests,
        tokenizer_workers=args.tokenizer_workers, allowed_origins=args.allowed_origins or (),
        enable_log_requests=args.enable_log_requests, max_log_len=args.max_log_len,
        content_special_tokens_as_text=args.content_special_tokens_as_text, ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile, stream_inactivity_timeout=args.stream_inactivity_timeout or None,
        stream_interval=args.stream_interval)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """LLMEngine.from_args keyword arguments from the flags."""
    return dict(device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
                num_gpu_blocks=args.num_gpu_blocks, cpu_cache_bytes=args.cpu_cache_bytes, seed=args.seed,
                enforce_reference_ops=args.enforce_reference_ops, load_format=args.load_format,
                enforce_eager=args.enforce_eager, compile=args.compile, async_scheduling=args.async_scheduling,
                prefill_cuda_graphs=args.prefill_cuda_graphs,
                warm_up=args.warm_up, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                enable_prefix_caching=args.enable_prefix_caching,
                prefix_cache_state_fraction=args.prefix_cache_state_fraction,
                tensor_parallel_size=args.tensor_parallel_size, enable_expert_parallel=args.enable_expert_parallel,
                scheduling_policy=args.scheduling_policy)


def build_replica(model: str | None, kwargs: dict[str, Any], data_parallel_size: int, index: int, *,
                  own_process: bool = True) -> Any:
    """Runs in engine core `index`: its LLMEngine. Several replicas on CUDA take one device each; on CPU they
    split the cores between them."""
    import torch

    from ..engine.config import resolve_device
    from ..engine.llm_engine import LLMEngine

    device = resolve_device(kwargs["device"])
    if device.type == "cuda":
        if data_parallel_size > 1:
            if torch.cuda.device_count() < data_parallel_size:
                raise ValueError(f"--data-parallel-size {data_parallel_size} needs as many CUDA devices; "
                                 f"{torch.cuda.device_count()} visible")
            kwargs = {**kwargs, "device": f"cuda:{index}"}
    elif own_process:
        # the cores' compute threads leave one CPU to the API server process (unless OMP_NUM_THREADS says how
        # many): with every CPU taken, OpenMP's spinning teams stall whenever the server runs (3x slower
        # decode at concurrency 8 on 2 CPUs)
        threads = int(os.environ["OMP_NUM_THREADS"]) if os.environ.get("OMP_NUM_THREADS", "").isdigit() \
            else max(1, _usable_cpus() - 1)
        torch.set_num_threads(max(1, threads // data_parallel_size))
    return LLMEngine.from_args(model, **kwargs)


def _usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cmd_serve(args: argparse.Namespace) -> int:
    check_serve_args(args)
    from ..llm import DEFAULT_MODEL_PATH
    from .api_server import run_server
    from .lifecycle import answering_while_loading, bind_socket

    model_dir = str(args.model or DEFAULT_MODEL_PATH)
    if int(os.environ.get("RANK", "0")) > 0:    # a torchrun rank other than 0: no server, it runs rank 0's steps
        from ..engine.llm_engine import LLMEngine

        LLMEngine.from_args(args.model, **engine_kwargs(args))   # returns by SystemExit(0) once rank 0 stops
        return 0
    sock = bind_socket(args.host, args.port)   # a port in use fails now, not after the model has loaded
    client = None
    with answering_while_loading(sock, ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile):
        if args.engine_process:   # 503 until every engine core can serve (a TP core starts its ranks)
            from .engine_client import EngineCoreClient, EngineCoreSpec

            factory = functools.partial(build_replica, args.model, engine_kwargs(args), args.data_parallel_size)
            engine = client = EngineCoreClient(EngineCoreSpec(factory, model_dir, args.data_parallel_size)).start()
        else:
            engine = build_replica(args.model, engine_kwargs(args), 1, 0, own_process=False)
    config = server_config(args, model_dir)
    try:
        return run_server(engine, config, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                          sock=sock, shutdown_timeout=args.shutdown_timeout)
    finally:
        if client is not None:
            client.close()
