"""One workload of the serving benchmark under several configurations in one command: each `--http NAME=ARGS`
launches `deltaserve serve --model MODEL ARGS` on a free port, benchmarks it and stops it; each
`--offline NAME=JSON` runs the same workload through deltaserve.LLM(MODEL, **JSON). Writes OUT/NAME.json per
run and OUT/table.md (a Markdown table for docs/PERFORMANCE.md), and prints the table.

  python benchmarks/serve_compare.py --model benchmarks/configs/Qwen3.5-35B-A3B --out /tmp/pc \
      --common-server-args "--load-format dummy --max-model-len 16384" \
      --http "cache on=--enable-prefix-caching" --http "cache off=--no-enable-prefix-caching" \
      --offline 'offline={"load_format": "dummy", "max_model_len": 16384}' \
      -- --dataset prefix-repetition --num-prompts 1000 --ignore-eos --max-concurrency 64

Arguments after `--` are serve.py's (dataset, sizes, concurrency, rate, ...), the same for every run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serve

COLUMNS = (("req/s", "request_throughput", "{:.2f}"), ("out tok/s", "output_throughput", "{:.0f}"),
           ("total tok/s", "total_token_throughput", "{:.0f}"), ("TTFT p50 ms", "median_ttft_ms", "{:.1f}"),
           ("TTFT p99 ms", "p99_ttft_ms", "{:.1f}"), ("TPOT p50 ms", "median_tpot_ms", "{:.2f}"),
           ("ITL p50 ms", "median_itl_ms", "{:.2f}"), ("hit (usage)", "cache_hit_rate_usage", "{:.1%}"),
           ("hit of reusable", "cache_hit_of_reusable", "{:.1%}"), ("hit (/metrics)", "cache_hit_rate_metrics",
                                                                    "{:.1%}"))


def _named(spec: str, flag: str) -> tuple[str, str]:
    name, sep, value = spec.partition("=")
    if not sep or not name:
        raise SystemExit(f"{flag} wants NAME=VALUE, got {spec!r}")
    return name, value


def table(results: list[dict[str, Any]]) -> str:
    head = "| run | backend | " + " | ".join(c[0] for c in COLUMNS) + " |"
    rows = [head, "|" + "---|" * (len(COLUMNS) + 2)]
    for r in results:
        cells = ["n/a" if r.get(key) is None else fmt.format(r[key]) for _, key, fmt in COLUMNS]
        rows.append(f"| {r['label']} | {r['backend']} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True, help="directory for the JSON results and table.md")
    ap.add_argument("--common-server-args", default="", help="`deltaserve serve` arguments of every --http run")
    ap.add_argument("--http", action="append", default=[], metavar="NAME=SERVER_ARGS")
    ap.add_argument("--offline", action="append", default=[], metavar="NAME=LLM_KWARGS_JSON")
    args = ap.parse_args(own)
    if not args.http and not args.offline:
        ap.error("give at least one --http or --offline run")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [(n, ["--launch", "--server-args", f"{args.common_server_args} {v}".strip()])
            for n, v in (_named(s, "--http") for s in args.http)]
    for name, kwargs in (_named(s, "--offline") for s in args.offline):
        json.loads(kwargs)    # refuse bad JSON before the first run starts
        runs.append((name, ["--backend", "offline", "--llm-kwargs", kwargs]))
    results, failed = [], 0
    for name, extra in runs:
        path = out / (name.replace(" ", "_").replace("/", "_") + ".json")
        run_args = serve.parse_args(["--model", args.model, "--label", name, "--save-result", str(path),
                                     *extra, *bench_args])
        if run_args.launch:
            import shlex

            with serve.launched_server(args.model, shlex.split(run_args.server_args), run_args.launch_timeout,
                                       run_args.server_log) as base_url:
                run_args.base_url = base_url
                result = serve.benchmark(run_args)
        else:
            result = serve.benchmark(run_args)
        print(serve.format_report(result), file=sys.stderr)
        failed += result["failed"]
        results.append(result)
    md = table(results)
    (out / "table.md").write_text(md + "\n")
    print(md)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
