"""A daemon started on a gRPC or HTTP port already in use says so in one line and
exits 1: no traceback, no C-core log lines, no arena left behind, and never a
second server silently sharing the port."""

from __future__ import annotations

import glob
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvdepot.apps.cluster import LocalCluster

pytestmark = pytest.mark.integration


def kvdepot(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "kvdepot.apps.cli", "--log-level", "WARNING", *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{args[0]} on a port in use kept running: {exc.stderr!r}")


def assert_port_refused(out: subprocess.CompletedProcess[str], port: int, what: str) -> None:
    assert out.returncode == 1, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("kvdepot: error: cannot listen on "), lines
    assert f"port {port} is already in use" in lines[0] and what in lines[0], lines


@pytest.fixture()
def held_port() -> Iterator[int]:
    """A loopback port some other program listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


@pytest.fixture(scope="module")
def running() -> Iterator[LocalCluster]:
    with LocalCluster(nodes=1, capacity="16MiB") as c:
        yield c


def test_metadata_on_the_port_of_a_running_metadata(running: LocalCluster) -> None:
    port = int(running.metadata.info["port"])  # type: ignore[union-attr]
    out = kvdepot("metadata", "--host", "127.0.0.1", "--port", str(port))
    assert_port_refused(out, port, "metadata gRPC")


def test_metadata_on_a_port_in_use(held_port: int) -> None:
    out = kvdepot("metadata", "--host", "127.0.0.1", "--port", str(held_port))
    assert_port_refused(out, held_port, "metadata gRPC")


def test_store_on_the_grpc_port_of_a_running_store(running: LocalCluster) -> None:
    # gRPC turns SO_REUSEPORT on by default: two stores would share the port.
    port = int(str(running.stores[0].info["grpc_address"]).rpartition(":")[2])
    node = "port-clash"
    out = kvdepot(
        "store", "--node-id", node, "--port", "0", "--grpc-port", str(port),
        "--metadata", running.metadata_address, "--capacity", "16MiB", "--nixl", "off",
    )  # fmt: skip
    assert_port_refused(out, port, f"store {node} gRPC")
    assert not glob.glob(f"/dev/shm/kvdepot-{node}-*"), "the arena was left behind"


def test_proxy_on_a_port_in_use(held_port: int) -> None:
    out = kvdepot(
        "proxy", "--port", str(held_port),
        "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
    )  # fmt: skip
    assert_port_refused(out, held_port, "proxy")


def test_up_on_a_metadata_port_in_use(held_port: int) -> None:
    cmd = [sys.executable, "-m", "kvdepot.apps.cli", "up", "--nodes", "1"]
    out = subprocess.run(
        [*cmd, "--metadata-port", str(held_port), "--capacity", "16MiB"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr
    # The metadata daemon's line, then up's own.
    lines = out.stderr.strip().splitlines()
    assert lines[0].startswith("kvdepot: error: cannot listen on "), lines
    assert f"port {held_port} is already in use" in lines[0], lines
    assert lines[1:] == ["kvdepot: error: metadata exited with status 1"], lines
