"""``kvdepot up`` supervises its daemons: one that dies is restarted (the
metadata service on its own port, so the stores keep their chunks and register
again), and one that keeps dying ends ``up`` with an error, never status 0."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest

from kvdepot.apps.cluster import wait_nodes
from kvdepot.connector.client import ClientConfig, KVDepotClient
from kvdepot.keys import Namespace, chunk_keys
from tests.conftest import free_port

pytestmark = pytest.mark.integration

NS = Namespace("test/supervision", chunk_tokens=16)


@dataclass
class Up:
    """A running ``kvdepot up`` and what it said."""

    proc: subprocess.Popen[str]
    address: str
    pids: dict[str, int]
    stderr: list[str] = field(default_factory=list)

    def wait_for_line(self, pattern: str, timeout_s: float = 30.0) -> re.Match[str]:
        """The first stderr line matching ``pattern`` (waiting for it)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.stderr):
                if m := re.search(pattern, line):
                    return m
            time.sleep(0.05)
        tail = "".join(self.stderr[-40:])
        raise AssertionError(f"no line matching {pattern!r} within {timeout_s} s:\n{tail}")


def _drain(stream: Iterator[str], into: list[str]) -> None:
    for line in stream:
        into.append(line)


def _spawn_up(*extra: str) -> Up:
    """``kvdepot up`` of two stores in its own process group, once it runs."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVDEPOT_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvdepot.apps.cli", "up", "--nodes", "2",
         "--metadata-port", str(port), "--capacity", "64MiB", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
        text=True, env=env, start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    up = Up(proc, f"127.0.0.1:{port}", {})
    threading.Thread(target=_drain, args=(proc.stderr, up.stderr), daemon=True).start()
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        if m := re.search(r"^kvdepot cluster up: metadata \S+, pid (\d+)$", line):
            up.pids["metadata"] = int(m.group(1))
        if m := re.search(r"^  store (\S+): .*, pid (\d+)$", line):
            up.pids[m.group(1)] = int(m.group(2))
        if line.startswith("Ctrl-C stops all") or time.monotonic() > deadline:
            break
    assert set(up.pids) == {"metadata", "store-0", "store-1"}, "".join(up.stderr[-40:])
    threading.Thread(target=_drain, args=(proc.stdout, []), daemon=True).start()
    return up


@pytest.fixture()
def start_up() -> Iterator[Callable[..., Up]]:
    started: list[Up] = []

    def start(*extra: str) -> Up:
        up = _spawn_up(*extra)
        started.append(up)
        return up

    yield start
    for up in started:
        if up.proc.poll() is None:
            os.killpg(up.proc.pid, signal.SIGINT)
            try:
                up.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(up.proc.pid, signal.SIGKILL)
                up.proc.wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes (its parent has yet to reap it).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_until(check: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Seconds until ``check()`` held."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{what} not within {timeout_s} s")
        time.sleep(0.1)
    return time.monotonic() - start


def test_a_killed_metadata_service_is_restarted_and_the_chunks_are_found_again(
    start_up: Callable[..., Up],
) -> None:
    up = start_up()
    size = 64 << 10
    keys = chunk_keys(NS, list(range(16 * 8)))
    bufs = [np.frombuffer(os.urandom(size), dtype=np.uint8) for _ in keys]
    with KVDepotClient(ClientConfig(metadata=up.address, rpc_timeout_s=2)) as client:
        assert client.put(keys, bufs).stored == len(keys)
        assert client.lookup(keys) == len(keys)

        os.kill(up.pids["metadata"], signal.SIGKILL)
        m = up.wait_for_line(
            rf"metadata \(pid {up.pids['metadata']}\) exited \(killed by SIGKILL\); "
            r"restarted it as pid (\d+)"
        )
        restarted = int(m.group(1))
        assert restarted != up.pids["metadata"] and _alive(restarted)

        def all_found() -> bool:
            try:
                return client.lookup(keys) == len(keys)
            except Exception:
                return False

        # The stores kept their DRAM: they register with the new service,
        # and their inventory is the index again.
        _wait_until(all_found, 20, "lookups hitting every chunk again")
        out = [np.zeros(size, dtype=np.uint8) for _ in keys]
        assert client.get_into(keys, out).leading == len(keys)
        assert all(np.array_equal(a, b) for a, b in zip(out, bufs, strict=True))
    assert up.proc.poll() is None, "".join(up.stderr[-40:])
    for name in ("store-0", "store-1"):
        assert _alive(up.pids[name]), f"{name} was restarted too"

    # A store that dies is restarted under its node id, and registers again.
    os.kill(up.pids["store-1"], signal.SIGKILL)
    m = up.wait_for_line(
        rf"store-1 \(pid {up.pids['store-1']}\) exited \(killed by SIGKILL\); "
        r"restarted it as pid (\d+)"
    )
    assert _alive(int(m.group(1)))
    wait_nodes(up.address, 2, timeout_s=20)
    assert up.proc.poll() is None

    # A signal to up itself is still a clean stop.
    os.killpg(up.proc.pid, signal.SIGINT)
    assert up.proc.wait(timeout=30) == 0, "".join(up.stderr[-40:])
    assert not [p for p in (restarted, up.pids["store-0"]) if _alive(p)]


def test_a_daemon_that_keeps_dying_ends_up_with_an_error(start_up: Callable[..., Up]) -> None:
    up = start_up("--max-restarts", "1", "--restart-window", "120")
    first = up.pids["metadata"]
    os.kill(first, signal.SIGKILL)
    m = up.wait_for_line(rf"metadata \(pid {first}\) exited .*; restarted it as pid (\d+)")
    second = int(m.group(1))
    os.kill(second, signal.SIGKILL)
    assert up.proc.wait(timeout=60) == 1, "".join(up.stderr[-40:])
    time.sleep(0.2)  # the reader thread has the last lines
    line = up.wait_for_line(r"^kvdepot: error: .*").group(0)
    assert line.startswith(f"kvdepot: error: metadata (pid {second}) exited (killed by SIGKILL)")
    assert "giving up" in line
    assert "Traceback" not in "".join(up.stderr)
    # It stopped the stores on its way out.
    assert not [p for p in (up.pids["store-0"], up.pids["store-1"]) if _alive(p)]


def test_without_restarts_the_first_death_ends_up_non_zero(start_up: Callable[..., Up]) -> None:
    up = start_up("--max-restarts", "0")
    os.kill(up.pids["store-0"], signal.SIGTERM)
    assert up.proc.wait(timeout=60) == 1, "".join(up.stderr[-40:])
    line = up.wait_for_line(r"^kvdepot: error: .*").group(0)
    assert f"store-0 (pid {up.pids['store-0']}) exited (status 0)" in line, line
    assert not _alive(up.pids["metadata"]) and not _alive(up.pids["store-1"])
