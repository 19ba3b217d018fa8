"""`deltaserve serve [MODEL]`: the positional model as in vLLM, --help with a line and the default for every
flag, and every argument checked before the model loads (the engine is never built for a bad command)."""

from __future__ import annotations

import argparse

import pytest

from deltaserve.cli import build_parser, main
from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.server.cli_args import check_serve_args, server_config
from deltaserve.server.engine_client import EngineCoreClient


class _Loaded(Exception):
    pass


@pytest.fixture
def loads(monkeypatch):
    """Records what the engine would load (and stops there)."""
    calls = []

    def from_args(model, **kw):
        calls.append(model)
        raise _Loaded()

    monkeypatch.setattr(LLMEngine, "from_args", staticmethod(from_args))
    # the engine core process would build a real engine: build replica 0 here instead
    monkeypatch.setattr(EngineCoreClient, "start", lambda self: self.spec.factory(0))
    return calls


def _serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def test_model_as_positional_or_flag(tiny_model_dir, loads):
    for argv in (["serve", str(tiny_model_dir)], ["serve", "--model", str(tiny_model_dir)],
                 ["serve", str(tiny_model_dir), "--model", str(tiny_model_dir)]):
        with pytest.raises(_Loaded):
            main(argv)
    assert loads == [str(tiny_model_dir)] * 3


def test_two_different_models_are_refused_before_loading(tiny_model_dir, tmp_path, loads, capsys):
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    assert main(["serve", str(tiny_model_dir), "--model", str(other)]) == 2
    assert "given twice" in capsys.readouterr().err and loads == []


@pytest.mark.parametrize("argv, message", [
    (["serve", "/no/such/model"], "does not exist"),
    (["serve", "--ssl-certfile", "/no/cert.pem"], "--ssl-certfile"),
    (["serve", "--ssl-keyfile", "/no/key.pem"], "needs --ssl-certfile"),
    (["serve", "--port", "70000"], "--port"),
    (["serve", "--max-model-len", "1"], "--max-model-len"),
    (["serve", "--max-log-len", "10"], "needs --enable-log-requests"),
    (["serve", "--api-key", ""], "--api-key"),
    (["serve", "--device", "gpu"], "--device"),
])
def test_bad_arguments_fail_before_loading(argv, message, loads, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err and loads == []


@pytest.mark.parametrize("argv, message", [
    (["serve", "--max-n", "0"], "--max-n"),
    (["serve", "--max-num-seqs", "0"], "--max-num-seqs"),
    (["serve", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["serve", "--max-request-bytes", "-1"], "--max-request-bytes"),
    (["serve", "--allowed-origins", "not an origin"], "--allowed-origins"),
    (["serve", "--allowed-origins", "https://a.example/path"], "--allowed-origins"),
    (["serve", "--dtype", "int3"], "int3"),
])
def test_bad_values_are_refused_by_the_parser(argv, message, loads, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err and loads == []


def test_origins_parse_from_a_list_or_json():
    parser = _serve_parser()
    args = parser.parse_args(["--allowed-origins", "https://a.example, http://localhost:3000"])
    assert args.allowed_origins == ("https://a.example", "http://localhost:3000")
    assert parser.parse_args(["--allowed-origins", '["*"]']).allowed_origins == ("*",)


def test_every_flag_has_a_help_line_and_defaults_are_shown():
    parser = _serve_parser()
    missing = [a.dest for a in parser._actions if not a.help]
    assert missing == []
    text = parser.format_help()
    for shown in ("(default: 16777216)", "(default: 128)", "(default: 127.0.0.1)", "(default: 8000)",
                  "MODEL", "--enable-log-requests", "--content-special-tokens-as-text", "Off by"):
        assert shown in text, shown


def test_flags_reach_the_server_config():
    args = _serve_parser().parse_args([
        "--max-request-bytes", "1000", "--max-prompt-chars", "50", "--max-n", "4", "--max-stop-sequences", "2",
        "--max-tools", "3", "--max-waiting-requests", "7", "--allowed-origins", "*", "--enable-log-requests",
        "--max-log-len", "9", "--content-special-tokens-as-text", "--tokenizer-workers", "3", "--api-key", "k"])
    check_serve_args(args)
    config = server_config(args, "m")
    assert (config.max_request_bytes, config.max_prompt_chars, config.max_n, config.max_stop_sequences,
            config.max_tools, config.max_waiting_requests, config.allowed_origins, config.enable_log_requests,
            config.max_log_len, config.content_special_tokens_as_text, config.tokenizer_workers, config.api_key) == \
        (1000, 50, 4, 2, 3, 7, ("*",), True, 9, True, 3, "k")
    defaults = server_config(_serve_parser().parse_args([]), "m")
    assert (defaults.allowed_origins, defaults.enable_log_requests, defaults.content_special_tokens_as_text,
            defaults.max_waiting_requests, defaults.max_n) == ((), False, False, None, 128)
