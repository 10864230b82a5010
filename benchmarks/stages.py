"""Where the time of a kvdepot put or get goes, stage by stage, in the client.

:class:`StageTimer` wraps the functions a put or get passes through
(metadata calls, control messages, socket sends and receives, copies,
hashing, connection checkout) with timers, for the duration of a ``with``
block. Each stage is timed exclusively: a stage's time excludes the stages
called inside it, so the stages of an operation add up to at most its wall
time, and what is left is the client's own Python work (validation,
building requests, grouping, results). A stage marked opaque (a control
round trip) keeps the sends and receives inside it as its own time.

Times on the store's side show up as the wait for its reply (``store
reply``, ``control …``): on the own-node put path that includes the store's
``PutStart``, which commits the chunks into the index before the store
answers. :func:`profile_env` profiles the daemons themselves.

Used by ``python benchmarks/dataplane.py --stages``; nothing here touches
kvdepot when it is not in use.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc

KiB = 1 << 10

# (module, attribute path, stage name, opaque). A name of None takes the
# stage from the first argument (the metadata method).
_TARGETS: list[tuple[str, str, str | None, bool]] = [
    ("kvdepot.metadata_client", "MetadataClient.call", None, True),
    ("kvdepot.connector.transport.tcp_pool", "TcpPool.checkout", "connection checkout", True),
    ("kvdepot.connector.transport.control", "ControlPool.checkout", "connection checkout", True),
    ("kvdepot.connector.transport.control", "ControlConnection.reserve", "control RESERVE", True),
    (
        "kvdepot.connector.transport.control",
        "ControlConnection.send_commit",
        "control COMMIT",
        True,
    ),
    (
        "kvdepot.connector.transport.control",
        "ControlConnection.finish_commits",
        "control COMMIT",
        True,
    ),
    ("kvdepot.connector.transport.control", "ControlConnection.lease", "control LEASE", True),
    (
        "kvdepot.connector.transport.control",
        "ControlConnection.release_later",
        "control RELEASE",
        True,
    ),
    ("kvdepot.connector.transport.shm", "copy_hashed", "copy (shm)", False),
    ("kvdepot.connector.transport.tcp", "send_all", "socket send", False),
    ("kvdepot.connector.transport.tcp", "send_hashed", "socket send", False),
    ("kvdepot.wire.sockets", "send_all", "socket send", False),
    ("kvdepot.connector.transport.tcp", "recv_reply_header", "store reply", True),
    ("kvdepot.connector.transport.tcp", "recv_exact", "socket recv", False),
    ("kvdepot.connector.transport.tcp", "recv_hashed_into", "socket recv", False),
    ("kvdepot.wire.sockets", "recv_exact_into", "socket recv", False),
    ("kvdepot.wire.xxh3", "BlockHasher.update", "hash", False),
    ("kvdepot.wire.xxh3", "BlockHasher.digest", "hash", False),
    ("kvdepot.wire.sockets", "xxh3_64", "hash", False),
    ("kvdepot.connector.transport.shm", "xxh3_64", "hash", False),
]


class StageTimer:
    """Exclusive time per stage, summed over every call made inside :meth:`timing`."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._local = threading.local()
        self._lock = threading.Lock()

    def _stack(self) -> list[list[Any]]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _wrap(self, fn: Callable[..., Any], stage: str | None, opaque: bool) -> Callable[..., Any]:
        timer = self

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            stack = timer._stack()
            if stack and stack[-1][2]:  # inside an opaque stage: its own time
                return fn(*args, **kwargs)
            name = stage if stage is not None else f"metadata {args[1]}"
            frame = [name, 0.0, opaque]  # name, time of the stages inside, opaque
            stack.append(frame)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                took = time.perf_counter() - t0
                stack.pop()
                if stack:
                    stack[-1][1] += took
                with timer._lock:
                    timer.totals[name] += took - frame[1]
                    timer.calls[name] += 1

        return timed

    @contextlib.contextmanager
    def timing(self) -> Iterator[StageTimer]:
        """Wrap the stage functions while the block runs; restore them after."""
        undo: list[tuple[Any, str, Any]] = []
        try:
            for module, path, stage, opaque in _TARGETS:
                owner: Any = importlib.import_module(module)
                *parents, attr = path.split(".")
                for p in parents:
                    owner = getattr(owner, p)
                original = owner.__dict__[attr]
                undo.append((owner, attr, original))
                setattr(owner, attr, self._wrap(original, stage, opaque))
            yield self
        finally:
            for owner, attr, original in reversed(undo):
                setattr(owner, attr, original)

    def reset(self) -> None:
        with self._lock:
            self.totals.clear()
            self.calls.clear()


