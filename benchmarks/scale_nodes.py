"""The pieces of ``benchmarks/scale.py``: its processes, its synthetic store nodes, its plot.

Every process started here dies with the benchmark: each comes from
``benchmarks/procs.py`` (a parent-death signal) and is stopped in a
``finally``. Synthetic nodes speak the real gRPC API of the metadata service
(paged ``RegisterNode`` + ``RegisterInventory``, ``Heartbeat``, packed
``Lookup``) with inventories of random 16-byte keys that are never turned
into one Python object per chunk.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks import procs
from kvdepot.apps.cluster import wait_ready
from kvdepot.errors import Unavailable
from kvdepot.proto.gen import common_pb2, metadata_pb2, metadata_pb2_grpc
from kvdepot.wire.lookup import unpack_lookup

CHUNK_BYTES = 2 << 20
LOOKUP_KEYS = 128
SERVING = health_pb2.HealthCheckResponse.SERVING
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]


# -- processes ----------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 15 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


@contextlib.contextmanager
def redis_server(workdir: Path) -> Iterator[int]:
    """A throwaway ``redis-server`` (no persistence) on a free loopback port."""
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("scale: redis-server not found (apt-get install redis-server)")
    port = free_port()
    proc = procs.popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        client = redis.Redis(port=port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.05)
        client.close()
        yield port
    finally:
        stop(proc)


@dataclass
class Daemon:
    """A running ``kvdepot metadata`` process."""

    address: str
    pid: int
    log: Path

    def rss_bytes(self) -> int:
        return proc_status_kb(self.pid, "VmRSS") * 1024

    def hwm_bytes(self) -> int:
        return proc_status_kb(self.pid, "VmHWM") * 1024

    def cpu_s(self) -> float:
        return proc_cpu_s(self.pid)

    def cpu_ns_s(self) -> float:
        return proc_sched_s(self.pid)

    def log_tail(self, lines: int = 5) -> list[str]:
        """The last warnings and errors of its log (what the lead should see)."""
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return []
        # Warnings, errors, and the exception line that ends each traceback.
        kept = [
            t
            for i, t in enumerate(text)
            if "WARNING" in t
            or "ERROR" in t
            or (t[:1].isalpha() and i and text[i - 1].startswith(" ") and ":" in t)
        ]
        return kept[-lines:]


@contextlib.contextmanager
def metadata_daemon(index: str, log: Path, lease_s: float, heartbeat_s: float) -> Iterator[Daemon]:
    """A ``kvdepot metadata`` process over ``index``; yields it once READY."""
    with open(log, "ab") as err:
        proc = procs.popen(
            [sys.executable, "-m", "kvdepot.apps.cli", "--log-level", "WARNING", "metadata",
             "--host", "127.0.0.1", "--port", "0", "--index", index,
             "--lease-ttl", str(lease_s), "--heartbeat-interval", str(heartbeat_s)],
            stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
            death_signal=signal.SIGTERM,
        )  # fmt: skip
    try:
        try:
            info = wait_ready(proc, f"metadata ({index})", 60)
        except Unavailable as exc:
            tail = log.read_text(errors="replace").strip().splitlines()[-3:]
            raise Unavailable(f"{exc}: {' | '.join(tail)}") from exc
        yield Daemon(f"127.0.0.1:{info['port']}", proc.pid, log)
    finally:
        stop(proc)


def proc_status_kb(pid: int, name: str) -> int:
    """A ``kB`` field of ``/proc/PID/status`` (VmRSS, VmHWM)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1])
    return 0


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds, from ``/proc/PID/stat``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_sched_s(pid: int) -> float:
    """CPU seconds of a process's live threads from ``schedstat`` (ns, not 10 ms ticks)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/schedstat") as f:
            total += int(f.read().split()[0])
    return total / 1e9


def mem_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


# -- synthetic nodes ------------------------------------------------------------
def inventory(count: int, seed: int) -> bytes:
    """``count`` random 16-byte keys, concatenated (distinct in practice)."""
    return np.random.default_rng(seed).bytes(16 * count)


def channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


class Node:
    """A synthetic store node: registers its inventory in pages, heartbeats."""

    def __init__(self, stub: Any, node_id: str, keys: bytes) -> None:
        self.stub = stub
        self.node_id = node_id
        self.keys = keys
        self.epoch = 0

    @property
    def chunks(self) -> int:
        return len(self.keys) // 16

    def register(self, timeout_s: float = 120.0) -> tuple[float, int]:
        """RegisterNode, then every page; (wall seconds to the last answer, chunks indexed)."""
        t0 = time.perf_counter()
        reply = self.stub.RegisterNode(
            metadata_pb2.RegisterNodeRequest(
                node_id=self.node_id,
                address=f"127.0.0.1:{20000 + sum(self.node_id.encode()) % 30000}",
                instance_id=f"{self.node_id}-bench",
                tiers=[common_pb2.TierStats(name="cpu", capacity_bytes=1 << 50)],
                paged=True,
            ),
            timeout=timeout_s,
        )
        self.epoch = reply.epoch
        page = max(1, min(int(reply.max_page_chunks) or 65536, 65536))
        count, chunks, start = self.chunks, 0, 0
        while True:
            n = min(page, count - start)
            answer = self.stub.RegisterInventory(
                metadata_pb2.RegisterInventoryRequest(
                    node_id=self.node_id,
                    epoch=self.epoch,
                    keys=self.keys[16 * start : 16 * (start + n)],
                    sizes=[CHUNK_BYTES] * n,
                    last=start + n >= count,
                ),
                timeout=timeout_s,
            )
            chunks = int(answer.chunks)
            start += n
            if start >= count:
                return time.perf_counter() - t0, chunks

    def heartbeat_request(self) -> metadata_pb2.HeartbeatRequest:
        return metadata_pb2.HeartbeatRequest(node_id=self.node_id, epoch=self.epoch)

    def key(self, i: int) -> bytes:
        return self.keys[16 * i : 16 * (i + 1)]


def windows(nodes: list[Node], count: int, seed: int) -> list[list[bytes]]:
    """``count`` lookups of 128 keys that hit, key j from node ``j % len(nodes)``."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        keys = []
        for j in range(LOOKUP_KEYS):
            node = nodes[j % len(nodes)]
            keys.append(node.key(int(rng.integers(node.chunks))))
        out.append(keys)
    return out


