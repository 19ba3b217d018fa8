"""Serving benchmark, in the manner of `vllm bench serve`: drives a running deltaserve (or any
OpenAI-compatible) server over HTTP with streamed requests, or the same workload offline through
deltaserve.LLM, and reports request throughput, output / total tok/s, TTFT / TPOT / ITL (mean, p50, p99) and
the prefix-cache hit rate.

  # a running server
  python benchmarks/serve.py --base-url http://127.0.0.1:8000 --dataset random --random-input-len 1024 \
      --random-output-len 128 --num-prompts 1000 --max-concurrency 64 --ignore-eos --save-result out.json
  # start `deltaserve serve` on a free port, benchmark it, stop it
  python benchmarks/serve.py --launch --model benchmarks/configs/Qwen3.5-35B-A3B \
      --server-args "--load-format dummy --max-model-len 16384" --dataset prefix-repetition ...
  # the same workload offline
  python benchmarks/serve.py --backend offline --model PATH --llm-kwargs '{"load_format": "dummy"}' ...

Datasets (benchmarks/serve_datasets.py): random, prefix-repetition, multi-turn. Prompts are token ids sent to
/v1/completions (exact lengths) except `--multi-turn-api chat` (text through /v1/chat/completions). Multi-turn
over completions resends the answer's token ids, read from `logprobs` (a server without a tokenizer names
tokens `token_id:N`; with a tokenizer use the chat form).

The cache hit rate comes from `usage.prompt_tokens_details.cached_tokens` when the server returns it, and from
the deltas of /metrics `deltaserve:prefix_cache_hits_total` / `deltaserve:prefix_cache_queries_total`; "n/a"
when the server has neither. ITL is "n/a" when the server sent fewer chunks than tokens (a server without a
tokenizer sends no text: pass --logprobs 0 to get a chunk per token).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from serve_datasets import BenchRequest, Conversation, multi_turn_dataset, prefix_repetition_dataset, random_dataset
from serve_launch import launched_server
from serve_report import METRIC_NAMES, format_report, summarize

TOKEN_ID = re.compile(r"^token_id:(\d+)$")


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None
    reusable: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunks: int = 0
    answer_ids: list[int] = field(default_factory=list)
    answer_text: str = ""


# ---- one streamed request ------------------------------------------------------------------------

def _payload(args, prompt: Any, output_len: int, chat: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": args.served_model_name, "max_tokens": output_len, "stream": True,
                            "stream_options": {"include_usage": True}, "temperature": args.temperature,
                            "ignore_eos": args.ignore_eos}
    if chat:
        body["messages"] = prompt
    else:
        body["prompt"] = prompt
        if args.logprobs is not None:
            body["logprobs"] = args.logprobs
    return body


async def send(client: httpx.AsyncClient, args, prompt: Any, output_len: int, chat: bool,
               reusable: int = 0) -> RequestResult:
    res = RequestResult(reusable=reusable, prompt_tokens=0 if chat else len(prompt))
    url = "/v1/chat/completions" if chat else "/v1/completions"
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=_payload(args, prompt, output_len, chat)) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:300]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    res.error = str(event["error"])[:300]
                    return res
                if event.get("usage"):
                    u = event["usage"]
                    res.prompt_tokens, res.output_tokens = u["prompt_tokens"], u["completion_tokens"]
                    details = u.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        res.cached_tokens = details["cached_tokens"]
                if not event.get("choices") or not _carries_tokens(event["choices"][0], chat, res):
                    continue
                now = time.perf_counter()
                if res.chunks == 0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
                res.chunks += 1
        res.latency = time.perf_counter() - start
        res.ok = res.chunks > 0 or res.output_tokens == 0
        if not res.ok:
            res.error = "the stream carried no tokens"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


def _carries_tokens(choice: dict[str, Any], chat: bool, res: RequestResult) -> bool:
    """Whether a chunk brings generated tokens, and remembers the answer (text, and token ids named in
    logprobs). A completions chunk is one engine output (its text may be empty: no tokenizer, or a token
    ending inside a character); chat's role-only first chunk comes before any output."""
    if chat:
        delta = choice.get("delta") or {}
        text = delta.get("content") or delta.get("reasoning_content") or ""
        res.answer_text += text
        return bool(text or delta.get("tool_calls") or choice.get("finish_reason"))
    res.answer_text += choice.get("text") or ""
    for t in (choice.get("logprobs") or {}).get("tokens") or []:
        m = TOKEN_ID.match(t)
        res.answer_ids.append(int(m.group(1)) if m else -1)
    return True


