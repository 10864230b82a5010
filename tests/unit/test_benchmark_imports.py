"""benchmarks/ is a package without import cycles, whose scripts run both ways.

Its modules import each other as ``benchmarks.NAME`` (never by bare name,
which only works with benchmarks/ itself on the path), no import cycle, and
every entry script starts as ``python benchmarks/NAME.py`` and as
``python -m benchmarks.NAME``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
MODULES = {p.stem for p in BENCHMARKS.glob("*.py") if p.stem != "__init__"}


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """(sibling modules imported as benchmarks.NAME, siblings imported by bare name)."""
    package, bare = set(), set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] == "benchmarks":
                if len(parts) > 1:
                    package.add(parts[1])
                else:
                    package.update(a.name for a in node.names if a.name in MODULES)
            elif parts[0] in MODULES:
                bare.add(parts[0])
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "benchmarks" and len(parts) > 1:
                    package.add(parts[1])
                elif parts[0] in MODULES:
                    bare.add(parts[0])
    return package, bare


def _graph() -> dict[str, set[str]]:
    return {p.stem: _imports(p)[0] for p in BENCHMARKS.glob("*.py") if p.stem != "__init__"}


def test_the_package_and_its_shared_modules_exist() -> None:
    assert (BENCHMARKS / "__init__.py").is_file()
    assert {"procs", "systems", "measure", "visible", "dataplane", "peers"} <= MODULES


def test_no_sibling_imported_by_bare_name() -> None:
    offenders = {p.name: _imports(p)[1] for p in BENCHMARKS.glob("*.py") if _imports(p)[1]}
    assert not offenders


def test_no_import_cycle() -> None:
    graph = _graph()
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            pytest.fail("import cycle: " + " -> ".join([*path[path.index(name) :], name]))
        if name in done:
            return
        for nxt in sorted(graph.get(name, ())):
            visit(nxt, [*path, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    # The graph is not empty for the wrong reason.
    assert "systems" in graph["dataplane"] and "procs" in graph["systems"]


@pytest.mark.parametrize("name", ["dataplane", "peers", "get_cost", "scale"])
def test_entry_scripts_start_as_files_and_as_modules(name: str, tmp_path: Path) -> None:
    for cmd in (
        [sys.executable, str(BENCHMARKS / f"{name}.py"), "--help"],
        [sys.executable, "-m", f"benchmarks.{name}", "--help"],
    ):
        # From another folder: a file finds the package by itself; -m needs the root on the path.
        cwd = tmp_path if cmd[1] != "-m" else ROOT
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"{cmd}: {out.stderr[-2000:]}"
        assert "usage:" in out.stdout
