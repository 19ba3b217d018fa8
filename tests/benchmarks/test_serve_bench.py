"""benchmarks/serve.py (the serving benchmark client): the dataset generators (deterministic, exact lengths,
reuse accounting), the figures, and whole runs against real `deltaserve serve` processes on the embedded model
(one with its tokenizer for chat, one without for token-id multi-turn), offline, and serve_compare."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import serve
import serve_compare
import serve_datasets as ds
from serve_launch import launched_server
from serve_report import summarize

from deltaserve.engine.llm_engine import DEFAULT_MODEL_PATH

SERVER_ARGS = ["--device", "cpu", "--max-model-len", "512"]
LLM_KWARGS = json.dumps({"device": "cpu", "max_model_len": 512})
KEYS = {"duration_s", "completed", "failed", "errors", "total_input_tokens", "total_output_tokens",
        "request_throughput", "output_throughput", "total_token_throughput", "chunks_per_token", "cached_tokens",
        "reusable_tokens", "cache_hit_rate_usage", "cache_hit_of_reusable", "metrics_cache_hits",
        "metrics_cache_queries", "cache_hit_rate_metrics", "label", "backend", "dataset", "config", "offline",
        *(f"{s}_{m}_ms" for s in ("mean", "median", "p99") for m in serve.METRIC_NAMES)}
SMALL = {"random": ["--random-input-len", "24", "--random-output-len", "5", "--random-range-ratio", "0.5"],
         "prefix-repetition": ["--prefix-repetition-num-prefixes", "2", "--prefix-repetition-prefix-len", "40",
                               "--prefix-repetition-suffix-len", "7", "--prefix-repetition-output-len", "4"],
         "multi-turn": ["--multi-turn-turns", "3", "--multi-turn-system-len", "20", "--multi-turn-user-len", "9",
                        "--multi-turn-output-len", "4"]}


# ---- datasets ------------------------------------------------------------------------------------

def test_random_dataset_is_seeded_and_in_range():
    a = ds.random_dataset(50, 100, 20, 0.25, seed=3)
    assert a == ds.random_dataset(50, 100, 20, 0.25, seed=3)
    assert a != ds.random_dataset(50, 100, 20, 0.25, seed=4)
    assert all(75 <= len(r.prompt) <= 125 and 15 <= r.output_len <= 25 for r in a)
    assert len({len(r.prompt) for r in a}) > 5, "the range ratio spreads the lengths"
    assert all(ds.TOKEN_LO <= t < ds.TOKEN_HI for r in a for t in r.prompt)
    exact = ds.random_dataset(5, 64, 8)
    assert [len(r.prompt) for r in exact] == [64] * 5 and [r.output_len for r in exact] == [8] * 5
    assert sum(r.reusable for r in a) == 0
    with pytest.raises(ValueError, match="range-ratio"):
        ds.random_dataset(1, 10, 10, 1.0)


def test_prefix_repetition_shares_exactly_n_prefixes():
    reqs = ds.prefix_repetition_dataset(20, 4, 30, 6, 3, seed=1)
    assert reqs == ds.prefix_repetition_dataset(20, 4, 30, 6, 3, seed=1)
    assert all(len(r.prompt) == 36 and r.output_len == 3 for r in reqs)
    prefixes = [tuple(r.prompt[:30]) for r in reqs]
    assert len(set(prefixes)) == 4 and all(prefixes.count(p) == 5 for p in set(prefixes))
    assert len({tuple(r.prompt[30:]) for r in reqs}) == 20, "distinct suffixes"
    # the first request of each prefix cannot reuse it, every later one can
    assert sum(r.reusable for r in reqs) == (20 - 4) * 30
    assert all((r.reusable == 0) == (prefixes.index(p) == i) for i, (r, p) in enumerate(zip(reqs, prefixes)))


def test_multi_turn_conversations():
    convs = ds.multi_turn_dataset(3, 4, 50, 10, 7, seed=2)
    assert convs == ds.multi_turn_dataset(3, 4, 50, 10, 7, seed=2)
    assert all(c.system == convs[0].system and len(c.system) == 50 for c in convs), "one shared system prompt"
    assert [c.system_shared for c in convs] == [False, True, True]
    assert all(len(c.users) == 4 and all(len(u) == 10 for u in c.users) for c in convs)
    text = ds.multi_turn_dataset(2, 2, 12, 5, 3, text=True)
    assert isinstance(text[0].system, str) and len(text[0].system.split()) == 12
    assert len(text[1].users[0].split()) == 5


# ---- figures -------------------------------------------------------------------------------------

def _res(**kw):
    base = {"ok": True, "error": "", "prompt_tokens": 10, "output_tokens": 3, "cached_tokens": None, "reusable": 0, "ttft": 0.1,
                "latency": 0.3, "itl": [0.1, 0.1], "chunks": 3}
    return SimpleNamespace(**{**base, **kw})


def test_summary_figures_and_cache_rates():
    s = summarize([_res(cached_tokens=4, reusable=8), _res(cached_tokens=2, reusable=0), _res(ok=False, error="x")],
                  2.0, {"deltaserve:prefix_cache_hits_total": 3.0, "deltaserve:prefix_cache_queries_total": 12.0})
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["x"])
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 3.0 and s["total_token_throughput"] == 13.0
    assert s["median_tpot_ms"] == pytest.approx(100.0) and s["mean_itl_ms"] == pytest.approx(100.0)
    assert s["cache_hit_rate_usage"] == pytest.approx(6 / 20) and s["cache_hit_of_reusable"] == pytest.approx(6 / 8)
    assert s["cache_hit_rate_metrics"] == pytest.approx(0.25)
    none = summarize([_res(chunks=2, itl=[0.2])], 1.0, None)    # a chunk missing for a token: no ITL
    assert none["mean_itl_ms"] is None and none["mean_ttft_ms"] is not None
    assert none["cache_hit_rate_usage"] is None and none["cache_hit_rate_metrics"] is None


def test_parse_counters():
    text = ("# HELP x\ndeltaserve:prefix_cache_hits_total 5.0\n"
            'deltaserve:prefix_cache_queries_total{kind="a"} 6.0\ndeltaserve:prefix_cache_queries_total{kind="b"} 4\n')
    assert serve.parse_counters(text) == {"deltaserve:prefix_cache_hits_total": 5.0,
                                          "deltaserve:prefix_cache_queries_total": 10.0}
    assert serve.parse_counters("deltaserve:prefix_cache_hits_total 5.0\n") is None
    underscores = "deltaserve_prefix_cache_hits_total 1\ndeltaserve_prefix_cache_queries_total 2\n"
    assert serve.parse_counters(underscores) == {"deltaserve:prefix_cache_hits_total": 1.0,
                                                 "deltaserve:prefix_cache_queries_total": 2.0}


# ---- whole runs ----------------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"       # the server subprocesses: nothing to gain from two on the tiny model
    yield
    if old is None:
        os.environ.pop("OMP_NUM_THREADS")
    else:
        os.environ["OMP_NUM_THREADS"] = old


@pytest.fixture(scope="module")
def no_tokenizer_model(tmp_path_factory) -> str:
    """The embedded model without its tokenizer files: the server names tokens `token_id:N`."""
    path = tmp_path_factory.mktemp("no-tokenizer")
    for f in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(Path(DEFAULT_MODEL_PATH) / f, path / f)
    return str(path)


@pytest.fixture(scope="module")
def ids_server(no_tokenizer_model):
    with launched_server(no_tokenizer_model, SERVER_ARGS, timeout=120) as url:
        yield url


@pytest.fixture(scope="module")
def text_server():
    with launched_server(str(DEFAULT_MODEL_PATH), SERVER_ARGS, timeout=120) as url:
        yield url


def _run(tmp_path, dataset, *extra):
    out = tmp_path / f"{dataset}.json"
    result = serve.benchmark(serve.parse_args(["--dataset", dataset, *SMALL[dataset], "--num-prompts", "4",
                                               "--max-concurrency", "3", "--ignore-eos", "--disable-tqdm",
                                               "--seed", "5", "--save-result", str(out), *extra]))
    saved = json.loads(out.read_text())
    assert saved.keys() == KEYS | {"requests"} and result.keys() == KEYS
    assert len(saved["requests"]) == result["completed"] + result["failed"]
    assert result["failed"] == 0, result["errors"]
    return result


def _check_timing(r, chunk_per_token=True):
    for q in ("mean", "median", "p99"):
        assert 0 < r[f"{q}_ttft_ms"] <= r[f"{q}_e2el_ms"]
    assert 0 < r["median_tpot_ms"] < r["median_e2el_ms"]
    if chunk_per_token:
        assert r["median_itl_ms"] is not None and r["chunks_per_token"] == pytest.approx(1.0)


@pytest.mark.parametrize("dataset", ["random", "prefix-repetition"])
def test_http_single_turn(ids_server, text_server, tmp_path, dataset):
    want = {"random": ds.random_dataset(4, 24, 5, 0.5, seed=5),
            "prefix-repetition": ds.prefix_repetition_dataset(4, 2, 40, 7, 4, seed=5)}[dataset]
    for url, extra in ((text_server, ["--logprobs", "0"]), (ids_server, ["--logprobs", "0"])):
        r = _run(tmp_path, dataset, "--base-url", url, *extra)
        assert r["completed"] == 4
        assert r["total_input_tokens"] == sum(len(q.prompt) for q in want), "token-id prompts: exact lengths"
        assert r["total_output_tokens"] == sum(q.output_len for q in want), "ignore_eos: exact lengths"
        assert r["reusable_tokens"] == sum(q.reusable for q in want)
        _check_timing(r)
    # without logprobs a server without a tokenizer still sends a chunk per token (its token_ids)
    r = _run(tmp_path, dataset, "--base-url", ids_server)
    _check_timing(r)
    # with a tokenizer a token that ends inside a character brings no text (a chunk fewer)
    r = _run(tmp_path, dataset, "--base-url", text_server)
    print("text server, chunks per token:", r["chunks_per_token"])
    _check_timing(r, chunk_per_token=False)


def test_http_multi_turn_over_completions_matches_offline(ids_server, no_tokenizer_model, tmp_path):
    http = _run(tmp_path, "multi-turn", "--base-url", ids_server)
    assert http["completed"] == 4 * 3
    # turn t resends system 20 + t * (user 9 + answer 4) + the new user's 9 tokens
    per_conv = sum(20 + 9 + t * 13 for t in range(3))
    assert http["total_input_tokens"] == 4 * per_conv and http["total_output_tokens"] == 4 * 3 * 4
    assert http["reusable_tokens"] == 3 * 20 + 4 * sum(20 + 9 + (t - 1) * 13 + 4 for t in (1, 2))
    _check_timing(http)
    offline = _run(tmp_path, "multi-turn", "--backend", "offline", "--model", no_tokenizer_model,
                   "--llm-kwargs", LLM_KWARGS)
    assert (offline["completed"], offline["total_input_tokens"]) == (12, http["total_input_tokens"])
    assert offline["output_throughput"] > 0 and offline["median_ttft_ms"] is None


def test_warmups_are_untimed_and_leave_no_cache_behind(ids_server, no_tokenizer_model, tmp_path):
    """--num-warmups: the warm-up requests are not counted, and the workload then starts from an empty prefix
    cache (random prompts: no hits at all, and /metrics' queries are the workload's prompt tokens only)."""
    for extra in (["--base-url", ids_server],
                  ["--backend", "offline", "--model", no_tokenizer_model, "--llm-kwargs", LLM_KWARGS]):
        r = _run(tmp_path, "random", "--num-warmups", "3", *extra)
        assert r["completed"] == 4 and r["cached_tokens"] == 0
        assert r["metrics_cache_queries"] == r["total_input_tokens"]
    assert serve.warmup_workload(serve.parse_args(["--num-warmups", "2"]))[0] != serve.build_workload(
        serve.parse_args([]))[0], "warm-ups are seeded apart from the workload"


def test_http_multi_turn_chat(text_server, tmp_path):
    r = _run(tmp_path, "multi-turn", "--base-url", text_server, "--multi-turn-api", "chat")
    assert r["completed"] == 12 and r["total_output_tokens"] == 48
    assert r["reusable_tokens"] > 0
    _check_timing(r, chunk_per_token=False)


def test_multi_turn_completions_refuses_a_server_with_a_tokenizer(text_server, tmp_path):
    with pytest.raises(RuntimeError, match="--multi-turn-api chat"):
        _run(tmp_path, "multi-turn", "--base-url", text_server)


def test_compare_launches_and_tabulates(no_tokenizer_model, tmp_path, capsys):
    rc = serve_compare.main(["--model", no_tokenizer_model, "--out", str(tmp_path),
                             "--common-server-args", " ".join(SERVER_ARGS), "--http", "served=--max-num-seqs 4",
                             "--offline", f"offline={LLM_KWARGS}", "--", "--dataset", "random",
                             *SMALL["random"], "--num-prompts", "3", "--ignore-eos", "--disable-tqdm"])
    assert rc == 0
    table = (tmp_path / "table.md").read_text().splitlines()
    assert table[0].startswith("| run | backend | req/s") and len(table) == 4
    assert table[2].startswith("| served | http |") and table[3].startswith("| offline | offline |")
    runs = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert runs["served"]["total_output_tokens"] == runs["offline"]["total_output_tokens"] > 0


def test_multi_turn_counts_the_turns_after_a_failure_as_failed(ids_server):
    # turn 2 (450 + 20 + 50 tokens) exceeds the server's 512-token context: it and turn 3 fail
    r = serve.benchmark(serve.parse_args(["--base-url", ids_server, "--dataset", "multi-turn", "--num-prompts", "2",
                                          "--multi-turn-turns", "3", "--multi-turn-system-len", "400",
                                          "--multi-turn-user-len", "50", "--multi-turn-output-len", "20",
                                          "--ignore-eos", "--disable-tqdm"]))
    assert (r["completed"], r["failed"]) == (2, 4)
    assert any("HTTP 400" in e for e in r["errors"]) and any("an earlier turn failed" in e for e in r["errors"])
