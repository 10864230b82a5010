"""A local cluster of real daemon processes: one metadata service, N stores.

Used by ``kvdepot up``, ``kvdepot demo`` and the integration tests. Each daemon
prints one ``KVDEPOT READY {json}`` line on stdout once it can do its job (a
metadata service once it listens, a store once it is registered with one);
its logs go to stderr. A store that cannot register retries for as long as it
runs: the wait for its READY line is what bounds it (``ready_timeout_s``).

A :class:`Supervisor` keeps the cluster running (``kvdepot up``): a daemon that
dies is started again as it was, the metadata service on its own port, so the
stores keep their chunks and register with it again, as they would with a
standalone metadata service restarted by its service manager.
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

from kvdepot.errors import KVDepotError, Unavailable
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
    # Its command line after ``kvdepot``, to start it again the same way.
    args: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid


def wait_ready(
    proc: subprocess.Popen[bytes],
    name: str,
    timeout_s: float,
    abort: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """Read ``proc``'s stdout until its READY line; raise if it dies or stalls,
    or once ``abort()`` is true (checked a few times a second)."""
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
            if abort is not None and abort():
                raise Unavailable(f"{name}: the wait for it was interrupted")
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
                    info: dict[str, Any] = json.loads(line[len(READY_PREFIX) :])
                    return info
    finally:
        sel.close()


def _wait_listed(
    metadata: str,
    listed: Callable[[Sequence[metadata_pb2.NodeStats]], bool],
    timeout_s: float,
    security: SecurityConfig | None,
    abort: Callable[[], bool] | None = None,
) -> bool:
    """Poll the metadata service's node list until ``listed`` holds (or
    ``abort()`` is true); whether it did."""
    deadline = time.monotonic() + timeout_s
    with secure_channel(metadata, security) as channel:
        stub = metadata_pb2_grpc.MetadataStub(channel)
        while time.monotonic() < deadline and not (abort is not None and abort()):
            try:
                if listed(stub.GetStats(metadata_pb2.GetStatsRequest(), timeout=2).nodes):
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.05)
    return False


def wait_nodes(
    metadata: str,
    count: int,
    timeout_s: float = 30.0,
    security: SecurityConfig | None = None,
    abort: Callable[[], bool] | None = None,
) -> None:
    """Wait until the metadata service at ``metadata`` lists ``count`` nodes
    (raises once ``abort()`` is true)."""
    seen = [0]

    def enough(nodes: Sequence[metadata_pb2.NodeStats]) -> bool:
        seen[0] = len(nodes)
        return len(nodes) >= count

    if not _wait_listed(metadata, enough, timeout_s, security, abort):
        if abort is not None and abort():
            raise Unavailable("the wait for the stores to register was interrupted")
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
            proc = self._popen(
                [sys.executable, "-m", "kvdepot.apps.cli", *fmt, *args, *self._security_args()],
                stdout=subprocess.PIPE,
                stderr=stderr,
                stdin=subprocess.DEVNULL,
                env=self.env,
            )
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        return DaemonProcess(name, proc, args=args)

    def _popen(self, cmd: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        """Start one daemon's process (a subclass may add to how, e.g. that it
        ends with its parent)."""
        return subprocess.Popen(cmd, **kwargs)

    def _security_args(self) -> list[str]:
        if self._secrets is None and self.security.auth_token:
            self._secrets = Path(tempfile.mkdtemp(prefix="kvdepot-cluster-"))
        return child_args(self.security, self._secrets or Path())

    def _metadata_args(self, port: int, metrics_port: int | None) -> list[str]:
        metrics = [] if metrics_port is None else ["--metrics-port", str(metrics_port)]
        return [
            "metadata",
            "--host", self.host,
            "--port", str(port),
            "--lease-ttl", str(self.lease_ttl_s),
            "--heartbeat-interval", str(self.heartbeat_interval_s),
            "--index", self.index,
            *metrics,
        ]  # fmt: skip

    def start(self, abort: Callable[[], bool] | None = None) -> LocalCluster:
        """Start the metadata service and the stores; return once every store
        registered. ``abort()`` true ends the start early (raises
        ``Unavailable``): an interrupted ``kvdepot up`` must not wait for a
        store started after the signal that stopped the metadata service.
        What was started is stopped when it fails."""
        try:
            metrics_port = 0 if self.metrics else None
            args = self._metadata_args(self.metadata_port, metrics_port)
            self.metadata = self._spawn("metadata", args)
            self.metadata.info = wait_ready(
                self.metadata.proc, "metadata", self.ready_timeout_s, abort
            )
            # A restart binds the ports it got (a store keeps the address it knows).
            info = self.metadata.info
            self.metadata.args = self._metadata_args(info["port"], info.get("metrics_port"))
            for i in range(self.nodes):
                if abort is not None and abort():
                    raise Unavailable("the start was interrupted")
                self.add_store(f"store-{i}", abort=abort)
            wait_nodes(
                self.metadata_address, self.nodes, self.ready_timeout_s, self.security, abort
            )
        except BaseException:
            self.stop()
            raise
        return self

    def add_store(
        self, name: str, *extra: str, abort: Callable[[], bool] | None = None
    ) -> DaemonProcess:
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
        )  # fmt: skip
        self.stores.append(store)
        store.info = wait_ready(store.proc, name, self.ready_timeout_s, abort)
        return store

    def daemons(self) -> list[DaemonProcess]:
        """The metadata service (once started) and the stores."""
        return [*([self.metadata] if self.metadata is not None else []), *self.stores]

    def restart(
        self, daemon: DaemonProcess, abort: Callable[[], bool] | None = None
    ) -> DaemonProcess:
        """Start ``daemon``, which exited, again with its arguments, in its
        place; return once it is ready (a store: registered).

        A store takes its node id over at once: its previous process is gone,
        so waiting for that one's lease to run out would only delay it.

        Raises:
            Unavailable: It exited again or was not ready within
                ``ready_timeout_s`` (it is stopped then), or ``abort()`` came
                true meanwhile (it is left to :meth:`stop`).
        """
        if daemon.proc.poll() is None:
            raise KVDepotError(f"{daemon.name} is still running (pid {daemon.pid})")
        if daemon.proc.stdout is not None:
            daemon.proc.stdout.close()
        forced = ["--force-node-id"] if daemon is not self.metadata else []
        fresh = self._spawn(daemon.name, [*daemon.args, *forced])
        fresh.args = daemon.args
        if daemon is self.metadata:
            self.metadata = fresh
        else:
            self.stores[self.stores.index(daemon)] = fresh
        try:
            fresh.info = wait_ready(fresh.proc, fresh.name, self.ready_timeout_s, abort)
        except Unavailable:
            if abort is None or not abort():
                _end(fresh.proc, timeout_s=5.0)
            raise
        return fresh

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
            _end(p, max(0.1, deadline - time.monotonic()), signalled=True)
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


def exit_reason(returncode: int) -> str:
    """How a process ended, e.g. ``status 1`` or ``killed by SIGKILL``."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"status {returncode}"


