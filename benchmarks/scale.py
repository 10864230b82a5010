"""The metadata service at production scale: index size, registration, lookups, heartbeats.

Synthetic store nodes speak the real gRPC API (paged ``RegisterNode`` +
``RegisterInventory``, ``Heartbeat``, packed 128-key ``Lookup``) against a real
``kvdepot metadata`` daemon, on the memory index and on a Redis index (its own
``redis-server`` on a free loopback port, no persistence). Each curve is
measured next to an empty gRPC call (the health check of the same daemon):

- sizes: one node registers N chunks (100 K .. 10 M) by pages into a fresh
  daemon: wall time from RegisterNode to the last page's answer; index bytes
  per chunk (memory: growth of the daemon's VmRSS; Redis: growth of INFO
  ``used_memory``); then lookups of keys that hit, p50/p99;
- nodes: 2 .. 128 nodes share a fixed number of chunks, each heartbeating every
  ``--heartbeat-interval`` from this process; the daemon's CPU (utime+stime of
  /proc/PID/stat) per heartbeat over a window, net of its idle CPU, projected
  to 1,000 nodes at 1 s; then lookups whose 128 keys span all nodes;
- churn: lookup p99 (and whether health said SERVING) while idle, while a big
  node registers (from another process), and from that node's lease end until
  the daemon has purged it (its keys miss) and a few seconds more.

Usage::

    python benchmarks/scale.py [--quick] [--json] [--backends memory,redis] [--plot PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import queue
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repo root

from benchmarks import procs
from benchmarks.scale_nodes import (
    LOOKUP_KEYS,
    Daemon,
    Heartbeater,
    Node,
    Prober,
    Samples,
    inventory,
    mem_available_bytes,
    metadata_daemon,
    percentile,
    plot,
    redis_server,
    register_child,
    windows,
)
from kvdepot.errors import Unavailable
from kvdepot.proto.gen import metadata_pb2

GiB = 1 << 30
RESERVE_BYTES = 2 * GiB  # left free for the OS and this process
# Index bytes per chunk assumed before a size measured it (a deliberately high guess).
GUESS_BYTES_PER_CHUNK = {"memory": 400.0, "redis": 300.0}
WINDOWS = 64


@dataclass(frozen=True)
class Plan:
    """What one run measures."""

    sizes: list[int]
    node_counts: list[int]
    spread_chunks: int  # over all nodes of the node-count sweep
    keeper_chunks: int  # the node that stays alive in the churn phase
    big_chunks: int  # the node that registers, then expires, in the churn phase
    lookup_s: float
    cpu_s: float
    cpu_max_s: float
    idle_s: float
    after_purge_s: float
    expiry_max_s: float
    lease_s: float
    heartbeat_s: float


def make_plan(args: argparse.Namespace) -> Plan:
    quick = args.quick
    sizes = args.sizes or (
        [100_000, 500_000] if quick else [100_000, 1_000_000, 5_000_000, 10_000_000]
    )
    nodes = args.nodes or ([2, 8] if quick else [2, 8, 32, 128])
    return Plan(
        sizes=sizes,
        node_counts=nodes,
        spread_chunks=200_000 if quick else 1_000_000,
        keeper_chunks=100_000 if quick else 200_000,
        big_chunks=args.big or (500_000 if quick else 2_000_000),
        lookup_s=1.0 if quick else 3.0,
        cpu_s=3.0 if quick else 8.0,
        cpu_max_s=6.0 if quick else 30.0,
        idle_s=2.0 if quick else 5.0,
        after_purge_s=1.0 if quick else 3.0,
        expiry_max_s=30.0 if quick else 60.0,
        lease_s=args.lease_ttl,
        heartbeat_s=args.heartbeat_interval,
    )


# -- backends -------------------------------------------------------------------------
class Backend:
    """A fresh metadata daemon per measurement over one index backend."""

    def __init__(self, name: str, plan: Plan, tmp: Path, stack: contextlib.ExitStack) -> None:
        self.name = name
        self.plan = plan
        self.tmp = tmp
        self.redis: redis.Redis | None = None
        self.url = "memory://"
        self.warnings: list[str] = []
        self._count = 0
        if name == "redis":
            port = stack.enter_context(redis_server(tmp))
            self.redis = redis.Redis(port=port)
            stack.callback(self.redis.close)
            self.url = f"redis://127.0.0.1:{port}/0?prefix=scale"

    def used_memory(self) -> int:
        """Redis INFO memory ``used_memory`` (0 on the memory backend)."""
        if self.redis is None:
            return 0
        return int(self.redis.info("memory")["used_memory"])

    @contextlib.contextmanager
    def daemon(self, label: str) -> Iterator[Daemon]:
        """A metadata daemon over an empty index; its log's warnings are kept."""
        if self.redis is not None:
            self.redis.flushall()
        self._count += 1
        log = self.tmp / f"{self.name}-{self._count}-{label}.log"
        d: Daemon | None = None
        try:
            with metadata_daemon(self.url, log, self.plan.lease_s, self.plan.heartbeat_s) as d:
                yield d
        finally:
            if d is not None:
                self.warnings += [f"[{label}] {t}" for t in d.log_tail()]


