"""`deltaserve serve`: flags -> LLMEngine + ServerConfig -> uvicorn."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

from .lifecycle import DEFAULT_SHUTDOWN_TIMEOUT, DEFAULT_STREAM_INACTIVITY_TIMEOUT

DEFAULT_SERVED_NAME = "deltaserve-default"


def add_serve_parser(subparsers, add_model_arguments: Callable[[argparse.ArgumentParser], None]) -> None:
    p = subparsers.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help=f"name clients use as 'model' (default: the model directory's name, or "
                        f"{DEFAULT_SERVED_NAME!r} for the embedded model)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one engine step")
    p.add_argument("--block-size", type=int, default=16, help="tokens per paged-KV block")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="KV blocks (default: from free memory)")
    p.add_argument("--cpu-cache-bytes", type=int, default=None, help="cache budget on CPU (default: the engine's)")
    p.add_argument("--enforce-reference-ops", action="store_true", help="torch reference ops even on CUDA")
    p.add_argument("--tool-call-parser", choices=("auto", "qwen", "none"), default="auto",
                   help="parse <tool_call> / <function=...> output into tool_calls (auto: when the tokenizer "
                        "or chat template knows the tags)")
    p.add_argument("--reasoning-parser", choices=("auto", "qwen3", "none"), default="auto",
                   help="split <think>...</think> into reasoning_content (auto: when the tokenizer knows <think>)")
    p.add_argument("--max-logprobs", type=int, default=20, help="largest logprobs / top_logprobs accepted")
    p.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT,
                   help="on SIGTERM / SIGINT, seconds live requests get to finish before they are ended with an "
                        "error (default: %(default)s)")
    p.add_argument("--stream-inactivity-timeout", type=float, default=DEFAULT_STREAM_INACTIVITY_TIMEOUT,
                   help="abort a response (and free its cache) whose client has not read it for this many seconds; "
                        "0 = never (default: %(default)s)")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug", "trace"))
    p.set_defaults(func=cmd_serve)


def served_model_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    return Path(args.model).resolve().name if args.model else DEFAULT_SERVED_NAME


def cmd_serve(args: argparse.Namespace) -> int:
    from ..engine.llm_engine import LLMEngine
    from ..llm import DEFAULT_MODEL_PATH
    from .api_server import run_server
    from .lifecycle import answering_while_loading, bind_socket
    from .state import ServerConfig

    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.max_logprobs < 0:
        raise ValueError(f"--max-logprobs must be >= 0, got {args.max_logprobs}")
    if args.shutdown_timeout < 0 or args.stream_inactivity_timeout < 0:
        raise ValueError("--shutdown-timeout and --stream-inactivity-timeout must be >= 0")
    sock = bind_socket(args.host, args.port)   # a port in use fails now, not after the model has loaded
    with answering_while_loading(sock):          # 503 until the engine can serve
        engine = LLMEngine.from_args(
            args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
            num_gpu_blocks=args.num_gpu_blocks, cpu_cache_bytes=args.cpu_cache_bytes, seed=args.seed,
            enforce_reference_ops=args.enforce_reference_ops, load_format=args.load_format,
            enforce_eager=args.enforce_eager, compile=args.compile, async_scheduling=args.async_scheduling,
            warm_up=args.warm_up)
    config = ServerConfig(served_model_name=served_model_name(args), model_path=str(args.model or DEFAULT_MODEL_PATH),
                          api_key=args.api_key, max_logprobs=args.max_logprobs,
                          tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                          stream_inactivity_timeout=args.stream_inactivity_timeout or None)
    return run_server(engine, config, host=args.host, port=args.port, log_level=args.uvicorn_log_level, sock=sock,
                      shutdown_timeout=args.shutdown_timeout)
