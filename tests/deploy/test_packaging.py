"""A non-editable install (what the images do) holds every subpackage.

The editable install of the dev venv finds any folder; ``pip install .``
installs only the packages ``pyproject.toml`` lists, and the compose cluster
once died at start with ``No module named 'kvdepot.metadata.index'``.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_subpackage_is_listed_in_pyproject() -> None:
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {v: k for k, v in tool["package-dir"].items()}
    listed = set(tool["packages"])
    found = set()
    for folder, name in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]))
    assert found - listed == set(), "packages missing from pyproject.toml"
