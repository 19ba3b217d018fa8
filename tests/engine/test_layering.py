"""The import seams, read from the source: the engine <-> runner objects live in a leaf both import, the runner
imports nothing of the engine, the cache side imports no torch, and no import between them is deferred into
a function to dodge a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import deltaserve

ROOT = Path(deltaserve.__file__).resolve().parent


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(absolute module, inside a function) for every import in a deltaserve source file."""
    package = ".".join(("deltaserve", *path.relative_to(ROOT).parent.parts))
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                found.extend((alias.name, in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = package.rsplit(".", child.level - 1)[0] if child.level else ""
                module = ".".join(p for p in (base, child.module) if p)
                found.extend((f"{module}.{alias.name}" if child.module is None else module, in_function)
                             for alias in child.names)
            visit(child, nested)

    visit(ast.parse(path.read_text()), False)
    return found


def _modules(*parts: str) -> list[Path]:
    paths = []
    for part in parts:
        p = ROOT / part
        paths.extend(sorted(p.rglob("*.py")) if p.is_dir() else [p])
    return paths


def test_step_objects_are_a_leaf():
    deps = {m for m, _ in _imports(ROOT / "step_io.py") if m.startswith("deltaserve")}
    assert deps <= {"deltaserve.outputs", "deltaserve.sampling_params"}, deps
    assert not any(m.split(".")[0] == "torch" for m, _ in _imports(ROOT / "step_io.py"))


def test_runner_imports_nothing_of_the_engine():
    for path in _modules("runner"):
        bad = [m for m, _ in _imports(path) if m.startswith(("deltaserve.engine", "deltaserve.server"))]
        assert not bad, (path.name, bad)


def test_cache_side_is_plain_python():
    for path in _modules("cache", "engine/scheduler.py", "engine/sequence.py", "step_io.py"):
        bad = [m for m, _ in _imports(path) if m.split(".")[0] == "torch" or m.startswith("deltaserve.runner")]
        assert not bad, (path.name, bad)


def test_engine_and_runner_import_each_other_at_module_level():
    """(Optional kernels, e.g. the Triton sampler, may still be imported where they are chosen.)"""
    seams = ("deltaserve.engine", "deltaserve.runner", "deltaserve.cache", "deltaserve.step_io", "deltaserve.models")
    for path in _modules("engine", "runner", "cache", "step_io.py"):
        lazy = [m for m, in_function in _imports(path) if in_function and m.startswith(seams)]
        assert not lazy, (path.name, lazy)