def summarize(
    timer: StageTimer, walls: list[float]
) -> tuple[float, dict[str, float], dict[str, float]]:
    """Median wall ms per op, mean ms per op of each stage (plus ``client
    Python``: the rest of the mean wall time), and calls per op of each."""
    ops = len(walls)
    mean_ms = sum(walls) / ops * 1e3
    stages = {k: v / ops * 1e3 for k, v in sorted(timer.totals.items(), key=lambda kv: -kv[1])}
    stages["client Python"] = max(0.0, mean_ms - sum(stages.values()))
    calls = {k: v / ops for k, v in timer.calls.items()}
    return statistics.median(walls) * 1e3, stages, calls


_SITE = '''\
"""Installed by benchmarks/stages.py --profile: profile every thread of this daemon."""
import atexit, cProfile, os, threading

_dir = os.environ.get("KVBENCH_PROFILE_DIR")
if _dir:
    _profiles = []
    _lock = threading.Lock()

    def _start():
        p = cProfile.Profile()
        with _lock:
            _profiles.append(p)
        p.enable()
        return p

    _run = threading.Thread.run

    def _profiled_run(self):
        p = _start()
        try:
            _run(self)
        finally:
            p.disable()

    threading.Thread.run = _profiled_run
    _main = _start()

    def _dump():
        import pstats
        _main.disable()
        with _lock:
            profs = list(_profiles)
        stats = None
        for p in profs:
            try:
                stats = pstats.Stats(p) if stats is None else (stats.add(p) or stats)
            except TypeError:
                pass  # a profiler that recorded nothing
        if stats is not None:
            stats.dump_stats(os.path.join(_dir, f"daemon-{os.getpid()}.prof"))

    atexit.register(_dump)
'''


def profile_env(directory: Path) -> dict[str, str]:
    """Environment for daemons that profile all their threads into ``directory``.

    Each daemon writes ``daemon-<pid>.prof`` (``pstats``) when it exits.
    """
    site = directory / "site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(_SITE)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    env["KVBENCH_PROFILE_DIR"] = str(directory)
    return env


