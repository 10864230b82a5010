"""Core code never writes the process environment, and reads it only where a
process starts: settings come from the config dataclasses, which the entry
points load (flags > ``KVDEPOT_*`` > file).

The entry points are the applications (``kvdepot/apps``, ``kvdepot/proxy``)
and the two classes another program loads as its entry into kvdepot: the vLLM
connector's facade and the LMCache backend, which hand ``os.environ`` to the
settings loader as a command does. Checked on the syntax tree, so a docstring
that names ``os.environ`` is no finding and an aliased import is one.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ["kvdepot", "store", "metadata", "connector"]
APPLICATIONS = {ROOT / "kvdepot" / "apps", ROOT / "kvdepot" / "proxy"}
READERS = {
    ROOT / "connector" / "vllm" / "__init__.py",
    ROOT / "connector" / "lmcache" / "connector.py",
}
WRITES = {"putenv", "unsetenv"}
ENV_METHODS_WRITING = {"setdefault", "update", "pop", "popitem", "clear", "__setitem__"}


def _library_files() -> list[Path]:
    files = []
    for top in LIBRARY:
        for path in sorted((ROOT / top).rglob("*.py")):
            generated = "gen" in path.relative_to(ROOT).parts
            if generated or any(a in path.parents for a in APPLICATIONS):
                continue
            files.append(path)
    return files


def _uses(path: Path) -> tuple[list[str], list[str]]:
    """Where ``path`` reads and where it writes the environment (``line: code``)."""
    tree = ast.parse(path.read_text(), str(path))
    aliases = {"os"}
    names = {"environ": "environ", "getenv": "getenv", "putenv": "putenv"}
    found: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name == "os"}
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            found |= {a.asname or a.name: a.name for a in node.names if a.name in names}
    reads: list[str] = []
    writes: list[str] = []
    parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in aliases and node.attr in ("environ", "getenv", *WRITES):
                what = node.attr
        elif isinstance(node, ast.Name) and node.id in found:
            what = found[node.id]
        if what is None:
            continue
        name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
        where = f"{name}:{node.lineno}: {ast.unparse(parents.get(node, node))}"
        parent = parents.get(node)
        writing = what in WRITES or (
            what == "environ"
            and (
                (isinstance(parent, ast.Attribute) and parent.attr in ENV_METHODS_WRITING)
                or (
                    isinstance(parent, ast.Subscript)
                    and isinstance(parent.ctx, ast.Store | ast.Del)
                )
            )
        )
        (writes if writing else reads).append(where)
    return sorted(reads, key=_line), sorted(writes, key=_line)


def _line(where: str) -> int:
    return int(where.split(":")[1])


def test_no_library_module_writes_the_environment() -> None:
    writes = [w for path in _library_files() for w in _uses(path)[1]]
    assert writes == []


def test_only_the_entry_points_read_the_environment() -> None:
    readers = {path for path in _library_files() if _uses(path)[0]}
    assert readers == READERS, sorted(str(p.relative_to(ROOT)) for p in readers ^ READERS)


def test_the_scan_finds_what_it_looks_for(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import os\nimport os as o\nfrom os import environ as e\n"
        "os.environ.setdefault('A', '1')\no.environ['B'] = '2'\ndel e['C']\n"
        "x = os.getenv('D')\ny = e.get('E')\n"
    )
    reads, writes = _uses(sample)
    assert [_line(w) for w in writes] == [4, 5, 6]
    assert [_line(r) for r in reads] == [7, 8]
