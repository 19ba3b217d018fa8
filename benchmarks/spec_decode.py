"""Speculative decoding: decode speed with and without drafts, and the acceptance.

CPU (default): the embedded model, batch 1 and 8, English prompts with the repetition prompt lookup feeds
on. Greedy decode tok/s of plain decoding, n-gram drafts (K = 1..4, pinned) and adaptive K, with the
n-gram acceptance (mean accepted length = tokens per verify step); and the same with the oracle drafter
(the tokens the target will produce, recorded from a plain run, each replaced by a wrong one with a set
probability) at acceptance lengths 2.0, 2.5, 3.39: what a drafter of that quality buys on this path.

--method mtp (CPU): the embedded model's MTP head drafts; plain decoding is an engine without speculation
(the MTP engine runs the head's first pass every step, even at K = 0), on the same decode path: eager, or
compiled (--compile on; verify steps run eagerly there, plain decode steps compiled; --compile both runs
each). Batch 1 and 8: tok/s, K = 1..4 pinned and adaptive K, the measured acceptance length.

--gpu: a published shape with random weights (load_format="dummy"; default Qwen3.5-35B-A3B), made predictable
(make_predictable: the embedding dominates the residual stream and the lm_head maps it to a fixed next token,
so the argmax has a wide margin and the verify forward's multi-row kernels pick the same tokens as one-row
decoding), with the oracle drafter (random weights accept nothing from a real drafter). The decode step time
of K = 1..4 (every draft accepted, so each step verifies K + 1 positions) against the plain decode step at
batch 1, 8, 64; tok/s of K = 3 at acceptance lengths 2.0, 2.5, 3.39 against plain; adaptive K (the default
policy) against plain at the largest batch, at acceptance 2.5 and with every draft rejected. Drafting is free
here (a host lookup), so the step time is verify + commit; then (not --no-mtp) an engine drafting with the
checkpoint's MTP head: its step time at K = 1..4 against the same plain step (its drafts are random, so its
acceptance says nothing; the cost is the point: spec/adaptive.py's "mtp" rows).

  PYTHONPATH=. python benchmarks/spec_decode.py [--out DIR]
  PYTHONPATH=. python benchmarks/spec_decode.py --method mtp [--compile off|on|both] [--out DIR]
  PYTHONPATH=. python benchmarks/spec_decode.py --gpu [--model benchmarks/configs/Qwen3.5-35B-A3B] --out DIR
  --quick: small workloads (a smoke run; with --gpu --device cpu --model DIR it runs a tiny config on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from deltaserve import LLM, SamplingParams  # noqa: E402
from deltaserve.spec.adaptive import AdaptiveK, AdaptivePolicy  # noqa: E402
from deltaserve.spec.drafter import make_drafter  # noqa: E402
from deltaserve.spec.oracle import OracleDrafter  # noqa: E402

ACCEPTANCE_LENGTHS = (2.0, 2.5, 3.39)      # 3.39: SGLang's reference for Qwen3.5's MTP at 3 drafts

ENGLISH = [
    "The committee reviewed the proposal in detail. The committee noted that the proposal, as written, "
    "would require the committee to meet twice a month. After discussion, the committee agreed that",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return",
    "Monday: wake up, run, work, cook, read. Tuesday: wake up, run, work, cook, read. Wednesday: wake up,",
    "Question: What is the capital of France? Answer: The capital of France is Paris. Question: What is the "
    "capital of Italy? Answer:",
    "Once upon a time there was a little fox who lived in a forest. Every morning the little fox went to the",
    "To install the package, run pip install. To upgrade the package, run pip install --upgrade. To remove",
    "Alice said hello to Bob. Bob said hello to Carol. Carol said hello to Dave. Dave said hello to",
    "The results show that the model improves accuracy on the first task and that the model improves",
]


def reach_for_length(length: float, k: int) -> float:
    """The per-draft acceptance s with 1 + s + s^2 + ... + s^k = length (a rejection ends the run)."""
    if not 1.0 <= length <= k + 1:
        raise ValueError(f"acceptance length {length} outside [1, {k + 1}]")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid ** j for j in range(k + 1)) < length else (lo, mid)
    return (lo + hi) / 2


def pin(llm: LLM, k: int) -> None:
    """k drafts every step (k = 0: plain decode steps, CUDA graphs included)."""
    spec = llm.engine.runner.speculation
    spec.adaptive = AdaptiveK(spec.adaptive.max_k, AdaptivePolicy.pinned(k))


def adaptive(llm: LLM) -> None:
    spec = llm.engine.runner.speculation
    spec.adaptive = AdaptiveK(spec.adaptive.max_k, AdaptivePolicy.for_device(llm.device.type, spec.config.method))


class Run:
    """One timed batch: every request added at once, the steps after all of them have their first token
    (prefill done) timed one by one."""

    def __init__(self, llm: LLM, prompts: list[list[int]], new_tokens: int):
        eng = llm.engine
        before = eng.get_stats()
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        for i, p in enumerate(prompts):
            eng.add_request(f"b{time.monotonic_ns()}-{i}", {"prompt_token_ids": p}, params)
        started: set[str] = set()
        outputs: dict[str, list[int]] = {}
        self.step_s: list[float] = []
        decode_tokens = 0
        # no device sync per step: with async scheduling (plain steps on CUDA) the period between step()
        # returns is the step time; a verify step reads its tokens inside step() anyway
        t0 = time.perf_counter()
        while eng.has_unfinished_requests():
            decoding = len(started) == len(prompts)
            outs = eng.step()
            t1 = time.perf_counter()
            dt, t0 = t1 - t0, t1
            produced = 0
            for o in outs:
                n = len(o.outputs[0].token_ids)
                produced += n - len(outputs.get(o.request_id, []))
                outputs[o.request_id] = list(o.outputs[0].token_ids)
                started.add(o.request_id)
            if decoding:
                self.step_s.append(dt)
                decode_tokens += produced
        after = eng.get_stats()
        self.outputs = [outputs[k] for k in sorted(outputs, key=lambda r: int(r.rsplit("-", 1)[1]))]
        self.decode_s = sum(self.step_s)
        self.tok_s = decode_tokens / self.decode_s if self.decode_s else float("nan")
        self.median_step_ms = 1e3 * statistics.median(self.step_s) if self.step_s else float("nan")
        self.mean_step_ms = 1e3 * statistics.fmean(self.step_s) if self.step_s else float("nan")
        drafts = after.spec_num_drafts_total - before.spec_num_drafts_total
        accepted = after.spec_num_accepted_tokens_total - before.spec_num_accepted_tokens_total
        self.acceptance_length = 1 + accepted / drafts if drafts else None
        self.draft_tokens = after.spec_num_draft_tokens_total - before.spec_num_draft_tokens_total
        self.accepted = accepted


def install_oracle(llm: LLM, prompts, outputs, reject_prob: float) -> None:
    llm.engine.runner.speculation.drafter = OracleDrafter(list(zip(prompts, outputs)), vocab_size=llm.config.vocab_size,
                                                          reject_prob=reject_prob, seed=0)


def install_ngram(llm: LLM) -> None:
    eng = llm.engine
    eng.runner.speculation.drafter = make_drafter(eng.config.speculative_config, llm.model, eng.runner.cache,
                                                  llm.device)


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def cpu(args, log) -> dict:
    torch.set_num_threads(args.threads)
    llm = LLM(device="cpu", enable_prefix_caching=False, compile=args.compile, seed=0,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3})
    new = 24 if args.quick else 96
    prompts_all = [llm.tokenizer.encode(t) for t in ENGLISH]
    results: dict = {"device": "cpu", "new_tokens": new, "rows": []}
    for batch in (1, 8):
        prompts = (prompts_all * 8)[:batch]
        pin(llm, 0)
        Run(llm, prompts, 4)                                    # warm
        plain = Run(llm, prompts, new)
        log(f"batch {batch}: plain {plain.tok_s:.1f} tok/s (median step {plain.median_step_ms:.1f} ms)")
        row = {"batch": batch, "plain_tok_s": plain.tok_s, "plain_step_ms": plain.median_step_ms}
        install_ngram(llm)
        for k in (1, 2, 3, 4):
            pin(llm, k)
            r = Run(llm, prompts, new)
            assert r.outputs == plain.outputs, "speculative greedy output differs from plain"
            row[f"ngram_k{k}"] = dict(tok_s=r.tok_s, speedup=r.tok_s / plain.tok_s, acceptance_length=r.acceptance_length)
            log(f"  ngram K={k}: {r.tok_s:.1f} tok/s ({r.tok_s / plain.tok_s:.2f}x), acceptance length "
                f"{_fmt(r.acceptance_length)}")
        adaptive(llm)
        r = Run(llm, prompts, new)
        row["ngram_adaptive"] = dict(tok_s=r.tok_s, speedup=r.tok_s / plain.tok_s, acceptance_length=r.acceptance_length)
        log(f"  ngram adaptive K: {r.tok_s:.1f} tok/s ({r.tok_s / plain.tok_s:.2f}x)")
        for length in ACCEPTANCE_LENGTHS:
            k = 3
            install_oracle(llm, prompts, plain.outputs, 1 - reach_for_length(length, k))
            pin(llm, k)
            r = Run(llm, prompts, new)
            assert r.outputs == plain.outputs
            row[f"oracle_len{length}"] = dict(tok_s=r.tok_s, speedup=r.tok_s / plain.tok_s,
                                              acceptance_length=r.acceptance_length)
            log(f"  oracle K=3 at acceptance length {length} (measured {_fmt(r.acceptance_length)}): "
                f"{r.tok_s:.1f} tok/s ({r.tok_s / plain.tok_s:.2f}x)")
        install_ngram(llm)
        results["rows"].append(row)
    return results


def cpu_mtp(args, log) -> dict:
    """MTP drafts against an engine without speculation, per decode path (eager, compiled)."""
    torch.set_num_threads(args.threads)
    new = 24 if args.quick else 96
    modes = ("off", "on") if args.compile == "both" else (args.compile,)
    results: dict = {"device": "cpu", "method": "mtp", "new_tokens": new, "threads": args.threads, "rows": []}
    for mode in modes:
        plain_llm = LLM(device="cpu", enable_prefix_caching=False, compile=mode, seed=0)
        mtp_llm = LLM(device="cpu", enable_prefix_caching=False, compile=mode, seed=0,
                      speculative_config={"method": "mtp", "num_speculative_tokens": 4})
        prompts_all = [plain_llm.tokenizer.encode(t) for t in ENGLISH]
        path = "compiled" if mode == "on" else "eager"
        for batch in (1, 8):
            prompts = (prompts_all * 8)[:batch]
            Run(plain_llm, prompts, 4)                          # warm
            plain = Run(plain_llm, prompts, new)
            log(f"{path} batch {batch}: plain {plain.tok_s:.1f} tok/s (median step {plain.median_step_ms:.1f} ms)")
            row = {"path": path, "batch": batch, "plain_tok_s": plain.tok_s, "plain_step_ms": plain.median_step_ms}
            for k in (1, 2, 3, 4, None):
                if k is None:
                    adaptive(mtp_llm)
                else:
                    pin(mtp_llm, k)
                Run(mtp_llm, prompts, 4)                        # warm this K's shapes
                r = Run(mtp_llm, prompts, new)
                assert r.outputs == plain.outputs, "MTP speculative greedy output differs from plain"
                name = "adaptive" if k is None else f"k{k}"
                row[f"mtp_{name}"] = {"tok_s": r.tok_s, "speedup": r.tok_s / plain.tok_s,
                                      "acceptance_length": r.acceptance_length, "step_ms": r.median_step_ms}
                log(f"  mtp {'adaptive K' if k is None else f'K={k}'}: {r.tok_s:.1f} tok/s "
                    f"({r.tok_s / plain.tok_s:.2f}x), acceptance length {_fmt(r.acceptance_length)}, "
                    f"median step {r.median_step_ms:.1f} ms")
            results["rows"].append(row)
        del plain_llm, mtp_llm
    return results


@torch.no_grad()
def make_predictable(llm: LLM) -> torch.Tensor:
    """Give dummy weights a predictable greedy continuation: the embedding scaled so it dominates the residual
    stream (every sublayer reads a normed input, so their outputs stay small), and the lm_head row of
    next[t] set to token t's unscaled embedding, so token t is followed by next[t] with a logit margin of
    ~sqrt(hidden) standard deviations. Flat random logits otherwise flip their argmax between the GEMM
    tiles of a multi-row verify and the one-row decode GEMV, and an oracle recorded from one path is
    rejected by the other. Same shapes, same kernels: the step times are those of the dummy model.
    Returns next (a permutation; the identity for a tied lm_head)."""
    model = llm.model
    emb = model.embed_tokens
    vocab = emb.shape[0]
    if model.lm_head is None:
        nxt = torch.arange(vocab, device=emb.device)
    else:
        nxt = torch.randperm(vocab, generator=torch.Generator().manual_seed(0)).to(emb.device)
        model.lm_head.weight[nxt] = emb
    emb.mul_(1000.0)
    return nxt


def chain(prompt: list[int], nxt: list[int], n: int) -> list[int]:
    out, t = [], prompt[-1]
    for _ in range(n):
        t = nxt[t]
        out.append(t)
    return out


def gpu_llm(args, device, batches, prompt_len, new, spec) -> LLM:
    return LLM(args.model, device=str(device), load_format="dummy", enable_prefix_caching=False, seed=0,
               dtype="bfloat16" if device.type == "cuda" else "float32",
               max_num_seqs=max(batches), max_model_len=prompt_len + new + 16, speculative_config=spec)


def gpu(args, log) -> dict:
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    batches = (1, 2) if args.quick else tuple(int(b) for b in args.batches.split(","))
    prompt_len, new = (16, 12) if args.quick else (args.prompt_len, args.new_tokens)
    llm = gpu_llm(args, device, batches, prompt_len, new, {"method": "ngram", "num_speculative_tokens": 4})
    nxt = make_predictable(llm).tolist()
    vocab = llm.config.vocab_size
    g = torch.Generator().manual_seed(0)
    results: dict = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                     "model": str(args.model), "prompt_len": prompt_len, "new_tokens": new, "rows": []}
    prompts_of: dict[int, list[list[int]]] = {}
    for batch in batches:
        prompts = prompts_of[batch] = [torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
                                       for _ in range(batch)]
        pin(llm, 0)
        Run(llm, prompts, 8)                                    # warm: graphs, kernels of this batch shape
        plain = Run(llm, prompts, new)
        follows = sum(o == chain(p, nxt, len(o)) for p, o in zip(prompts, plain.outputs)) / batch
        row = {"batch": batch, "plain_step_ms": plain.median_step_ms, "plain_mean_step_ms": plain.mean_step_ms,
               "plain_tok_s": plain.tok_s, "plain_follows_chain": follows}
        log(f"batch {batch}: plain step {plain.median_step_ms:.2f} ms, {plain.tok_s:.0f} tok/s "
            f"({follows:.0%} of the sequences follow the predictable chain)")
        for k in (1, 2, 3, 4):
            install_oracle(llm, prompts, plain.outputs, 0.0)
            pin(llm, k)
            Run(llm, prompts, new)                              # warm every verify shape of the timed run
            install_oracle(llm, prompts, plain.outputs, 0.0)
            r = Run(llm, prompts, new)
            ratio = r.median_step_ms / plain.median_step_ms
            cost = r.mean_step_ms / plain.mean_step_ms          # spec/adaptive.py's c(B, K)
            row[f"k{k}_step_ms"], row[f"k{k}_step_ratio"], row[f"k{k}_mean_cost"] = r.median_step_ms, ratio, cost
            row[f"k{k}_acceptance_length"] = r.acceptance_length
            log(f"  K={k}: step {r.median_step_ms:.2f} ms = {ratio:.2f}x plain, mean step {cost:.2f}x plain "
                f"(acceptance length {_fmt(r.acceptance_length)} of {k + 1}: {r.tok_s:.0f} tok/s = "
                f"{r.tok_s / plain.tok_s:.2f}x)")
        for length in ACCEPTANCE_LENGTHS:
            install_oracle(llm, prompts, plain.outputs, 1 - reach_for_length(length, 3))
            pin(llm, 3)
            r = Run(llm, prompts, new)
            row[f"len{length}_tok_s"] = r.tok_s
            row[f"len{length}_speedup"] = r.tok_s / plain.tok_s
            row[f"len{length}_measured"] = r.acceptance_length
            log(f"  K=3 at acceptance length {length} (measured {_fmt(r.acceptance_length)}): {r.tok_s:.0f} tok/s "
                f"= {r.tok_s / plain.tok_s:.2f}x plain")
        for label, reject in (("len2.5", 1 - reach_for_length(2.5, 3)), ("none_accepted", 1.0)):
            install_oracle(llm, prompts, plain.outputs, reject)
            adaptive(llm)
            r = Run(llm, prompts, new)
            row[f"adaptive_{label}_tok_s"], row[f"adaptive_{label}_speedup"] = r.tok_s, r.tok_s / plain.tok_s
            log(f"  adaptive K, oracle at {label}: {r.tok_s:.0f} tok/s = {r.tok_s / plain.tok_s:.2f}x plain "
                f"(acceptance length {_fmt(r.acceptance_length)}, {r.draft_tokens} drafts)")
        results["rows"].append(row)
    if args.no_mtp or not llm.config.mtp_num_layers:
        return results
    del llm
    import gc
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    llm = gpu_llm(args, device, batches, prompt_len, new, {"method": "mtp", "num_speculative_tokens": 4})
    for row in results["rows"]:
        prompts = prompts_of[row["batch"]]
        for k in (1, 2, 3, 4):
            pin(llm, k)
            Run(llm, prompts, new)
            r = Run(llm, prompts, new)
            ratio = r.median_step_ms / row["plain_step_ms"]
            cost = r.mean_step_ms / row["plain_mean_step_ms"]
            row[f"mtp_k{k}_step_ms"], row[f"mtp_k{k}_step_ratio"], row[f"mtp_k{k}_mean_cost"] = (
                r.median_step_ms, ratio, cost)
            log(f"batch {row['batch']}: MTP K={k} step (drafts + verify + commit) {r.median_step_ms:.2f} ms = "
                f"{ratio:.2f}x plain, mean step {cost:.2f}x plain")
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", action="store_true", help="the published shape with dummy weights and the oracle drafter")
    ap.add_argument("--model", default=str(ROOT / "benchmarks" / "configs" / "Qwen3.5-35B-A3B"))
    ap.add_argument("--device", default="cuda", help="--gpu only (cpu: a smoke run with a tiny --model)")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--compile", default="off", choices=("off", "on", "both"),
                    help="CPU: the compiled decode step (both: --method mtp only, each path)")
    ap.add_argument("--method", default="ngram", choices=("ngram", "mtp"),
                    help="CPU: n-gram and oracle drafts, or the MTP head against plain decoding")
    ap.add_argument("--threads", type=int, default=1, help="CPU intra-op threads")
    ap.add_argument("--batches", default="1,8,64", help="--gpu: comma-separated batch sizes")
    ap.add_argument("--no-mtp", action="store_true", help="--gpu: skip the MTP drafter's step times")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None, help="directory for spec_decode.json and the log")
    args = ap.parse_args()
    lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    if args.compile == "both" and (args.gpu or args.method != "mtp"):
        ap.error("--compile both: with --method mtp on CPU only")
    load_before = os.getloadavg()           # the CPU rows are only comparable at a similar machine load
    results = gpu(args, log) if args.gpu else cpu_mtp(args, log) if args.method == "mtp" else cpu(args, log)
    results["load_average"] = {"before": load_before, "after": os.getloadavg()}
    log("load average (1, 5, 15 min) before: {:.2f} {:.2f} {:.2f}; after: {:.2f} {:.2f} {:.2f}".format(
        *load_before, *results["load_average"]["after"]))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "spec_decode.json").write_text(json.dumps(results, indent=1))
        (out / "spec_decode.log").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
