"""The command line: --version, help with defaults, flags checked before anything loads, generate's text and
JSON output (labels per prompt, logprobs)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

import deltaserve
from deltaserve import cli
from deltaserve.outputs import CompletionOutput, Logprob, RequestOutput


def subparser(name: str) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def help_entries(text: str) -> dict[str, str]:
    """--flag -> its help text (unwrapped) from an argparse help page."""
    entries: dict[str, str] = {}
    flag = None
    for line in text.splitlines():
        if line.startswith("  -"):
            flag = next((w.rstrip(",") for w in line.split() if w.startswith("--")), None)
            entries[flag] = line
        elif flag and line.startswith("    "):
            entries[flag] += " " + line.strip()
        else:
            flag = None
    return {k: " ".join(v.split()) for k, v in entries.items()}


def test_version_prints_the_package_version_without_importing_torch():
    code = ("import sys; from deltaserve.cli import main\n"
            "try:\n    main(['--version'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "assert 'torch' not in sys.modules, 'torch imported'")
    res = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"deltaserve {deltaserve.__version__}"


def test_top_level_help_is_a_user_facing_description():
    text = cli.build_parser().format_help()
    assert "Gated-DeltaNet" in text and "generate" in text and "serve" in text and "--version" in text
    assert cli.__doc__.splitlines()[0] not in text


def test_every_generate_flag_has_help_and_shows_its_default():
    gen = subparser("generate")
    for action in gen._actions:
        assert action.help, f"{action.option_strings or action.dest} has no help"
    entries = help_entries(gen.format_help())
    for flag, default in [("--max-tokens", "128"), ("--temperature", "0.0"), ("--top-p", "1.0"), ("--n", "1"),
                          ("--device", "auto"), ("--seed", "0"), ("--load-format", "auto")]:
        assert f"(default: {default})" in entries[flag], (flag, entries[flag])
    assert "(default:" not in entries["--ignore-eos"]          # nothing to show for a store_true flag


def test_model_flags_of_serve_have_help():
    serve = subparser("serve")
    shared = {s for a in subparser("generate")._actions for s in a.option_strings if s.startswith("--")
              and a.container.title != "sampling"}
    for action in serve._actions:
        if set(action.option_strings) & shared:
            assert action.help, action.option_strings


class Loaded(Exception):
    pass


@pytest.fixture
def no_loading(monkeypatch):
    """LLM() raises: a test that reaches it has loaded before checking its flags."""
    import deltaserve.llm

    def refuse(*a, **k):
        raise Loaded
    monkeypatch.setattr(deltaserve.llm, "LLM", refuse)


@pytest.mark.parametrize("argv, says", [
    (["--temperature", "-1", "x"], "temperature"),
    (["--top-p", "2", "x"], "top_p"),
    (["--n", "0", "x"], "SamplingParams.n"),
    (["--max-tokens", "0", "x"], "max_tokens"),
    (["--device", "gpu", "x"], "--device"),
    (["--model", "/nonexistent/checkpoint", "x"], "not a directory"),
    (["--max-model-len", "1", "x"], "--max-model-len"),
    (["--prompt-token-ids", "[1, 2"], "JSON"),
    (["--prompt-token-ids", "[1, \"a\"]"], "integers"),
    (["--prompt-token-ids", "[1, 999999]"], "vocabulary"),
    (["--stop-token-id", "8192", "x"], "--stop-token-id"),
    ([], "give a prompt"),
])
def test_invalid_generate_arguments_fail_before_the_model_loads(no_loading, capsys, argv, says):
    assert cli.main(["generate", *argv]) == 2
    assert says in capsys.readouterr().err


def test_model_directory_without_config_is_refused_before_loading(no_loading, capsys, tmp_path):
    assert cli.main(["generate", "--model", str(tmp_path), "x"]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_unknown_dtype_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", "--dtype", "int8", "x"])
    assert exc.value.code == 2 and "--dtype" in capsys.readouterr().err


def test_bad_compile_environment_value_is_an_error(no_loading, monkeypatch, capsys):
    monkeypatch.setenv("DELTASERVE_COMPILE", "fast")
    assert cli.main(["generate", "x"]) == 2
    assert "DELTASERVE_COMPILE='fast'" in capsys.readouterr().err


def _output(prompt, ids, texts, with_logprobs: bool) -> RequestOutput:
    completions = []
    for j, text in enumerate(texts):
        lps = [{5: Logprob(-0.5, 1, "a"), 6: Logprob(-1.5, 2, "b")},
               {7: Logprob(-2.0, 3, "c"), 5: Logprob(-0.1, 1, "a")}]
        completions.append(CompletionOutput(j, text, [5, 7], lps if with_logprobs else None, "length"))
    return RequestOutput("r", prompt, ids, None, completions, True)


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"json": False, "echo": False, **kw})


def test_several_prompts_are_labelled_and_each_completion_of_n(capsys):
    outs = [_output("first prompt", [1, 2], ["one", "two"], False), _output(None, [3, 4, 5], ["three"], False)]
    cli.print_outputs(outs, _args())
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["=== prompt 1: 'first prompt' ===", "--- completion 1 (finish_reason: length) ---", "one",
                     "--- completion 2 (finish_reason: length) ---", "two",
                     "=== prompt 2: token ids [3, 4, 5] ===", "three"]


def test_a_single_prompt_prints_its_text_alone(capsys):
    cli.print_outputs([_output("p", [1], [" text"], False)], _args(echo=True))
    assert capsys.readouterr().out == "p text\n"


def test_logprobs_are_printed_per_generated_token(capsys):
    cli.print_outputs([_output("p", [1], ["ac"], True)], _args())
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "ac" and lines[1].startswith("--- logprobs (2 tokens")
    assert lines[2].split() == ["'a'", "-0.5000", "'a'", "-0.5000,", "'b'", "-1.5000"]
    assert lines[3].split() == ["'c'", "-2.0000", "'a'", "-0.1000,", "'c'", "-2.0000"]   # by rank


def test_json_gives_one_record_per_completion_with_logprobs(capsys):
    cli.print_outputs([_output("p", [1], ["x", "y"], True), _output("q", [2], ["z"], False)], _args(json=True))
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["prompt_index"], r["index"], r["text"]) for r in rows] == [(0, 0, "x"), (0, 1, "y"), (1, 0, "z")]
    assert rows[0]["finish_reason"] == "length" and rows[2]["logprobs"] is None
    first = rows[0]["logprobs"][0]
    assert first["token_id"] == 5 and first["logprob"] == -0.5 and first["token"] == "a"
    assert [t["token_id"] for t in first["top_logprobs"]] == [5, 6]


def test_generate_end_to_end_json_with_logprobs(tiny_model_with_tokenizer):
    cmd = [sys.executable, "-m", "deltaserve", "generate", "--model", str(tiny_model_with_tokenizer), "--max-tokens",
           "5", "--ignore-eos", "--json", "--logprobs", "2", "The quick brown", "To be"]
    res = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.strip().splitlines()]
    assert [r["prompt"] for r in rows] == ["The quick brown", "To be"]
    for r in rows:
        assert len(r["token_ids"]) == 5 and r["finish_reason"] == "length" and len(r["logprobs"]) == 5
        assert [p["token_id"] for p in r["logprobs"]] == r["token_ids"]
        assert all(len([t for t in p["top_logprobs"] if t["rank"] <= 2]) == 2 for p in r["logprobs"])
