"""A store reports SERVING only once it is registered with a metadata service.

The compose file starts the stores' dependants (and its test its clients) on
the stores' health checks: a store that said SERVING before its registration
landed was "healthy" while no client could find it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvdepot.cluster import wait_ready
from tests.conftest import free_port

pytestmark = pytest.mark.integration

KVDEPOT = [sys.executable, "-m", "kvdepot.cli"]


def health(target: str) -> str:
    r = subprocess.run(
        [*KVDEPOT, "health", "--target", target],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return r.stdout.strip() or r.stderr.strip()


def test_store_is_not_serving_until_registered(tmp_path: Path) -> None:
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        store = subprocess.Popen(
            [
                *KVDEPOT,
                "store",
                "--metadata",
                f"127.0.0.1:{port}",
                "--port",
                "0",
                "--capacity",
                "8MiB",
                "--no-shm",
            ],
            stdout=subprocess.PIPE,
            stderr=open(tmp_path / "store.log", "wb"),  # noqa: SIM115
        )
        procs.append(store)
        target = wait_ready(store, "store", 30)["grpc_address"]
        assert health(target) == "NOT_SERVING"
        meta = subprocess.Popen(
            [*KVDEPOT, "metadata", "--port", str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        procs.append(meta)
        wait_ready(meta, "metadata", 30)
        deadline = time.monotonic() + 20
        while health(target) != "SERVING":
            assert time.monotonic() < deadline, "store never SERVING after registering"
            time.sleep(0.3)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    log = (tmp_path / "store.log").read_text()
    assert "NOT_SERVING (not registered with a metadata service yet)" in log
    assert "WARNING kvdepot.health" not in log
