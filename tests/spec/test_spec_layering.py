"""The scheduler-side pieces of deltaserve/spec (config, n-gram index, adaptive K) import no torch and
nothing of the runner or the rest of deltaserve; the runner-side ones (drafters, verify, rejection) are
imported by the runner only, never by the scheduler or the cache side."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "deltaserve"
SPEC = ROOT / "spec"
RUNNER_SIDE = {"rejection.py", "drafter.py", "verify.py", "oracle.py", "mtp.py"}


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            out.add(("." * node.level) + (node.module or ""))
    return out


def _runner_side(name: str) -> bool:
    return name in RUNNER_SIDE or name.startswith("mtp")


def test_scheduler_side_spec_modules_import_no_torch():
    files = sorted(p for p in SPEC.glob("*.py") if not _runner_side(p.name))
    assert {p.name for p in files} >= {"__init__.py", "config.py", "ngram.py", "adaptive.py"}
    for path in files:
        bad = [m for m in _imports(path) if m.split(".")[0] == "torch" or "runner" in m or m.startswith("..")]
        assert not bad, (path.name, bad)


def test_scheduler_and_cache_import_no_runner_side_spec_module():
    runner_side = {p.stem for p in SPEC.glob("*.py") if _runner_side(p.name)}
    for path in [ROOT / "engine" / "scheduler.py", ROOT / "engine" / "sequence.py", *sorted((ROOT / "cache").glob("*.py"))]:
        bad = [m for m in _imports(path) if "spec" in m and m.rsplit(".", 1)[-1] in runner_side]
        assert not bad, (path.name, bad)
