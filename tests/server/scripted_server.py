"""Run the real app and uvicorn around the scripted engine (tests only):
`python tests/server/scripted_server.py --model DIR --port PORT [any HTTP-server flag of deltaserve serve]`."""

from __future__ import annotations

import argparse
import logging

from fake_engine import ScriptedEngine

from deltaserve.server.api_server import run_server
from deltaserve.server.cli_args import add_server_arguments, check_server_args, server_config


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--max-model-len", type=int, default=512)
    add_server_arguments(p)
    args = p.parse_args()
    check_server_args(args)
    logging.basicConfig(level=logging.INFO)
    engine = ScriptedEngine(args.model, max_model_len=args.max_model_len)
    args.served_model_name = args.served_model_name or "scripted"
    run_server(engine, server_config(args, args.model), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
