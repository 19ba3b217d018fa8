"""DELTASERVE_* settings: defaults, both spellings of a flag, and a loud error for anything else."""

import pytest

from deltaserve.env import settings


def test_defaults(monkeypatch):
    for name in ("DELTASERVE_REFERENCE_OPS", "DELTASERVE_FUSED_SAMPLER", "DELTASERVE_COMPILE", "DELTASERVE_LOG_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    s = settings()
    assert not s.force_reference_ops and s.fused_sampler and s.compile == "off" and s.log_level == "INFO"


@pytest.mark.parametrize("value, want", [("0", False), ("off", False), ("FALSE", False), ("1", True), ("yes", True)])
def test_flag_spellings(monkeypatch, value, want):
    monkeypatch.setenv("DELTASERVE_FUSED_SAMPLER", value)
    monkeypatch.setenv("DELTASERVE_REFERENCE_OPS", value)
    s = settings()
    assert s.fused_sampler is want and s.force_reference_ops is want


def test_unknown_flag_value_is_an_error(monkeypatch):
    monkeypatch.setenv("DELTASERVE_FUSED_SAMPLER", "maybe")
    with pytest.raises(ValueError, match="DELTASERVE_FUSED_SAMPLER='maybe'"):
        settings()


@pytest.mark.parametrize("value", ["auto", "ON", " off "])
def test_compile_modes(monkeypatch, value):
    monkeypatch.setenv("DELTASERVE_COMPILE", value)
    assert settings().compile == value.strip().lower()


def test_unknown_compile_mode_is_an_error(monkeypatch):
    monkeypatch.setenv("DELTASERVE_COMPILE", "fast")
    with pytest.raises(ValueError, match="DELTASERVE_COMPILE='fast'"):
        settings()
