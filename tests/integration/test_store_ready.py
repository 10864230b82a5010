"""A store says READY only once it can do its job, and says why it cannot.

A store that can never register (a node id the metadata service refuses, a
wrong token, an address that is no metadata service) exits 1 with one line
on stderr, the service's own reason in it, never READY and never a process
left running. One whose metadata service does not answer keeps trying, not
READY meanwhile, and is READY once it registered. During an outage its log
holds a line per kind of failure every 10 s at most, with a count of the
attempts, not a line per attempt.
"""

from __future__ import annotations

import glob
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdepot.apps.cluster import LocalCluster, wait_ready, wait_registered
from kvdepot.errors import Unavailable
from tests.conftest import free_port, stop_daemon
from tests.integration.hostile import wait_for

pytestmark = pytest.mark.integration

KVDEPOT = [sys.executable, "-m", "kvdepot.apps.cli"]


@pytest.fixture(scope="module")
def metadata() -> Iterator[str]:
    with LocalCluster(nodes=0, capacity="16MiB") as c:
        yield c.metadata_address


def store_cmd(metadata: str, node_id: str, *extra: str) -> list[str]:
    return [
        *KVDEPOT, "--log-level", "WARNING", "store",
        "--node-id", node_id,
        "--port", "0",
        "--metadata", metadata,
        "--capacity", "16MiB",
        "--nixl", "off",
        *extra,
    ]  # fmt: skip


