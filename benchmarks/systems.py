"""The systems the data-plane benchmarks time, and the references among them.

A :class:`System` moves batches of chunks and says when its work is done:

* :meth:`System.put` writes one batch. It may return before the system's
  own work on it has ended (kvdepot's deferred index commit);
  :meth:`System.settle` waits until it has (the store received, verified
  and committed every put so far, so that other processes' lookups name
  the chunks). A throughput run times ``put`` back to back, then
  ``settle``: every system's own work is inside the timed region.
* :meth:`System.visible` times one put of the first ``k`` chunks of the
  batch from its start until another process names all of them (its own
  lookup through a watcher process, :mod:`benchmarks.visible`, or for the
  raw references the receiving process itself).
* :meth:`System.get` reads one batch (verified where the system verifies).

The references here:

* ``memcpy``: numpy ``copyto`` between cold buffers (the copy limit);
* ``raw-tcp``: plain Python loopback TCP between two processes,
  ``sendall(memoryview)`` / ``recv_into`` preallocated buffers, one ack per
  batch (the receiver of puts rotates its buffers over 512 MiB, as a store's
  puts land in space not recently written); a put is visible when the
  receiver holds its last byte (its clock, sent back with the ack);
* ``raw-shm``: a copy into (put) or out of (get) a shared-memory segment
  owned by another process, one Unix-socket round trip per batch (puts
  rotate over 512 MiB of it); a put is visible when the owner reads the
  message that follows the copy;
* ``redis``: a ``redis-server`` started here, redis-py with hiredis,
  pipelined SET / GET of the batch (the same keys each time, overwritten);
  visible when another process's ``EXISTS`` names the keys.
"""

from __future__ import annotations

import abc
import mmap
import multiprocessing as mp
import os
import shutil
import socket
import struct
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks import procs
from benchmarks.visible import timed_put, watcher

KiB = 1 << 10
MiB = 1 << 20
SIZES = (256 * KiB, MiB, 4 * MiB, 16 * MiB)
_CLOCK = struct.Struct("<q")


@dataclass(frozen=True, slots=True)
class Row:
    """One result: a system's put or get of ``batch`` chunks of ``size`` bytes.

    ``timing``: ``throughput`` (GB/s of batches back to back, every system's
    own work included; p50/p99: the time per batch of each run) or
    ``visible`` (a put from its start until another process's lookup names
    its chunks; p50/p99 of that latency, GB/s the batch's bytes over its median).

    ``client_cpu_ms`` / ``server_cpu_ms`` (throughput rows): CPU time per
    batch, medians over the runs, of the benchmark's process (every thread:
    the client, its copy threads, a peer's client library) and of the
    system's own processes (:meth:`System.server_pids`). Their sum over the
    cores bounds the time per batch from below: the work is done on this
    machine's cores whatever overlaps.
    """

    system: str
    op: str
    size: int
    gbps: float
    p50_ms: float
    p99_ms: float
    timing: str = "throughput"
    batch: int = 0
    client_cpu_ms: float = 0.0
    server_cpu_ms: float = 0.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


def recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    n = view.nbytes
    while got < n:
        r = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if r == 0:
            raise ConnectionError("peer closed")
        got += r


def recv_clock(sock: socket.socket) -> int:
    """A peer's ``time.monotonic_ns()`` (one clock for every process on a host)."""
    buf = bytearray(_CLOCK.size)
    recv_into(sock, memoryview(buf))
    return int(_CLOCK.unpack(buf)[0])


