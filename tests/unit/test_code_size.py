"""Size limits of the source: no module over 800 lines, no function over 80.

Generated code (proto/gen) is left out: its size is protoc's, not ours.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREES = ("kvdepot", "store", "metadata", "connector", "proto", "benchmarks", "deploy", "tests")
SKIPPED_PARTS = {".venv", "__pycache__", "build", ".typecheck"}
GENERATED = ROOT / "proto" / "gen"
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 80


def sources() -> Iterator[Path]:
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if SKIPPED_PARTS.isdisjoint(rel.parts) and not path.is_relative_to(GENERATED):
                yield path


def long_modules(paths: list[Path], root: Path = ROOT) -> list[str]:
    out = []
    for path in paths:
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            out.append(f"{path.relative_to(root)}: {lines} lines")
    return out


def long_functions(paths: list[Path], root: Path = ROOT) -> list[str]:
    out = []
    for path in paths:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    out.append(f"{path.relative_to(root)}:{node.lineno} {node.name} {length}")
    return out


def test_the_scan_sees_the_source_trees() -> None:
    paths = list(sources())
    names = {p.relative_to(ROOT).as_posix() for p in paths}
    # A scan that finds nothing would pass for the wrong reason.
    assert {"kvdepot/apps/cli.py", "store/daemon.py", "tests/conftest.py"} <= names
    assert not any(n.startswith("proto/gen/") for n in names)


def test_no_module_over_800_lines() -> None:
    offenders = long_modules(list(sources()))
    assert not offenders, "modules over 800 lines:\n" + "\n".join(offenders)


def test_no_function_over_80_lines() -> None:
    offenders = long_functions(list(sources()))
    assert not offenders, "functions over 80 lines (file:line name length):\n" + "\n".join(
        offenders
    )


def test_the_limits_catch_a_long_function_and_a_long_module(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    long = tmp_path / "long.py"
    long.write_text(f"def too_long():\n{body}\n\n\nasync def short():\n    return 1\n")
    big = tmp_path / "big.py"
    big.write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    found = long_functions([long, big], tmp_path)
    assert found == [f"long.py:1 too_long {MAX_FUNCTION_LINES + 1}"]
    assert long_modules([long, big], tmp_path) == [f"big.py: {MAX_MODULE_LINES + 1} lines"]
