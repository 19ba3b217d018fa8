"""Run the real app and uvicorn around the scripted engine (tests only):
`python tests/server/scripted_server.py --model DIR --port PORT [--api-key KEY]`."""

from __future__ import annotations

import argparse
import logging

from fake_engine import ScriptedEngine

from deltaserve.server.api_server import run_server
from deltaserve.server.state import ServerConfig


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--api-key", default=None)
    p.add_argument("--max-model-len", type=int, default=512)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    engine = ScriptedEngine(args.model, max_model_len=args.max_model_len)
    config = ServerConfig(served_model_name="scripted", model_path=args.model, api_key=args.api_key)
    run_server(engine, config, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
