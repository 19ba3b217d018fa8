"""Offline generation: `LLM(model_path).generate(prompts, SamplingParams(...))`, vLLM-shaped."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Iterable, Union

import torch
from tqdm.auto import tqdm

from .batch import CacheBuffers
from .config import ModelConfig
from .engine.detokenizer import IncrementalDetokenizer
from .env import settings
from .models.loader import load_model
from .ops import select_kernels
from .outputs import CompletionOutput, RequestOutput
from .runner.model_runner import ModelRunner, SeqInput
from .runner.sampler import SamplingRow
from .sampling_params import SamplingParams
from .tokenizer import NoTokenizerError, Tokenizer

logger = logging.getLogger(__name__)

PromptType = Union[str, dict[str, Any]]
DEFAULT_MODEL_PATH = Path(__file__).parent / "default_model"
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but CUDA is not available")
    return device


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig, device: torch.device) -> torch.dtype:
    """'auto': the checkpoint's dtype on GPU, float32 on CPU (bf16 matmuls are slow on most CPUs)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else _DTYPES.get(config.torch_dtype, torch.bfloat16)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported (one of auto, {', '.join(_DTYPES)})")
    return _DTYPES[dtype]


class LLM:
    def __init__(self, model: str | Path | None = None, *, device: str = "auto", dtype: str | torch.dtype = "auto",
                 seed: int | None = 0, max_model_len: int | None = None, max_num_seqs: int = 64,
                 block_size: int = 16, enforce_reference_ops: bool = False):
        self.model_path = Path(model) if model is not None else DEFAULT_MODEL_PATH
        self.config = ModelConfig.from_hf(self.model_path)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.config, self.device)
        kernels = select_kernels(self.device, force_reference=enforce_reference_ops or settings().force_reference_ops)
        self.model = load_model(self.model_path, device=self.device, dtype=self.dtype, kernels=kernels,
                                config=self.config)
        self.tokenizer = Tokenizer.from_dir(self.model_path)
        self.max_model_len = min(max_model_len or self.config.max_position_embeddings,
                                 self.config.max_position_embeddings)
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.max_num_seqs, self.block_size, self.seed = max_num_seqs, block_size, seed
        self.eos_token_ids = set(self.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)

    # ---- prompts -------------------------------------------------------------------------
    def _prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise NoTokenizerError(f"text prompt given but {self.model_path} has no tokenizer.json; "
                                       "pass {'prompt_token_ids': [...]} instead")
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif isinstance(prompt, dict) and "prompt" in prompt:
            return self._prompt_ids(prompt["prompt"])
        else:
            raise ValueError(f"a prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty (no tokens)")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.config.vocab_size}): {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the context limit is {self.max_model_len} "
                             "(at least one token must be generated)")
        return text, ids

    # ---- generation ----------------------------------------------------------------------
    def generate(self, prompts: PromptType | Iterable[PromptType],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        requests = [_Request(str(i), *self._prompt_ids(p), sp, self) for i, (p, sp) in enumerate(zip(prompts, params))]
        seqs = [seq for r in requests for seq in r.seqs]
        with tqdm(total=len(requests), desc="Generating", disable=not use_tqdm or len(requests) < 2) as bar:
            for start in range(0, len(seqs), self.max_num_seqs):
                self._run_wave(seqs[start : start + self.max_num_seqs])
                bar.update(sum(r.done() and not r.reported for r in requests))
                for r in requests:
                    r.reported = r.reported or r.done()
        return [r.output() for r in requests]

    def _run_wave(self, seqs: list["_Sequence"]) -> None:
        """Static batching: prefill every sequence of the wave, then decode them together until done."""
        blocks_per_seq = [-(-(len(s.req.prompt_ids) + s.max_new) // self.block_size) for s in seqs]
        cache = CacheBuffers.allocate(self.config, num_slots=len(seqs), num_blocks=sum(blocks_per_seq),
                                      block_size=self.block_size, device=self.device, dtype=self.dtype)
        runner = ModelRunner(self.model, cache, device=self.device, seed=self.seed)
        first = 0
        for slot, (s, n) in enumerate(zip(seqs, blocks_per_seq)):
            s.slot, s.blocks = slot, list(range(first, first + n))
            first += n
            s.make_generator(runner)
        live = seqs
        while live:
            inputs = [s.next_input() for s in live]
            for s, out in zip(live, runner.execute(inputs)):
                s.accept(out)
            live = [s for s in live if s.finish_reason is None]


class _Request:
    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams, llm: LLM):
        self.request_id, self.prompt, self.prompt_ids, self.params = request_id, prompt, prompt_ids, params
        self.prompt_logprobs = None
        self.reported = False
        self.arrival = time.monotonic()
        self.seqs = [_Sequence(self, i, llm) for i in range(params.n)]

    def done(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)

    def output(self) -> RequestOutput:
        outs = [CompletionOutput(s.index, s.text(), s.output_ids, s.logprobs, s.finish_reason, s.stop_reason)
                for s in self.seqs]
        return RequestOutput(self.request_id, self.prompt, self.prompt_ids, self.prompt_logprobs, outs, True)


class _Sequence:
    def __init__(self, req: _Request, index: int, llm: LLM):
        self.req, self.index, self.params = req, index, req.params
        limit = llm.max_model_len - len(req.prompt_ids)
        self.max_new = min(self.params.max_tokens or limit, limit)
        self.output_ids: list[int] = []
        self.logprobs = [] if self.params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.eos_ids = frozenset() if self.params.ignore_eos else frozenset(llm.eos_token_ids)
        self.detok = None
        if llm.tokenizer is not None and self.params.detokenize:
            self.detok = IncrementalDetokenizer(
                llm.tokenizer, req.prompt_ids, skip_special_tokens=self.params.skip_special_tokens,
                stop=self.params.stop, include_stop_str_in_output=self.params.include_stop_str_in_output)
        elif self.params.stop:
            raise ValueError("stop strings need a tokenizer (the model directory has no tokenizer.json)")
        self.slot, self.blocks, self.row = -1, [], None

    def make_generator(self, runner: ModelRunner) -> None:
        gen = None if self.params.seed is None else runner.new_generator(self.params.seed + self.index)
        self.row = SamplingRow(self.params, gen, self.req.prompt_ids, self.output_ids,
                               self.eos_ids | frozenset(self.params.stop_token_ids))

    def next_input(self) -> SeqInput:
        prompt = self.req.prompt_ids
        if not self.output_ids:
            want_prompt_lp = self.params.prompt_logprobs is not None and self.index == 0
            return SeqInput(prompt, 0, self.slot, self.blocks, self.row,
                            prompt_logprobs=self.params.prompt_logprobs if want_prompt_lp else None,
                            next_prompt_token_ids=prompt[1:] if want_prompt_lp else None)
        return SeqInput([self.output_ids[-1]], len(prompt) + len(self.output_ids) - 1, self.slot, self.blocks, self.row)

    def accept(self, out) -> None:
        if out.prompt_logprobs is not None:
            self.req.prompt_logprobs = [None] + out.prompt_logprobs
        token = out.sampled.token_id
        self.output_ids.append(token)
        if self.logprobs is not None:
            self.logprobs.append(out.sampled.logprobs)
        if self.detok is not None and self.detok.add_token(token):
            self.finish_reason, self.stop_reason = "stop", self.detok.stop_reason
        elif len(self.output_ids) >= self.params.min_tokens and (
                token in self.eos_ids or token in self.params.stop_token_ids):
            self.finish_reason = "stop"
            self.stop_reason = None if token in self.eos_ids and token not in self.params.stop_token_ids else token
        elif len(self.output_ids) >= self.max_new:
            self.finish_reason = "length"

    def text(self) -> str:
        return "" if self.detok is None else self.detok.text
