"""Data-plane benchmark: kvdepot's transports next to the limits and to Redis.

Put and get of batches of chunks (256 KiB to 16 MiB) through:

* ``memcpy``: numpy ``copyto`` between cold buffers (the copy limit);
* ``raw-tcp``: plain Python loopback TCP between two processes,
  ``sendall(memoryview)`` / ``recv_into`` preallocated buffers, one ack per
  batch (the receiver of puts rotates its buffers over 512 MiB, as a store's
  puts land in space not recently written);
* ``raw-shm``: a copy into (put) or out of (get) a shared-memory segment
  owned by another process, one Unix-socket round trip per batch (puts
  rotate over 512 MiB of it, as a store's puts land in space not recently
  written);
* ``raw-tcp-xxh3``, ``raw-shm-xxh3``: the same, hashing as kvdepot does (``floors.py``);
* ``redis``: a ``redis-server`` started here, redis-py with hiredis,
  pipelined SET / GET of the batch;
* ``kvdepot-tcp``, ``kvdepot-shm``, ``kvdepot-nixl``: a real local cluster
  (metadata service and store daemon processes) and ``KVDepotClient.put`` /
  ``get_into``, metadata calls included, checksums verified end to end;
* ``kvdepot-tcp-remote``, ``-lookup``, ``-probe``: see :class:`KVDepotRemote`.

Systems run round-robin within each trial, so a ratio compares runs made
under the same load. GB/s is the batch's bytes over the median batch time;
p50/p99 are batch latencies. ``--quick`` takes under a minute; ``--json``
prints the rows; a PNG plot of GB/s against chunk size is written. The
store daemon's resident memory is sampled during the kvdepot runs and
reported against its arena.

Run: ``python benchmarks/dataplane.py --quick``.
"""

from __future__ import annotations

import abc
import argparse
import contextlib
import json
import mmap
import multiprocessing as mp
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rss import RssSampler
from stages import client_profiler, print_profiles, profile_env, put_ceilings, run_stages

KiB = 1 << 10
MiB = 1 << 20
SIZES = (256 * KiB, MiB, 4 * MiB, 16 * MiB)


@dataclass(frozen=True, slots=True)
class Row:
    """One result: a system's put or get of chunks of ``size`` bytes."""

    system: str
    op: str
    size: int
    gbps: float
    p50_ms: float
    p99_ms: float


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    n = view.nbytes
    while got < n:
        r = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if r == 0:
            raise ConnectionError("peer closed")
        got += r


class System(abc.ABC):
    """One way of moving a batch of chunks; set up per chunk size."""

    name: str

    @abc.abstractmethod
    def prepare(self, size: int, batch: int) -> None:
        """Allocate buffers for batches of ``batch`` chunks of ``size`` bytes."""

    def before_get(self) -> None:  # noqa: B027 - optional hook
        """Make sure the batch read by :meth:`get` is stored (puts may have evicted it)."""

    @abc.abstractmethod
    def put(self) -> None:
        """Write one batch."""

    @abc.abstractmethod
    def get(self) -> None:
        """Read one batch (verified where the system verifies)."""

    def quiesce(self) -> None:  # noqa: B027 - optional hook
        """Wait, untimed, until the work of the last operation has ended.

        A put that returns before its store has committed (kvdepot's
        deferred, pipelined puts) leaves work running; without this, it
        would run inside the next system's timed operation and be charged
        to that system."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stop whatever the system started."""