class Heartbeater(threading.Thread):
    """Heartbeats every node each ``interval_s``, spread over it, from this process."""

    def __init__(self, address: str, nodes: list[Node], interval_s: float) -> None:
        super().__init__(daemon=True)
        self._channel = channel(address)
        self._stub = metadata_pb2_grpc.MetadataStub(self._channel)
        self.nodes = list(nodes)
        self.interval_s = interval_s
        self.sent = 0
        self.failed: dict[str, str] = {}
        self._done = threading.Event()

    def run(self) -> None:
        # Each node at its own phase of the interval, as independent stores
        # are: a burst of every node at once is a load no cluster sees.
        next_at = time.monotonic()
        while not self._done.is_set():
            nodes = list(self.nodes)
            step = self.interval_s / max(1, len(nodes))
            futures = []
            for n in nodes:
                futures.append(
                    (n.node_id, self._stub.Heartbeat.future(n.heartbeat_request(), timeout=5))
                )
                next_at += step
                if self._done.wait(max(0.0, next_at - time.monotonic())):
                    break
            for node_id, fut in futures:
                try:
                    fut.result()
                except grpc.RpcError as exc:
                    self.failed[node_id] = str(exc.code())
            self.sent += len(futures)

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=10)
        self._channel.close()


# -- probes -----------------------------------------------------------------------
@dataclass
class Samples:
    """Latencies (ms) of lookups and of health checks measured in one loop."""

    lookup_ms: list[float] = field(default_factory=list)
    health_ms: list[float] = field(default_factory=list)
    not_serving: int = 0
    errors: list[str] = field(default_factory=list)
    misses: int = 0


class Prober:
    """Times packed 128-key lookups and the empty health check of one daemon."""

    def __init__(self, address: str) -> None:
        self._channel = channel(address)
        self.stub = metadata_pb2_grpc.MetadataStub(self._channel)
        self.health = health_pb2_grpc.HealthStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def lookup(self, keys: list[bytes], timeout_s: float = 30.0) -> int:
        reply = self.stub.Lookup(
            metadata_pb2.LookupRequest(keys=keys, tokens_per_key=256, packed=True),
            timeout=timeout_s,
        )
        return unpack_lookup(reply).hits

    def check(self, timeout_s: float = 30.0) -> bool:
        reply = self.health.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        return bool(reply.status == SERVING)

    def loop(
        self,
        wins: list[list[bytes]],
        seconds: float,
        *,
        health: bool = True,
        until: threading.Event | None = None,
        into: Samples | None = None,
    ) -> Samples:
        """Lookups (and health checks, one after each) for ``seconds`` or until ``until``."""
        out = into if into is not None else Samples()
        end = time.perf_counter() + seconds
        i = 0
        while time.perf_counter() < end and not (until is not None and until.is_set()):
            try:
                t0 = time.perf_counter()
                hits = self.lookup(wins[i % len(wins)])
                t1 = time.perf_counter()
                out.lookup_ms.append((t1 - t0) * 1000)
                out.misses += hits < LOOKUP_KEYS
                if health:
                    serving = self.check()
                    out.health_ms.append((time.perf_counter() - t1) * 1000)
                    out.not_serving += not serving
            except grpc.RpcError as exc:
                out.errors.append(f"{exc.code()}: {exc.details()}")
                time.sleep(0.05)
            i += 1
        return out

    def floor(self, seconds: float) -> list[float]:
        """Back-to-back empty health checks: the floor under any call here."""
        lat = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            self.check()
            lat.append((time.perf_counter() - t0) * 1000)
        return lat


