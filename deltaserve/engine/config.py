"""Engine options (frozen) and the device / dtype resolution shared by LLM and LLMEngine."""

from __future__ import annotations

import dataclasses

import torch

from ..cache.plan import DEFAULT_PREFIX_CACHE_STATE_FRACTION
from ..config import ModelConfig
from ..spec.config import SpeculativeConfig

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
SCHEDULING_POLICIES = ("fcfs", "priority")


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


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """What the engine was asked for. The cache plan may lower max_num_seqs / max_model_len at start-up
    (logged); the engine's attributes hold the values in force."""

    max_model_len: int | None = None          # None: the model's max_position_embeddings
    max_num_seqs: int = 64                    # sequences in the running batch at once
    max_num_batched_tokens: int | None = None  # tokens per forward (prefill chunks + decodes); None: 2048
    block_size: int = 16                      # tokens per KV block
    gpu_memory_utilization: float = 0.9       # GPU: fraction of total memory the process may use
    cpu_cache_bytes: int | None = None        # CPU: bytes for KV blocks + state slots; None: 1 GiB
    num_kv_blocks: int | None = None          # fix the KV pool size (tests, tuning) instead of deriving it
    seed: int | None = 0                      # seed of the shared generator (requests without their own seed)
    enforce_reference_ops: bool = False       # torch references everywhere, even where Triton is available
    async_scheduling: bool | None = None      # schedule + launch step N+1 before reading step N; None: on CUDA
    enable_prefix_caching: bool = True        # reuse cached KV blocks + GDN state snapshots of earlier requests
    prefix_cache_state_fraction: float = DEFAULT_PREFIX_CACHE_STATE_FRACTION  # budget share of the snapshots
    prefix_cache_checkpoint_interval: int = 0  # also snapshot every this many prompt tokens (0: off)
    tensor_parallel_size: int = 1             # ranks the model is sharded over (one process and device each)
    enable_expert_parallel: bool = False      # MoE: whole experts per rank instead of split expert widths
    scheduling_policy: str = "fcfs"           # waiting-queue order: "fcfs" (arrival) or "priority" (vLLM's names)
    speculative_config: SpeculativeConfig | None = None  # speculative decoding (spec/config.py); None: off

    def __post_init__(self) -> None:
        def fail(field: str, why: str):
            raise ValueError(f"{field}: {why} (got {getattr(self, field)!r})")

        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            fail("max_model_len", "must be an integer >= 2")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            fail("max_num_seqs", "must be an integer >= 1")
        if self.max_num_batched_tokens is not None and (
                not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1):
            fail("max_num_batched_tokens", "must be an integer >= 1")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            fail("block_size", "must be an integer >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            fail("gpu_memory_utilization", "must be in (0, 1]")
        if self.cpu_cache_bytes is not None and (not isinstance(self.cpu_cache_bytes, int) or self.cpu_cache_bytes < 1):
            fail("cpu_cache_bytes", "must be a positive integer")
        if self.async_scheduling not in (None, True, False):
            fail("async_scheduling", "must be True, False or None (auto: on for CUDA devices)")
        if not isinstance(self.enable_prefix_caching, bool):
            fail("enable_prefix_caching", "must be True or False")
        if isinstance(self.prefix_cache_state_fraction, bool) or \
                not isinstance(self.prefix_cache_state_fraction, (int, float)) or \
                not 0 < self.prefix_cache_state_fraction < 1:
            fail("prefix_cache_state_fraction", "must be a number in (0, 1)")
        if not isinstance(self.prefix_cache_checkpoint_interval, int) or self.prefix_cache_checkpoint_interval < 0:
            fail("prefix_cache_checkpoint_interval", "must be an integer >= 0")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            fail("tensor_parallel_size", "must be an integer >= 1")
        if self.enable_expert_parallel not in (True, False):
            fail("enable_expert_parallel", "must be True or False")
        if self.enable_expert_parallel and self.tensor_parallel_size == 1:
            fail("enable_expert_parallel", "needs tensor_parallel_size > 1 (experts are split over those ranks)")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            fail("scheduling_policy", f"must be one of {', '.join(SCHEDULING_POLICIES)}")
        if self.speculative_config is not None and not isinstance(self.speculative_config, SpeculativeConfig):
            fail("speculative_config", "must be a SpeculativeConfig (SpeculativeConfig.parse reads dicts and JSON)")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 1):
            fail("num_kv_blocks", "must be an integer >= 1")

    @property
    def token_budget(self) -> int:
        return self.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
