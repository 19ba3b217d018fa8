"""LLMEngine: the request registry and the step loop (schedule -> run -> update).

Requests are validated where they are added (the caller's thread) and queued; `step()` applies queued
adds and aborts, asks the scheduler what to run, runs it, appends the sampled tokens, applies the stop
rules, frees whatever finished in the same step, and returns a RequestOutput for every request that
moved. `add_request` and `abort_request` may be called from other threads while `step()` runs.

Async scheduling (on by default on CUDA): `step()` schedules and launches step N+1 first and then reads
and processes step N's tokens, so the host's bookkeeping (stop rules, outputs, scheduling, packing, launch)
overlaps the GPU's forward instead of leaving it idle between steps. Step N+1 feeds the tokens of step N
from the device; a sequence that step N finished (EOS, stop string, abort) runs one extra position whose
token is dropped, and its slot and blocks are freed as usual (the GPU runs steps in order, so a later
owner never sees those writes). Outputs are the same as synchronous scheduling for greedy and seeded
sampling; rows with penalties (which read the token values) make the engine read step N first.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterable

import torch

from ..cache.manager import HybridCacheManager
from ..cache.plan import DEFAULT_CPU_CACHE_BYTES, CachePlan
from ..config import ConfigError, ModelConfig
from ..distributed.parallel import Parallel, check_model_divides
from ..env import settings
from ..models.loader import check_load_format
from ..outputs import PositionLogprobs, RequestOutput
from ..runner.worker import KV_CACHE_DTYPES, Worker, WorkerConfig
from ..sampling_params import SamplingParams
from ..spec.config import SpeculativeConfig, check_model
from ..spec.drafter import check_available
from ..structured.engine_hooks import EngineGrammars
from ..tokenizer import NoTokenizerError, Tokenizer
from . import executor
from .config import DEFAULT_PREFIX_CACHE_STATE_FRACTION, EngineConfig, resolve_device, resolve_dtype
from .detokenizer import IncrementalDetokenizer
from .scheduler import Scheduler, SchedulerConfig
from .sequence import Request, Sequence, SeqStatus

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PATH = Path(__file__).resolve().parent.parent / "default_model"


@dataclasses.dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_preempted_total: int
    kv_blocks_total: int
    kv_blocks_used: int
    state_slots_total: int
    state_slots_used: int
    prompt_tokens_total: int          # prompt tokens of requests whose prompt has been processed
    generation_tokens_total: int      # sampled tokens
    num_finished_total: dict[str, int]  # completions by finish reason ("stop", "length", "abort")
    num_steps_total: int = 0
    num_batched_tokens_total: int = 0  # tokens run through the model, recomputation included
    prefix_cache_queries_total: int = 0   # tokens looked up in the prefix cache (first admissions)
    prefix_cache_hits_total: int = 0      # ... of which were resumed from it
    prefix_cache_blocks: int = 0          # KV blocks the prefix cache holds
    prefix_cache_snapshots_total: int = 0  # state snapshot slots
    prefix_cache_snapshots_used: int = 0
    prefix_cache_snapshot_evictions_total: int = 0
    # speculative decoding (vLLM's names): verify chunks run, drafts they verified, drafts accepted, and
    # the accepted count per draft position (index j: drafts at position j that were accepted)
    spec_num_drafts_total: int = 0
    spec_num_draft_tokens_total: int = 0
    spec_num_accepted_tokens_total: int = 0
    spec_num_accepted_tokens_per_pos: dict[int, int] = dataclasses.field(default_factory=dict)


def check_speculation(spec: SpeculativeConfig, model_config: ModelConfig, tensor_parallel_size: int,
                      kv_cache_dtype: str = "auto") -> None:
    """Refuse, by name, a speculative_config this build or checkpoint cannot run (before loading weights)."""
    try:
        check_model(spec, model_config)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_available(spec)
    if tensor_parallel_size > 1:
        raise ConfigError("speculative_config with tensor_parallel_size > 1 is not supported yet: use "
                          "tensor_parallel_size=1 or no speculative_config")
    if spec.method == "mtp" and kv_cache_dtype != "auto":
        raise ConfigError(f"speculative_config: method 'mtp' with kv_cache_dtype={kv_cache_dtype!r} is not "
                          "implemented (the MTP head's KV multipliers are not calibrated); use kv_cache_dtype='auto'")


def check_parallel_features(model_config: ModelConfig, kv_cache_dtype: str) -> None:
    """Refuse, by name, what tensor parallelism does not shard yet (before any process starts)."""
    if kv_cache_dtype != "auto":
        raise ValueError(f"tensor_parallel_size > 1 with kv_cache_dtype={kv_cache_dtype!r} is not supported yet: "
                         "use kv_cache_dtype='auto'")


class LLMEngine:
    def __init__(self, *, model_config: ModelConfig, tokenizer: Tokenizer | None, runner: Any,
                 cache: HybridCacheManager, plan: CachePlan, config: EngineConfig, model_path: Path | None = None):
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.runner = runner
        self.cache = cache
        self.plan = plan
        self.config = config
        self.model_path = model_path
        self.max_model_len = plan.max_model_len
        self.max_num_seqs = plan.max_num_seqs
        spec = config.speculative_config
        # MTP drafts: blocks for the head's draft rows (steps 2..K write K/V at the K - 1 positions after a chunk)
        lookahead = spec.num_speculative_tokens - 1 if spec is not None and spec.method == "mtp" else 0
        self.scheduler = Scheduler(SchedulerConfig(plan.max_num_seqs, config.token_budget,
                                                   config.prefix_cache_checkpoint_interval,
                                                   config.scheduling_policy, draft_lookahead=lookahead), cache)
        device = getattr(runner, "device", None)
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else device is not None and torch.device(device).type == "cuda")
        self._inflight = None                            # the launched step whose tokens are not read yet
        self.eos_token_ids = frozenset(model_config.eos_token_ids) | frozenset(
            [tokenizer.eos_token_id] if tokenizer is not None and tokenizer.eos_token_id is not None else [])
        self._requests: dict[str, Request] = {}          # live (added and not yet reported finished)
        self._seqs: dict[int, Sequence] = {}
        self._seq_ids = itertools.count()                # next() is atomic: ids can be drawn from any thread
        self._lock = threading.Lock()                    # guards the pending queues and _live_ids
        self._step_lock = threading.Lock()               # held while the engine state changes
        self._pending_adds: list[Request] = []
        self._pending_aborts: list[str] = []
        self._pending_reset = False
        self._live_ids: set[str] = set()                 # pending + live request ids
        self._outbox: list[RequestOutput] = []           # outputs made between steps (aborts)
        self._finished_by_reason: collections.Counter[str] = collections.Counter()
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._steps_total = 0
        self._batched_tokens_total = 0
        # structured output, logit_bias and bad_words: checks, matchers, masks (structured/engine_hooks.py)
        self.grammars = EngineGrammars(tokenizer, model_config.vocab_size, self.eos_token_ids)
        spec = config.speculative_config
        self._spec_drafts_total = self._spec_draft_tokens_total = self._spec_accepted_total = 0
        self._spec_accepted_per_pos = [0] * (spec.num_speculative_tokens if spec is not None else 0)

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def from_args(cls, model: str | Path | dict[str, Any] | None = None, *, device: str | torch.device = "auto",
                  dtype: str | torch.dtype = "auto", max_model_len: int | None = None, max_num_seqs: int = 64,
                  max_num_batched_tokens: int | None = None, block_size: int = 16,
                  gpu_memory_utilization: float = 0.9, cpu_cache_bytes: int | None = None,
                  num_gpu_blocks: int | None = None, seed: int | None = 0,
                  enforce_reference_ops: bool = False, load_format: str = "auto",
                  enforce_eager: bool = False, compile: str | None = None,
                  async_scheduling: bool | None = None, warm_up: bool | None = None,
                  quantization: str | None = None, kv_cache_dtype: str = "auto",
                  enable_prefix_caching: bool = True,
                  prefix_cache_state_fraction: float = DEFAULT_PREFIX_CACHE_STATE_FRACTION,
                  prefix_cache_checkpoint_interval: int = 0,
                  tensor_parallel_size: int = 1, enable_expert_parallel: bool = False,
                  scheduling_policy: str = "fcfs", prefill_cuda_graphs: bool = True,
                  speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None) -> "LLMEngine":
        """Validate the options into configs, have a Worker (runner/worker.py) do the device half of start-up
        (load the checkpoint directory, default: the embedded model; select kernels; size the cache from the
        memory budget, GPU: measured, CPU: cpu_cache_bytes; allocate it; capture graphs), build the engine
        over the worker's runner and cache plan, and log one summary line. num_gpu_blocks fixes the number
        of KV blocks on any device (tests, tuning); max_num_seqs / max_model_len may come out lower (logged).
        load_format="dummy": random weights from the config alone (`model` is a directory holding a
        config.json, or a config dict); without a tokenizer.json only token-id prompts work.
        enforce_eager: no CUDA graphs (decode steps are otherwise captured per batch-size bucket on CUDA when
        every decode-path op is a Triton kernel; runner/cuda_graphs.py), no piecewise prefill graphs and no
        compiled CPU decode step. prefill_cuda_graphs: prefill and mixed steps of up to 8,192 tokens run as
        piecewise CUDA graphs per token-count bucket on CUDA (runner/prefill_graphs.py); False runs them eagerly.
        compile: the compiled CPU decode step (runner/cpu_compile.py): "auto" compiles in the background and
        decodes eagerly until it is ready, "on" compiles before returning, "off" never; None reads
        DELTASERVE_COMPILE (default "off": eager measured faster on a small CPU). Ignored off CPU.
        async_scheduling: launch each step before reading the previous one's tokens; None: on for CUDA
        devices (on CPU the forward runs in the launching thread, so there is nothing to overlap).
        warm_up: run `warm_up()` before returning; None: on CUDA (on CPU there are no kernels to build).
        quantization: "fp8" quantises a dense checkpoint's weights at load into block-FP8 (vLLM's name; an FP8
        checkpoint's quantization_config is read from config.json without it).
        kv_cache_dtype: "auto" (the activation dtype) or "fp8" / "fp8_e4m3": e4m3 K/V with per-layer multipliers
        from the checkpoint's k_scale / v_scale, else calibrated at start-up (runner/kv_calibration.py); the
        GDN state stays fp32. Reference attention only for now (refused with the Triton kernels).
        enable_prefix_caching: resume requests from the KV blocks and GDN state snapshots of earlier ones
        (engine/scheduler.py, cache/prefix_index.py); prefix_cache_state_fraction: the share of the cache
        budget for state snapshots; prefix_cache_checkpoint_interval: also snapshot every this many prompt
        tokens (0: only at request ends, prompt ends and branch points).
        tensor_parallel_size: shard the model over this many ranks, one process and device each
        (engine/executor.py); enable_expert_parallel: MoE experts split whole across them. Under torchrun the
        ranks other than 0 serve steps inside this call and exit when rank 0 shuts down.
        scheduling_policy: "fcfs" admits waiting requests in arrival order; "priority" by add_request's
        `priority` (lower first, ties by arrival; vLLM's --scheduling-policy).
        speculative_config: speculative decoding (vLLM's keys, a dict or its JSON string; spec/config.py):
        {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": .., "prompt_lookup_max": ..};
        K is the most drafts per step, adaptive K (spec/adaptive.py) picks fewer or none per step. Output
        is unchanged: greedy and seeded requests give the tokens they give without it.
        {"method": "mtp", "num_speculative_tokens": K}: the checkpoint's MTP head drafts (spec/mtp.py); refused
        by name on a checkpoint without one, with tensor_parallel_size > 1 and with an FP8 KV cache."""
        t0 = time.perf_counter()
        config = EngineConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                              gpu_memory_utilization=gpu_memory_utilization, cpu_cache_bytes=cpu_cache_bytes,
                              num_kv_blocks=num_gpu_blocks, seed=seed, enforce_reference_ops=enforce_reference_ops,
                              async_scheduling=async_scheduling, enable_prefix_caching=enable_prefix_caching,
                              prefix_cache_state_fraction=prefix_cache_state_fraction,
                              prefix_cache_checkpoint_interval=prefix_cache_checkpoint_interval,
                              tensor_parallel_size=tensor_parallel_size,
                              enable_expert_parallel=enable_expert_parallel,
                              scheduling_policy=scheduling_policy,
                              speculative_config=SpeculativeConfig.parse(speculative_config))
        check_load_format(load_format)
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported "
                             f"(one of {', '.join(KV_CACHE_DTYPES)})")
        if isinstance(model, dict):
            if load_format != "dummy":
                raise ValueError("a config dict as the model needs load_format='dummy' (there are no weights to read)")
            path, model_config = None, ModelConfig.from_dict(model)
        else:
            path = Path(model) if model is not None else DEFAULT_MODEL_PATH
            model_config = ModelConfig.from_hf(path)
        model_config = model_config.with_quantization(quantization)
        if config.speculative_config is not None:
            check_speculation(config.speculative_config, model_config, tensor_parallel_size, kv_cache_dtype)
        spec = config.speculative_config
        # method mtp: the head's attention layer(s) get a KV layer each in the pools, after the model's
        mtp_kv_layers = model_config.mtp_num_layers if spec is not None and spec.method == "mtp" else 0
        dev = resolve_device(device)
        limit = model_config.max_position_embeddings
        if max_model_len is not None and max_model_len > limit:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {limit}")
        worker_config = WorkerConfig(
            model=model_config, model_path=path, load_format=load_format, device=dev,
            dtype=resolve_dtype(dtype, model_config, dev), max_num_seqs=max_num_seqs,
            max_num_batched_tokens=config.token_budget, max_model_len=max_model_len or limit, block_size=block_size,
            gpu_memory_utilization=gpu_memory_utilization, cpu_cache_bytes=cpu_cache_bytes or DEFAULT_CPU_CACHE_BYTES,
            num_kv_blocks=num_gpu_blocks, seed=seed,
            force_reference_ops=enforce_reference_ops or settings().force_reference_ops,
            enforce_eager=enforce_eager, compile=compile or settings().compile,
            prefill_cuda_graphs=prefill_cuda_graphs,
            kv_cache_dtype="fp8" if kv_cache_dtype.startswith("fp8") else kv_cache_dtype,
            prefix_cache_state_fraction=prefix_cache_state_fraction if enable_prefix_caching else 0.0,
            mtp_kv_layers=mtp_kv_layers, num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0)
        tokenizer = Tokenizer.from_dir(path) if path is not None else None
        if tensor_parallel_size > 1:
            check_parallel_features(model_config, kv_cache_dtype)
            check_model_divides(model_config, Parallel(0, tensor_parallel_size, enable_expert_parallel))
            if int(os.environ.get("RANK", "0")) > 0:      # a torchrun rank other than 0
                executor.run_torchrun_worker(worker_config, expert_parallel=enable_expert_parallel)
                raise SystemExit(0)
            runner = executor.start_tensor_parallel(worker_config, tensor_parallel_size,
                                                    expert_parallel=enable_expert_parallel)
            worker = runner.worker
        else:
            worker = Worker(worker_config)
            runner = worker.start()
            if config.speculative_config is not None:
                runner.enable_speculation(config.speculative_config, verify_graph_sizes=worker.verify_sizes)
        plan = worker.plan
        manager = HybridCacheManager(num_blocks=plan.num_blocks, block_size=block_size,
                                     num_slots=plan.num_slots - plan.num_snapshot_slots,
                                     num_snapshot_slots=plan.num_snapshot_slots,
                                     enable_prefix_caching=enable_prefix_caching)
        prefix = "prefix caching off"
        if enable_prefix_caching:
            snap_bytes = plan.num_snapshot_slots * worker.cache_spec().state_slot_bytes
            prefix = (f"prefix caching: {plan.num_snapshot_slots} of the state slots are snapshots "
                      f"({snap_bytes / (1 << 20):.1f} MiB, prefix_cache_state_fraction {prefix_cache_state_fraction})")
            if plan.num_snapshot_slots == 0:
                logger.warning("prefix caching has no room for a state snapshot: no request can hit "
                               "(raise prefix_cache_state_fraction or the cache budget)")
        if config.token_budget < plan.max_num_seqs:
            logger.info("max_num_batched_tokens %d < max_num_seqs %d: a full batch decodes over several steps",
                        config.token_budget, plan.max_num_seqs)
        engine = cls(model_config=model_config, tokenizer=tokenizer, runner=runner, cache=manager, plan=plan,
                     config=config, model_path=path)
        warm = engine.warm_up() if (warm_up if warm_up is not None else dev.type == "cuda") else None
        phases = dict(getattr(worker, "phase_seconds", {}))
        if warm is not None:
            phases["warm-up"] = warm
        detail = ", ".join(f"{name} {secs:.1f} s" for name, secs in phases.items())
        logger.info("engine ready in %.1f s%s: %s; %s", time.perf_counter() - t0, f" ({detail})" if detail else "",
                    worker.summary(), prefix)
        return engine

    def shutdown(self) -> None:
        """End the worker processes of a tensor-parallel engine (a no-op for one device)."""
        shutdown = getattr(self.runner, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def warm_up(self) -> float:
        """Run throw-away requests in the packings serving meets, so that Triton builds their kernel variants
        now and not in the middle of a step (a step that compiles takes seconds, one that does not a fraction
        of that): several prompts in one step (3 and 16 sequences: Triton specialises integers equal to 1 or
        divisible by 16), prompts admitted beside running decodes, a prompt longer than the step budget
        (a chunk continuing from saved state), greedy and seeded sampling. Token-id prompts, so no tokenizer
        is needed. It leaves no trace: every slot and block is free again and the counters are reset.
        Returns the seconds it took."""
        if self.has_unfinished_requests():
            raise RuntimeError("warm_up() runs before serving: the engine has requests")
        t0 = time.perf_counter()
        vocab, seqs, budget = self.model_config.vocab_size, self.max_num_seqs, self.config.token_budget
        names = itertools.count()

        def add(n: int, length: int, **kw) -> None:
            for _ in range(min(n, seqs)):
                ids = [(7 * i + 3) % vocab for i in range(length)]
                params = SamplingParams(**{"max_tokens": 2, "ignore_eos": True, "temperature": 0.0, **kw})
                if self.cache.can_ever_fit(length + params.max_tokens):
                    self.add_request(f"warm-up-{next(names)}", {"prompt_token_ids": ids}, params, stream=False)

        def drain() -> None:
            while self.has_unfinished_requests():
                self.step()
            self.cache.reset_prefix_cache()   # the prompts share prefixes: keep each packing's shape

        add(3, 17)
        add(1, 17, temperature=1.0, seed=0)
        drain()
        add(16, 32)
        drain()
        add(5, 9, max_tokens=6)
        self.step()                                      # their prompts ...
        add(3, 40)                                       # ... then more prompts beside their decodes
        drain()
        if budget + 17 < self.max_model_len - 2:
            add(1, budget + 17)
            drain()
        if self.config.speculative_config is not None:   # verify chunks: a repeating prompt n-gram drafts on
            k = self.config.speculative_config.num_speculative_tokens
            for n in (1, 3):
                for _ in range(min(n, seqs)):
                    ids = [(5 * (i % 4) + 1) % vocab for i in range(24)]
                    self.add_request(f"warm-up-{next(names)}", {"prompt_token_ids": ids},
                                     SamplingParams(max_tokens=2 * k + 2, ignore_eos=True, temperature=0.0),
                                     stream=False)
                drain()
            self.runner.speculation.reset()
        self._finished_by_reason.clear()
        self._prompt_tokens_total = self._generation_tokens_total = 0
        self._steps_total = self._batched_tokens_total = 0
        self._spec_drafts_total = self._spec_draft_tokens_total = self._spec_accepted_total = 0
        self._spec_accepted_per_pos = [0] * len(self._spec_accepted_per_pos)
        self.scheduler.num_preempted_total = 0
        self.cache.reset_prefix_cache()
        self.scheduler.prefix_queries_total = self.scheduler.prefix_hits_total = 0
        if self.cache.prefix is not None:
            self.cache.prefix.num_evicted_snapshots = self.cache.prefix.num_evicted_blocks = 0
        assert self.cache.blocks.num_used == 0 and self.cache.slots.num_used == 0, "warm-up left cache in use"
        seconds = time.perf_counter() - t0
        logger.debug("warm-up: kernel variants of several packings built in %.1f s", seconds)
        return seconds

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int] | dict[str, Any], params: SamplingParams,
                    arrival_time: float | None = None, *, stream: bool = True, priority: int = 0) -> None:
        """Validate and queue a request; it joins the batch at the next step. `prompt` is text, token ids,
        or {"prompt_token_ids": [...], "prompt": optional text}. stream=False: report only the final
        output (saves building an output per token). priority: lower is admitted first; only with
        scheduling_policy="priority" (else it must be 0, as in vLLM). params.truncate_prompt_tokens keeps the
        prompt's last k tokens; params.max_tokens=0 runs the prompt only (its logprobs) and generates nothing."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority={priority} needs scheduling_policy='priority' (serve: --scheduling-policy "
                             f"priority); the engine runs {self.config.scheduling_policy!r}")
        text, ids = self._prompt_ids(prompt, params)
        vocab = self.model_config.vocab_size
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"stop_token_ids: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if params.stop and (self.tokenizer is None or not params.detokenize):
            raise ValueError("stop strings need detokenized text: the model directory has no tokenizer.json"
                             if self.tokenizer is None else "stop strings need detokenize=True")
        max_new = self.max_model_len - len(ids)
        if params.max_tokens is not None:
            max_new = min(max_new, params.max_tokens)
        if not self.cache.can_ever_fit(len(ids) + max_new):
            raise ValueError(
                f"request needs {len(ids) + max_new} tokens of KV cache ({len(ids)} prompt + {max_new} new) but the "
                f"whole pool holds {self.cache.blocks.num_blocks * self.cache.block_size}; lower max_tokens")
        params = self.grammars.check(request_id, params)
        req = Request(request_id, text, ids, params, time.monotonic() if arrival_time is None else arrival_time,
                      stream=stream, priority=priority)
        req.seqs = [Sequence(next(self._seq_ids), req, i, max_new_tokens=max_new, eos_token_ids=self.eos_token_ids,
                             detokenizer=self._detokenizer(ids, params)) for i in range(params.n)]
        with self._lock:
            if request_id in self._live_ids:
                self.grammars.forget(request_id)
                raise ValueError(f"request id {request_id!r} is already in use")
            self._live_ids.add(request_id)
            self._pending_adds.append(req)

    def _prompt_ids(self, prompt: str | list[int] | dict[str, Any],
                    params: SamplingParams) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                return self._prompt_ids(prompt["prompt"], params)
            else:
                raise ValueError("a prompt dict needs 'prompt_token_ids' or 'prompt'")
        elif isinstance(prompt, str):
            if self.tokenizer is None:
                where = self.model_path if self.model_path is not None else "the model (built from a config dict)"
                raise NoTokenizerError(f"text prompt given but {where} has no tokenizer.json; "
                                       "pass token ids instead ({'prompt_token_ids': [...]})")
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, prompt
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"a prompt must be a string or a list of token ids, got {type(ids).__name__}")
        ids = list(ids)
        if not ids:
            raise ValueError("prompt is empty (no tokens)")
        keep = params.truncate_prompt_tokens
        if keep is not None:
            keep = self.max_model_len if keep == -1 else keep
            if len(ids) > keep:
                text, ids = None, ids[-keep:]     # the text no longer matches the kept tokens
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        if len(ids) + (params.max_tokens != 0) > self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the context limit is {self.max_model_len} "
                             "(prompt + at least one generated token)")
        return text, ids

    def _detokenizer(self, prompt_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None or not params.detokenize:
            return None
        return IncrementalDetokenizer(self.tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens,
                                      stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests (unknown or finished ids are ignored). Their blocks and slots are freed now when
        no step is running, else as the next step starts; the abort output comes with the next step()."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        with self._lock:
            self._pending_aborts.extend(ids)
        if self._step_lock.acquire(blocking=False):
            try:
                self._apply_pending()
            finally:
                self._step_lock.release()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block and snapshot (now when no step runs, else as the next step starts);
        running requests keep theirs. False when prefix caching is off."""
        if not self.cache.prefix_caching:
            return False
        with self._lock:
            self._pending_reset = True
        if self._step_lock.acquire(blocking=False):
            try:
                self._apply_pending()
            finally:
                self._step_lock.release()
        return True

    def _apply_pending(self) -> None:
        with self._lock:
            adds, self._pending_adds = self._pending_adds, []
            aborts, self._pending_aborts = self._pending_aborts, []
            reset, self._pending_reset = self._pending_reset, False
        if reset:
            self.cache.reset_prefix_cache()
        for req in adds:
            self._requests[req.request_id] = req
            self.grammars.admit(req.request_id, [seq.seq_id for seq in req.seqs])
            for seq in req.seqs:
                self._seqs[seq.seq_id] = seq
                self.scheduler.add(seq)
        for rid in aborts:
            req = self._requests.get(rid)
            if req is None:
                continue
            live = [s for s in req.seqs if s.status is not SeqStatus.FINISHED]
            for seq in live:
                seq.finish_reason, seq.stop_reason = "abort", None
            self.scheduler.finish_many(live)
            req.metrics["finished_time"] = time.monotonic()
            self._retire(req)
            self._outbox.append(req.output())

    def _retire(self, req: Request) -> None:
        for seq in req.seqs:
            self._seqs.pop(seq.seq_id, None)
            self.grammars.retire(seq.seq_id)
        del self._requests[req.request_id]
        with self._lock:
            for seq in req.seqs:
                self._finished_by_reason[seq.finish_reason or "abort"] += 1
            self._live_ids.discard(req.request_id)

    # ---- the loop ------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        with self._lock:
            pending = bool(self._pending_adds or self._pending_aborts or self._outbox)
        return pending or self._inflight is not None or self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        with self._step_lock:
            self._apply_pending()
            outputs, self._outbox = self._outbox, []
            if self._inflight is not None and getattr(self._inflight, "collect_first", False):
                outputs.extend(self._collect_inflight())     # its accepted drafts / new drafts move the batch
            sched = self.scheduler.schedule()
            if sched.is_empty and not (sched.freed_seq_ids or sched.state_copies or sched.block_copies):
                if self._inflight is not None:              # nothing new to run: read the step in flight
                    outputs.extend(self._collect_inflight())
                elif self.scheduler.waiting and not self.scheduler.running:
                    raise RuntimeError("scheduler admitted nothing with an idle batch (a request cannot fit)")
                return outputs
            if self._inflight is not None and (not self.runner.can_launch_ahead(sched)
                                               or self.grammars.needs_pending(sched, self._seqs)):
                outputs.extend(self._collect_inflight())
            sched.grammar = self.grammars.masks(sched, self._seqs)   # filled while the forward runs
            now = time.monotonic()
            for new in sched.new_seqs:
                self._seqs[new.seq_id].request.metrics.setdefault("first_scheduled_time", now)
            handle = self.runner.launch(sched)
            self.scheduler.update(sched)
            for seq_id in handle.seq_ids:
                self._seqs[seq_id].num_pending += 1
            self._steps_total += 1
            self._batched_tokens_total += sched.num_tokens
            previous, self._inflight = self._inflight, handle
            if previous is not None:
                outputs.extend(self._process(self.runner.collect(previous)))
            if not self.async_scheduling:
                outputs.extend(self._collect_inflight())
            return outputs

    def _collect_inflight(self) -> list[RequestOutput]:
        handle, self._inflight = self._inflight, None
        return self._process(self.runner.collect(handle))

    def _process(self, result) -> list[RequestOutput]:
        now = time.monotonic()
        moved: dict[str, Request] = {}
        for seq_id, lps in result.prompt_logprobs.items():
            seq = self._seqs.get(seq_id)
            if seq is not None and seq.status is SeqStatus.RUNNING:  # preempted since: recomputed on readmission
                seq.request.prompt_logprobs.extend(self._with_text(lp) for lp in lps)
        finished: list[Sequence] = []
        appended = 0
        for seq_id, token, lp in zip(result.seq_ids, result.token_ids, result.logprobs):
            seq = self._seqs.get(seq_id)
            if seq is None:                  # its request finished or was aborted while this token was in flight
                continue
            seq.num_pending -= 1
            accepted = result.accepted_token_ids.get(seq_id, [])
            if seq_id in result.num_drafts_verified:
                self._count_verify(result.num_drafts_verified[seq_id], len(accepted))
            if seq.status is SeqStatus.FINISHED:
                continue
            req = seq.request
            if seq.max_new_tokens == 0:      # prefill only (max_tokens=0): the token sampled after the prompt is dropped
                seq.finish_reason = "length"
                finished.append(seq)
            else:
                if seq_id in result.num_drafts_verified:
                    self.scheduler.accept(seq, result.num_drafts_verified[seq_id], len(accepted))
                tokens = [*accepted, token]
                lps = [*result.accepted_logprobs.get(seq_id, []), lp]
                for tok, tok_lp in zip(tokens, lps, strict=True):  # a stop inside an accepted run drops the rest
                    appended += 1
                    grammar_done = self.grammars.accept(seq_id, tok)
                    if seq.append_token(tok, self._with_text(tok_lp)):
                        finished.append(seq)
                        break
                    if grammar_done:                 # the grammar is complete: the sequence ends here
                        seq.finish_reason, seq.stop_reason = "stop", None
                        finished.append(seq)
                        break
                else:
                    if not self.grammars.constrained(seq_id):   # constrained rows never speculate (masks)
                        seq.draft_token_ids = result.draft_token_ids.get(seq_id, [])
            if "first_token_time" not in req.metrics:
                req.metrics["first_token_time"] = now
                self._prompt_tokens_total += len(req.prompt_token_ids)
            req.metrics["last_token_time"] = now
            moved[req.request_id] = req
        self._generation_tokens_total += appended
        self.scheduler.finish_many(finished)
        outputs = []
        for req in moved.values():
            done = req.finished
            if done:
                req.metrics["finished_time"] = now
                self._retire(req)
            if done or req.stream:
                outputs.append(req.output())
        return outputs

    def _count_verify(self, num_drafts: int, num_accepted: int) -> None:
        self._spec_drafts_total += 1
        self._spec_draft_tokens_total += num_drafts
        self._spec_accepted_total += num_accepted
        for j in range(num_accepted):
            self._spec_accepted_per_pos[j] += 1

    def _with_text(self, entry: PositionLogprobs | None) -> PositionLogprobs | None:
        if entry is None or self.tokenizer is None:
            return entry
        for token_id, lp in entry.items():
            lp.decoded_token = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return entry

    # ---- introspection ------------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        """A snapshot; safe to call from another thread (counts may lag a running step by one)."""
        with self._lock:
            finished = dict(self._finished_by_reason)
        prefix = self.cache.prefix
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=self.scheduler.num_waiting,
            num_preempted_total=self.scheduler.num_preempted_total,
            kv_blocks_total=self.cache.blocks.num_blocks, kv_blocks_used=self.cache.num_live_blocks,
            state_slots_total=self.cache.slots.num_slots, state_slots_used=self.cache.slots.num_used,
            prompt_tokens_total=self._prompt_tokens_total, generation_tokens_total=self._generation_tokens_total,
            num_finished_total=finished, num_steps_total=self._steps_total,
            num_batched_tokens_total=self._batched_tokens_total,
            prefix_cache_queries_total=self.scheduler.prefix_queries_total,
            prefix_cache_hits_total=self.scheduler.prefix_hits_total,
            prefix_cache_blocks=self.cache.num_cached_blocks,
            prefix_cache_snapshots_total=0 if prefix is None else prefix.num_slots,
            prefix_cache_snapshots_used=0 if prefix is None else prefix.num_snapshots,
            prefix_cache_snapshot_evictions_total=0 if prefix is None else prefix.num_evicted_snapshots,
            spec_num_drafts_total=self._spec_drafts_total, spec_num_draft_tokens_total=self._spec_draft_tokens_total,
            spec_num_accepted_tokens_total=self._spec_accepted_total,
            spec_num_accepted_tokens_per_pos=dict(enumerate(self._spec_accepted_per_pos)))