def _cold_sets(size: int, batch: int) -> int:
    """Batches of buffers to rotate over: 512 MiB, more than the last-level
    cache (up to 300 MiB on these machines), so each use finds them cold."""
    return max(2, (512 * MiB) // (size * batch))


def _sources(size: int, batch: int, pools: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(size)
    return [
        [rng.integers(0, 255, size, dtype=np.uint8) for _ in range(batch)] for _ in range(pools)
    ]


class Memcpy(System):
    """numpy copyto between buffers rotated so they are cold (not in cache)."""

    name = "memcpy"

    def prepare(self, size: int, batch: int) -> None:
        pools = _cold_sets(size, batch)
        self._src = [[np.full(size, 7, dtype=np.uint8) for _ in range(batch)] for _ in range(pools)]
        self._dst = [[np.ones(size, dtype=np.uint8) for _ in range(batch)] for _ in range(pools)]
        self._i = 0

    def _copy(self) -> None:
        self._i = (self._i + 1) % len(self._src)
        for d, s in zip(self._dst[self._i], self._src[self._i], strict=True):
            np.copyto(d, s)

    def put(self) -> None:
        self._copy()

    def get(self) -> None:
        self._copy()


def _raw_tcp_server(port_q: Any, size: int, batch: int) -> None:
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)
    port_q.put(lst.getsockname()[1])
    conn, _ = lst.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # Puts land in buffers rotated over 512 MiB (more than the last-level
    # cache), as a store's puts land in arena space not recently written;
    # gets send the same batch each time, as the kvdepot rows read theirs.
    slots = [
        [memoryview(np.ones(size, dtype=np.uint8)) for _ in range(batch)]
        for _ in range(_cold_sets(size, batch))
    ]
    nxt = 0
    while True:
        op = conn.recv(1)
        if not op:
            return
        if op == b"p":
            nxt = nxt % (len(slots) - 1) + 1
            for b in slots[nxt]:
                _recv_into(conn, b)
            conn.sendall(b"k")
        else:
            for b in slots[0]:
                conn.sendall(b)


class RawTcp(System):
    """Plain Python TCP over loopback to another process."""

    name = "raw-tcp"

    def prepare(self, size: int, batch: int) -> None:
        self.close()
        q: Any = mp.get_context("spawn").Queue()
        self._proc = mp.get_context("spawn").Process(
            target=_raw_tcp_server, args=(q, size, batch), daemon=True
        )
        self._proc.start()
        self._sock = socket.create_connection(("127.0.0.1", q.get(timeout=30)))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._src = [memoryview(a) for a in _sources(size, batch, 1)[0]]
        self._dst = [memoryview(np.ones(size, dtype=np.uint8)) for _ in range(batch)]

    def put(self) -> None:
        self._sock.sendall(b"p")
        for b in self._src:
            self._sock.sendall(b)
        self._sock.recv(1)

    def get(self) -> None:
        self._sock.sendall(b"g")
        for b in self._dst:
            _recv_into(self._sock, b)

    def close(self) -> None:
        if getattr(self, "_sock", None) is not None:
            self._sock.close()
            self._proc.join(5)
            self._sock = None  # type: ignore[assignment]


def _raw_shm_server(path: str, sock_path: str, ready: Any) -> None:
    # Owns the segment (as a store owns its arena) and answers each batch.
    lst = socket.socket(socket.AF_UNIX)
    lst.bind(sock_path)
    lst.listen(1)
    ready.set()
    conn, _ = lst.accept()
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED)
    while conn.recv(1):
        conn.sendall(b"k")
    mm.close()


