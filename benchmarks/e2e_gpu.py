"""End-to-end benchmark at a published model shape with random weights (load_format="dummy"), ours and
transformers + flash-linear-attention in the same command on the same GPU, one after the other (two
35B models do not fit one H200 together), each in its own subprocess.

  ours   LLMEngine built from the config alone (weights drawn on the GPU). Measures
         - output throughput at concurrency 1, 8, 64, 256: that many requests of 1024 random prompt tokens
           and 256 new tokens (ignore_eos) submitted at once; output tok/s over the whole run (prefill
           included) and the steady decode rate (median of the steps where every request decodes);
         - batch-1 decode = the steady decode rate at concurrency 1;
         - time to first token of one 8k and one 32k prompt (after an 8k warm-up request);
         each concurrency level runs its batch shape briefly first (kernel compilation), then measures;
         - a torch.profiler summary of batch-1 decode steps: kernel time per family, GPU idle gaps, host time.
  peer   transformers `generate` (greedy, min_new_tokens = max_new_tokens) on the same config with its own
         random init on the GPU, batch 1 and batch 8 with 1024-token prompts; decode tok/s from two lengths
         (n2 - n1 new tokens over the time difference: prefill cancels), fewer new tokens than ours because
         it is slow; TTFT of an 8k prompt.
  limits Bandwidth limit of a decode step = bytes it must move / device-to-device copy bandwidth measured in
         the same run: dense weights (everything but the routed experts, lm_head included, embedding rows
         only), the distinct routed experts the step's tokens select (counted from the router's actual
         choices on a recorded 8k-token prefill, grouped C tokens at a time; the uniform-routing expectation
         E (1 - (1 - k/E)^C) is printed next to it), the KV cache read (mean context of the decode phase)
         and written, GDN recurrent + conv state read and written. Activations are ignored (< 0.1 %).

  PYTHONPATH=. python benchmarks/e2e_gpu.py --model benchmarks/configs/Qwen3.5-35B-A3B --out DIR
  PYTHONPATH=. python benchmarks/e2e_gpu.py --quick --out DIR      # tiny shape on CPU, seconds
  --smoke: the real shape with a short workload (concurrency 1 and 8, 64 new tokens, 8k TTFT, peer batch 1).
  --prefill-ttft: only the lone-prompt TTFT at 128 / 1,024 / 4,096 tokens (one step each) and the host time
         of that step's launch(), with piecewise prefill CUDA graphs on and off (two subprocesses):
  PYTHONPATH=. python benchmarks/e2e_gpu.py --prefill-ttft --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

QUICK_CONFIG = {
    "model_type": "qwen3_5_moe",
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_moe_text", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"], "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25},
    },
}


@dataclasses.dataclass(frozen=True)
class Workload:
    concurrency: tuple[int, ...] = (1, 8, 64, 256)
    prompt_len: int = 1024
    new_tokens: int = 256
    ttft_lens: tuple[int, ...] = (8192, 32768)
    max_num_batched_tokens: int = 8192
    profile_steps: int = 5
    peer_batches: tuple[int, ...] = (1, 8)
    peer_new_tokens: tuple[int, int] = (4, 20)   # decode rate from the difference of two generate lengths
    peer_ttft_len: int = 8192


SMOKE = Workload(concurrency=(1, 8), new_tokens=64, ttft_lens=(8192,), profile_steps=3, peer_batches=(1,),
                 peer_new_tokens=(2, 6), peer_ttft_len=0)
QUICK = Workload(concurrency=(1, 2), prompt_len=16, new_tokens=6, ttft_lens=(32, 48), max_num_batched_tokens=64,
                 profile_steps=2, peer_batches=(1, 2), peer_new_tokens=(2, 4), peer_ttft_len=32)


# ---- model description shared by both parts ---------------------------------------------------------

def raw_config(args) -> dict:
    if args.quick:
        return QUICK_CONFIG
    return json.loads((Path(args.model) / "config.json").read_text())


def uniform_distinct(E: int, k: int, C: int) -> float:
    """Expected number of distinct experts C tokens select when each picks k of E uniformly."""
    return E * (1.0 - (1.0 - k / E) ** C)


def step_limit(bytes_info: dict, C: int, ctx: float, distinct: float, copy_bps: float) -> dict:
    """Bytes a decode step of C sequences at mean context ctx must move, and the implied limit."""
    b = bytes_info
    moved = (b["dense"] + C * b["embed_row"] + b["moe_layers"] * distinct * b["expert"]
             + C * (ctx + 1) * b["kv_per_token"] + C * b["state_rw"])
    step_s = moved / copy_bps
    return dict(bytes=moved, step_s=step_s, tok_s=C / step_s)


def _cpu_threads(device) -> None:
    """One intra-op thread for the CPU smoke run: tiny tensors, and two OpenMP threads collapse on a
    shared 2-core machine (seconds per step instead of milliseconds)."""
    import torch

    if device.type == "cpu":
        torch.set_num_threads(1)


def _dtype(device) -> str:
    """bf16 on the GPU (the benchmark); fp32 for the CPU smoke run (bf16 matmuls are slow on CPUs)."""
    return "bfloat16" if device.type == "cuda" else "float32"


# ---- ours ---------------------------------------------------------------------------------------

def copy_bandwidth(device) -> float:
    """Device-to-device copy rate, bytes read + written per second (median of repeated 1 GiB copies, after
    five untimed ones so the clocks have ramped)."""
    import torch

    n = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    for _ in range(5):
        dst.copy_(src)
    times = []
    for _ in range(15):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e-3)
        else:
            t = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t)
    times.sort()
    return 2 * n / times[len(times) // 2]


def _expert_bytes(w) -> int:
    """Bytes of one expert of a stacked [E, N, K] weight (block-FP8: its values and its scales)."""
    from deltaserve.ops.quant.fp8 import is_fp8

    if is_fp8(w):
        return w.qweight[0].numel() * w.qweight.element_size() + w.scale[0].numel() * w.scale.element_size()
    return w[0].numel() * w.element_size()


def model_bytes(net, cfg) -> dict:
    """Parameter bytes of the main model by what a decode step reads (the MTP head is not run)."""
    from deltaserve.layers.moe import SparseMoeBlock

    main = [p for name, p in net.named_parameters() if not name.startswith("mtp.")]
    total = sum(p.numel() * p.element_size() for p in main)
    embed = net.embed_tokens.numel() * net.embed_tokens.element_size()
    moe = [m for name, m in net.named_modules() if isinstance(m, SparseMoeBlock) and not name.startswith("mtp.")]
    E = cfg.num_experts
    expert = 0
    routed_total = 0
    for m in moe:
        expert = sum(_expert_bytes(w) for w in (m.w13, m.w2))
        routed_total += E * expert
    elem = net.embed_tokens.element_size()
    gdn, attn = len(cfg.gdn_layer_ids), len(cfg.attention_layer_ids)
    state = gdn * (cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
                   + cfg.gdn_conv_dim * (cfg.linear_conv_kernel_dim - 1) * elem)
    dense = total - routed_total - (0 if cfg.tie_word_embeddings else embed)
    return dict(total=total, dense=dense, embed_row=cfg.hidden_size * elem, expert=expert, moe_layers=len(moe),
                routed_total=routed_total, kv_per_token=attn * 2 * cfg.num_key_value_heads * cfg.head_dim * elem,
                state_rw=2 * state, experts=E, top_k=cfg.num_experts_per_tok)


class RoutingRecorder:
    """Records the top-k experts the router picks for each token of the MoE blocks (eager forwards only: a
    captured graph bypasses Python, and then nothing is recorded). Wraps the block's `forward_projected`
    (the router logits arrive computed, with the pre-norm folded into the router GEMV) or, for a block
    without it, a forward pre-hook that computes the router logits itself."""

    def __init__(self, net, max_tokens: int):
        from deltaserve.layers.moe import SparseMoeBlock

        self.ids: dict[str, list] = {}
        self.max_tokens = max_tokens
        self._undo = []
        for name, m in net.named_modules():
            if not isinstance(m, SparseMoeBlock) or name.startswith("mtp."):
                continue
            if hasattr(m, "forward_projected"):
                m.forward_projected = self._wrap(name, m, m.forward_projected)
                self._undo.append(lambda m=m: vars(m).pop("forward_projected", None))
            else:
                self._undo.append(m.register_forward_pre_hook(self._hook(name)).remove)

    def _record(self, name: str, module, logits) -> None:
        have = sum(t.shape[0] for t in self.ids.get(name, []))
        if have >= self.max_tokens or logits.shape[0] < 2:
            return
        experts = logits[:, : module.num_experts].float()      # a folded shared gate is the router's last row
        self.ids.setdefault(name, []).append(experts.topk(module.top_k, dim=-1).indices.cpu())

    def _wrap(self, name, module, forward_projected):
        def wrapped(x, router_logits, *a, **kw):
            self._record(name, module, router_logits)
            return forward_projected(x, router_logits, *a, **kw)
        return wrapped

    def _hook(self, name):
        import torch

        def hook(module, inputs):
            self._record(name, module, torch.nn.functional.linear(inputs[0], module.gate.weight))
        return hook

    def remove(self) -> None:
        for undo in self._undo:
            undo()
        self._undo = []

    def num_tokens(self) -> int:
        return max((sum(t.shape[0] for t in chunks) for chunks in self.ids.values()), default=0)

    def distinct(self, C: int) -> float | None:
        """Mean distinct experts per group of C consecutive recorded tokens, over layers and groups."""
        import torch

        counts = []
        for chunks in self.ids.values():
            ids = torch.cat(chunks)
            for g in range(ids.shape[0] // C):
                counts.append(ids[g * C : (g + 1) * C].unique().numel())
        return sum(counts) / len(counts) if counts else None


class CompileRecorder:
    """Triton kernel variants built while it is installed (jit_cache_hook marks the start of a build,
    jit_post_compile_hook its end): a variant built in the middle of a measured run is a stall of that
    step (seconds for a fresh compile, ~ms from Triton's on-disk cache). `take()` returns and clears the
    builds since the last call: kernel name, seconds, and the specialization (signature + attributes)."""

    def __init__(self):
        import triton

        self.knobs = triton.knobs.runtime
        self.events: list[dict] = []
        self._start: dict = {}
        self._saved = (self.knobs.jit_cache_hook, self.knobs.jit_post_compile_hook)
        self.knobs.jit_cache_hook = self._before
        self.knobs.jit_post_compile_hook = self._after

    def _before(self, *, key, fn, **_):
        self._start[(fn.name, str(key))] = time.perf_counter()
        return False                                     # go on building

    def _after(self, *, key, fn, **_):
        t0 = self._start.pop((fn.name, str(key)), None)
        self.events.append(dict(kernel=fn.name, s=None if t0 is None else time.perf_counter() - t0,
                                variant=self.describe(key, fn)))

    @staticmethod
    def describe(key, fn) -> str:
        """`name=type/spec` per argument from the cache key: in Triton 3.6 the string of the per-argument
        (type, specialization) list followed by the options (older: a (list, options) tuple). The
        specialization ('D': divisible by 16, '1': equal to 1, a constexpr's value) makes a new variant. (The
        hook's own `repr` zips the arguments with the options string, so it names only the first.)"""
        import ast

        try:
            spec = ast.literal_eval(key[: key.index("]") + 1]) if isinstance(key, str) else key[0]
            args = ", ".join(f"{n}={t}/{sp}" if sp not in (None, "") else f"{n}={t}"
                             for n, (t, sp) in zip(fn.arg_names, spec))
        except (TypeError, ValueError, AttributeError, SyntaxError):
            args = str(key)
        return f"{fn.name}({args})"[:1200]

    def take(self) -> dict:
        events, self.events = self.events, []
        return dict(compiles=len(events), compile_s=sum(e["s"] or 0.0 for e in events),
                    compiled=[f"{e['kernel']} {e['s'] or 0:.2f}s" for e in events][:40],
                    variants=[e["variant"] for e in events][:12])

    def remove(self) -> None:
        self.knobs.jit_cache_hook, self.knobs.jit_post_compile_hook = self._saved


def run_requests(engine, prompts: list[list[int]], params, tag: str) -> dict:
    """Submit all prompts at once, step until done; per-step wall time and token counts."""
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, params, stream=False)
    steps = []
    first_token_at = None
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        s0 = engine.get_stats()
        ta = time.perf_counter()
        engine.step()
        tb = time.perf_counter()
        s1 = engine.get_stats()
        gen = s1.generation_tokens_total - s0.generation_tokens_total
        steps.append(dict(s=tb - ta, tokens=s1.num_batched_tokens_total - s0.num_batched_tokens_total, gen=gen))
        if first_token_at is None and gen:
            first_token_at = tb - t0
    total = time.perf_counter() - t0
    C = len(prompts)
    decode = sorted(st["s"] for st in steps if st["tokens"] == C and st["gen"] == C)
    out_tokens = sum(st["gen"] for st in steps)
    prefill = [st for st in steps if st["tokens"] > C]     # steps that carry prompt tokens
    return dict(total_s=total, first_token_s=first_token_at, steps=len(steps), output_tokens=out_tokens,
                prefill_steps=len(prefill), prefill_s=sum(st["s"] for st in prefill),
                prefill_tokens=sum(st["tokens"] for st in prefill),
                output_tok_s=out_tokens / total, decode_steps=len(decode),
                decode_step_s=decode[len(decode) // 2] if decode else None,
                decode_tok_s=C / decode[len(decode) // 2] if decode else None)


KERNEL_FAMILIES = [   # first match wins: our MoE GEMV kernels contain "gemv", the GDN gated norm "norm"
    ("MoE (routing + experts)",
     r"moe|topk_softmax|_route_|gemv_w13|gemv_w2|_w13_kernel|_w2_kernel|_combine_kernel"),
    ("embedding (+ the RoPE tables)", r"embed"),
    ("GDN (conv, gates, delta rule, gated norm)",
     r"gdn|recurrent|delta|conv1d|_conv_|chunk|gating|l2norm|recompute_w_u|_tokens_kernel|_finish_kernel|_decode_fused|"
     r"_verify|_commit|rms_norm_gated"),
    ("attention (paged, store_kv, rope)", r"attention|attn|paged|store_kv|merge_splits|flash|rotary|rope"),
    ("norms (RMSNorm + residual)", r"rms|norm"),
    ("activations (silu*mul, sigmoid*mul)", r"silu|sigmoid|act_and_mul"),
    ("linears (GEMV / GEMM)",
     r"gemm|gemv|split_sum|cutlass|nvjet|sm90|sm80|xmma|splitk|cublas|kernel2|matmul|linear|addmm|::mm"),
    ("sampler / logits", r"softmax|argmax|sampl|cumsum|sort|topk|multinomial|log_softmax"),
]


def family(name: str) -> str:
    low = name.lower()
    for fam, pattern in KERNEL_FAMILIES:
        if re.search(pattern, low):
            return fam
    return "other (copies, elementwise, indexing)"


def profile_decode(engine, prompt: list[int], steps: int, device) -> dict:
    """Profile `steps` batch-1 decode steps (after the prefill and two warm steps): kernel time per
    family, GPU idle time between the step's first and last kernel, host time outside that span."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    from deltaserve.sampling_params import SamplingParams

    engine.add_request("profile", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=steps + 4, ignore_eos=True),
                       stream=False)
    for _ in range(3):
        engine.step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for i in range(steps):
            with record_function(f"e2e_step_{i}"):
                engine.step()
    # the same step's forward alone: its graph replayed back to back (no host work, no logits, no sampling)
    graphs = getattr(engine.runner, "graphs", None)
    replay_us = None
    if device.type == "cuda" and graphs is not None:
        import torch

        graphs.replay_static(1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            graphs.replay_static(1)
        torch.cuda.synchronize()
        replay_us = (time.perf_counter() - t0) / 20 * 1e6
    while engine.has_unfinished_requests():
        engine.step()
    events = list(prof.events())
    # the host-side step ranges (the profiler also mirrors each range onto the GPU timeline; skip those)
    ranges = sorted((e.time_range.start, e.time_range.end) for e in events
                    if e.name.startswith("e2e_step_") and e.device_type == DeviceType.CPU)
    on_gpu = device.type == "cuda"
    if on_gpu:
        kernels = [e for e in events if e.device_type == DeviceType.CUDA and not e.name.startswith("e2e_step_")]
    else:   # CPU: leaf aten ops stand in for kernels (keeps the code path exercised)
        kernels = [e for e in events if e.name.startswith("aten::") and not e.cpu_children]
    fams: dict[str, float] = {}
    wall = busy = span_total = 0.0
    nk = 0
    for start, end in ranges:
        ks = sorted((k for k in kernels if start <= k.time_range.start <= end), key=lambda k: k.time_range.start)
        wall += end - start
        nk += len(ks)
        if not ks:
            continue
        for k in ks:
            fams[family(k.name)] = fams.get(family(k.name), 0.0) + (k.time_range.end - k.time_range.start)
        # union of kernel intervals (concurrent kernels counted once)
        cur_s, cur_e = ks[0].time_range.start, ks[0].time_range.end
        for k in ks[1:]:
            if k.time_range.start > cur_e:
                busy += cur_e - cur_s
                cur_s, cur_e = k.time_range.start, k.time_range.end
            else:
                cur_e = max(cur_e, k.time_range.end)
        busy += cur_e - cur_s
        span_total += max(k.time_range.end for k in ks) - ks[0].time_range.start
    n = max(len(ranges), 1)
    top = {}
    for k in kernels:
        top[k.name] = top.get(k.name, 0.0) + (k.time_range.end - k.time_range.start)
    return dict(steps=len(ranges), step_wall_us=wall / n, kernels_per_step=nk / n,
                family_us={f: v / n for f, v in sorted(fams.items(), key=lambda kv: -kv[1])},
                gpu_busy_us=busy / n, gpu_idle_in_span_us=(span_total - busy) / n,
                host_outside_span_us=(wall - span_total) / n, on_gpu=on_gpu, graph_replay_us=replay_us,
                top_kernels_us={k: v / n for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:15]})


def profile_prefill(engine, prompts: list[list[int]], device, decoding: list[list[int]] = ()) -> dict:
    """One step that carries these prompts (max_tokens 1, synchronous) under torch.profiler: wall time and
    kernel time per family, to compare one long prompt with many short ones of the same total, and, with
    `decoding`, a step of the same prompts admitted beside that many running decodes (a mixed step, as at
    high concurrency). The same step runs twice first without the profiler: the first builds whatever kernel
    variants it needs (reported), the second is the step's wall time. The prefix cache is emptied before each
    round (the running decodes keep their blocks), so no round hits the previous round's prompts."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from deltaserve.sampling_params import SamplingParams

    was, engine.async_scheduling = engine.async_scheduling, False
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    walls, prof = [], None
    for round_ in range(3):
        for i, p in enumerate(decoding):
            engine.add_request(f"pm{round_}-{i}", {"prompt_token_ids": p},
                               SamplingParams(max_tokens=1 << 20, ignore_eos=True), stream=False)
        sched = engine.scheduler
        while sched.waiting or any(q.num_computed < q.num_prompt_tokens for q in sched.running):
            engine.step()                               # until every decode is past its prompt
        engine.reset_prefix_cache()                     # each round's prompts miss, as the first one's did
        for i, p in enumerate(prompts):
            engine.add_request(f"pp{round_}-{len(p)}-{i}", {"prompt_token_ids": p},
                               SamplingParams(max_tokens=1, ignore_eos=True), stream=False)
        if round_ < 2:
            sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
            sync()
            t0 = time.perf_counter()
            engine.step()
            sync()
            walls.append(time.perf_counter() - t0)
        else:
            with profile(activities=acts) as prof:
                engine.step()
        for i in range(len(decoding)):
            engine.abort_request(f"pm{round_}-{i}")
        while engine.has_unfinished_requests():
            engine.step()
    engine.async_scheduling = was
    if device.type == "cuda":
        kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    else:
        kernels = [e for e in prof.events() if e.name.startswith("aten::") and not e.cpu_children]
    fams: dict[str, float] = {}
    for k in kernels:
        fams[family(k.name)] = fams.get(family(k.name), 0.0) + (k.time_range.end - k.time_range.start)
    return dict(prompts=len(prompts), tokens=sum(map(len, prompts)), decoding=len(decoding),
                wall_ms_first=walls[0] * 1e3, wall_ms=walls[1] * 1e3, kernels=len(kernels),
                kernel_ms=sum(fams.values()) / 1e3,
                family_ms={f: v / 1e3 for f, v in sorted(fams.items(), key=lambda kv: -kv[1])})


def host_breakdown(engine, prompt: list[int], steps: int) -> dict:
    """Wall time per batch-1 decode step split by phase (no profiler): scheduling, input packing + copies +
    graph launch, the logits launch, the sampler's launches, the wait for the tokens (synchronous: the GPU
    work of the step shows up here; async: only the part of the previous step the host work did not cover),
    output processing, and the rest of engine.step. Timing wrappers are installed on the engine's objects
    for the measurement and removed after."""
    import contextlib

    from deltaserve.runner import sampler as sampler_mod
    from deltaserve.sampling_params import SamplingParams

    totals: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                totals[name] = totals.get(name, 0.0) + time.perf_counter() - t
        return wrapper

    runner = engine.runner
    patches = [(engine.scheduler, "schedule", "schedule"), (runner, "_replay_decodes", "pack + copies + graph launch"),
               (runner.model, "compute_logits", "logits launch"), (runner.sampler, "launch", "sampler launches"),
               (sampler_mod.HostCopy, "get", "wait for tokens"), (engine, "_process", "process outputs")]
    engine.add_request("host", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=steps + 4, ignore_eos=True),
                       stream=False)
    for _ in range(3):
        engine.step()
    saved = []
    with contextlib.ExitStack() as undo:
        for obj, attr, name in patches:
            had = attr in vars(obj)
            saved.append((obj, attr, getattr(obj, attr), had))
            setattr(obj, attr, timed(name, getattr(obj, attr)))
        undo.callback(lambda: [setattr(o, a, v) if had else delattr(o, a) for o, a, v, had in saved])
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - t0
    while engine.has_unfinished_requests():
        engine.step()
    per = {k: v / steps * 1e6 for k, v in totals.items()}
    per["rest of engine.step"] = wall / steps * 1e6 - sum(per.values())
    return dict(step_us=wall / steps * 1e6, phases_us=per, async_scheduling=engine.async_scheduling)


def _graph_info(engine) -> str:
    graphs = getattr(engine.runner, "graphs", None)
    if graphs is None:
        return "none (eager decode)"
    return (f"{len(graphs.sizes)} decode buckets up to {graphs.max_size}, captured in "
            f"{getattr(graphs, 'capture_seconds', float('nan')):.1f} s")


def ours_part(args, wl: Workload, out: Path) -> None:
    import random

    import torch

    from deltaserve import LLM, SamplingParams

    device = torch.device("cpu" if args.quick else "cuda")
    _cpu_threads(device)
    log = _logger(out / "ours.jsonl")
    copy_first = copy_bandwidth(device)
    t = time.perf_counter()
    model = dict(raw_config(args)) if args.quick else args.model
    max_len = max(wl.ttft_lens) + 16
    llm = LLM(model, device=str(device), dtype=_dtype(device), load_format="dummy", max_num_seqs=max(wl.concurrency),
              max_model_len=max_len, max_num_batched_tokens=wl.max_num_batched_tokens)
    if device.type == "cuda":
        torch.cuda.synchronize()
    engine, cfg = llm.engine, llm.config
    info = model_bytes(llm.model, cfg)
    log(dict(what="build", s=time.perf_counter() - t, plan=dataclasses.asdict(engine.plan)
             if dataclasses.is_dataclass(engine.plan) else str(engine.plan), bytes=info,
             gpu=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
             dtype=_dtype(device), max_num_batched_tokens=wl.max_num_batched_tokens,
             cuda_graphs=_graph_info(engine)))
    # the limits use the higher of two measurements, before and after the build (one early measurement came out
    # ~3 % under the session's others and would have flattered every fraction)
    copy_samples = [copy_first, copy_bandwidth(device)]
    copy_bps = max(copy_samples)
    log(dict(what="copy_bandwidth", bytes_per_s=copy_bps, samples=copy_samples))
    rng = random.Random(0)
    vocab = cfg.vocab_size
    compiles = CompileRecorder()            # Triton builds during each measured run (stalls of its steps)

    def prompt(n):
        return [rng.randrange(vocab) for _ in range(n)]

    # warm-up + routing record: one long prefill (eager; hooks see it), then two prompts of the benchmark's
    # length (their chunk shapes); then, most important first: batch-1 decode, its profile, TTFT, the rest
    rec = RoutingRecorder(llm.model, max_tokens=min(wl.ttft_lens))
    warm = run_requests(engine, [prompt(min(wl.ttft_lens))], SamplingParams(max_tokens=2, ignore_eos=True), "warm")
    rec.remove()
    log(dict(what="warmup", recorded_tokens=rec.num_tokens(), **warm))
    warm = run_requests(engine, [prompt(wl.prompt_len) for _ in range(2)],
                        SamplingParams(max_tokens=4, ignore_eos=True),
                        "warm2")
    log(dict(what="warmup2", **warm))
    params = SamplingParams(max_tokens=wl.new_tokens, ignore_eos=True)
    ctx = wl.prompt_len + wl.new_tokens / 2

    def concurrency(C):
        # the same batch shape once, briefly, first: Triton specialises kernels on batch-dependent integers
        # (== 1, multiples of 16), so a new shape class compiles on first sight (seconds, once per machine
        # with a warm on-disk cache); the measured run is the steady state
        run_requests(engine, [prompt(wl.prompt_len) for _ in range(C)], SamplingParams(max_tokens=3, ignore_eos=True),
                     f"w{C}")
        compiles.take()
        r = run_requests(engine, [prompt(wl.prompt_len) for _ in range(C)], params, f"c{C}")
        r.update(compiles.take())
        actual = rec.distinct(C)
        uniform = uniform_distinct(info["experts"], info["top_k"], C) if info["experts"] else 0.0
        lim = step_limit(info, C, ctx, actual if actual is not None else uniform, copy_bps)
        log(dict(what="concurrency", C=C, distinct_experts_actual=actual, distinct_experts_uniform=uniform,
                 limit=lim, frac_of_limit=(r["decode_tok_s"] / lim["tok_s"]) if r["decode_tok_s"] else None, **r))

    first, rest = wl.concurrency[0], wl.concurrency[1:]
    concurrency(first)
    # the same level twice more: the run-to-run spread of the headline number
    repeats = [run_requests(engine, [prompt(wl.prompt_len) for _ in range(first)], params, f"r{first}-{i}")
               for i in range(2)]
    log(dict(what="concurrency_repeats", C=first, decode_tok_s=[r["decode_tok_s"] for r in repeats]))
    if device.type == "cuda":            # the same level with the other temperature sampler, for the difference
        from deltaserve.ops.sampling import reference as sampling_ref
        from deltaserve.ops.sampling import triton as sampling_triton

        default_draw = engine.runner.sampler.temperature_sample
        other = (sampling_ref.temperature_sample if default_draw is sampling_triton.temperature_sample
                 else sampling_triton.temperature_sample)
        engine.runner.sampler.temperature_sample = other
        run_requests(engine, [prompt(wl.prompt_len) for _ in range(first)],
                     SamplingParams(max_tokens=3, ignore_eos=True), "wfs")
        r = run_requests(engine, [prompt(wl.prompt_len) for _ in range(first)], params, f"fs{first}")
        log(dict(what="concurrency_other_sampler", C=first, sampler=other.__module__, **r))
        engine.runner.sampler.temperature_sample = default_draw
    if engine.async_scheduling:          # the same level with synchronous scheduling, for the difference
        engine.async_scheduling = False
        r = run_requests(engine, [prompt(wl.prompt_len) for _ in range(first)], params, f"sync{first}")
        log(dict(what="concurrency_sync", C=first, **r))
        log(dict(what="host", **host_breakdown(engine, prompt(wl.prompt_len), 4 * wl.profile_steps)))
        engine.async_scheduling = True
    was, engine.async_scheduling = engine.async_scheduling, False   # kernel attribution needs ordered steps
    prof = profile_decode(engine, prompt(wl.prompt_len), wl.profile_steps, device)
    engine.async_scheduling = was
    log(dict(what="profile", **prof))
    log(dict(what="host", **host_breakdown(engine, prompt(wl.prompt_len), 4 * wl.profile_steps)))
    # one budget-sized prefill step: one long prompt against budget / prompt_len prompts of the workload's length
    long = min(wl.max_num_batched_tokens, max(wl.ttft_lens))
    many = [prompt(wl.prompt_len) for _ in range(max(long // wl.prompt_len, 1))]
    for prompts in ([prompt(long)], many):
        log(dict(what="prefill_profile", **profile_prefill(engine, prompts, device)))
    # the same prompts beside running decodes: the steps that admit new requests at concurrency 64
    n_dec = max(1, min(max(wl.concurrency), 64) - len(many))
    log(dict(what="prefill_profile", **profile_prefill(engine, many, device,
                                                           decoding=[prompt(wl.prompt_len) for _ in range(n_dec)])))
    for n in wl.ttft_lens:
        r = run_requests(engine, [prompt(n)], SamplingParams(max_tokens=1, ignore_eos=True), f"ttft{n}")
        log(dict(what="ttft", prompt_len=n, s=r["first_token_s"], steps=r["steps"]))
    for C in rest:
        concurrency(C)
    compiles.remove()


# ---- lone-prompt TTFT, prefill graphs on / off ---------------------------------------------------------

PREFILL_TTFT_LENS = (128, 1024, 4096)


def prefill_ttft_part(args, out: Path, graphs: bool) -> None:
    """TTFT of lone prompts (max_tokens=1, one step each) and the host time of their launch() (the step's
    enqueue: with the GPU idle before it, TTFT - launch is mostly GPU time the host did not hide)."""
    import random

    import torch

    from deltaserve import LLM, SamplingParams

    device = torch.device("cpu" if args.quick else "cuda")
    _cpu_threads(device)
    log = _logger(out / f"prefill_ttft_{'graphs' if graphs else 'eager'}.jsonl")
    model = dict(raw_config(args)) if args.quick else args.model
    lens = (16, 64, 256) if args.quick else PREFILL_TTFT_LENS
    top = max(lens)
    t = time.perf_counter()
    llm = LLM(model, device=str(device), dtype=_dtype(device), load_format="dummy", max_num_seqs=8,
              max_model_len=top + 16, max_num_batched_tokens=top, prefill_cuda_graphs=graphs)
    engine, runner = llm.engine, llm.engine.runner
    pg = runner.prefill_graphs
    log(dict(what="build", s=time.perf_counter() - t, graphs=graphs, decode_graphs=_graph_info(engine),
             prefill_graphs=None if pg is None else dict(sizes=pg.sizes, capture_s=pg.capture_seconds,
                                                          pool_bytes=pg.pool_bytes, buffer_bytes=pg.buffer_bytes)))
    launches: list[float] = []
    launch = runner.launch

    def timed_launch(step):
        t0 = time.perf_counter()
        handle = launch(step)
        launches.append(time.perf_counter() - t0)
        return handle

    runner.launch = timed_launch
    rng = random.Random(0)
    vocab = llm.config.vocab_size
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    for n in lens:
        ttft, host = [], []
        for i in range(7):                              # 2 warm-up runs, 5 measured
            if device.type == "cuda":
                torch.cuda.synchronize()
            launches.clear()
            r = run_requests(engine, [[rng.randrange(vocab) for _ in range(n)]], params, f"t{n}-{i}")
            if i >= 2:
                ttft.append(r["first_token_s"])
                host.append(launches[0])
        log(dict(what="ttft", prompt_len=n, ttft_ms=[x * 1e3 for x in ttft], launch_ms=[x * 1e3 for x in host],
                 median_ttft_ms=sorted(ttft)[2] * 1e3, median_launch_ms=sorted(host)[2] * 1e3,
                 prefill_graph_runs=None if pg is None else pg.num_runs))


def prefill_ttft_report(out: Path) -> str:
    rows, build = {}, []
    for mode in ("graphs", "eager"):
        for r in _read(out / f"prefill_ttft_{mode}.jsonl"):
            if r["what"] == "ttft":
                rows.setdefault(r["prompt_len"], {})[mode] = r
            elif r["what"] == "build" and r.get("prefill_graphs"):
                pg = r["prefill_graphs"]
                build = [f"prefill graphs: buckets {pg['sizes']}, captured in {pg['capture_s']:.1f} s, "
                         f"pool {pg['pool_bytes'] / MIB:.0f} MiB + buffers {pg['buffer_bytes'] / MIB:.0f} MiB"]
    lines = ["| prompt | TTFT graphs | TTFT eager | launch() graphs | launch() eager |", "|---|---|---|---|---|"]
    for n, m in sorted(rows.items()):
        cell = lambda mode, key: f"{m[mode][key]:.1f} ms" if mode in m else "-"  # noqa: E731
        lines.append(f"| {n} | {cell('graphs', 'median_ttft_ms')} | {cell('eager', 'median_ttft_ms')} | "
                     f"{cell('graphs', 'median_launch_ms')} | {cell('eager', 'median_launch_ms')} |")
    return "\n".join(lines + build)


MIB = 1 << 20


# ---- peer: transformers + flash-linear-attention ----------------------------------------------------

def peer_part(args, wl: Workload, out: Path) -> None:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    device = torch.device("cpu" if args.quick else "cuda")
    os.environ.setdefault("FLA_FLASH_QLA", "0")
    _cpu_threads(device)
    log = _logger(out / "peer.jsonl")
    raw = raw_config(args)
    text = dict(raw.get("text_config", raw))
    model_type = text.pop("model_type", raw["model_type"])
    if "text_config" in raw and not model_type.endswith("_text"):
        model_type += "_text"
    text["eos_token_id"] = None             # random weights: generate runs to max_new_tokens anyway
    text["tie_word_embeddings"] = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    cfg = AutoConfig.for_model(model_type, **text)
    t = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, _dtype(device))).eval()
    model.requires_grad_(False)
    patched = _use_fla(model) if device.type == "cuda" else 0
    fla = sys.modules.get("fla")
    log(dict(what="build", s=time.perf_counter() - t, cls=type(model).__name__, transformers=transformers.__version__,
             fla=getattr(fla, "__version__", "loaded") if fla else None,
             experts_implementation=getattr(model.config, "_experts_implementation", None),
             attn_implementation=getattr(model.config, "_attn_implementation", None), fla_patched_layers=patched))
    g = torch.Generator().manual_seed(1)

    def generate(batch: int, plen: int, new: int) -> float:
        ids = torch.randint(0, cfg.vocab_size, (batch, plen), generator=g).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    generate(1, 16, 2)                                      # warm-up (kernel compilation)
    log(dict(what="peer_kernels", **_peer_kernels(lambda: generate(1, 16, 3), device)))
    n1, n2 = wl.peer_new_tokens
    for B in wl.peer_batches:
        generate(B, wl.prompt_len, 2)                       # this shape's compilation / autotuning, untimed
        t1 = generate(B, wl.prompt_len, n1)
        t2 = generate(B, wl.prompt_len, n2)
        log(dict(what="peer_decode", B=B, prompt_len=wl.prompt_len, new_tokens=[n1, n2], s=[t1, t2],
                 decode_tok_s=B * (n2 - n1) / (t2 - t1), output_tok_s=B * n2 / t2))
    if wl.peer_ttft_len:
        generate(1, wl.peer_ttft_len, 1)                    # untimed: first call at this length autotunes
        t1 = generate(1, wl.peer_ttft_len, 1)
        log(dict(what="peer_ttft", prompt_len=wl.peer_ttft_len, s=t1))


def _use_fla(model) -> int:
    """transformers picks FLA's GDN kernels itself when it finds the `fla` package; where a layer still holds
    the torch fallback as an attribute (older releases), hand it FLA's. Returns the layers changed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError:
        return 0
    n = 0
    for m in model.modules():
        fn = getattr(m, "chunk_gated_delta_rule", None)
        if callable(fn) and not getattr(fn, "__module__", "").startswith("fla"):
            m.chunk_gated_delta_rule = chunk_gated_delta_rule
            if hasattr(m, "recurrent_gated_delta_rule"):
                m.recurrent_gated_delta_rule = fused_recurrent_gated_delta_rule
            n += 1
    return n


def _peer_kernels(fn, device) -> dict:
    """Kernel time by family over one short generate (evidence of which GDN kernels the peer runs)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        return {}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    fams: dict[str, float] = {}
    gdn_names = set()
    for k in kernels:
        fam = family(k.name)
        fams[fam] = fams.get(fam, 0.0) + (k.time_range.end - k.time_range.start)
        if fam.startswith("GDN"):
            gdn_names.add(k.name[:80])
    return dict(kernels=len(kernels), family_us=fams, gdn_kernel_names=sorted(gdn_names)[:12])


# ---- orchestration and report ------------------------------------------------------------------------

def _logger(path: Path):
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    start = time.perf_counter()

    def log(row: dict) -> None:
        row = {**row, "t": round(time.perf_counter() - start, 2)}
        print(json.dumps(row, default=str), flush=True)
        with open(path, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")
    return log


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def report(out: Path, name: str, wl: Workload) -> str:
    ours, peer = _read(out / "ours.jsonl"), _read(out / "peer.jsonl")
    get = lambda rows, what: [r for r in rows if r["what"] == what]  # noqa: E731
    copy = get(ours, "copy_bandwidth")
    build = get(ours, "build")
    lines = [f"## {name}", ""]
    if not copy or not build:
        return "\n".join(lines + ["ours: no results (see ours.log)"])
    bps = copy[0]["bytes_per_s"]
    b = build[0]["bytes"]
    samples = "/".join(f"{x / 1e12:.2f}" for x in copy[0].get("samples", [bps]))
    lines += [f"device {build[0]['gpu']}, torch {build[0]['torch']}; copy bandwidth {bps / 1e12:.2f} TB/s "
              f"(read + write; the higher of {samples}); model {b['total'] / 1e9:.1f} GB {build[0].get('dtype', '')} (main model), "
              f"dense {b['dense'] / 1e9:.2f} GB "
              f"per step, {b['moe_layers']} MoE layers x {b['expert'] / 1e6:.1f} MB per routed expert; "
              f"GDN state r+w {b['state_rw'] / 1e6:.1f} MB/seq, KV {b['kv_per_token'] / 1e3:.1f} kB/token; "
              f"build {build[0]['s']:.1f} s", "",
              f"ours: dummy weights, {build[0].get('dtype')} on {build[0]['gpu']}, "
              f"CUDA graphs: {build[0].get('cuda_graphs')}; chunked prefill "
              f"budget {build[0].get('max_num_batched_tokens')} tokens per step; cache plan {build[0].get('plan')}", ""]
    conc = {r["C"]: r for r in get(ours, "concurrency")}
    pdec = {r["B"]: r for r in get(peer, "peer_decode")}
    pbuild = get(peer, "build")
    if pbuild:
        p = pbuild[0]
        lines += [f"peer: transformers {p['transformers']} {p['cls']}, flash-linear-attention {p['fla']}, experts "
                  f"{p['experts_implementation']}, attention {p['attn_implementation']}; new tokens "
                  f"{wl.peer_new_tokens[0]} and {wl.peer_new_tokens[1]} (decode rate from the difference)", ""]
    lines += ["| metric | ours | peer | ours / peer | limit | ours % of limit | peer % of limit |",
              "|---|---|---|---|---|---|---|"]

    def row(metric, o, p, lim, fmt="{:.1f}", higher=True):
        f = lambda v: fmt.format(v) if v is not None else "-"  # noqa: E731
        ratio = (o / p if higher else p / o) if o and p else None
        frac = lambda v: f"{100 * (v / lim if higher else lim / v):.1f} %" if v and lim else "-"  # noqa: E731
        lines.append(f"| {metric} | {f(o)} | {f(p)} | {f'{ratio:.1f}x' if ratio else '-'} | {f(lim)} | "
                     f"{frac(o)} | {frac(p)} |")

    for C, r in sorted(conc.items()):
        lim = r["limit"]["tok_s"]
        p = pdec.get(C)
        row(f"decode tok/s, concurrency {C} (steady, ctx ~{wl.prompt_len + wl.new_tokens // 2})", r["decode_tok_s"],
            p["decode_tok_s"] if p else None, lim)
    for C, r in sorted(conc.items()):
        p = pdec.get(C)
        row(f"output tok/s, concurrency {C} ({wl.prompt_len} in / {wl.new_tokens} out, whole run)",
            r["output_tok_s"], p["output_tok_s"] if p else None, None)
    pt = {r["prompt_len"]: r["s"] for r in get(peer, "peer_ttft")}
    for r in get(ours, "ttft"):
        row(f"time to first token, {r['prompt_len']} tokens (s)", r["s"], pt.get(r["prompt_len"]), None,
            fmt="{:.3f}", higher=False)
    lines += ["", "| concurrency | distinct experts / MoE layer (actual; uniform) | bytes / step (GB) | limit step "
              "ms | ours step ms | decode steps | prompt-carrying steps: count, s, tokens/s |",
              "|---|---|---|---|---|---|---|"]
    for C, r in sorted(conc.items()):
        act = r["distinct_experts_actual"]
        pre = (f"{r['prefill_steps']}, {r['prefill_s']:.2f}, {r['prefill_tokens'] / r['prefill_s']:.0f}"
               if r.get("prefill_steps") else "-")
        if r.get("compiles"):
            pre += f"; {r['compiles']} Triton builds in the run ({r['compile_s']:.1f} s)"
        lines.append(f"| {C} | {act if act is None else f'{act:.1f}'}; {r['distinct_experts_uniform']:.1f} | "
                     f"{r['limit']['bytes'] / 1e9:.3f} | {r['limit']['step_s'] * 1e3:.3f} | "
                     f"{r['decode_step_s'] * 1e3 if r['decode_step_s'] else float('nan'):.3f} | {r['decode_steps']} "
                     f"| {pre} |")
    for prof in get(ours, "profile"):
        unit = "kernel" if prof["on_gpu"] else "CPU leaf op"
        lines += ["", f"Profile of a batch-1 decode step ({prof['steps']} steps under torch.profiler, "
                  f"{prof['kernels_per_step']:.0f} {unit}s per step, step wall {prof['step_wall_us']:.0f} us "
                  "with the profiler on):", "", "| part | us / step |", "|---|---|"]
        for fam, us in prof["family_us"].items():
            lines.append(f"| {fam} | {us:.1f} |")
        lines += [f"| GPU idle between the step's first and last {unit} (launch gaps) | "
                  f"{prof['gpu_idle_in_span_us']:.1f} |",
                  "| host time outside that span (batch packing, sampling sync) | "
                  f"{prof['host_outside_span_us']:.1f} |"]
        if prof.get("graph_replay_us"):
            lines += ["", f"Without the profiler: the batch-1 forward's graph replayed back to back takes "
                      f"{prof['graph_replay_us']:.0f} us (kernels and the gaps between them, no host work, no "
                      "logits or sampling); the rest of the measured step is host time, the lm_head and the sampler."]
    for r in get(ours, "prefill_profile"):
        fam = ", ".join(f"{k} {v:.1f}" for k, v in r["family_ms"].items())
        beside = f" beside {r['decoding']} running decodes" if r.get("decoding") else ""
        lines += ["", f"One step of {r['prompts']} prompt(s), {r['tokens']} tokens{beside}: {r['wall_ms']:.1f} ms wall "
                  f"(first time {r['wall_ms_first']:.1f}); under the profiler {r['kernels']} kernels, "
                  f"{r['kernel_ms']:.1f} ms of kernel time; by family: {fam}."]
    for r in get(ours, "concurrency_repeats"):
        rates = ", ".join(f"{x:.1f}" for x in r["decode_tok_s"])
        lines += ["", f"Concurrency {r['C']} decode, run twice more in the same process: {rates} tok/s."]
    for r in get(ours, "concurrency_other_sampler"):
        lines += ["", f"The other temperature sampler ({r['sampler']}), concurrency {r['C']}: decode "
                  f"{r['decode_tok_s']:.1f} tok/s ({r['decode_step_s'] * 1e3:.3f} ms/step)."]
    for r in get(ours, "concurrency_sync"):
        lines += ["", f"Synchronous scheduling (async off), concurrency {r['C']}: decode {r['decode_tok_s']:.1f} tok/s "
                  f"({r['decode_step_s'] * 1e3:.3f} ms/step), output {r['output_tok_s']:.1f} tok/s whole run."]
    for host in get(ours, "host"):
        mode = "async scheduling" if host.get("async_scheduling") else "synchronous scheduling"
        lines += ["", f"Where a batch-1 decode step's wall time goes, {mode}, no profiler ({host['step_us']:.0f} us "
                  "per step; the GPU work not covered by host work is in the wait for tokens):", "",
                  "| phase | us / step |", "|---|---|"]
        lines += [f"| {k} | {v:.1f} |" for k, v in host["phases_us"].items()]
    return "\n".join(lines)


def run_part(part: str, args, out: Path, timeout: float) -> int:
    cmd = [sys.executable, os.path.abspath(__file__), "--part", part, "--out", args.out]
    cmd += ["--quick"] if args.quick else ["--model", args.model] + (["--smoke"] if args.smoke else [])
    for flag, value in (("--concurrency", args.concurrency), ("--ttft", args.ttft),
                        ("--peer-batches", args.peer_batches)):
        if value:
            cmd += [flag, value]
    with open(out / f"{part}.log", "a") as f:
        try:
            return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                                  env={**os.environ,
                                       "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
                                  ).returncode
        except subprocess.TimeoutExpired:
            f.write(f"\n{part}: killed after {timeout:.0f} s\n")
            return 124


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "benchmarks" / "configs" / "Qwen3.5-35B-A3B"),
                    help="directory holding the config.json of the shape to build")
    ap.add_argument("--out", default="e2e_out")
    ap.add_argument("--quick", action="store_true", help="tiny shape on CPU (a smoke test of this script)")
    ap.add_argument("--smoke", action="store_true", help="real shape, short workload (finds problems fast)")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--no-ours", action="store_true",
                    help="run only the peer (keeps an earlier ours.jsonl for the report)")
    ap.add_argument("--concurrency", default=None, help="comma list overriding the workload's (e.g. 1,8,64)")
    ap.add_argument("--ttft", default=None, help="comma list of TTFT prompt lengths overriding the workload's")
    ap.add_argument("--peer-batches", default=None, help="comma list overriding the peer's batch sizes")
    ap.add_argument("--ours-timeout", type=float, default=420.0)
    ap.add_argument("--peer-timeout", type=float, default=240.0)
    ap.add_argument("--prefill-ttft", action="store_true",
                    help="only lone-prompt TTFT and launch() host time, prefill CUDA graphs on vs off")
    ap.add_argument("--part", choices=("ours", "peer", "ttft-graphs", "ttft-eager"), default=None,
                    help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    wl = QUICK if args.quick else SMOKE if args.smoke else Workload()
    ints = lambda v: tuple(int(x) for x in v.split(","))  # noqa: E731
    for field, value in (("concurrency", args.concurrency), ("ttft_lens", args.ttft),
                         ("peer_batches", args.peer_batches)):
        if value:
            wl = dataclasses.replace(wl, **{field: ints(value)})
    name = "quick (tiny qwen3_5_moe, CPU)" if args.quick else Path(args.model).name
    out = Path(args.out) / ("quick" if args.quick else Path(args.model).name)
    out.mkdir(parents=True, exist_ok=True)
    if args.part == "ours":
        ours_part(args, wl, out)
        return 0
    if args.part == "peer":
        peer_part(args, wl, out)
        return 0
    if args.part in ("ttft-graphs", "ttft-eager"):
        prefill_ttft_part(args, out, graphs=args.part == "ttft-graphs")
        return 0
    if args.prefill_ttft:
        rc = {}
        for part in ("ttft-graphs", "ttft-eager"):
            (out / f"prefill_{part.replace('-', '_')}.jsonl").unlink(missing_ok=True)
            rc[part] = run_part(part, args, out, args.ours_timeout)
        text = prefill_ttft_report(out) + f"\n\nexit codes: {rc}\n"
        (out / "prefill_ttft.md").write_text(text)
        print(text)
        return 0 if all(v == 0 for v in rc.values()) else 1
    rc = {}
    for part, skip, timeout in (("ours", args.no_ours, args.ours_timeout), ("peer", args.no_peer, args.peer_timeout)):
        if not skip:
            (out / f"{part}.jsonl").unlink(missing_ok=True)
            rc[part] = run_part(part, args, out, timeout)
    text = report(out, name, wl) + f"\n\nexit codes: {rc}\n"
    (out / "report.md").write_text(text)
    print(text)
    return 0 if all(v == 0 for v in rc.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