def percentile(ms: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of samples, nearest rank; 0 for none."""
    if not ms:
        return 0.0
    s = sorted(ms)
    return round(s[min(len(s) - 1, int(q * len(s)))], 3)


# -- a registration in a child process (so it does not share this one's GIL) ------
def register_child(address: str, node_id: str, chunks: int, seed: int, queue: Any) -> None:
    """Register ``chunks`` keys of ``seed`` as ``node_id``; put the result on ``queue``
    (run by :func:`benchmarks.procs.process`: it dies with the benchmark)."""
    keys = inventory(chunks, seed)
    with channel(address) as ch:
        node = Node(metadata_pb2_grpc.MetadataStub(ch), node_id, keys)
        queue.put({"started": time.time()})
        try:
            started = time.time()
            took, indexed = node.register()
            queue.put({"ok": True, "s": took, "chunks": indexed, "end": time.time(),
                       "start": started, "epoch": node.epoch})  # fmt: skip
        except grpc.RpcError as exc:
            queue.put({"ok": False, "error": f"{exc.code()}: {exc.details()}"})


# -- the plot ---------------------------------------------------------------------
def plot(result: dict[str, Any], path: Path) -> None:
    """Six panels: bytes/chunk, registration, lookups by size and by nodes, CPU, churn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 3, figsize=(16, 9))
    series = [("memory: daemon RSS", result.get("memory_bytes_per_chunk"))]
    series.append(("redis: used_memory", result.get("redis_bytes_per_chunk")))
    curve(ax[0][0], series, "index bytes per chunk", "chunks")
    reg = list(result["register_s_by_chunks"].items())
    curve(ax[0][1], reg, "registration of one node (s)", "chunks", log_y=True)
    lookups = [(f"{b} p99", v) for b, v in result["lookup_p99_ms_by_chunks"].items()]
    lookups += [(f"{b} p50", v) for b, v in result["lookup_p50_ms_by_chunks"].items()]
    lookups += [(f"{b} floor p99", v) for b, v in result["grpc_floor_p99_ms_by_chunks"].items()]
    curve(ax[0][2], lookups, "128-key lookup (ms)", "chunks in the index")
    lookups = [(f"{b} p99", v) for b, v in result["lookup_p99_ms_by_nodes"].items()]
    lookups += [(f"{b} floor p99", v) for b, v in result["grpc_floor_p99_ms_by_nodes"].items()]
    curve(ax[1][0], lookups, "128-key lookup (ms), keys over all nodes", "nodes", base=2)
    cpu = [(f"{b} net", v) for b, v in result["heartbeat_cpu_ms_net_by_nodes"].items()]
    cpu += [(f"{b} gross", v) for b, v in result["heartbeat_cpu_ms_by_nodes"].items()]
    curve(ax[1][1], cpu, "daemon CPU ms per heartbeat", "heartbeating nodes", base=2)
    churn_bars(ax[1][2], result)
    fig.suptitle("kvdepot metadata service at scale (grpc floor: empty health check)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def curve(
    ax: Any,
    series: list[tuple[str, Any]],
    ylabel: str,
    xlabel: str,
    *,
    base: int = 10,
    log_y: bool = False,
) -> None:
    """One panel: each series a ``{x: y}`` dict, x on a log scale."""
    from matplotlib.ticker import ScalarFormatter

    for label, values in series:
        if values:
            xs = sorted(values, key=float)
            ax.plot([float(x) for x in xs], [values[x] for x in xs], marker="o", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_xscale("log", base=base)
    if base == 2:
        ax.xaxis.set_major_formatter(ScalarFormatter())
    if log_y:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def churn_bars(ax: Any, result: dict[str, Any]) -> None:
    """Lookup p99 idle, while a node registers, while one expires; the floor."""
    keys = [
        ("grpc floor", "grpc_floor_p99_ms"),
        ("idle", "lookup_p99_idle_ms"),
        ("registering", "lookup_p99_during_register_ms"),
        ("expiring", "lookup_p99_during_expiry_ms"),
    ]
    backends = list(result["lookup_p99_idle_ms"])
    width = 0.8 / max(len(backends), 1)
    for i, b in enumerate(backends):
        values = [result[k].get(b) or 0.0 for _, k in keys]
        ax.bar([j + i * width for j in range(len(keys))], values, width, label=b)
    ax.set_xticks([j + width * (len(backends) - 1) / 2 for j in range(len(keys))])
    ax.set_xticklabels([label for label, _ in keys])
    ax.set_ylabel("128-key lookup p99 (ms)")
    ax.legend(fontsize=8)