# ---- arrivals, concurrency and the workloads --------------------------------------------------------

class Progress:
    def __init__(self, total: int, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="req", file=sys.stderr)

    def update(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def _arrivals(n: int, rate: float, rng: random.Random):
    """Yield n times, Poisson at `rate` per second (inf: all at once)."""
    for i in range(n):
        if i and rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
        yield i


async def run_http(args, workload: list[BenchRequest] | list[Conversation]) -> list[RequestResult]:
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    n_requests = len(workload) * (args.multi_turn_turns if args.dataset == "multi-turn" else 1)
    progress = Progress(n_requests, not args.disable_tqdm)
    results: list[RequestResult] = []
    chat = args.dataset == "multi-turn" and args.multi_turn_api == "chat"
    timeout = httpx.Timeout(args.request_timeout, connect=30)
    limits = httpx.Limits(max_connections=args.max_concurrency or n_requests or 1, max_keepalive_connections=None)

    async def one(prompt, output_len, reusable) -> RequestResult:
        if limit is None:
            res = await send(client, args, prompt, output_len, chat, reusable)
        else:
            async with limit:
                res = await send(client, args, prompt, output_len, chat, reusable)
        results.append(res)
        progress.update()
        return res

    async def conversation(conv: Conversation) -> None:
        history: Any = ([{"role": "system", "content": conv.system}] if chat else list(conv.system))
        reusable = len(conv.system) if conv.system_shared and not chat else 0
        for turn, user in enumerate(conv.users):
            prompt = history + ([{"role": "user", "content": user}] if chat else list(user))
            res = await one(prompt, conv.output_len, reusable)
            if not res.ok:   # the later turns cannot be sent: count them as failed too
                for _ in conv.users[turn + 1:]:
                    results.append(RequestResult(error=f"an earlier turn failed: {res.error}"))
                    progress.update()
                return
            if chat:
                history = prompt + [{"role": "assistant", "content": res.answer_text}]
                reusable = res.prompt_tokens + res.output_tokens   # about: the template adds a few
            else:
                if len(res.answer_ids) != res.output_tokens or -1 in res.answer_ids:
                    raise RuntimeError("multi-turn over /v1/completions needs the answer's token ids from "
                                       "logprobs (`token_id:N`, a server without a tokenizer); use "
                                       "--multi-turn-api chat for a server with one")
                history = prompt + res.answer_ids
                reusable = len(history)

    async with httpx.AsyncClient(base_url=args.base_url, timeout=timeout, limits=limits,
                                 headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
                                 ) as client:
        rng = random.Random(args.seed)
        tasks = []
        async for i in _arrivals(len(workload), args.request_rate, rng):
            item = workload[i]
            tasks.append(asyncio.create_task(conversation(item) if isinstance(item, Conversation)
                                             else one(item.prompt, item.output_len, item.reusable)))
        await asyncio.gather(*tasks)
    progress.close()
    return results


def warmup_workload(args) -> list[BenchRequest] | list[Conversation]:
    """--num-warmups requests of the workload's shape from another seed (so they do not prime its cache)."""
    return build_workload(argparse.Namespace(**{**vars(args), "num_prompts": args.num_warmups,
                                                "seed": args.seed + 1_000_003}))


def build_workload(args) -> list[BenchRequest] | list[Conversation]:
    if args.dataset == "random":
        return random_dataset(args.num_prompts, args.random_input_len, args.random_output_len,
                              args.random_range_ratio, args.seed)
    if args.dataset == "prefix-repetition":
        return prefix_repetition_dataset(args.num_prompts, args.prefix_repetition_num_prefixes,
                                         args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len,
                                         args.prefix_repetition_output_len, args.seed)
    if args.dataset == "multi-turn":
        if args.multi_turn_api == "completions" and args.backend == "http" and args.logprobs is None:
            args.logprobs = 0     # the answer's token ids come back in logprobs
        return multi_turn_dataset(args.num_prompts, args.multi_turn_turns, args.multi_turn_system_len,
                                  args.multi_turn_user_len, args.multi_turn_output_len, args.seed,
                                  text=args.multi_turn_api == "chat" and args.backend == "http")
    raise ValueError(f"unknown --dataset {args.dataset!r}")


# ---- /metrics counters ---------------------------------------------------------------------------

CACHE_COUNTERS = ("deltaserve:prefix_cache_hits_total", "deltaserve:prefix_cache_queries_total")
# the engine-stats attributes behind them (offline backend)
STATS_ATTRS = ("prefix_cache_hits_total", "prefix_cache_queries_total")


def scrape_counters(base_url: str, api_key: str | None = None) -> dict[str, float] | None:
    """The prefix-cache counters of the server's /metrics, or None when it lacks them."""
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=10,
                         headers={"Authorization": f"Bearer {api_key}"} if api_key else None).text
    except httpx.HTTPError:
        return None
    return parse_counters(text)