class RawShm(System):
    """A copy into / out of another process's shared-memory segment, one round trip per batch.

    Puts rotate over 512 MiB of the segment (more than the last-level
    cache), as a store's puts land in arena space not recently written;
    gets read the same batch each time, as the kvdepot rows do.
    """

    name = "raw-shm"

    def prepare(self, size: int, batch: int) -> None:
        self.close()
        self._dir = tempfile.mkdtemp(prefix="kvbench-")
        self._path = f"/dev/shm/kvbench-{self.name}-{os.getpid()}"
        slots = _cold_sets(size, batch)
        with open(self._path, "wb") as f:
            f.truncate(size * batch * slots)
        sock_path = os.path.join(self._dir, "s")
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        self._proc = ctx.Process(
            target=_raw_shm_server, args=(self._path, sock_path, ready), daemon=True
        )
        self._proc.start()
        ready.wait(30)
        self._sock = socket.socket(socket.AF_UNIX)
        self._sock.connect(sock_path)
        with open(self._path, "r+b") as f:
            self._mm = mmap.mmap(
                f.fileno(), 0, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            )
        seg = np.frombuffer(self._mm, dtype=np.uint8)
        self._slots = [
            [seg[(j * batch + i) * size : (j * batch + i + 1) * size] for i in range(batch)]
            for j in range(slots)
        ]
        self._next = 0
        self._src = _sources(size, batch, 1)[0]
        self._dst = [np.ones(size, dtype=np.uint8) for _ in range(batch)]
        for s, d in zip(self._src, self._slots[0], strict=True):
            np.copyto(d, s)

    def put(self) -> None:
        self._next = self._next % (len(self._slots) - 1) + 1  # slot 0 is what gets read
        for s, d in zip(self._src, self._slots[self._next], strict=True):
            np.copyto(d, s)
        self._sock.sendall(b"p")
        self._sock.recv(1)

    def get(self) -> None:
        self._sock.sendall(b"g")
        self._sock.recv(1)
        for s, d in zip(self._slots[0], self._dst, strict=True):
            np.copyto(d, s)

    def close(self) -> None:
        if getattr(self, "_sock", None) is None:
            return
        self._sock.close()
        self._proc.join(5)
        self._slots = []
        self._mm.close()
        os.unlink(self._path)
        shutil.rmtree(self._dir, ignore_errors=True)
        self._sock = None  # type: ignore[assignment]


class Redis(System):
    """redis-server started here; redis-py with hiredis, pipelined SET/GET."""

    name = "redis"

    def __init__(self) -> None:
        import redis

        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not installed")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self._dir = tempfile.mkdtemp(prefix="kvbench-redis-")
        self._proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
             "no", "--dir", self._dir, "--proto-max-bulk-len", "1gb"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self._r = redis.Redis(port=port)
        deadline = time.monotonic() + 10
        while True:
            try:
                self._r.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def prepare(self, size: int, batch: int) -> None:
        self._r.flushall()
        self._src = [a.tobytes() for a in _sources(size, batch, 1)[0]]
        self._keys = [f"k{size}-{i}" for i in range(batch)]
        self.put()

    def put(self) -> None:
        pipe = self._r.pipeline(transaction=False)
        for k, v in zip(self._keys, self._src, strict=True):
            pipe.set(k, v)
        pipe.execute()

    def get(self) -> None:
        pipe = self._r.pipeline(transaction=False)
        for k in self._keys:
            pipe.get(k)
        pipe.execute()

    def close(self) -> None:
        self._r.close()
        self._proc.terminate()
        self._proc.wait(10)
        shutil.rmtree(self._dir, ignore_errors=True)


class KVDepot(System):
    """KVDepotClient.put / get_into against a local cluster, one transport."""

    def __init__(self, transport: str, cluster: Any, node_id: str) -> None:
        from kvdepot.connector.client import ClientConfig, KVDepotClient

        self.name = f"kvdepot-{transport}"
        # As the vLLM connector publishes: the index commit right behind the answer.
        self._client = KVDepotClient(
            ClientConfig(
                metadata=cluster.metadata_address,
                node_id=node_id,
                transport=transport,
                defer_index_commit=True,
            )
        )
        self._n = 0

    def _fresh_keys(self, batch: int) -> list[bytes]:
        self._n += 1
        return [os.urandom(16) for _ in range(batch)]

    def prepare(self, size: int, batch: int) -> None:
        self._src = _sources(size, batch, 1)[0]
        self._dst = [np.ones(size, dtype=np.uint8) for _ in range(batch)]
        self.before_get()

    def before_get(self) -> None:
        self._keys = self._fresh_keys(len(self._src))
        result = self._client.put(self._keys, self._src)
        if result.stored + result.pending != len(self._src):
            raise RuntimeError(f"{self.name}: setup put stored {result.stored} of {len(self._src)}")

    def put(self) -> None:
        result = self._client.put(self._fresh_keys(len(self._src)), self._src)
        # Pending: in the node's store, its index commit right behind the answer.
        if result.stored + result.pending != len(self._src):
            raise RuntimeError(f"{self.name}: put stored {result.stored} of {len(self._src)}")

    def get(self) -> None:
        result = self._client.get_into(self._keys, self._dst)
        if result.leading != len(self._keys):
            raise RuntimeError(f"{self.name}: get loaded {result.leading} of {len(self._keys)}")

    def quiesce(self) -> None:
        # The store's answers to the puts and its index commits.
        self._client.sync_index()

    def close(self) -> None:
        self._client.close()


