"""Offline generation: `LLM(model_path).generate(prompts, SamplingParams(...))`, vLLM-shaped, on the
continuous-batching engine."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Iterable, Union

import torch
from tqdm.auto import tqdm

from .engine.config import DEFAULT_PREFIX_CACHE_STATE_FRACTION, resolve_device, resolve_dtype
from .engine.llm_engine import DEFAULT_MODEL_PATH, LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "DEFAULT_MODEL_PATH", "resolve_device", "resolve_dtype"]

PromptType = Union[str, list[int], dict[str, Any]]


class LLM:
    """vLLM's offline API over LLMEngine (LLMEngine.from_args documents every option). On CPU the decode step runs
    eagerly unless compile="auto" / "on" (or DELTASERVE_COMPILE) asks for the compiled one."""

    def __init__(self, model: str | Path | dict[str, Any] | None = None, *, device: str = "auto",
                 dtype: str | torch.dtype = "auto",
                 seed: int | None = 0, max_model_len: int | None = None, max_num_seqs: int = 64,
                 block_size: int = 16, enforce_reference_ops: bool = False, max_num_batched_tokens: int | None = None,
                 gpu_memory_utilization: float = 0.9, cpu_cache_bytes: int | None = None,
                 num_gpu_blocks: int | None = None, load_format: str = "auto", enforce_eager: bool = False,
                 compile: str | None = None, async_scheduling: bool | None = None, warm_up: bool | None = None,
                 quantization: str | None = None, kv_cache_dtype: str = "auto",
                 enable_prefix_caching: bool = True,
                 prefix_cache_state_fraction: float = DEFAULT_PREFIX_CACHE_STATE_FRACTION,
                 tensor_parallel_size: int = 1, enable_expert_parallel: bool = False,
                 scheduling_policy: str = "fcfs", prefill_cuda_graphs: bool = True,
                 speculative_config: dict[str, Any] | str | None = None):
        self.engine = LLMEngine.from_args(
            model, device=device, dtype=dtype, seed=seed, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            block_size=block_size, enforce_reference_ops=enforce_reference_ops,
            max_num_batched_tokens=max_num_batched_tokens, gpu_memory_utilization=gpu_memory_utilization,
            cpu_cache_bytes=cpu_cache_bytes, num_gpu_blocks=num_gpu_blocks, load_format=load_format,
            enforce_eager=enforce_eager, compile=compile, async_scheduling=async_scheduling, warm_up=warm_up,
            quantization=quantization, kv_cache_dtype=kv_cache_dtype,
            enable_prefix_caching=enable_prefix_caching, prefix_cache_state_fraction=prefix_cache_state_fraction,
            tensor_parallel_size=tensor_parallel_size, enable_expert_parallel=enable_expert_parallel,
            scheduling_policy=scheduling_policy, prefill_cuda_graphs=prefill_cuda_graphs,
            speculative_config=speculative_config)
        self.model_path = self.engine.model_path
        self.config = self.engine.model_config
        self.tokenizer = self.engine.tokenizer
        self.model = self.engine.runner.model
        self.device = self.engine.runner.device
        self.max_model_len = self.engine.max_model_len
        self._request_ids = itertools.count()

    def shutdown(self) -> None:
        """End every worker process (tensor_parallel_size > 1); the LLM cannot generate afterwards."""
        self.engine.shutdown()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached KV block and state snapshot (vLLM's name); False when prefix caching is off."""
        return self.engine.reset_prefix_cache()

    def generate(self, prompts: PromptType | Iterable[PromptType],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None) -> list[RequestOutput]:
        """Outputs in prompt order. A prompt is text, {"prompt_token_ids": [...]} or {"prompt": text}.
        priority: one value per prompt (lower first), with scheduling_policy="priority"."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, Iterable):
            raise ValueError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
        prompts = list(prompts)
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        for p in prompts:
            if not isinstance(p, (str, dict)):
                raise ValueError(f"a prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(p).__name__}")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(priorities)} priorities")
        ids = [f"llm-{next(self._request_ids)}" for _ in prompts]
        added = []
        try:
            for rid, prompt, sp, prio in zip(ids, prompts, params, priorities):
                self.engine.add_request(rid, prompt, sp, stream=False, priority=prio)
                added.append(rid)
        except BaseException:
            self.engine.abort_request(added)
            self.engine.step()    # collect the abort outputs so the engine is clean for the next call
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", disable=not use_tqdm or len(ids) < 2) as bar:
            while len(done) < len(ids):
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError(f"engine stopped with {len(ids) - len(done)} requests unfinished")
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[rid] for rid in ids]