def reset_prefix_cache(base_url: str, api_key: str | None = None) -> None:
    """POST /reset_prefix_cache; a server with prefix caching off answers 400, which is fine here."""
    httpx.post(f"{base_url}/reset_prefix_cache", timeout=30,
               headers={"Authorization": f"Bearer {api_key}"} if api_key else None)


def parse_counters(text: str) -> dict[str, float] | None:
    """CACHE_COUNTERS from Prometheus text (each summed over its label sets; `deltaserve_` spelt for
    `deltaserve:` too), or None when one is missing."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0].replace("deltaserve_", "deltaserve:", 1)
        if name in CACHE_COUNTERS:
            found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found if len(found) == len(CACHE_COUNTERS) else None


# ---- the offline backend -------------------------------------------------------------------------

def run_offline(args, workload) -> tuple[list[RequestResult], float, dict[str, Any]]:
    """The same workload through deltaserve.LLM.generate: one call for random / prefix-repetition, one call per
    turn (every conversation's turn k together) for multi-turn. Returns the results, the seconds spent in
    generate (the engine's build is not timed) and run info. Latencies are not measured per request."""
    from deltaserve import LLM, SamplingParams

    kwargs = dict(json.loads(args.llm_kwargs))
    if args.max_concurrency:
        kwargs.setdefault("max_num_seqs", args.max_concurrency)
    llm = LLM(args.model, **kwargs)
    results: list[RequestResult] = []
    elapsed = 0.0

    def generate(prompts: list[list[int]], output_lens: list[int], reusable: list[int]) -> list[list[int]]:
        params = [SamplingParams(temperature=args.temperature, max_tokens=n, ignore_eos=args.ignore_eos)
                  for n in output_lens]
        nonlocal elapsed
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=not args.disable_tqdm)
        elapsed += time.perf_counter() - start
        answers = []
        for p, out, r in zip(prompts, outs, reusable):
            ids = list(out.outputs[0].token_ids)
            results.append(RequestResult(ok=True, prompt_tokens=len(p), output_tokens=len(ids), reusable=r,
                                         cached_tokens=getattr(out, "num_cached_tokens", None)))
            answers.append(ids)
        return answers

    def drive(items) -> None:
        if args.dataset != "multi-turn":
            generate([r.prompt for r in items], [r.output_len for r in items], [r.reusable for r in items])
            return
        histories = [list(c.system) for c in items]
        reusable = [len(c.system) if c.system_shared else 0 for c in items]
        for turn in range(args.multi_turn_turns):
            prompts = [h + list(c.users[turn]) for h, c in zip(histories, items)]
            answers = generate(prompts, [c.output_len for c in items], reusable)
            histories = [p + a for p, a in zip(prompts, answers)]
            reusable = [len(h) for h in histories]

    if args.num_warmups:
        drive(warmup_workload(args))
        results.clear()
        elapsed = 0.0
        llm.reset_prefix_cache()
    before = _engine_counters(llm)
    drive(workload)
    after = _engine_counters(llm)
    counters = ({c: after[a] - before[a] for c, a in zip(CACHE_COUNTERS, STATS_ATTRS)}
                if before is not None and after is not None else None)
    return results, elapsed, {"model": args.model, "llm_kwargs": kwargs, "counters": counters}


def _engine_counters(llm) -> dict[str, float] | None:
    stats = llm.engine.get_stats()
    values = {a: getattr(stats, a, None) for a in STATS_ATTRS}
    return None if None in values.values() else values


# ---- main ----------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--backend", choices=("http", "offline"), default="http")
    ap.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (without /v1)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--model", default=None, help="model directory: for --launch and --backend offline")
    ap.add_argument("--served-model-name", default=None, help="the `model` field of requests (default: omitted)")
    ap.add_argument("--launch", action="store_true", help="start `deltaserve serve --model MODEL` on a free port")
    ap.add_argument("--server-args", default="", help="extra `deltaserve serve` arguments for --launch (one string)")
    ap.add_argument("--launch-timeout", type=float, default=900.0, help="seconds to wait for /health")
    ap.add_argument("--server-log", default=None, help="--launch: the server's log file (default: a temp file)")
    ap.add_argument("--llm-kwargs", default="{}", help="--backend offline: JSON keyword arguments of LLM(...)")
    ap.add_argument("--dataset", choices=("random", "prefix-repetition", "multi-turn"), default="random")
    ap.add_argument("--num-prompts", type=int, default=1000, help="requests (multi-turn: conversations)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-warmups", type=int, default=0,
                    help="first run this many untimed requests (conversations for multi-turn) of the same shape, "
                         "seeded apart from the workload, then reset the prefix cache")
    ap.add_argument("--random-input-len", type=int, default=1024)
    ap.add_argument("--random-output-len", type=int, default=128)
    ap.add_argument("--random-range-ratio", type=float, default=0.0)
    ap.add_argument("--prefix-repetition-num-prefixes", type=int, default=8)
    ap.add_argument("--prefix-repetition-prefix-len", type=int, default=4000)
    ap.add_argument("--prefix-repetition-suffix-len", type=int, default=500)
    ap.add_argument("--prefix-repetition-output-len", type=int, default=128)
    ap.add_argument("--multi-turn-turns", type=int, default=4)
    ap.add_argument("--multi-turn-system-len", type=int, default=2000)
    ap.add_argument("--multi-turn-user-len", type=int, default=300)
    ap.add_argument("--multi-turn-output-len", type=int, default=200)
    ap.add_argument("--multi-turn-api", choices=("completions", "chat"), default="completions",
                    help="completions: token ids, answers resent as ids; chat: text messages")
    ap.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    ap.add_argument("--request-rate", type=float, default=float("inf"),
                    help="Poisson arrivals per second (multi-turn: conversation starts)")
    ap.add_argument("--ignore-eos", action="store_true", help="generate exactly the wanted output lengths")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--logprobs", type=int, default=None, help="completions' logprobs field (default: omitted)")
    ap.add_argument("--request-timeout", type=float, default=3600.0)
    ap.add_argument("--disable-tqdm", action="store_true")
    ap.add_argument("--label", default=None, help="a name for this run in the result")
    ap.add_argument("--save-result", default=None, metavar="PATH", help="write the result as JSON")
    args = ap.parse_args(argv)
    if args.backend == "offline" and args.model is None:
        ap.error("--backend offline needs --model")
    if args.launch and (args.model is None or args.backend != "http"):
        ap.error("--launch needs --model and the http backend")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        ap.error("--max-concurrency must be >= 1")
    if args.num_warmups < 0:
        ap.error("--num-warmups must be >= 0")
    if args.request_rate <= 0:
        ap.error("--request-rate must be > 0 (inf: all at once)")
    return args


def benchmark(args) -> dict[str, Any]:
    """Run the configured benchmark; returns the result dict (also written to --save-result)."""
    workload = build_workload(args)
    extra: dict[str, Any] = {}
    if args.backend == "offline":
        results, duration, extra = run_offline(args, workload)
        counters = extra.pop("counters")
    else:
        if args.num_warmups:
            asyncio.run(run_http(args, warmup_workload(args)))
            reset_prefix_cache(args.base_url, args.api_key)
        before = scrape_counters(args.base_url, args.api_key)
        start = time.perf_counter()
        results = asyncio.run(run_http(args, workload))
        duration = time.perf_counter() - start
        after = scrape_counters(args.base_url, args.api_key)
        counters = ({k: after[k] - before[k] for k in CACHE_COUNTERS} if before is not None and after is not None
                    else None)
    result = summarize(results, duration, counters, track_itl=args.backend == "http")
    config = {k: v for k, v in vars(args).items() if k not in ("api_key",)}
    result.update(label=args.label, backend=args.backend, dataset=args.dataset, config=config,
                  offline=extra or None)
    if args.save_result:
        # per request, in completion order: enough to see where a cache miss falls (e.g. a conversation's first turn)
        requests = [{"ok": r.ok, "prompt_tokens": r.prompt_tokens, "reusable": r.reusable,
                     "cached_tokens": r.cached_tokens, "ttft": round(r.ttft, 5)} for r in results]
        Path(args.save_result).write_text(json.dumps({**result, "requests": requests}, indent=1, default=str))
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.launch:
        with launched_server(args.model, shlex.split(args.server_args), args.launch_timeout,
                             args.server_log) as base_url:
            args.base_url = base_url
            result = benchmark(args)
    else:
        result = benchmark(args)
    print(format_report(result))
    return 0 if result["failed"] == 0 else 1


__all__ = ["METRIC_NAMES", "RequestResult", "asdict", "benchmark", "format_report", "launched_server", "main",
           "parse_args"]

if __name__ == "__main__":
    sys.exit(main())