class KVDepotSyncIndex(KVDepot):
    """A put whose store answers only once the index committed the chunks
    (``defer_index_commit`` off), for comparison in the same run."""

    def __init__(self, transport: str, cluster: Any, node_id: str) -> None:
        from kvdepot.connector.client import ClientConfig, KVDepotClient

        self.name = f"kvdepot-{transport}-sync"
        self._client = KVDepotClient(
            ClientConfig(
                metadata=cluster.metadata_address,
                node_id=node_id,
                transport=transport,
                defer_index_commit=False,
            )
        )
        self._n = 0


class KVDepotTwoTrips(KVDepot):
    """The reference put path, for comparison in the same run: PutStart, the
    bytes, PutEnd (a client that forgets its node's store before each put;
    gets as :class:`KVDepot`)."""

    def __init__(self, transport: str, cluster: Any, node_id: str) -> None:
        super().__init__(transport, cluster, node_id)
        self.name = f"kvdepot-{transport}-2rt"

    def put(self) -> None:
        self._client._local_address = None
        super().put()


class KVDepotRemote(KVDepot):
    """Chunks node 1 holds, over tcp: puts from a client with no store (PutStart,
    bytes, PutEnd), gets by a client of node 0. ``-remote``: node 1 served its
    last get whole, so it is read first, no lookup (a decode node reading one
    prefill node); ``-lookup``: a Lookup first (as after a get no one store
    served whole); ``-probe``: node 0's store first (a miss, a Lookup, node 1)."""

    def __init__(self, cluster: Any, name: str = "kvdepot-tcp-remote") -> None:
        from kvdepot.connector.client import ClientConfig, KVDepotClient

        self.name = name
        self._first = _READ_FIRST[name]
        nodes = [s.info["node_id"] for s in cluster.stores]
        address = cluster.metadata_address
        self._client = KVDepotClient(ClientConfig(metadata=address, transport="tcp"))
        self._holder = KVDepotClient(ClientConfig(metadata=address, node_id=nodes[1]))
        self._reader = KVDepotClient(
            ClientConfig(metadata=address, node_id=nodes[0], transport="tcp")
        )
        self._reader.put([os.urandom(16)], [np.ones(4096, dtype=np.uint8)])  # learns node 0
        self._n = 0

    def before_get(self) -> None:
        self._keys = self._fresh_keys(len(self._src))
        result = self._holder.put(self._keys, self._src)
        if result.stored != len(self._src):
            raise RuntimeError(f"{self.name}: setup put stored {result.stored} of {len(self._src)}")

    def get(self) -> None:
        if self._first is not None:
            self._reader._sticky, self._reader._lookup_first = None, self._first
        result = self._reader.get_into(self._keys, self._dst)
        if result.leading != len(self._keys):
            raise RuntimeError(f"{self.name}: get loaded {result.leading} of {len(self._keys)}")

    def close(self) -> None:
        for c in (self._client, self._holder, self._reader):
            c.close()


