"""Every DELTASERVE_* environment variable, typed, read in one place."""

from __future__ import annotations

import dataclasses
import os


def _flag(name: str, default: bool = False) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={value!r}: expected 1/0, true/false, yes/no or on/off")


# Eager by default: on a 2-core CPU the compiled decode step measured slower than eager at batch 1 and 16
# (benchmarks/cpu_decode.py; README, speed settings), and a background compile takes cores from serving.
COMPILE_MODES = ("auto", "on", "off")


def _choice(name: str, choices: tuple[str, ...], default: str) -> str:
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(choices)}")
    return value


@dataclasses.dataclass(frozen=True)
class Settings:
    force_reference_ops: bool     # DELTASERVE_REFERENCE_OPS=1: torch references everywhere, even on CUDA
    log_level: str                # DELTASERVE_LOG_LEVEL (default INFO)
    compile: str                  # DELTASERVE_COMPILE=auto|on|off: the default of --compile / LLM(compile=...)
    fused_sampler: bool           # DELTASERVE_FUSED_SAMPLER=0: torch sampling on CUDA too (default: Triton there)


def settings() -> Settings:
    return Settings(
        force_reference_ops=_flag("DELTASERVE_REFERENCE_OPS"),
        log_level=os.environ.get("DELTASERVE_LOG_LEVEL", "INFO").upper(),
        compile=_choice("DELTASERVE_COMPILE", COMPILE_MODES, default="off"),
        fused_sampler=_flag("DELTASERVE_FUSED_SAMPLER", default=True),
    )
