"""A short run of ``benchmarks/soak.py``: mixed load under eviction, every byte verified."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def test_soak_short_run_serves_no_wrong_byte(tmp_path: Path) -> None:
    # 8 MiB arenas against 1 MiB and 256 KiB chunks: chunks are evicted while
    # clients pull them, which is where a store could serve stale bytes.
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--seconds", "10", "--clients", "2", "--json",
         "--capacity", "8MiB", "--warmup", "2", "--log-dir", str(tmp_path / "logs")],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    assert r["wrong_bytes"] == 0 and r["wrong_chunks"] == 0, r["error_samples"]
    assert r["errors"] == 0, r["error_samples"]
    assert r["crashes"] == 0, r["crashed_daemons"]
    assert r["per_op"]["publish"]["ops"] > 0 and r["per_op"]["lookup"]["ops"] > 0
    assert r["per_op"]["pull"]["ops"] > 0
    assert r["chunks_verified"] > 0 and r["bytes_verified"] > 0
    assert r["evictions"] > 0  # the arenas churned: misses were possible, wrong bytes were not
    assert r["ops"] > 0 and r["gbps"] > 0 and r["p99_ms"] > 0
    for daemon in ("metadata", "store-0", "store-1"):
        assert r["daemon_rss_start_mb"][daemon] > 0 and r["daemon_rss_end_mb"][daemon] > 0
