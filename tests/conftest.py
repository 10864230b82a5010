"""Shared fixtures: real daemons as subprocesses on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvdepot.apps.cluster import LocalCluster, kill_explained
from kvdepot.connector.client import ClientConfig, KVDepotClient


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvdepot fuzzing (tests/integration/test_fuzz.py)")
    group.addoption(
        "--fuzz-examples",
        type=int,
        default=None,
        help="examples per fuzz property (default 150; env KVDEPOT_FUZZ_EXAMPLES)",
    )
    group.addoption(
        "--fuzz-seconds",
        type=float,
        default=None,
        help="repeat the fuzz properties of each test, new examples each round, this long "
        "(default: one round; env KVDEPOT_FUZZ_SECONDS)",
    )


def _fuzz_seconds(config: pytest.Config) -> float:
    seconds = config.getoption("--fuzz-seconds")
    if seconds is None:
        seconds = float(os.environ.get("KVDEPOT_FUZZ_SECONDS", "0"))
    return float(seconds)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A long fuzz run outlasts the suite's per-test timeout: give it room.
    seconds = _fuzz_seconds(config)
    if seconds > 0:
        for item in items:
            if "fuzz_budget" in getattr(item, "fixturenames", ()):
                item.add_marker(pytest.mark.timeout(int(seconds) + 300))


@dataclass(frozen=True, slots=True)
class FuzzBudget:
    """How hard the fuzz tests try: examples per property, and for how long to repeat."""

    examples: int
    seconds: float


@pytest.fixture(autouse=True)
def _environment_kept() -> Iterator[None]:
    """Undo what a library in the test process wrote to ``os.environ``: LMCache
    sets ``PROMETHEUS_MULTIPROC_DIR`` (to a directory in /tmp that outlives
    every run), and a ``vllm serve`` started later inherited it and summed its
    counters with every process that ever wrote there (CI read 40 requests'
    worth of loaded tokens for the 2 a test sent)."""
    before = dict(os.environ)
    yield
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)


@pytest.fixture(scope="session")
def fuzz_budget(request: pytest.FixtureRequest) -> FuzzBudget:
    """Bounded for ``make test``; ``--fuzz-examples``/``--fuzz-seconds`` for a long run."""
    examples = request.config.getoption("--fuzz-examples")
    seconds = _fuzz_seconds(request.config)
    if examples is None:
        examples = int(os.environ.get("KVDEPOT_FUZZ_EXAMPLES", "150"))
    if examples < 1 or seconds < 0:
        raise pytest.UsageError("--fuzz-examples must be positive and --fuzz-seconds not negative")
    return FuzzBudget(examples, seconds)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def stderr_tail(log: Path, chars: int = 6000) -> str:
    """The end of a daemon's stderr file (where its stacks go when it hangs)."""
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError as exc:
        return f"(cannot read {log}: {exc})"


def stop_daemon(proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 20.0) -> str:
    """SIGTERM a daemon whose stderr goes to ``log`` and reap it: ``""`` if
    it exited 0 within ``timeout_s``, else what it did and the end of ``log``.

    One still running at ``timeout_s`` writes its stacks to ``log``
    (SIGUSR1) and is killed. Give the daemon a ``--stop-timeout`` below
    ``timeout_s``: past it, it writes them itself and exits 1.
    """
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        status = proc.wait(timeout=timeout_s)
        what = "" if status == 0 else f"exited with status {status} after SIGTERM"
    except subprocess.TimeoutExpired:
        kill_explained(proc, f"did not stop within {timeout_s:g} s of SIGTERM")
        what = f"did not exit within {timeout_s:g} s of SIGTERM"
    finally:
        if proc.stdout is not None:
            proc.stdout.close()
    if not what:
        return ""
    return f"pid {proc.pid} {what}; the end of its stderr ({log}):\n{stderr_tail(log)}"


@pytest.fixture()
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    """Metadata + two stores with a short lease, logs under the test's tmp dir."""
    c = LocalCluster(
        nodes=2,
        capacity="64MiB",
        lease_ttl_s=1.5,
        heartbeat_interval_s=0.3,
        log_dir=tmp_path / "logs",
    )
    c.start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture()
def client(cluster: LocalCluster) -> Iterator[KVDepotClient]:
    with KVDepotClient(
        ClientConfig(metadata=cluster.metadata_address, node_id=cluster.stores[0].info["node_id"])
    ) as c:
        yield c


# -- Redis ----------------------------------------------------------------------
# Real redis-server processes for the `redis` index backend. Session-scoped
# (a cluster takes seconds to form): tests keep apart by using their own key
# prefix, e.g. ``?prefix=<test-unique>`` in the index URL.


def _redis_binaries(*names: str) -> dict[str, str]:
    import shutil

    found = {n: shutil.which(n) for n in names}
    missing = [n for n, path in found.items() if path is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (apt-get install redis-server)")
    return {n: p for n, p in found.items() if p is not None}


def _free_ports(count: int) -> list[int]:
    # Held open together, so the ports are distinct from each other.
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def _redis_ping(port: int) -> bytes:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64)
    except OSError:
        return b""


def _start_redis(binary: str, workdir: Path, port: int, *extra: str) -> subprocess.Popen[bytes]:
    import time

    workdir.mkdir(parents=True, exist_ok=True)
    log = open(workdir / "redis.log", "wb")  # noqa: SIM115 - owned by the process
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
            *extra,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    log.close()
    deadline = time.monotonic() + 10
    while not _redis_ping(port).startswith(b"+PONG"):
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop_redis([proc])
            pytest.fail(f"redis-server on port {port} did not start: see {workdir / 'redis.log'}")
        time.sleep(0.02)
    return proc


def _stop_redis(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A throwaway redis-server on a free loopback port; yields ``redis://…/0``."""
    binary = _redis_binaries("redis-server")["redis-server"]
    port = free_port()
    proc = _start_redis(binary, tmp_path_factory.mktemp("redis"), port)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        _stop_redis([proc])


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A 3-master Redis Cluster on loopback; yields ``redis+cluster://h:p,h:p,h:p``."""
    import time

    bins = _redis_binaries("redis-server", "redis-cli")
    root = tmp_path_factory.mktemp("redis-cluster")
    ports = _free_ports(6)  # 3 clients, 3 cluster buses
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for port, bus in zip(ports[:3], ports[3:], strict=True):
            procs.append(
                _start_redis(
                    bins["redis-server"],
                    root / str(port),
                    port,
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "5000",
                    # The bus port defaults to port + 10000, which may be taken.
                    "--cluster-port",
                    str(bus),
                )
            )
        created = subprocess.run(
            [
                bins["redis-cli"],
                "--cluster",
                "create",
                *(f"127.0.0.1:{p}" for p in ports[:3]),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if created.returncode != 0:
            pytest.fail(f"redis-cli --cluster create failed: {created.stdout}{created.stderr}")
        deadline = time.monotonic() + 30
        for port in ports[:3]:
            while True:
                info = subprocess.run(
                    [bins["redis-cli"], "-p", str(port), "cluster", "info"],
                    capture_output=True,
                    text=True,
                    timeout=10,
                ).stdout
                if "cluster_state:ok" in info:
                    break
                if time.monotonic() > deadline:
                    pytest.fail(f"redis cluster node {port} not ready: {info}")
                time.sleep(0.1)
        yield "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports[:3])
    finally:
        _stop_redis(procs)
