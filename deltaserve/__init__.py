"""deltaserve: an inference engine for hybrid Gated-DeltaNet language models (Qwen3-Next, Qwen3.5 / 3.6).

The public names load on first use, so `deltaserve --version` / `--help` and flag errors come back without
importing torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {"LLM": ".llm", "DEFAULT_MODEL_PATH": ".llm", "SamplingParams": ".sampling_params",
            "RequestOutput": ".outputs", "CompletionOutput": ".outputs", "Logprob": ".outputs"}
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "DEFAULT_MODEL_PATH"]

if TYPE_CHECKING:
    from .llm import DEFAULT_MODEL_PATH, LLM
    from .outputs import CompletionOutput, Logprob, RequestOutput
    from .sampling_params import SamplingParams


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