def cpu_seconds(pids: list[int]) -> float:
    """CPU time so far of every live thread of the processes ``pids`` (Linux
    ``schedstat``, nanoseconds; 0 where there is none to read)."""
    total = 0
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                continue  # a thread that just ended
    return total / 1e9


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
        """Write one batch (the system's own work on it may still run)."""

    def settle(self) -> None:  # noqa: B027 - optional hook
        """Wait until the work of every put so far has ended: timed, in a throughput run."""

    def release(self) -> None:  # noqa: B027 - optional hook
        """Untimed, after a throughput run: free what its puts stored, where the
        system would not free it itself (a store with no eviction)."""

    @abc.abstractmethod
    def get(self) -> None:
        """Read one batch (verified where the system verifies)."""

    def visible(self, k: int) -> float | None:
        """Seconds from the start of a put of the batch's first ``k`` chunks
        until another process names them all; ``None``: not measured here."""
        return None

    def quiesce(self) -> None:
        """Untimed, between two operations that are timed one at a time (gets,
        visible latencies): wait until the last one's work has ended, so that
        it is not charged to the next system."""
        self.settle()

    def server_pids(self) -> list[int]:
        """The processes besides this one that do the system's work (its
        servers, stores, index), for the CPU columns of throughput rows."""
        return []

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stop whatever the system started."""


def cold_sets(size: int, batch: int) -> int:
    """Batches of buffers to rotate over: 512 MiB, more than the last-level
    cache (up to 300 MiB on these machines), so each use finds them cold."""
    return max(2, (512 * MiB) // (size * batch))


def sources(size: int, batch: int, pools: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(size)
    return [
        [rng.integers(0, 255, size, dtype=np.uint8) for _ in range(batch)] for _ in range(pools)
    ]


class Memcpy(System):
    """numpy copyto between buffers rotated so they are cold (not in cache)."""

    name = "memcpy"

    def prepare(self, size: int, batch: int) -> None:
        pools = cold_sets(size, batch)
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
        for _ in range(cold_sets(size, batch))
    ]
    nxt = 0
    while True:
        op = conn.recv(1)
        if not op:
            return
        if op == b"g":
            for b in slots[0]:
                conn.sendall(b)
            continue
        # b"p": a batch, acked; b"v" + k: k chunks, answered with the clock on arrival.
        k = batch if op == b"p" else conn.recv(1)[0]
        nxt = nxt % (len(slots) - 1) + 1
        for b in slots[nxt][:k]:
            recv_into(conn, b)
        conn.sendall(b"k" if op == b"p" else _CLOCK.pack(time.monotonic_ns()))


class RawTcp(System):
    """Plain Python TCP over loopback to another process."""

    name = "raw-tcp"

    def prepare(self, size: int, batch: int) -> None:
        self.close()
        ctx = mp.get_context("spawn")
        q: Any = ctx.Queue()
        self._proc = procs.process(ctx, _raw_tcp_server, (q, size, batch), daemon=True)
        self._proc.start()
        self._sock = socket.create_connection(("127.0.0.1", q.get(timeout=30)))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._src = [memoryview(a) for a in sources(size, batch, 1)[0]]
        self._dst = [memoryview(np.ones(size, dtype=np.uint8)) for _ in range(batch)]

    def _send(self, k: int) -> None:
        """The bytes of the batch's first ``k`` chunks."""
        for b in self._src[:k]:
            self._sock.sendall(b)

    def put(self) -> None:
        self._sock.sendall(b"p")
        self._send(len(self._src))
        self._sock.recv(1)

    def visible(self, k: int) -> float:
        t0 = time.monotonic_ns()
        self._sock.sendall(b"v" + bytes([k]))
        self._send(k)
        return (recv_clock(self._sock) - t0) / 1e9

    def get(self) -> None:
        self._sock.sendall(b"g")
        for b in self._dst:
            recv_into(self._sock, b)

    def server_pids(self) -> list[int]:
        proc = getattr(self, "_proc", None)
        return [proc.pid] if proc is not None and proc.pid is not None else []

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
    while op := conn.recv(1):
        conn.sendall(_CLOCK.pack(time.monotonic_ns()) if op == b"v" else b"k")
    mm.close()


