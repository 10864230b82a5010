"""The README as a user meets it.

Its marked Python example runs as written against a real cluster (the
example reads the metadata address from ``KVDEPOT_CLIENT_METADATA``, as a
user's code may, and defaults to the one ``kvdepot up`` listens on); every
relative link in the README, ``docs/`` and ``benchmarks/RESULTS.md`` names a
file that exists, and a heading there where it names one; the README stays a
short front door that states the test command CI runs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvdepot.apps.cluster import LocalCluster

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MARKER = "<!-- tests/integration/test_readme.py runs this block as written -->"
# The README is a front door; the rest lives in docs/.
README_MAX_BYTES = 15 * 1024

FENCE = re.compile(r"^(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
INLINE_CODE = re.compile(r"`[^`]*`")


def marked_blocks(text: str) -> list[str]:
    """The fenced ``python`` blocks right after the marker comment."""
    blocks = []
    for m in re.finditer(re.escape(MARKER) + r"\n```python\n(.*?)^```", text, re.S | re.M):
        blocks.append(m.group(1))
    return blocks


def the_example() -> str:
    text = README.read_text()
    blocks = marked_blocks(text)
    assert len(blocks) == 1, f"the README has {len(blocks)} marked python blocks, not one"
    section = text[text.index("## Using the client") :]
    assert section.index(MARKER) < section.index("\n## ", 1), (
        "the marked block is not in 'Using the client'"
    )
    return blocks[0]


def run_example(env_address: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVDEPOT_CLIENT_METADATA": env_address}
    return subprocess.run(
        [sys.executable, "-c", the_example()],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
        check=False,
    )


@pytest.mark.integration
def test_client_example_runs_as_written(cluster: LocalCluster) -> None:
    # A user's process, twice: the second publishes nothing new.
    first = run_example(cluster.metadata_address)
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines() == ["stored 3, already stored 0", "loaded 2 of 4 chunks"]
    again = run_example(cluster.metadata_address)
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines() == ["stored 0, already stored 3", "loaded 2 of 4 chunks"]


@pytest.mark.integration
def test_client_example_loads_the_bytes_it_published(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVDEPOT_CLIENT_METADATA", cluster.metadata_address)
    env: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(the_example(), str(README), "exec"), env)
    assert len(env["keys"]) == 3, "the 100 trailing tokens got a key"
    assert env["keys"][:2] == env["later"][:2] and env["keys"][2] != env["later"][2]
    assert env["n"] == 2 and env["usable"] == 2
    result = env["result"]
    assert result.loaded == (True, True) and result.reasons == ("", "")
    for i in range(2):
        assert np.array_equal(env["out_buffers"][i], env["kv_of_chunk"](i))


def markdown_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "RESULTS.md"]


def prose_lines(text: str) -> list[str]:
    """Lines outside fenced code blocks, with inline code removed."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(INLINE_CODE.sub("", line))
    return lines


def heading_anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``path`` (inline code keeps its text)."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_relative_links_name_files_that_exist() -> None:
    broken = []
    checked = 0
    for md in markdown_files():
        for line in prose_lines(md.read_text()):
            for target in LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                    continue  # https:, mailto:
                path, _, anchor = target.partition("#")
                dest = (md.parent / path).resolve() if path else md
                checked += 1
                if not dest.exists():
                    broken.append(f"{md.relative_to(ROOT)}: {target} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest):
                    broken.append(f"{md.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
    assert checked > 20, "the link pattern found almost no links"


def test_readme_is_a_short_front_door() -> None:
    data = README.read_bytes()
    assert len(data) <= README_MAX_BYTES, (
        f"README.md is {len(data)} bytes; move detail into docs/ (limit {README_MAX_BYTES})"
    )
    text = data.decode()
    # CI runs the README's test command (.ci/run): it must say exactly that.
    quick = text[text.index("## Quick start") : text.index("## Commands")]
    assert re.search(r"^make test\b", quick, re.M), "Quick start no longer says `make test`"
    assert re.search(r"^make demo\b", quick, re.M)
    # Every doc is reachable from the front door.
    for doc in sorted((ROOT / "docs").glob("*.md")):
        assert f"](docs/{doc.name})" in text, f"README links no docs/{doc.name}"


def test_readme_layout_names_every_package() -> None:
    text = README.read_text()
    layout = text[text.index("## Layout") :]
    layout = layout[: layout.index("\n## ", 1)]
    missing = []
    for top in ("kvdepot", "store", "metadata", "connector", "proto"):
        for init in sorted((ROOT / top).rglob("__init__.py")):
            package = init.parent
            name = package.name + "/"
            if name not in layout:
                missing.append(str(package.relative_to(ROOT)))
    assert not missing, f"README's Layout lacks {missing}"
