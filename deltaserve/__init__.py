"""deltaserve: an inference engine for hybrid Gated-DeltaNet language models (Qwen3-Next, Qwen3.5 / 3.6)."""

from .llm import DEFAULT_MODEL_PATH, LLM
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "DEFAULT_MODEL_PATH"]
__version__ = "0.1.0"