class DaemonFailed(KVDepotError):
    """A daemon of a supervised cluster kept dying: its restarts ran out."""


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """How often a daemon that dies is started again before the supervisor
    gives up.

    Attributes:
        max_restarts: Restarts of one daemon within ``window_s``; one more
            death in that window is final (0: the first one is).
        window_s: The span restarts are counted over.
        backoff_s: The wait before the second restart within the window,
            doubling for each further one (the first one is at once: a
            one-off crash costs no more than the start).
        max_backoff_s: The longest such wait.
    """

    max_restarts: int = 5
    window_s: float = 60.0
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0

    def delay(self, recent: int) -> float:
        """The wait before a restart that ``recent`` restarts in the window preceded."""
        if recent <= 0:
            return 0.0
        return float(min(self.max_backoff_s, self.backoff_s * 2 ** (recent - 1)))


class Supervisor:
    """Restarts the daemons of a running :class:`LocalCluster` that exit.

    Call :meth:`poll` a few times a second. Each restart is reported in one
    line (which daemon, how it ended, its new pid); a daemon that dies more
    than ``policy.max_restarts`` times within ``policy.window_s`` is given
    up on (:class:`DaemonFailed`), and the caller stops the cluster. Nothing
    is restarted once ``stopping()`` is true: daemons exiting because the
    cluster is being stopped (Ctrl-C reaches them too) did not crash.
    """

    def __init__(
        self,
        cluster: LocalCluster,
        policy: RestartPolicy | None = None,
        *,
        report: Callable[[str], None] | None = None,
        stopping: Callable[[], bool] = lambda: False,
    ) -> None:
        self.cluster = cluster
        self.policy = policy or RestartPolicy()
        self._report = report or logger.warning
        self._stopping = stopping
        self._restarts: dict[str, list[float]] = {}
        self.restarts = 0
        """Restarts made so far, of all daemons."""

    def poll(self) -> None:
        """Restart each daemon that exited (returns once each one runs again).

        Raises:
            DaemonFailed: One ran out of restarts.
        """
        for daemon in self.cluster.daemons():
            if daemon.proc.poll() is not None and not self._stopping():
                self._recover(daemon)

    def _recent(self, name: str) -> list[float]:
        since = time.monotonic() - self.policy.window_s
        recent = [t for t in self._restarts.get(name, []) if t >= since]
        self._restarts[name] = recent
        return recent

    def _pause(self, delay_s: float) -> bool:
        """Sleep ``delay_s``, unless the cluster is stopped meanwhile (then False)."""
        deadline = time.monotonic() + delay_s
        while not self._stopping():
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            time.sleep(min(left, 0.1))
        return False

    def _recover(self, daemon: DaemonProcess) -> None:
        name, pid = daemon.name, daemon.pid
        why = exit_reason(daemon.proc.returncode)
        while True:
            recent = self._recent(name)
            if len(recent) >= self.policy.max_restarts:
                times = f"{len(recent)} restart{'' if len(recent) == 1 else 's'}"
                raise DaemonFailed(
                    f"{name} (pid {pid}) exited ({why}) after {times} within "
                    f"{self.policy.window_s:g} s: giving up"
                )
            if not self._pause(self.policy.delay(len(recent))):
                return
            recent.append(time.monotonic())
            self.restarts += 1
            try:
                fresh = self.cluster.restart(daemon, abort=self._stopping)
            except Unavailable:
                if self._stopping():
                    return
                self._report(f"{name} (pid {pid}) exited ({why}); its restart failed")
                daemon = next(d for d in self.cluster.daemons() if d.name == name)
                pid = daemon.pid
                why = exit_reason(daemon.proc.returncode) + " while starting"
                continue
            # A store listens on new ports (the metadata service on its own).
            moved = "".join(
                f", {label} {fresh.info[key]}"
                for label, key in (("data", "address"), ("gRPC", "grpc_address"))
                if key in fresh.info
            )
            self._report(
                f"{name} (pid {pid}) exited ({why}); restarted it as pid {fresh.pid}{moved} "
                f"(restart {len(recent)} of at most {self.policy.max_restarts} "
                f"within {self.policy.window_s:g} s)"
            )
            return


def _end(proc: subprocess.Popen[bytes], timeout_s: float, signalled: bool = False) -> None:
    """Stop ``proc`` (SIGTERM unless ``signalled``, SIGKILL past ``timeout_s``)
    and reap it."""
    if not signalled and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_explained(proc, f"did not stop within {timeout_s:.1f} s of SIGTERM")
    if proc.stdout is not None:
        proc.stdout.close()


DUMP_WAIT_S = 2.0
"""How long a daemon is given to write its stacks before its SIGKILL."""


def kill_explained(proc: subprocess.Popen[Any], why: str) -> None:
    """SIGKILL a daemon, after SIGUSR1: it writes where it is (its threads'
    stacks, its asyncio tasks) to its stderr first (:mod:`kvdepot.shutdown`)."""
    if proc.poll() is None:
        logger.warning("pid %d %s: its stacks go to its stderr, then SIGKILL", proc.pid, why)
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGUSR1)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=DUMP_WAIT_S)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
