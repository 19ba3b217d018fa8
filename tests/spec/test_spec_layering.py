"""The scheduler-side pieces of deltaserve/spec import no torch and nothing of the runner; only
rejection.py and mtp.py (runner side) do."""

import ast
from pathlib import Path

SPEC = Path(__file__).resolve().parents[2] / "deltaserve" / "spec"
RUNNER_SIDE = ("rejection.py", "mtp.py")


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            out.add(("." * node.level) + (node.module or ""))
    return out


def test_scheduler_side_spec_modules_import_no_torch():
    files = sorted(p for p in SPEC.glob("*.py") if p.name not in RUNNER_SIDE)
    assert {p.name for p in files} >= {"__init__.py", "config.py", "ngram.py", "adaptive.py"}
    for path in files:
        bad = [m for m in _imports(path) if m.split(".")[0] == "torch" or "runner" in m or m.startswith("..")]
        assert not bad, (path.name, bad)
