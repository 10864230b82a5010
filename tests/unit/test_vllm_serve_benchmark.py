"""benchmarks/vllm_serve.py starts (its ``--help``) without vLLM or a cluster."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "vllm_serve.py"


def test_help() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    for flag in ("--quick", "--json", "--plot"):
        assert flag in out.stdout
