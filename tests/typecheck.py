"""Run mypy over the ``kvdepot`` namespace as it is installed.

The top-level folders map onto ``kvdepot.*`` only through pyproject's
``package-dir``, which mypy cannot follow; this builds a tree of symlinks
with the installed layout and checks that.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = {"store": "store", "metadata": "metadata", "connector": "connector", "proto": "proto"}


def build_tree(dest: Path) -> Path:
    pkg = dest / "kvdepot"
    pkg.mkdir(parents=True)
    for item in (ROOT / "kvdepot").iterdir():
        if item.name != "__pycache__":
            (pkg / item.name).symlink_to(item)
    for name, folder in PARTS.items():
        (pkg / name).symlink_to(ROOT / folder)
    return pkg


def run() -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory(prefix="kvdepot-typecheck-") as tmp:
        build_tree(Path(tmp))
        return subprocess.run(
            [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
             "--cache-dir", str(ROOT / ".mypy_cache"), "-p", "kvdepot"],
            cwd=tmp,
            capture_output=True,
            text=True,
            check=False,
        )


if __name__ == "__main__":
    result = run()
    sys.stdout.write(result.stdout.replace("kvdepot/", "kvdepot/"))
    sys.stderr.write(result.stderr)
    raise SystemExit(result.returncode)
