"""The real app, run_server and its lifecycle around the scripted engine (tests only), plus a way to kill
the engine loop: a prompt containing `[[crash]]` makes the next engine step raise.
`python tests/server/lifecycle_server.py --model DIR --port PORT [--shutdown-timeout S]
[--stream-inactivity-timeout S] [--send-buffer BYTES] [--no-engine-process] [--data-parallel-size N]`; exits with run_server's status. --send-buffer caps
the kernel send buffer of every connection, so a client that stops reading blocks the server's sends after
kilobytes instead of the megabytes Linux buffers by default."""

from __future__ import annotations

import argparse
import functools
import logging
import socket
import sys

from fake_engine import ScriptedEngine

from deltaserve.server.api_server import run_server
from deltaserve.server.lifecycle import bind_socket
from deltaserve.server.state import ServerConfig


class CrashingEngine(ScriptedEngine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.crash = False

    def add_request(self, request_id, prompt, params, arrival_time=None) -> None:
        super().add_request(request_id, prompt, params, arrival_time)
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        self.crash = self.crash or "[[crash]]" in self.tokenizer.decode(ids, skip_special_tokens=False)

    def step(self):
        if self.crash:
            raise RuntimeError("scripted engine failure")
        return super().step()


def make_engine(model_dir: str, index: int) -> CrashingEngine:
    return CrashingEngine(model_dir)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--shutdown-timeout", type=float, default=5.0)
    p.add_argument("--stream-inactivity-timeout", type=float, default=60.0)
    p.add_argument("--send-buffer", type=int, default=None)
    p.add_argument("--engine-process", default=True, action=argparse.BooleanOptionalAction,
                   help="the engine in engine core process(es), as `deltaserve serve` does; --no-engine-process: "
                        "in a thread of the server process")
    p.add_argument("--data-parallel-size", type=int, default=1)
    p.add_argument("--stream-interval", type=int, default=1)
    args = p.parse_args()
    sock = bind_socket("127.0.0.1", args.port)
    if args.send_buffer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, args.send_buffer)   # inherited by accepted sockets
    logging.basicConfig(level=logging.INFO)
    client = None
    if args.engine_process:
        from deltaserve.server.engine_client import EngineCoreClient, EngineCoreSpec

        spec = EngineCoreSpec(functools.partial(make_engine, args.model), args.model, args.data_parallel_size)
        engine = client = EngineCoreClient(spec).start()
        print(f"engine core pids: {[c.process.pid for c in client._cores]}", flush=True)
    else:
        engine = CrashingEngine(args.model)
    config = ServerConfig(served_model_name="scripted", model_path=args.model,
                          stream_inactivity_timeout=args.stream_inactivity_timeout or None,
                          stream_interval=args.stream_interval)
    try:
        return run_server(engine, config, host="127.0.0.1", port=args.port, log_level="warning",
                          sock=sock, shutdown_timeout=args.shutdown_timeout)
    finally:
        if client is not None:
            client.close()


if __name__ == "__main__":
    sys.exit(main())
