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


@dataclasses.dataclass(frozen=True)
class Settings:
    force_reference_ops: bool     # DELTASERVE_REFERENCE_OPS=1: torch references everywhere, even on CUDA
    log_level: str                # DELTASERVE_LOG_LEVEL (default INFO)
    compile: str | None           # DELTASERVE_COMPILE=auto|on|off (None: unset, each command's own default)
    fused_sampler: bool           # DELTASERVE_FUSED_SAMPLER=0: torch sampling on CUDA too (default: Triton there)


def settings() -> Settings:
    return Settings(
        force_reference_ops=_flag("DELTASERVE_REFERENCE_OPS"),
        log_level=os.environ.get("DELTASERVE_LOG_LEVEL", "INFO").upper(),
        compile=os.environ.get("DELTASERVE_COMPILE", "").strip().lower() or None,
        fused_sampler=_flag("DELTASERVE_FUSED_SAMPLER", default=True),
    )