def fits(backend: Backend, chunks: int, per_chunk: float, say: Callable[[str], None]) -> bool:
    """Whether ``chunks`` fit in free memory at ``per_chunk`` bytes (one line if not)."""
    need = chunks * (per_chunk + 16 * 3) + RESERVE_BYTES
    free = mem_available_bytes()
    if need <= free:
        return True
    say(
        f"scale: skipping {chunks:,} chunks on {backend.name}: needs ~{need / GiB:.1f} GiB "
        f"at {per_chunk:.0f} B/chunk, {free / GiB:.1f} GiB available"
    )
    return False


def measure_lookups(prober: Prober, wins: list[list[bytes]], seconds: float) -> dict[str, Any]:
    """Lookups for ``seconds``, then the health floor for as long, same daemon."""
    s = prober.loop(wins, seconds, health=False)
    floor = prober.floor(seconds)
    return {
        "lookup_p50_ms": percentile(s.lookup_ms, 0.5),
        "lookup_p99_ms": percentile(s.lookup_ms, 0.99),
        "lookups": len(s.lookup_ms),
        "lookup_misses": s.misses,
        "lookup_errors": len(s.errors),
        "floor_p50_ms": percentile(floor, 0.5),
        "floor_p99_ms": percentile(floor, 0.99),
    }


# -- sizes ---------------------------------------------------------------------------
def size_point(backend: Backend, chunks: int, seed: int) -> dict[str, Any]:
    """One node registers ``chunks`` into a fresh daemon; memory growth; lookups."""
    plan = backend.plan
    with backend.daemon(f"size{chunks}") as d:
        prober = Prober(d.address)
        beats: Heartbeater | None = None
        try:
            prober.check()
            keys = inventory(chunks, seed)
            rss0, redis0 = d.rss_bytes(), backend.used_memory()
            node = Node(prober.stub, "big", keys)
            took, indexed = node.register()
            rss1, hwm, redis1 = d.rss_bytes(), d.hwm_bytes(), backend.used_memory()
            beats = Heartbeater(d.address, [node], plan.heartbeat_s)
            beats.start()
            row: dict[str, Any] = {
                "chunks": chunks,
                "indexed": indexed,
                "register_s": round(took, 3),
                "chunks_per_s": round(chunks / took) if took else 0,
                "rss_bytes_per_chunk": round((rss1 - rss0) / chunks, 1),
                "hwm_bytes": hwm,
                "redis_bytes_per_chunk": round((redis1 - redis0) / chunks, 1)
                if backend.redis is not None
                else None,
            }
            row.update(measure_lookups(prober, windows([node], WINDOWS, seed), plan.lookup_s))
            row["heartbeat_failures"] = dict(beats.failed)
            return row
        finally:
            if beats is not None:
                beats.stop()
            prober.close()