def top_functions(path: Path, n: int = 12) -> list[str]:
    """The ``n`` functions of a profile with the most time of their own, as lines."""
    import pstats

    stats = pstats.Stats(str(path))
    rows = []
    for (file, line, name), (_, ncalls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append((tottime, ncalls, cumtime, f"{Path(file).name}:{line}({name})"))
    rows.sort(reverse=True)
    return [
        f"{t * 1e3:9.1f} ms own {c * 1e3:9.1f} ms cum {k:8d} calls  {w}" for t, k, c, w in rows[:n]
    ]


_STAGED = (
    "kvdepot-tcp",
    "kvdepot-tcp-sync",
    "kvdepot-tcp-2rt",
    "kvdepot-shm",
    "kvdepot-shm-sync",
    "kvdepot-shm-2rt",
    "kvdepot-tcp-remote",
    "kvdepot-tcp-lookup",
    "kvdepot-tcp-probe",
)


def run_stages(
    systems: list[Any],
    sizes: tuple[int, ...],
    batch_of: Callable[[int], int],
    trials: int,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    """Per-stage breakdown of the kvdepot puts and gets, round-robin with the raw
    systems: each round times one batch of every system, so the breakdowns and
    the raw references compare runs under the same load."""
    out: list[dict[str, Any]] = []
    staged = [s for s in systems if s.name in _STAGED]
    raws = [s for s in systems if s.name in ("raw-tcp", "raw-shm")]
    log("\nstages (ms per batch; exclusive; mean over the batches; round-robin):")
    for size in sizes:
        batch = batch_of(size)
        for s in staged + raws:
            s.prepare(size, batch)
        for op in ("put", "get"):
            timers = {s.name: StageTimer() for s in staged}
            walls: dict[str, list[float]] = {s.name: [] for s in staged + raws}
            for s in staged + raws:
                s.before_get()
            for _ in range(max(trials, 20)):
                for s in staged + raws:
                    timer = timers.get(s.name)
                    with timer.timing() if timer else contextlib.nullcontext():
                        t0 = time.perf_counter()
                        getattr(s, op)()
                        walls[s.name].append(time.perf_counter() - t0)
                    s.quiesce()
            refs = {r.name: statistics.median(walls[r.name]) * 1e3 for r in raws}
            for s in staged:
                wall, stages, calls = summarize(timers[s.name], walls[s.name])
                raw = "raw-" + s.name.split("-")[1]
                ref = f", {raw} {refs[raw]:.2f} ms: {wall / refs[raw]:.2f}x" if raw in refs else ""
                log(f"  {s.name} {op} {batch} x {size // KiB} KiB: p50 {wall:.2f} ms{ref}")
                for stage, ms in stages.items():
                    n = calls.get(stage)
                    per = f"  ({n:.1f} calls)" if n else ""
                    log(f"      {stage:26s} {ms:7.3f} ms{per}")
                    out.append(
                        {"system": s.name, "op": op, "size": size, "stage": stage,
                         "ms_per_op": round(ms, 4), "calls_per_op": round(n or 0.0, 2)}
                    )  # fmt: skip
    return out


def client_profiler(directory: Path | None) -> Any:
    if directory is None:
        return None
    import cProfile

    directory.mkdir(parents=True, exist_ok=True)
    profiler = cProfile.Profile()
    profiler.enable()
    return profiler


def print_profiles(directory: Path, log: Callable[[str], None]) -> None:
    for path in sorted(directory.glob("*.prof")):
        log(f"\nprofile {path.name} (own time):")
        for line in top_functions(path):
            log("  " + line)


def _metadata_round_trips(address: str, node_id: str, size: int, batch: int) -> float:
    """p50 ms of a put's metadata calls without the transfer, as kvdepot-tcp makes them.

    A batch the client writes into its own store first (at most
    ``LOCAL_FIRST_STREAM_BYTES`` over tcp) costs one call, ``PutStart``, which
    the store makes before it answers (timed here alone); a larger one makes
    two, timed as ``PutStart`` and a ``PutRevoke`` (of the same shape as
    ``PutEnd``, leaving nothing behind).
    """
    stream_bytes = _local_first_stream_bytes()
    from kvdepot.proto.gen import metadata_pb2, metadata_pb2_grpc

    both = size * batch > stream_bytes
    times: list[float] = []
    with grpc.insecure_channel(address) as channel:
        stub = metadata_pb2_grpc.MetadataStub(channel)
        for _ in range(41):
            keys = [os.urandom(16) for _ in range(batch)]
            t0 = time.perf_counter()
            stub.PutStart(
                metadata_pb2.PutStartRequest(
                    keys=keys, sizes=[size] * batch, writer_node_id=node_id
                ),
                timeout=10,
            )
            if not both:
                times.append(time.perf_counter() - t0)
            stub.PutRevoke(metadata_pb2.PutRevokeRequest(keys=keys, node_id=node_id), timeout=10)
            if both:
                times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e3


def _local_first_stream_bytes() -> int:
    """The largest put over tcp that goes to the writer's own store first."""
    try:
        from kvdepot.connector.put_plan import LOCAL_FIRST_STREAM_BYTES
    except ImportError:  # before the put's plan had a module of its own
        from kvdepot.connector.client import LOCAL_FIRST_STREAM_BYTES
    return int(LOCAL_FIRST_STREAM_BYTES)


def put_ceilings(
    raw: dict[int, float], address: str, node_id: str, batch_of: Callable[[int], int]
) -> list[str]:
    """What kvdepot-tcp/raw-tcp put could reach with a transport as fast as raw-tcp.

    A small put into the writer's own node is the transfer, then the store's
    ``PutStart`` (which commits what was written); a larger one over tcp is ``PutStart``,
    the transfer, ``PutEnd``. The round trips add to raw-tcp's batch time
    (``raw``: its put p50 ms per chunk size).
    """
    stream_bytes = _local_first_stream_bytes()

    lines = []
    for size in sorted(raw):
        batch = batch_of(size)
        calls = "PutStart + PutEnd" if size * batch > stream_bytes else "PutStart"
        try:
            md = _metadata_round_trips(address, node_id, size, batch)
        except grpc.RpcError as exc:
            lines.append(f"  {size // KiB:5d} KiB: not measured ({exc.code().name})")
            continue
        lines.append(
            f"  {size // KiB:5d} KiB x {batch}: {calls} {md:5.2f} ms, raw-tcp batch "
            f"{raw[size]:6.2f} ms -> kvdepot-tcp/raw-tcp put <= {raw[size] / (raw[size] + md):.2f}"
        )
    return lines
