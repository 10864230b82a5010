"""A local cluster of real daemon processes: one metadata service, N stores.

Used by ``kvdepot up``, ``kvdepot demo`` and the integration tests. Each daemon
prints one ``KVDEPOT READY {json}`` line on stdout once it can do its job (a
metadata service once it listens, a store once it is registered with one);
its logs go to stderr. A store that cannot register retries for as long as it
runs: the wait for its READY line is what bounds it (``ready_timeout_s``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import grpc

from kvdepot.errors import Unavailable
from kvdepot.proto.gen import metadata_pb2, metadata_pb2_grpc
from kvdepot.rpc.security import channel as secure_channel
from kvdepot.rpc.security_config import NO_SECURITY, SecurityConfig, child_args

logger = logging.getLogger(__name__)

READY_PREFIX = "KVDEPOT READY "


@dataclass(slots=True)
class DaemonProcess:
    """A started daemon and what it announced."""

    name: str
    proc: subprocess.Popen[bytes]
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid


def wait_ready(proc: subprocess.Popen[bytes], name: str, timeout_s: float) -> dict[str, Any]:
    """Read ``proc``'s stdout until its READY line; raise if it dies or stalls."""
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    buf = b""
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Unavailable(f"{name} did not become ready within {timeout_s:.0f} s")
            if not sel.select(min(left, 0.2)):
                if proc.poll() is not None:
                    raise Unavailable(f"{name} exited with status {proc.returncode}")
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                proc.wait(timeout=5)
                raise Unavailable(f"{name} exited with status {proc.returncode}")
            buf += chunk
            for line in buf.decode(errors="replace").splitlines():
                if line.startswith(READY_PREFIX):
                    info: dict[str, Any] = json.loads(line[len(READY_PREFIX):])
                    return info
    finally:
        sel.close()


def _wait_listed(
    metadata: str,
    listed: Callable[[Sequence[metadata_pb2.NodeStats]], bool],
    timeout_s: float,
    security: SecurityConfig | None,
) -> bool:
    """Poll the metadata service's node list until ``listed`` holds; whether it did."""
    deadline = time.monotonic() + timeout_s
    with secure_channel(metadata, security) as channel:
        stub = metadata_pb2_grpc.MetadataStub(channel)
        while time.monotonic() < deadline:
            try:
                if listed(stub.GetStats(metadata_pb2.GetStatsRequest(), timeout=2).nodes):
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.05)
    return False


def wait_nodes(
    metadata: str, count: int, timeout_s: float = 30.0, security: SecurityConfig | None = None
) -> None:
    """Wait until the metadata service at ``metadata`` lists ``count`` nodes."""
    seen = [0]

    def enough(nodes: Sequence[metadata_pb2.NodeStats]) -> bool:
        seen[0] = len(nodes)
        return len(nodes) >= count

    if not _wait_listed(metadata, enough, timeout_s, security):
        raise Unavailable(f"only {seen[0]} of {count} stores registered within {timeout_s:.0f} s")


def wait_registered(
    metadata: str,
    node_id: str,
    grpc_address: str,
    timeout_s: float = 30.0,
    security: SecurityConfig | None = None,
) -> None:
    """Wait until the metadata service lists this start of store ``node_id``.

    A store announces READY once registered, but may be replaced since; the
    gRPC address (a fresh port per start) tells a restarted store from the
    listing its previous start left.
    """

    def this_start(nodes: Sequence[metadata_pb2.NodeStats]) -> bool:
        return any(n.node_id == node_id and n.grpc_address == grpc_address for n in nodes)

    if not _wait_listed(metadata, this_start, timeout_s, security):
        raise Unavailable(f"store {node_id} did not register within {timeout_s:.0f} s")


