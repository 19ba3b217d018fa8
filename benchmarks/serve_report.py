"""The serving benchmark's figures from per-request results, and the printed report. Key names follow
`vllm bench serve` (mean_ttft_ms, median_ttft_ms, p99_ttft_ms, ...); a figure that cannot be measured is None
(printed "n/a")."""

from __future__ import annotations

import statistics
from typing import Any

METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")


def _percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _stats(name: str, values: list[float] | None) -> dict[str, float | None]:
    if not values:
        return {f"mean_{name}_ms": None, f"median_{name}_ms": None, f"p99_{name}_ms": None}
    return {f"mean_{name}_ms": 1000 * statistics.fmean(values), f"median_{name}_ms": 1000 * _percentile(values, 50),
            f"p99_{name}_ms": 1000 * _percentile(values, 99)}


def summarize(results: list, duration: float, counters: dict[str, float] | None,
              track_itl: bool = True) -> dict[str, Any]:
    """results: RequestResult-like objects; counters: /metrics deltas of the prefix-cache counters or None."""
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    out: dict[str, Any] = {
        "duration_s": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:10],
        "total_input_tokens": prompt, "total_output_tokens": output,
        "request_throughput": len(ok) / duration if duration > 0 else None,
        "output_throughput": output / duration if duration > 0 else None,
        "total_token_throughput": (prompt + output) / duration if duration > 0 else None,
    }
    timed = [r for r in ok if track_itl and r.chunks > 0]
    itl = [x for r in timed for x in r.itl]
    chunks = sum(r.chunks for r in timed)
    # a chunk per token, or ITL would be the gap between batches of tokens (a server without a tokenizer
    # sends no text without logprobs)
    itl_ok = bool(timed) and chunks >= 0.9 * sum(r.output_tokens for r in timed)
    out.update(_stats("ttft", [r.ttft for r in timed]))
    out.update(_stats("tpot", [(r.latency - r.ttft) / (r.output_tokens - 1) for r in timed if r.output_tokens > 1]))
    out.update(_stats("itl", itl if itl_ok else None))
    out.update(_stats("e2el", [r.latency for r in timed]))
    out["chunks_per_token"] = chunks / max(1, sum(r.output_tokens for r in timed)) if timed else None
    cached = [r.cached_tokens for r in ok]
    has_usage = bool(ok) and all(c is not None for c in cached)
    reusable = sum(r.reusable for r in ok)
    out["cached_tokens"] = sum(cached) if has_usage else None
    out["reusable_tokens"] = reusable
    out["cache_hit_rate_usage"] = sum(cached) / prompt if has_usage and prompt else None
    out["cache_hit_of_reusable"] = sum(cached) / reusable if has_usage and reusable else None
    if counters is not None:
        hits, queries = counters["deltaserve:prefix_cache_hits_total"], counters["deltaserve:prefix_cache_queries_total"]
        out["metrics_cache_hits"], out["metrics_cache_queries"] = hits, queries
        out["cache_hit_rate_metrics"] = hits / queries if queries else None
    else:
        out["metrics_cache_hits"] = out["metrics_cache_queries"] = out["cache_hit_rate_metrics"] = None
    return out


def _fmt(v: Any, spec: str = ".2f") -> str:
    return "n/a" if v is None else format(v, spec)


def format_report(r: dict[str, Any]) -> str:
    lines = [f"{'=' * 18} Serving benchmark: {r.get('label') or r['dataset']} ({r['backend']}) {'=' * 18}",
             f"Successful requests:            {r['completed']}",
             f"Failed requests:                {r['failed']}"]
    lines += [f"  error: {e}" for e in r["errors"]]
    lines += [f"Benchmark duration (s):         {r['duration_s']:.2f}",
              f"Total input tokens:             {r['total_input_tokens']}",
              f"Total generated tokens:         {r['total_output_tokens']}",
              f"Request throughput (req/s):     {_fmt(r['request_throughput'])}",
              f"Output token throughput (tok/s): {_fmt(r['output_throughput'], '.1f')}",
              f"Total token throughput (tok/s): {_fmt(r['total_token_throughput'], '.1f')}"]
    for name, title in (("ttft", "Time to first token"), ("tpot", "Time per output token (excl. 1st)"),
                        ("itl", "Inter-token latency"), ("e2el", "End-to-end latency")):
        lines.append(f"{'-' * 12} {title} {'-' * 12}")
        for k in ("mean", "median", "p99"):
            lines.append(f"{k.capitalize() + ' ' + name.upper() + ' (ms):':<32}{_fmt(r[f'{k}_{name}_ms'])}")
    lines.append(f"{'-' * 12} Prefix cache {'-' * 12}")
    pct = lambda v: "n/a" if v is None else f"{100 * v:.1f} %"
    lines += [f"Hit rate (usage cached_tokens): {pct(r['cache_hit_rate_usage'])}",
              (f"Hit rate of reusable tokens:    {pct(r['cache_hit_of_reusable'])} "
               f"(reusable {r['reusable_tokens']}, cached {_fmt(r['cached_tokens'], 'd')})"),
              f"Hit rate (/metrics counters):   {pct(r['cache_hit_rate_metrics'])}"]
    return "\n".join(lines)
