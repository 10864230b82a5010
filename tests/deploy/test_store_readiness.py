"""A store reports SERVING, and prints READY, only once it is registered with a
metadata service.

The compose file starts the stores' dependants (and its test its clients) on
the stores' health checks: a store that said SERVING before its registration
landed was "healthy" while no client could find it. Before it registers its
gRPC port answers health checks (NOT_SERVING) and it retries the metadata
service for as long as it runs.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvdepot.apps.cluster import wait_ready
from kvdepot.errors import Unavailable
from tests.conftest import free_port

pytestmark = pytest.mark.integration

KVDEPOT = [sys.executable, "-m", "kvdepot.apps.cli"]


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
    target = f"127.0.0.1:{free_port()}"
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
                "--grpc-port",
                target.rpartition(":")[2],
                "--capacity",
                "8MiB",
                "--no-shm",
            ],
            stdout=subprocess.PIPE,
            stderr=open(tmp_path / "store.log", "wb"),  # noqa: SIM115
        )
        procs.append(store)
        deadline = time.monotonic() + 30
        while (status := health(target)) != "NOT_SERVING":
            assert time.monotonic() < deadline, f"store gRPC never answered: {status}"
            time.sleep(0.3)
        # Not READY while no metadata service answers: it keeps trying.
        with pytest.raises(Unavailable, match="did not become ready"):
            wait_ready(store, "store", 3)
        assert store.poll() is None
        meta = subprocess.Popen(
            [*KVDEPOT, "metadata", "--port", str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        procs.append(meta)
        wait_ready(meta, "metadata", 30)
        assert wait_ready(store, "store", 30)["grpc_address"] == target
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
    assert "WARNING kvdepot.rpc.health" not in log