# Loopback only, and no RDMA modules (see README "Data plane": they crash at exit here).
_UCX_NO_RDMA = {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib,ib_mlx5,ib_efa,rdmacm"}
_READ_FIRST = {"kvdepot-tcp-remote": None, "kvdepot-tcp-lookup": True, "kvdepot-tcp-probe": False}


def _measure(
    systems: list[System],
    sizes: tuple[int, ...],
    batch_of: Callable[[int], int],
    trials: int,
    log: Callable[[str], None],
) -> list[Row]:
    rows: list[Row] = []
    for size in sizes:
        batch = batch_of(size)
        ready: list[System] = []
        for s in systems:
            try:
                s.prepare(size, batch)
                ready.append(s)
            except Exception as exc:
                log(f"  {s.name}: skipped at {size // KiB} KiB ({exc})")
        for op in ("put", "get"):
            times: dict[str, list[float]] = {s.name: [] for s in ready}
            for s in ready:  # warm-up
                if op == "get":
                    s.before_get()
                getattr(s, op)()
                s.quiesce()
            for _ in range(trials):
                for s in ready:  # round-robin: ratios compare runs under the same load
                    t0 = time.perf_counter()
                    getattr(s, op)()
                    times[s.name].append(time.perf_counter() - t0)
                    s.quiesce()
            for s in ready:
                ts = times[s.name]
                med = statistics.median(ts)
                rows.append(
                    Row(s.name, op, size, size * batch / med / 1e9,
                        _percentile(ts, 0.5) * 1e3, _percentile(ts, 0.99) * 1e3)
                )  # fmt: skip
                log(f"  {s.name:13s} {op} {size // KiB:6d} KiB  {rows[-1].gbps:6.2f} GB/s")
    return rows


def _small_target(a: str, op: str, size: int) -> float:
    """Targets below 4 MiB: shm puts within 0.9 of raw-shm from 1 MiB; a tcp put of
    256 KiB chunks at most twice raw-tcp's time (issue 19); the rest reported."""
    if (a, op) == ("kvdepot-shm", "put") and size >= MiB:
        return 0.9
    if (a, op, size) == ("kvdepot-tcp", "put", 256 * KiB):
        return 0.5
    return 0.0


def _ratios(rows: list[Row]) -> list[tuple[str, float, str]]:
    index = {(r.system, r.op, r.size): r.gbps for r in rows}
    out: list[tuple[str, float, str]] = []
    checks = [
        ("kvdepot-tcp", "raw-tcp", 0.9),
        ("kvdepot-shm", "raw-shm", 0.9),
        ("kvdepot-nixl", "raw-tcp", 0.0),
        ("kvdepot-tcp-remote", "raw-tcp", 0.0),
        ("kvdepot-tcp-lookup", "raw-tcp", 0.0),
        ("kvdepot-tcp-probe", "raw-tcp", 0.0),
        ("kvdepot-tcp-sync", "raw-tcp", 0.0),
        ("kvdepot-shm-sync", "raw-shm", 0.0),
        ("kvdepot-tcp-2rt", "raw-tcp", 0.0),
        ("kvdepot-shm-2rt", "raw-shm", 0.0),
    ]
    for size in SIZES:
        label = f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"
        for op in ("get", "put"):
            for a, b, target in checks:
                if size < 4 * MiB:
                    target = _small_target(a, op, size)
                if (a, op, size) in index and (b, op, size) in index:
                    r = index[(a, op, size)] / index[(b, op, size)]
                    goal = f"target >= {target}" if target else "reported"
                    if target and (a, op, size) == ("kvdepot-tcp", "put", 256 * KiB):
                        goal += " (p50 <= 2 x raw-tcp)"
                    out.append((f"{a}/{b} {op} {label}", r, goal))
            if (op, size) == ("put", 256 * KiB) and ("kvdepot-shm", op, size) in index:
                gbps = index[("kvdepot-shm", op, size)]
                out.append((f"kvdepot-shm {op} {label} GB/s", gbps, "target >= 2"))
            if (
                size >= 4 * MiB
                and ("kvdepot-tcp", op, size) in index
                and ("redis", op, size) in index
            ):
                r = index[("kvdepot-tcp", op, size)] / index[("redis", op, size)]
                target = 1.3 if size == 4 * MiB else 2.0
                out.append((f"kvdepot-tcp/redis {op} {label}", r, f"target >= {target}"))
    return out


def _plot(rows: list[Row], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, op in zip(axes, ("put", "get"), strict=True):
        for system in dict.fromkeys(r.system for r in rows):
            pts = sorted((r.size, r.gbps) for r in rows if r.system == system and r.op == op)
            if pts:
                ax.plot([p[0] / KiB for p in pts], [p[1] for p in pts], marker="o", label=system)
        ax.set_xscale("log", base=2)
        ax.set_xticks([s / KiB for s in SIZES], ["256K", "1M", "4M", "16M"])
        ax.set_xlabel("chunk size")
        ax.set_title(op)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


@contextlib.contextmanager
def _cluster(capacity: str, env: dict[str, str] | None, nodes: int = 1) -> Iterator[Any]:
    from kvdepot.apps.cluster import LocalCluster

    c = LocalCluster(nodes=nodes, capacity=capacity, env=env, stderr=subprocess.DEVNULL)
    c.start()
    try:
        yield c
    finally:
        c.stop()


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer trials: under a minute")
    ap.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    ap.add_argument("--trials", type=int, help="batches timed per system, op and size")
    ap.add_argument(
        "--batch", type=int, default=8, help="chunks per put/get (default 8; --quick: <= 64 MiB)"
    )
    ap.add_argument("--plot", type=Path, default=Path(__file__).resolve().parent / "dataplane.png")
    ap.add_argument("--capacity", default="1GiB", help="arena of the store (default 1GiB)")
    ap.add_argument(
        "--systems",
        default="memcpy,raw-tcp,raw-shm,redis,kvdepot-tcp,kvdepot-shm,kvdepot-tcp-remote,kvdepot-nixl",
    )
    ap.add_argument(
        "--sizes", help="chunk sizes in KiB, comma-separated (default 256,1024,4096,16384)"
    )
    ap.add_argument(
        "--stages",
        action="store_true",
        help="also time each stage of the kvdepot puts and gets (metadata calls, control\n"
        "messages, hashing, copy or socket, commit); --json adds rows with a 'stage'",
    )
    ap.add_argument(
        "--profile", type=Path, help="cProfile the client and every daemon thread into this folder"
    )
    return ap


def _start(
    args: argparse.Namespace, stack: contextlib.ExitStack, log: Callable[[str], None]
) -> tuple[list[System], Any, RssSampler | None]:
    """The systems --systems names (each closed by ``stack``), the kvdepot
    cluster if one was started, and the sampler of its store's memory."""
    wanted = args.systems.split(",")
    systems: list[System] = []
    cluster: Any = None
    rss: RssSampler | None = None
    from floors import RawShmXxh3, RawTcpXxh3  # imports this module: not at the top

    for cls in (Memcpy, RawTcp, RawShm, RawTcpXxh3, RawShmXxh3, Redis):
        if cls.name in wanted:
            try:
                systems.append(cls())
            except Exception as exc:
                log(f"{cls.name}: not run ({exc})")
    kv = [w for w in wanted if w in ("kvdepot-tcp", "kvdepot-shm")]
    two = [w for w in wanted if w in ("kvdepot-tcp-2rt", "kvdepot-shm-2rt")]
    sync = [w for w in wanted if w in ("kvdepot-tcp-sync", "kvdepot-shm-sync")]
    remote = [w for w in wanted if w in _READ_FIRST]
    if kv or two or sync or remote:
        env = profile_env(args.profile) if args.profile is not None else None
        cluster = stack.enter_context(_cluster(args.capacity, env, 2 if remote else 1))
        store = cluster.stores[0]
        rss = RssSampler(store.pid)
        for w in kv:
            systems.append(KVDepot(w.split("-", 1)[1], cluster, store.info["node_id"]))
        for w in two:
            systems.append(KVDepotTwoTrips(w.split("-")[1], cluster, store.info["node_id"]))
        for w in sync:
            systems.append(KVDepotSyncIndex(w.split("-")[1], cluster, store.info["node_id"]))
        systems.extend(KVDepotRemote(cluster, w) for w in remote)
    if "kvdepot-nixl" in wanted:
        from kvdepot.wire.nixl import nixl_available

        if nixl_available():
            env = dict(os.environ, KVDEPOT_STORE_NIXL="on", KVDEPOT_STORE_SHM="0")
            for name, value in _UCX_NO_RDMA.items():
                env.setdefault(name, value)
                os.environ.setdefault(name, value)
            nixl_cluster = stack.enter_context(_cluster("512MiB", env))
            systems.append(KVDepot("nixl", nixl_cluster, ""))
        else:
            log("kvdepot-nixl: not run (NIXL not installed: pip install kvdepot[rdma])")
    for s in systems:
        stack.callback(s.close)
    return systems, cluster, rss


def _report(
    rows: list[Row],
    ceilings: list[str],
    rss: RssSampler | None,
    capacity: str,
    log: Callable[[str], None],
) -> None:
    log(f"\n{'system':14s} {'op':3s} {'size':>7s} {'GB/s':>6s} {'p50 ms':>8s} {'p99 ms':>8s}")
    for r in rows:
        log(f"{r.system:14s} {r.op:3s} {r.size // KiB:>5d}Ki {r.gbps:6.2f} "
            f"{r.p50_ms:8.2f} {r.p99_ms:8.2f}")  # fmt: skip
    log("\nratios (same run):")
    for label, ratio, goal in _ratios(rows):
        log(f"  {label:34s} {ratio:5.2f}  ({goal})")
    if ceilings:
        log(
            "\nthe metadata round trips of a kvdepot-tcp put (p50, same run),"
            " and the put ratio they leave:"
        )
        for line in ceilings:
            log(line)
    if rss is not None:
        from kvdepot.config import parse_size

        arena = parse_size(capacity)
        log(
            f"\nstore memory under load: max RSS {rss.max_rss / MiB:.0f} MiB "
            f"(shared arena pages {rss.max_shmem / MiB:.0f} MiB, "
            f"private {rss.max_anon / MiB:.0f} MiB)"
            f" vs arena {arena / MiB:.0f} MiB: overhead {(rss.max_rss - arena) / MiB:+.0f} MiB"
        )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    sizes = tuple(int(k) * KiB for k in args.sizes.split(",")) if args.sizes else SIZES
    trials = args.trials or (4 if args.quick else 15)

    def batch_of(size: int) -> int:
        return max(2, min(args.batch, (64 * MiB) // size)) if args.quick else args.batch

    out = sys.stderr if args.json else sys.stdout

    def log(msg: str) -> None:
        print(msg, file=out, flush=True)

    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        systems, cluster, rss = _start(args, stack, log)
        log(
            "batches of "
            + ", ".join(f"{batch_of(s)} x {s // KiB} KiB" for s in sizes)
            + f"; {trials} timed batches per system/op/size, round-robin"
        )
        profiler = client_profiler(args.profile)
        rows = _measure(systems, sizes, batch_of, trials, log)
        stage_rows: list[dict[str, Any]] = []
        if args.stages:
            stage_rows = run_stages(systems, sizes, batch_of, trials, log)
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(str(args.profile / "client.prof"))
        if rss is not None:
            rss.stop()
        ceilings: list[str] = []
        if "kvdepot-tcp" in args.systems.split(","):
            raw = {r.size: r.p50_ms for r in rows if r.system == "raw-tcp" and r.op == "put"}
            node_id = cluster.stores[0].info["node_id"]
            ceilings = put_ceilings(raw, cluster.metadata_address, node_id, batch_of)
    elapsed = time.monotonic() - started
    _report(rows, ceilings, rss, args.capacity, log)
    if _plot(rows, args.plot):
        log(f"plot: {args.plot}")
    log(f"elapsed {elapsed:.1f} s")
    if args.profile is not None:
        print_profiles(args.profile, log)
    if args.json:
        print(json.dumps([asdict(r) for r in rows] + stage_rows))
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    raise SystemExit(main())