def refused(cmd: list[str]) -> str:
    """Run a store that must not start: exit 1, one line, no READY; the line."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"a store that cannot register kept running: {exc.stderr!r}")
    assert "KVDEPOT READY" not in out.stdout
    assert out.returncode == 1, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("kvdepot: error: "), lines
    return lines[0]


def no_arena(node_id: str) -> bool:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", node_id)[:64]
    return not glob.glob(f"/dev/shm/kvdepot-{glob.escape(safe)}-*")


@pytest.mark.parametrize("node_id", ["two words", "x" * 257, "tab\there"])
def test_a_node_id_the_service_would_refuse_is_refused_before_starting(
    metadata: str, node_id: str
) -> None:
    started = time.monotonic()
    line = refused(store_cmd(metadata, node_id))
    assert "--node-id" in line and "at most 256 printable characters without spaces" in line
    assert time.monotonic() - started < 30  # at config time: no registration tried
    assert no_arena(node_id)
    # --check says so too.
    out = subprocess.run(
        store_cmd(metadata, node_id, "--check"), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 1 and "--node-id" in out.stderr


def test_a_registration_refused_as_invalid_ends_the_store_with_the_reason(
    metadata: str,
) -> None:
    # An address of more than 256 characters: the metadata service refuses it.
    line = refused(store_cmd(metadata, "long-address", "--advertise-host", "h" * 300))
    assert f"metadata {metadata} refused store 'long-address'" in line
    assert "at most 256 printable characters without spaces" in line
    assert no_arena("long-address")


def test_an_address_that_is_no_metadata_service_ends_the_store(metadata: str) -> None:
    with LocalCluster(nodes=1, capacity="16MiB") as c:
        store_grpc = str(c.stores[0].info["grpc_address"])
        line = refused(store_cmd(store_grpc, "astray"))
    assert f"metadata {store_grpc} refused store 'astray'" in line
    assert "is that address a kvdepot metadata service?" in line


def token_file(path: Path, token: str) -> Path:
    path.write_text(token + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture()
def guarded(tmp_path: Path) -> Iterator[str]:
    """A metadata service that requires a token."""
    token = token_file(tmp_path / "cluster", "c" * 40)
    log = tmp_path / "guarded-metadata.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [*KVDEPOT, "metadata", "--port", "0", "--auth-token-file", str(token),
             "--stop-timeout", "10"],
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    try:
        yield f"127.0.0.1:{wait_ready(proc, 'metadata', 60)['port']}"
    finally:
        stopped = stop_daemon(proc, log)
    assert not stopped, stopped


def test_a_wrong_or_missing_token_ends_the_store(guarded: str, tmp_path: Path) -> None:
    wrong = token_file(tmp_path / "wrong", "w" * 40)
    line = refused(store_cmd(guarded, "wrong-token", "--auth-token-file", str(wrong)))
    assert f"metadata {guarded} refused store 'wrong-token'" in line
    assert "wrong auth token" in line and "cluster token" in line
    line = refused(store_cmd(guarded, "no-token"))
    assert "no auth token" in line
    assert no_arena("wrong-token") and no_arena("no-token")


def test_not_ready_until_registered(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "store.log"
    with open(log, "wb") as err:
        store = subprocess.Popen(
            [*KVDEPOT, "store", "--node-id", "patient", "--port", "0",
             "--metadata", f"127.0.0.1:{port}", "--capacity", "16MiB", "--no-shm"],
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    meta = None
    meta_log = tmp_path / "metadata.log"
    stops = []
    try:
        with pytest.raises(Unavailable, match="did not become ready"):
            wait_ready(store, "store", 6)
        assert store.poll() is None, "the store gave up"
        with open(meta_log, "wb") as meta_err:
            meta = subprocess.Popen(
                [*KVDEPOT, "metadata", "--port", str(port), "--stop-timeout", "10"],
                stdout=subprocess.PIPE,
                stderr=meta_err,
                stdin=subprocess.DEVNULL,
            )
        md = f"127.0.0.1:{wait_ready(meta, 'metadata', 60)['port']}"
        info = wait_ready(store, "store", 60)
        # READY means registered: the service lists it at once.
        wait_registered(md, "patient", str(info["grpc_address"]), timeout_s=1)
    finally:
        stops = [stop_daemon(p, p_log) for p, p_log in ((store, log), (meta, meta_log)) if p]
    assert not any(stops), "\n".join(stops)
    text = log.read_text()
    # The service's reason, once (the outage was shorter than the interval).
    assert text.count(f"metadata 127.0.0.1:{port} unreachable (UNAVAILABLE: ") == 1, text
    assert "Connection refused" in text
    assert "answers again, after" in text


def _metadata(port: int, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as err:
        return subprocess.Popen(
            [*KVDEPOT, "metadata", "--port", str(port), "--lease-ttl", "2",
             "--heartbeat-interval", "0.3"],
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip


def test_an_outage_is_logged_with_backoff_and_a_count(tmp_path: Path) -> None:
    ports = [free_port(), free_port()]
    metas = [_metadata(p, tmp_path / f"meta{i}.log") for i, p in enumerate(ports)]
    store = None
    outage_s = 12.0
    try:
        for m in metas:
            wait_ready(m, "metadata", 60)
        both = ",".join(f"127.0.0.1:{p}" for p in ports)
        log = tmp_path / "store.log"
        with open(log, "wb") as err:
            store = subprocess.Popen(
                [*KVDEPOT, "store", "--node-id", "s0", "--port", "0", "--metadata", both,
                 "--capacity", "16MiB", "--no-shm"],
                stdout=subprocess.PIPE,
                stderr=err,
                stdin=subprocess.DEVNULL,
            )  # fmt: skip
        wait_ready(store, "store", 60)
        before = len(log.read_text().splitlines())
        for m in metas:
            m.send_signal(signal.SIGKILL)
            m.wait()
        time.sleep(outage_s)
        metas = [_metadata(p, tmp_path / f"meta{i}.log") for i, p in enumerate(ports)]
        for m in metas:
            wait_ready(m, "metadata", 60)
        wait_for(lambda: "answers again, after" in log.read_text(), 30, "the store came back")
        assert store.poll() is None
    finally:
        # The store first: its log ends with the outage it came back from.
        pairs = [(store, tmp_path / "store.log")] if store else []
        pairs += [(m, tmp_path / f"meta{i}.log") for i, m in enumerate(metas)]
        stops = [stop_daemon(p, p_log) for p, p_log in pairs]
    assert not any(stops), "\n".join(stops)
    lines = log.read_text().splitlines()[before:]
    failover = [x for x in lines if "failing over to metadata" in x]
    unreachable = [x for x in lines if "unreachable (UNAVAILABLE" in x]
    # One line at once, one ~10 s later with the count: not one per attempt.
    assert 1 <= len(failover) <= 3, failover
    assert 1 <= len(unreachable) <= 3, unreachable
    counted = [x for x in failover + unreachable if "attempts since the last line" in x]
    assert counted, lines
    assert all(int(re.search(r"\((\d+) attempts", x)[1]) >= 2 for x in counted), counted  # type: ignore[index]
    back = [x for x in lines if "answers again, after" in x]
    assert len(back) == 1, back
    attempts = int(re.search(r"after (\d+) failed attempts", back[0])[1])  # type: ignore[index]
    assert attempts >= 4, back
    # Failed attempts back off: far fewer than one per retry interval (0.5 s).
    assert attempts < outage_s / 0.5, back
