"""Machinery of the chaos test (tests/faults/test_chaos.py): a second metadata
replica the test runs itself, the verifying clients, and what they tally."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kvdepot.apps.cluster import wait_ready
from kvdepot.connector.client import KVDepotClient, PutResult
from kvdepot.errors import KVDepotError
from kvdepot.keys import ChunkKey, Namespace, chunk_keys
from tests.faults.support import ReadTally, payload, sentinel_buffers

T = TypeVar("T")


class MetadataReplica:
    """A metadata service the test starts itself (LocalCluster runs one only):
    restarted on the port it first got, as a service manager would."""

    def __init__(
        self, name: str, index: str, log: Path, lease_ttl_s: float, heartbeat_s: float
    ) -> None:
        self.name = name
        self.index = index
        self.log = log
        self.lease_ttl_s = lease_ttl_s
        self.heartbeat_s = heartbeat_s
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout_s: float) -> None:
        """Start it (again, on its port); return once it listens."""
        assert self.proc is None or self.proc.poll() is not None, "still running"
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen(
                [
                    sys.executable, "-m", "kvdepot.apps.cli", "metadata",
                    "--host", "127.0.0.1",
                    "--port", str(self.port),
                    "--index", self.index,
                    "--lease-ttl", str(self.lease_ttl_s),
                    "--heartbeat-interval", str(self.heartbeat_s),
                ],
                stdout=subprocess.PIPE,
                stderr=err,
                stdin=subprocess.DEVNULL,
            )  # fmt: skip
        self.port = int(wait_ready(self.proc, self.name, timeout_s)["port"])

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a paused one takes no SIGTERM
            self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@dataclass(slots=True)
class OpStats:
    """What one client's operations did."""

    ops: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)  # "op: Class" -> count
    samples: dict[str, str] = field(default_factory=dict)  # "op: Class" -> first message
    chunks: Counter[str] = field(default_factory=Counter)  # puts' stored/skipped/pending/failed
    lookup_keys: int = 0
    lookup_hits: int = 0
    tally: ReadTally = field(default_factory=ReadTally)
    unexpected: list[str] = field(default_factory=list)  # errors that are no KVDepotError

    def merge(self, other: OpStats) -> None:
        self.ops.update(other.ops)
        self.errors.update(other.errors)
        for k, v in other.samples.items():
            self.samples.setdefault(k, v)
        self.chunks.update(other.chunks)
        self.lookup_keys += other.lookup_keys
        self.lookup_hits += other.lookup_hits
        for name in ("exact", "wrong", "misses", "touched_misses"):
            setattr(self.tally, name, getattr(self.tally, name) + getattr(other.tally, name))
        self.unexpected.extend(other.unexpected)

    def count_put(self, r: PutResult) -> None:
        self.chunks.update(stored=r.stored, skipped=r.skipped, pending=r.pending, failed=r.failed)