class LocalCluster:
    """Metadata service and stores as local processes on loopback.

    With ``security``, every daemon requires its token and serves its TLS
    certificate. The token reaches the daemons in a file (mode 0600, removed
    at stop) named by ``--auth-token-file``, never on their command lines.
    """

    def __init__(
        self,
        *,
        nodes: int = 2,
        metadata_port: int = 0,
        capacity: str = "256MiB",
        host: str = "127.0.0.1",
        lease_ttl_s: float = 5.0,
        heartbeat_interval_s: float = 1.0,
        log_dir: Path | None = None,
        stderr: IO[bytes] | int | None = None,
        extra_store_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        ready_timeout_s: float = 60.0,
        index: str = "memory://",
        metrics: bool = False,
        log_format: str | None = None,
        security: SecurityConfig | None = None,
    ) -> None:
        self.nodes = nodes
        self.metadata_port = metadata_port
        self.capacity = capacity
        self.host = host
        self.lease_ttl_s = lease_ttl_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.log_dir = log_dir
        self._stderr = stderr
        self.extra_store_args = extra_store_args
        self.env = env
        self.ready_timeout_s = ready_timeout_s
        self.index = index
        # Each daemon serves /metrics on a free port, announced as "metrics_port".
        self.metrics = metrics
        # "text" or "json"; None leaves it to the daemons (KVDEPOT_LOG_FORMAT).
        self.log_format = log_format
        self.metadata: DaemonProcess | None = None
        self.stores: list[DaemonProcess] = []
        self._logs: list[IO[bytes]] = []
        # What clients of this cluster use (the daemons' own settings).
        self.security = security or NO_SECURITY
        self._secrets: Path | None = None

    @property
    def metadata_address(self) -> str:
        assert self.metadata is not None
        return f"{self.host}:{self.metadata.info['port']}"

    def _spawn(self, name: str, args: list[str]) -> DaemonProcess:
        stderr: IO[bytes] | int | None = self._stderr
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop()
            self._logs.append(log)
            stderr = log
        fmt = ["--log-format", self.log_format] if self.log_format else []
        # A Ctrl-C while a daemon still imports would print its KeyboardInterrupt
        # traceback: it starts with SIGINT blocked (the mask is inherited) and
        # takes it once its handler is in place (kvdepot.shutdown).
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvdepot.apps.cli", *fmt, *args, *self._security_args()],
                stdout=subprocess.PIPE,
                stderr=stderr,
                stdin=subprocess.DEVNULL,
                env=self.env,
            )
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        return DaemonProcess(name, proc)

    def _security_args(self) -> list[str]:
        if self._secrets is None and self.security.auth_token:
            self._secrets = Path(tempfile.mkdtemp(prefix="kvdepot-cluster-"))
        return child_args(self.security, self._secrets or Path())

    def start(self) -> LocalCluster:
        try:
            self.metadata = self._spawn(
                "metadata",
                [
                    "metadata",
                    "--host", self.host,
                    "--port", str(self.metadata_port),
                    "--lease-ttl", str(self.lease_ttl_s),
                    "--heartbeat-interval", str(self.heartbeat_interval_s),
                    "--index", self.index,
                    *self._metrics_args(),
                ],
            )
            self.metadata.info = wait_ready(self.metadata.proc, "metadata", self.ready_timeout_s)
            for i in range(self.nodes):
                self.add_store(f"store-{i}")
            wait_nodes(self.metadata_address, self.nodes, self.ready_timeout_s, self.security)
        except BaseException:
            self.stop()
            raise
        return self

    def add_store(self, name: str, *extra: str) -> DaemonProcess:
        """Start a store ``name`` with ``extra`` flags; return once it is
        registered (its READY line), so that puts can be placed on it.

        Raises:
            Unavailable: It exited (it cannot register: its node id is
                refused, its token is wrong) or was not registered within
                ``ready_timeout_s``.
        """
        store = self._spawn(
            name,
            [
                "store",
                "--node-id", name,
                "--host", self.host,
                "--port", "0",
                "--grpc-port", "0",
                "--metadata", self.metadata_address,
                "--capacity", self.capacity,
                *self._metrics_args(),
                *self.extra_store_args,
                *extra,
            ],
        )
        self.stores.append(store)
        store.info = wait_ready(store.proc, name, self.ready_timeout_s)
        return store

    def _metrics_args(self) -> list[str]:
        return ["--metrics-port", "0"] if self.metrics else []

    def stop(self, timeout_s: float = 10.0) -> None:
        procs = [s.proc for s in self.stores]
        if self.metadata is not None:
            procs.append(self.metadata.proc)
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdout is not None:
                p.stdout.close()
        for log in self._logs:
            log.close()
        self._logs.clear()
        if self._secrets is not None:
            shutil.rmtree(self._secrets, ignore_errors=True)
            self._secrets = None

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