class RawShm(System):
    """A copy into / out of another process's shared-memory segment, one round trip per batch.

    Puts rotate over 512 MiB of the segment (more than the last-level
    cache), as a store's puts land in arena space not recently written;
    gets read the same batch each time, as the kvdepot rows do. The
    segment's file is unlinked once both processes mapped it: nothing is
    left in ``/dev/shm`` however the benchmark ends.
    """

    name = "raw-shm"

    def prepare(self, size: int, batch: int) -> None:
        self.close()
        self._dir = tempfile.mkdtemp(prefix="kvbench-")
        path = f"/dev/shm/kvbench-{self.name}-{os.getpid()}"
        slots = cold_sets(size, batch)
        with open(path, "wb") as f:
            f.truncate(size * batch * slots)
        try:
            self._start(path, os.path.join(self._dir, "s"))
        finally:
            os.unlink(path)
        seg = np.frombuffer(self._mm, dtype=np.uint8)
        self._slots = [
            [seg[(j * batch + i) * size : (j * batch + i + 1) * size] for i in range(batch)]
            for j in range(slots)
        ]
        self._next = 0
        self._src = sources(size, batch, 1)[0]
        self._dst = [np.ones(size, dtype=np.uint8) for _ in range(batch)]
        for s, d in zip(self._src, self._slots[0], strict=True):
            np.copyto(d, s)

    def _start(self, path: str, sock_path: str) -> None:
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        self._proc = procs.process(ctx, _raw_shm_server, (path, sock_path, ready), daemon=True)
        self._proc.start()
        ready.wait(30)
        self._sock = socket.socket(socket.AF_UNIX)
        self._sock.connect(sock_path)
        with open(path, "r+b") as f:
            self._mm = mmap.mmap(
                f.fileno(), 0, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            )
        self._sock.sendall(b"p")  # answered once the owner has mapped it too
        self._sock.recv(1)

    def _copy_in(self, k: int) -> None:
        """Copy the batch's first ``k`` chunks into the next slot of the segment."""
        self._next = self._next % (len(self._slots) - 1) + 1  # slot 0 is what gets read
        for s, d in zip(self._src[:k], self._slots[self._next][:k], strict=True):
            np.copyto(d, s)

    def put(self) -> None:
        self._copy_in(len(self._src))
        self._sock.sendall(b"p")
        self._sock.recv(1)

    def visible(self, k: int) -> float:
        t0 = time.monotonic_ns()
        self._copy_in(k)
        self._sock.sendall(b"v")
        return (recv_clock(self._sock) - t0) / 1e9

    def get(self) -> None:
        self._sock.sendall(b"g")
        self._sock.recv(1)
        for s, d in zip(self._slots[0], self._dst, strict=True):
            np.copyto(d, s)

    def server_pids(self) -> list[int]:
        proc = getattr(self, "_proc", None)
        return [proc.pid] if proc is not None and proc.pid is not None else []

    def close(self) -> None:
        if getattr(self, "_sock", None) is None:
            return
        self._sock.close()
        self._proc.join(5)
        self._slots = []
        self._mm.close()
        shutil.rmtree(self._dir, ignore_errors=True)
        self._sock = None  # type: ignore[assignment]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Redis(System):
    """redis-server started here; redis-py with hiredis, pipelined SET/GET."""

    name = "redis"

    def __init__(self) -> None:
        import redis

        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not installed")
        self._port = free_port()
        self._dir = tempfile.mkdtemp(prefix="kvbench-redis-")
        self._proc = procs.popen(
            [binary, "--port", str(self._port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self._dir, "--proto-max-bulk-len", "1gb"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self._r = redis.Redis(port=self._port)
        self._n = 0
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
        self._src = [a.tobytes() for a in sources(size, batch, 1)[0]]
        self._keys = [f"k{size}-{i}" for i in range(batch)]
        self.put()

    def _set(self, keys: list[str]) -> None:
        pipe = self._r.pipeline(transaction=False)
        for k, v in zip(keys, self._src, strict=False):
            pipe.set(k, v)
        pipe.execute()

    def put(self) -> None:
        self._set(self._keys)

    def visible(self, k: int) -> float:
        self._n += 1
        keys = [f"v{self._n}-{i}" for i in range(k)]
        return timed_put(watcher("redis", port=self._port), keys, lambda: self._set(keys))

    def get(self) -> None:
        pipe = self._r.pipeline(transaction=False)
        for k in self._keys:
            pipe.get(k)
        pipe.execute()

    def server_pids(self) -> list[int]:
        return [self._proc.pid]

    def close(self) -> None:
        self._r.close()
        procs.terminate(self._proc)
        shutil.rmtree(self._dir, ignore_errors=True)