class KeyPool:
    """Prefixes some client published whole: what any client may read back."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._prefixes: list[list[ChunkKey]] = []

    def add(self, keys: list[ChunkKey]) -> None:
        with self._lock:
            self._prefixes.append(keys)

    def pick(self, rng: random.Random) -> list[ChunkKey] | None:
        with self._lock:
            return rng.choice(self._prefixes) if self._prefixes else None

    def all(self) -> list[list[ChunkKey]]:
        with self._lock:
            return list(self._prefixes)


@dataclass(frozen=True, slots=True)
class Op:
    """One operation of the node client, timed."""

    cycle: int
    name: str
    start: float
    end: float
    ok: bool
    detail: str


class Worker:
    """A client thread publishing fresh prefixes (some sharing a head chunk
    with other clients' ones), reading back its own and others' prefixes and
    republishing old ones; every chunk read is checked against its payload."""

    def __init__(
        self,
        name: str,
        client: KVDepotClient,
        ns: Namespace,
        chunk: int,
        prefix_chunks: int,
        seed: int,
        pool: KeyPool,
        stop: threading.Event,
        pace_s: float,
        shared_heads: int = 8,
    ) -> None:
        self.name = name
        self.client = client
        self.ns = ns
        self.chunk = chunk
        self.prefix_chunks = prefix_chunks
        self.seed = seed
        self.rng = random.Random(seed)
        self.pool = pool
        self.stop = stop
        self.pace_s = pace_s
        self.shared_heads = shared_heads
        self.stats = OpStats()
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.last_error = ""  # the last operation's error, "" where it raised none
        self._n = 0

    def expected(self, key: bytes) -> Any:
        return payload(key, self.chunk)

    def fresh_keys(self, shared_head: bool) -> list[ChunkKey]:
        self._n += 1
        tokens_per = self.ns.chunk_tokens
        unique = self.seed * 1_000_000 + self._n
        head = 900_000 + self.rng.randrange(self.shared_heads) if shared_head else unique
        tokens = [head] * tokens_per + [unique] * tokens_per * (self.prefix_chunks - 1)
        return chunk_keys(self.ns, tokens)

    def op(self, name: str, call: Callable[[], T]) -> T | None:
        self.stats.ops[name] += 1
        self.last_error = ""
        try:
            return call()
        except Exception as exc:
            what = f"{name}: {type(exc).__name__}"
            self.last_error = f"{what}: {str(exc)[:200]}"
            self.stats.errors[what] += 1
            self.stats.samples.setdefault(what, str(exc)[:300])
            if not isinstance(exc, KVDepotError):
                self.stats.unexpected.append(f"{self.name} {what}: {exc!r}"[:500])
            return None

    def publish(self, keys: list[ChunkKey]) -> PutResult | None:
        put = self.op("put", lambda: self.client.put(keys, [self.expected(k) for k in keys]))
        if put is not None:
            self.stats.count_put(put)
            if put.failed == 0:
                self.pool.add(keys)
        return put

    def lookup(self, keys: list[ChunkKey]) -> int | None:
        hits = self.op("lookup", lambda: self.client.lookup(keys))
        if hits is not None:
            self.stats.lookup_keys += len(keys)
            self.stats.lookup_hits += hits
        return hits

    def get(self, keys: list[ChunkKey]) -> int | None:
        bufs = sentinel_buffers(len(keys), self.chunk)

        def read() -> int:
            got = self.client.get_into(keys, bufs)
            return self.stats.tally.add(keys, bufs, got, self.expected)

        return self.op("get_into", read)

    def cycle(self) -> None:
        choice = self.rng.random()
        old = self.pool.pick(self.rng)
        if choice < 0.55 or old is None:
            keys = self.fresh_keys(shared_head=self.rng.random() < 0.5)
            self.publish(keys)
        elif choice < 0.85:
            keys = old  # perhaps another client's, on another node
        else:
            keys = old
            self.publish(keys)  # a republish: skipped where still stored
        self.lookup(keys)
        self.get(keys)

    def _main(self) -> None:
        try:
            while not self.stop.is_set():
                self.cycle()
                self.stop.wait(self.pace_s)
        except BaseException as exc:  # reported by the test
            self.stats.unexpected.append(f"{self.name} died: {exc!r}")


class NodeWorker(Worker):
    """The client of one node's store (``ClientConfig.node_id``): fresh
    prefixes of its own only, each put, looked up and read back; every
    operation timed, to judge those made while Redis was down."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[Op] = []
        self._lock = threading.Lock()

    def record(self, cycle: int, name: str, start: float, ok: bool, detail: str) -> None:
        with self._lock:
            self.log.append(Op(cycle, name, start, time.monotonic(), ok, detail))

    def ok_cycle_since(self, since: float) -> bool:
        """Whether a whole cycle started after ``since`` succeeded."""
        with self._lock:
            good: dict[int, int] = Counter(o.cycle for o in self.log if o.start >= since and o.ok)
        return any(n == 3 for n in good.values())

    def cycle(self) -> None:
        keys = self.fresh_keys(shared_head=False)
        n, want = self._n, len(keys)
        start = time.monotonic()
        put = self.publish(keys)
        whole = (
            put is not None and put.failed == 0 and put.stored + put.skipped + put.pending == want
        )
        self.record(n, "put", start, whole, self.last_error or repr(put))
        if not whole:
            return
        start = time.monotonic()
        hits = self.lookup(keys)
        self.record(n, "lookup", start, hits == want, self.last_error or f"{hits} hits of {want}")
        start = time.monotonic()
        wrong = self.stats.tally.wrong
        loaded = self.get(keys)
        ok = loaded == want and self.stats.tally.wrong == wrong
        self.record(n, "get_into", start, ok, self.last_error or f"{loaded} loaded of {want}")


def log_tails(log_dir: Path, lines: int = 12) -> str:
    """The last ``lines`` of every daemon log under ``log_dir``, and how many
    tracebacks each holds."""
    out = []
    for log in sorted(log_dir.rglob("*.log")):
        text = log.read_text(errors="replace").splitlines()
        tracebacks = sum("Traceback" in line for line in text)
        out.append(f"--- {log.relative_to(log_dir)} ({len(text)} lines, {tracebacks} tracebacks)")
        out.extend(text[-lines:])
    return "\n".join(out)


def grep_logs(log_dir: Path, *needles: str, limit: int = 20) -> list[str]:
    """Lines of the daemon logs holding any of ``needles``, prefixed with the log's name."""
    found = []
    for log in sorted(log_dir.rglob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if any(n in line for n in needles):
                found.append(f"{log.stem}: {line[:300]}")
                if len(found) >= limit:
                    return found
    return found