def sweep_sizes(backend: Backend, say: Callable[[str], None]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    per_chunk = GUESS_BYTES_PER_CHUNK[backend.name]
    for i, chunks in enumerate(backend.plan.sizes):
        if not fits(backend, chunks, per_chunk, say):
            rows.append({"chunks": chunks, "skipped": "not enough free memory"})
            continue
        say(f"  {backend.name}: registering {chunks:,} chunks")
        try:
            row = size_point(backend, chunks, seed=100 + i)
        except grpc.RpcError as exc:
            say(f"scale: {chunks:,} chunks on {backend.name} failed: {exc.code()}: {exc.details()}")
            rows.append({"chunks": chunks, "failed": f"{exc.code()}: {exc.details()}"})
            break
        rows.append(row)
        say(
            f"    {row['register_s']} s, {row['rss_bytes_per_chunk']} B/chunk RSS"
            + (f", {row['redis_bytes_per_chunk']} B/chunk redis" if backend.redis else "")
            + f", lookup p99 {row['lookup_p99_ms']} ms (floor {row['floor_p99_ms']})"
        )
        grown = row["redis_bytes_per_chunk"] if backend.redis else row["rss_bytes_per_chunk"]
        if backend.redis is not None:
            grown += max(0.0, row["rss_bytes_per_chunk"])
        if chunks >= 500_000 and grown > 0:
            per_chunk = grown * 1.5
    return rows


# -- nodes and heartbeats ------------------------------------------------------------
@dataclass(frozen=True)
class CpuWindow:
    """Daemon CPU over a window: from /proc/PID/stat ticks and from schedstat (ns)."""

    ticks_s: float
    sched_s: float
    heartbeats: int
    wall_s: float


def cpu_window(d: Daemon, beats: Heartbeater | None, seconds: float) -> CpuWindow:
    c0, n0, t0 = d.cpu_s(), d.cpu_ns_s(), time.monotonic()
    s0 = beats.sent if beats else 0
    time.sleep(seconds)
    c1, n1, s1 = d.cpu_s(), d.cpu_ns_s(), beats.sent if beats else 0
    return CpuWindow(c1 - c0, n1 - n0, s1 - s0, time.monotonic() - t0)


def cpu_row(idle: CpuWindow, busy: CpuWindow) -> dict[str, Any]:
    """CPU per heartbeat, gross and net of the idle daemon, from both sources."""
    sent = max(busy.heartbeats, 1)
    row: dict[str, Any] = {
        "heartbeats_per_s": round(busy.heartbeats / busy.wall_s, 1),
        "cpu_window_s": round(busy.wall_s, 1),
    }
    for suffix, idle_s, busy_s in (
        ("", idle.ticks_s, busy.ticks_s),
        ("_schedstat", idle.sched_s, busy.sched_s),
    ):
        idle_cores = idle_s / idle.wall_s
        row[f"idle_cores{suffix}"] = round(idle_cores, 4)
        row[f"daemon_cores{suffix}"] = round(busy_s / busy.wall_s, 4)
        row[f"cpu_ms_per_heartbeat{suffix}"] = round(busy_s * 1000 / sent, 4)
        net = max(0.0, busy_s - idle_cores * busy.wall_s)
        row[f"cpu_ms_per_heartbeat_net{suffix}"] = round(net * 1000 / sent, 4)
    return row


def nodes_point(backend: Backend, count: int) -> dict[str, Any]:
    """``count`` nodes share the spread chunks, heartbeat; CPU per heartbeat; lookups."""
    plan = backend.plan
    # Long enough for ~100 heartbeats (10 ms ticks), within a bound.
    window = min(max(plan.cpu_s, 100 * plan.heartbeat_s / count), plan.cpu_max_s)
    with backend.daemon(f"nodes{count}") as d:
        prober = Prober(d.address)
        beats: Heartbeater | None = None
        try:
            prober.check()
            idle = cpu_window(d, None, plan.cpu_s)
            per = plan.spread_chunks // count
            nodes = [Node(prober.stub, f"n{i:03d}", inventory(per, 1000 + i)) for i in range(count)]
            t0 = time.perf_counter()
            beats = Heartbeater(d.address, [], plan.heartbeat_s)
            beats.start()
            for n in nodes:
                n.register()
                beats.nodes.append(n)  # heartbeats from its registration on
            register_s = time.perf_counter() - t0
            time.sleep(plan.heartbeat_s)
            busy = cpu_window(d, beats, window)
            row: dict[str, Any] = {
                "nodes": count,
                "chunks": per * count,
                "register_all_s": round(register_s, 3),
                **cpu_row(idle, busy),
            }
            row.update(measure_lookups(prober, windows(nodes, WINDOWS, count), plan.lookup_s))
            stats = prober.stub.GetStats(metadata_pb2.GetStatsRequest(), timeout=30)
            row["nodes_expired"] = int(stats.nodes_expired)
            row["nodes_listed"] = len(stats.nodes)
            row["heartbeat_failures"] = dict(beats.failed)
            return row
        finally:
            if beats is not None:
                beats.stop()
            prober.close()


def sweep_nodes(backend: Backend, say: Callable[[str], None]) -> list[dict[str, Any]]:
    rows = []
    for count in backend.plan.node_counts:
        say(f"  {backend.name}: {count} nodes")
        try:
            row = nodes_point(backend, count)
        except grpc.RpcError as exc:
            say(f"scale: {count} nodes on {backend.name} failed: {exc.code()}: {exc.details()}")
            rows.append({"nodes": count, "failed": f"{exc.code()}: {exc.details()}"})
            continue
        rows.append(row)
        say(
            f"    {row['cpu_ms_per_heartbeat']} ms CPU/heartbeat "
            f"({row['cpu_ms_per_heartbeat_net']} net; schedstat "
            f"{row['cpu_ms_per_heartbeat_schedstat']}), lookup p99 {row['lookup_p99_ms']} ms "
            f"(floor {row['floor_p99_ms']}), expired {row['nodes_expired']}"
        )
    return rows


# -- churn: a big node registers, then expires ---------------------------------------
def summarize(s: Samples, seconds: float) -> dict[str, Any]:
    return {
        "lookup_p50_ms": percentile(s.lookup_ms, 0.5),
        "lookup_p99_ms": percentile(s.lookup_ms, 0.99),
        "lookup_max_ms": round(max(s.lookup_ms), 3) if s.lookup_ms else 0.0,
        "lookups": len(s.lookup_ms),
        "health_p99_ms": percentile(s.health_ms, 0.99),
        "serving_throughout": s.not_serving == 0 and not s.errors,
        "not_serving": s.not_serving,
        "errors": s.errors[:3],
        "misses": s.misses,
        "seconds": round(seconds, 2),
    }


def during_register(
    prober: Prober, address: str, wins: list[list[bytes]], chunks: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Lookups while another process registers the big node; (window, its result)."""
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    child = procs.process(ctx, register_child, (address, "big", chunks, 7, results))
    child.start()
    try:
        done = threading.Event()
        answer: dict[str, Any] = {}

        def wait() -> None:
            with contextlib.suppress(queue.Empty):
                answer.update(results.get(timeout=1800))
            done.set()

        waiter = threading.Thread(target=wait, daemon=True)
        try:
            started = results.get(timeout=120)  # its keys are made: it registers now
        except queue.Empty:
            started = {"ok": False, "error": f"the registering process exited ({child.exitcode})"}
        if "started" not in started:
            return summarize(Samples(), 0.0), started
        t0 = time.perf_counter()
        waiter.start()
        s = prober.loop(wins, 1e9, until=done)
        took = time.perf_counter() - t0
        child.join(timeout=30)
        return summarize(s, took), answer
    finally:
        if child.is_alive():
            child.kill()
            child.join()


def during_expiry(
    prober: Prober,
    wins: list[list[bytes]],
    big: list[bytes],
    lease_end: float,
    plan: Plan,
    swept: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """From the big node's lease end until it is purged and ``after_purge_s`` more.

    Purged: its keys miss, and (Redis) ``swept()`` says its entries are gone
    from Redis too (the Redis index sweeps a dead node's replicas in the background).
    """
    prober.loop(wins, max(0.0, lease_end - time.time()), health=False)  # not measured
    s = Samples()
    t0 = time.perf_counter()
    missed_s: float | None = None
    purged_s: float | None = None
    deadline = t0 + plan.expiry_max_s
    probe_at = t0
    while time.perf_counter() < deadline:
        prober.loop(wins, 0.1, into=s)
        now = time.perf_counter()
        if purged_s is not None or now < probe_at:
            continue
        probe_at = now + 0.1
        if missed_s is None:
            with contextlib.suppress(grpc.RpcError):
                if prober.lookup(big) == 0:
                    missed_s = now - t0
        if missed_s is not None and (swept is None or swept()):
            purged_s = now - t0
            deadline = min(deadline, now + plan.after_purge_s)
    row = summarize(s, time.perf_counter() - t0)
    row["missed_after_s"] = round(missed_s, 2) if missed_s is not None else None
    row["purged_after_s"] = round(purged_s, 2) if purged_s is not None else None
    return row


def swept_check(backend: Backend, before: int, after: int) -> Callable[[], bool] | None:
    """Redis: whether ``used_memory`` fell back to within 10 % of the big node's growth."""
    if backend.redis is None:
        return None
    return lambda: backend.used_memory() <= before + 0.1 * max(0, after - before)


def churn(backend: Backend, say: Callable[[str], None]) -> dict[str, Any]:
    """Idle, during-register and during-expiry lookup p99 in one daemon."""
    plan = backend.plan
    if not fits(
        backend, plan.big_chunks + plan.keeper_chunks, GUESS_BYTES_PER_CHUNK["memory"], say
    ):
        return {"skipped": "not enough free memory"}
    with backend.daemon("churn") as d:
        prober = Prober(d.address)
        keeper = Node(prober.stub, "keeper", inventory(plan.keeper_chunks, 5))
        keeper.register()
        beats = Heartbeater(d.address, [keeper], plan.heartbeat_s)
        beats.start()
        try:
            wins = windows([keeper], WINDOWS, 5)
            prober.loop(wins, 0.3, health=False)  # warm-up
            idle = summarize(prober.loop(wins, plan.idle_s), plan.idle_s)
            floor = prober.floor(plan.idle_s)
            idle["floor_p99_ms"] = percentile(floor, 0.99)
            say(f"  {backend.name}: idle lookup p99 {idle['lookup_p99_ms']} ms; registering big")
            used0 = backend.used_memory()
            reg, answer = during_register(prober, d.address, wins, plan.big_chunks)
            swept = swept_check(backend, used0, backend.used_memory())
            reg["register"] = answer
            out: dict[str, Any] = {"idle": idle, "register": reg}
            if not answer.get("ok"):
                say(f"scale: the big node's registration failed: {answer}")
                return out
            big_keys = inventory(plan.big_chunks, 7)[: 16 * LOOKUP_KEYS]
            big = [big_keys[16 * i : 16 * (i + 1)] for i in range(LOOKUP_KEYS)]
            say(f"  {backend.name}: registered in {answer['s']:.1f} s; waiting for its expiry")
            lease_end = answer["end"] + plan.lease_s
            out["expiry"] = during_expiry(prober, wins, big, lease_end, plan, swept)
            stats = prober.stub.GetStats(metadata_pb2.GetStatsRequest(), timeout=30)
            out["nodes_left"] = sorted(n.node_id for n in stats.nodes)
            out["nodes_expired"] = int(stats.nodes_expired)
            out["keeper_heartbeat_failures"] = dict(beats.failed)
            return out
        finally:
            beats.stop()
            prober.close()


# -- the run -------------------------------------------------------------------------
def run_backend(name: str, plan: Plan, tmp: Path, say: Callable[[str], None]) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        backend = Backend(name, plan, tmp, stack)
        say(f"{name}: index sizes")
        sizes = sweep_sizes(backend, say)
        say(f"{name}: node counts and heartbeats")
        nodes = sweep_nodes(backend, say)
        say(f"{name}: lookups while a node registers and expires")
        try:
            churned = churn(backend, say)
        except grpc.RpcError as exc:
            churned = {"failed": f"{exc.code()}: {exc.details()}"}
        return {"sizes": sizes, "nodes": nodes, "churn": churned, "warnings": backend.warnings}


def by(rows: list[dict[str, Any]], key: str, value: str) -> dict[str, Any]:
    """``{row[key]: row[value]}`` over the rows that measured ``value``."""
    return {str(r[key]): r[value] for r in rows if r.get(value) is not None}


def projection(nodes: list[dict[str, Any]]) -> float | None:
    """Cores for 1,000 nodes at 1 s heartbeats, from the largest node count measured."""
    ok = [r for r in nodes if "cpu_ms_per_heartbeat_net" in r]
    if not ok:
        return None
    last = ok[-1]
    # 1,000 heartbeats a second at this many ms each, plus what the idle daemon spends.
    return round(last["idle_cores"] + 1000 * last["cpu_ms_per_heartbeat_net"] / 1000, 4)


def churn_value(c: dict[str, Any], phase: str, key: str) -> Any:
    return c.get(phase, {}).get(key)


def summary(raw: dict[str, dict[str, Any]], plan: Plan) -> dict[str, Any]:
    """The one JSON object: headline figures per backend, then the raw rows."""
    out: dict[str, Any] = {"register_chunks_max": {}}
    per: dict[str, dict[str, Any]] = {k: {} for k in _PER_BACKEND}
    for name, r in raw.items():
        done = [x for x in r["sizes"] if "register_s" in x and x["indexed"] == x["chunks"]]
        out["register_chunks_max"][name] = max((x["chunks"] for x in done), default=0)
        per["register_s_by_chunks"][name] = by(done, "chunks", "register_s")
        per["lookup_p50_ms_by_chunks"][name] = by(done, "chunks", "lookup_p50_ms")
        per["lookup_p99_ms_by_chunks"][name] = by(done, "chunks", "lookup_p99_ms")
        per["grpc_floor_p99_ms_by_chunks"][name] = by(done, "chunks", "floor_p99_ms")
        nodes = [x for x in r["nodes"] if "lookup_p99_ms" in x]
        per["lookup_p50_ms_by_nodes"][name] = by(nodes, "nodes", "lookup_p50_ms")
        per["lookup_p99_ms_by_nodes"][name] = by(nodes, "nodes", "lookup_p99_ms")
        per["grpc_floor_p99_ms_by_nodes"][name] = by(nodes, "nodes", "floor_p99_ms")
        per["heartbeat_cpu_ms_by_nodes"][name] = by(nodes, "nodes", "cpu_ms_per_heartbeat")
        per["heartbeat_cpu_ms_net_by_nodes"][name] = by(nodes, "nodes", "cpu_ms_per_heartbeat_net")
        per["heartbeat_cpu_ms_schedstat_by_nodes"][name] = by(
            nodes, "nodes", "cpu_ms_per_heartbeat_schedstat"
        )
        per["heartbeat_cores_1000_nodes_1s"][name] = projection(nodes)
        floors = [x["floor_p99_ms"] for x in done + nodes]
        c = r["churn"]
        if churn_value(c, "idle", "floor_p99_ms") is not None:
            floors.append(c["idle"]["floor_p99_ms"])
        per["grpc_floor_p99_ms"][name] = round(statistics.median(floors), 3) if floors else None
        per["lookup_p99_idle_ms"][name] = churn_value(c, "idle", "lookup_p99_ms")
        per["lookup_p99_during_register_ms"][name] = churn_value(c, "register", "lookup_p99_ms")
        per["lookup_p99_during_expiry_ms"][name] = churn_value(c, "expiry", "lookup_p99_ms")
        # The floor under the same load: an empty call's p99 in the same loop.
        per["empty_call_p99_during_register_ms"][name] = churn_value(c, "register", "health_p99_ms")
        per["empty_call_p99_during_expiry_ms"][name] = churn_value(c, "expiry", "health_p99_ms")
        per["empty_call_p99_idle_ms"][name] = churn_value(c, "idle", "health_p99_ms")
        per["expiry_purged_after_s"][name] = churn_value(c, "expiry", "purged_after_s")
        per["health_serving_throughout"][name] = {
            p: churn_value(c, p, "serving_throughout") for p in ("idle", "register", "expiry")
        }
        if name == "memory":
            out["memory_bytes_per_chunk"] = by(done, "chunks", "rss_bytes_per_chunk")
        if name == "redis":
            out["redis_bytes_per_chunk"] = by(done, "chunks", "redis_bytes_per_chunk")
            out["redis_daemon_rss_bytes_per_chunk"] = by(done, "chunks", "rss_bytes_per_chunk")
    out.update(per)
    out["config"] = {**asdict(plan), "cpus": os.cpu_count(), "backends": list(raw)}
    out["note"] = (
        "register_chunks_max is per backend; *_bytes_per_chunk are keyed by chunks; "
        "heartbeat_cores_1000_nodes_1s = idle cores + 1000/s x net CPU ms per heartbeat "
        "at the largest node count"
    )
    out["raw"] = raw
    return out


_PER_BACKEND = [
    "register_s_by_chunks",
    "lookup_p50_ms_by_chunks",
    "lookup_p99_ms_by_chunks",
    "grpc_floor_p99_ms_by_chunks",
    "lookup_p50_ms_by_nodes",
    "lookup_p99_ms_by_nodes",
    "grpc_floor_p99_ms_by_nodes",
    "grpc_floor_p99_ms",
    "lookup_p99_idle_ms",
    "lookup_p99_during_register_ms",
    "lookup_p99_during_expiry_ms",
    "empty_call_p99_idle_ms",
    "empty_call_p99_during_register_ms",
    "empty_call_p99_during_expiry_ms",
    "expiry_purged_after_s",
    "health_serving_throughout",
    "heartbeat_cpu_ms_by_nodes",
    "heartbeat_cpu_ms_net_by_nodes",
    "heartbeat_cpu_ms_schedstat_by_nodes",
    "heartbeat_cores_1000_nodes_1s",
]


# -- output --------------------------------------------------------------------------
def fmt(v: Any) -> str:
    return "-" if v is None else f"{v:,}" if isinstance(v, int) else str(v)


def render_sizes(name: str, rows: list[dict[str, Any]]) -> list[str]:
    head = (
        f"{'chunks':>11} {'register_s':>10} {'chunks/s':>9} {'RSS B/ch':>9} {'redis B/ch':>10} "
        f"{'p50_ms':>7} {'p99_ms':>7} {'floor99':>7}"
    )
    lines = [f"{name}: index size (one node)", head]
    for r in rows:
        if "register_s" not in r:
            lines.append(f"{r['chunks']:>11,} {r.get('skipped') or r.get('failed')}")
            continue
        lines.append(
            f"{r['chunks']:>11,} {r['register_s']:>10} {r['chunks_per_s']:>9,} "
            f"{r['rss_bytes_per_chunk']:>9} {fmt(r['redis_bytes_per_chunk']):>10} "
            f"{r['lookup_p50_ms']:>7} {r['lookup_p99_ms']:>7} {r['floor_p99_ms']:>7}"
        )
    return lines


def render_nodes(name: str, rows: list[dict[str, Any]]) -> list[str]:
    head = (
        f"{'nodes':>5} {'chunks':>9} {'hb/s':>6} {'cores':>6} {'ms/hb':>7} {'net':>7} {'sched':>7} "
        f"{'p50_ms':>7} {'p99_ms':>7} {'floor99':>7} {'expired':>7}"
    )
    lines = [f"{name}: node count (chunks spread, heartbeats from this process)", head]
    for r in rows:
        if "lookup_p99_ms" not in r:
            lines.append(f"{r['nodes']:>5} {r.get('failed')}")
            continue
        lines.append(
            f"{r['nodes']:>5} {r['chunks']:>9,} {r['heartbeats_per_s']:>6} "
            f"{r['daemon_cores']:>6} {r['cpu_ms_per_heartbeat']:>7} "
            f"{r['cpu_ms_per_heartbeat_net']:>7} {r['cpu_ms_per_heartbeat_schedstat']:>7} "
            f"{r['lookup_p50_ms']:>7} "
            f"{r['lookup_p99_ms']:>7} {r['floor_p99_ms']:>7} {r['nodes_expired']:>7}"
        )
    return lines


def render_churn(name: str, c: dict[str, Any]) -> list[str]:
    lines = [f"{name}: lookups while a node registers / expires"]
    if "idle" not in c:
        return [*lines, f"  {c}"]
    for phase in ("idle", "register", "expiry"):
        p = c.get(phase)
        if p is None:
            continue
        extra = (
            f", keys miss after {fmt(p['missed_after_s'])} s, purged after "
            f"{fmt(p['purged_after_s'])} s"
            if phase == "expiry"
            else ""
        )
        lines.append(
            f"  {phase:<8} p50 {p['lookup_p50_ms']} ms, p99 {p['lookup_p99_ms']} ms, max "
            f"{p['lookup_max_ms']} ms, {p['lookups']} lookups over {p['seconds']} s, "
            f"empty call p99 {p['health_p99_ms']} ms, "
            f"SERVING throughout: {p['serving_throughout']}{extra}"
        )
    if c["idle"].get("floor_p99_ms") is not None:
        lines.append(f"  grpc floor p99 {c['idle']['floor_p99_ms']} ms")
    reg = c.get("register", {}).get("register", {})
    if reg.get("ok"):
        lines.append(f"  big node: {reg['chunks']:,} chunks registered in {reg['s']:.2f} s")
    if "nodes_left" in c:
        lines.append(
            f"  nodes left {c['nodes_left']}, expired {c['nodes_expired']}, "
            f"keeper heartbeat failures {c['keeper_heartbeat_failures'] or 'none'}"
        )
    return lines


def render(result: dict[str, Any]) -> str:
    lines: list[str] = []
    for name, r in result["raw"].items():
        lines += [*render_sizes(name, r["sizes"]), ""]
        lines += [*render_nodes(name, r["nodes"]), ""]
        lines += [*render_churn(name, r["churn"]), ""]
        if r["warnings"]:
            lines += [f"{name}: daemon warnings", *(f"  {w}" for w in r["warnings"][-8:]), ""]
    lines.append(f"register_chunks_max: {result['register_chunks_max']}")
    lines.append(f"grpc_floor_p99_ms (median): {result['grpc_floor_p99_ms']}")
    lines.append(
        f"heartbeat cores at 1,000 nodes / 1 s (projected): "
        f"{result['heartbeat_cores_1000_nodes_1s']}"
    )
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------
def ints(text: str) -> list[int]:
    return [int(float(x)) for x in text.split(",") if x]


def interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="small sizes, short windows (~2 min)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--backends", default="memory,redis", help="memory,redis (default both)")
    p.add_argument(
        "--plot",
        type=Path,
        default=Path(__file__).resolve().parent / "results" / "scale.png",
        help="PNG of the curves (default benchmarks/results/scale.png)",
    )
    p.add_argument("--logs", type=Path, help="keep the daemons' logs in this folder")
    p.add_argument("--sizes", type=ints, help="chunk counts of the size sweep, e.g. 1e5,1e6")
    p.add_argument("--nodes", type=ints, help="node counts, e.g. 2,8,32,128")
    p.add_argument("--big", type=int, help="chunks of the node that registers and expires")
    p.add_argument("--lease-ttl", type=float, default=5.0, help="daemon lease (default 5 s)")
    p.add_argument("--heartbeat-interval", type=float, default=0.5, help="default 0.5 s")
    args = p.parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    if any(b not in ("memory", "redis") for b in backends):
        p.error(f"unknown backend in {args.backends!r}")
    plan = make_plan(args)
    signal.signal(signal.SIGTERM, interrupted)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    raw: dict[str, dict[str, Any]] = {}
    t0 = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="kvdepot-scale-") as tmp:
            logs = args.logs or Path(tmp)
            logs.mkdir(parents=True, exist_ok=True)
            for name in backends:
                raw[name] = run_backend(name, plan, logs, say)
    except KeyboardInterrupt:
        say("scale: interrupted; every process it started was stopped")
        return 130
    except Unavailable as exc:
        say(f"scale: {exc}")
        return 1
    result = summary(raw, plan)
    result["config"]["wall_s"] = round(time.monotonic() - t0, 1)
    plot(result, args.plot)
    print(json.dumps(result) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
