"""Lookup and put latency of the metadata service: memory vs Redis index vs raw Redis.

Starts its own ``redis-server`` on a free loopback port and metadata services
as subprocesses (memory index; Redis index; a second Redis replica on the same
Redis), registers a fake store node with an inventory through gRPC and keeps
it alive with heartbeats, then measures through the gRPC service with the
sync stub:

- ``lookup``: one 128-key ``Lookup`` (all hits);
- ``put``: one 128-key ``PutStart`` + ``PutEnd`` of new keys;
- ``health`` (backend ``grpc-floor``): one empty gRPC health check of the
  memory-index process, the floor under any call through the service here;

and, in the same run, the raw Redis cost of the equivalent pipelined commands
on the index's layout (lookup: 128 HGET of the chunks' bucket fields + the
node's lease in one pipeline; put: 128 SET NX PX of pending allocations, then
128 HSET into buckets with the allocations' DEL). The ``redis-2-replicas`` rows
drive both Redis replicas at once (one client process each) to show how
throughput scales with replicas.

What ``kvdepot explain`` keeps costs a lookup nothing: a second memory-index
service (``memory-history``) holds ``--history-nodes`` full departure rings
(65536 departures each, recorded as stores report them: ``ReportRemoved``
of chunks committed on departed nodes) and is asked lookups that name a
registered namespace (its counters tallied). Its lookups and the plain
``memory`` service's alternate in short rounds (``memory-a`` and
``memory-history`` rows), so that the machine's noise falls on both alike.

Usage::

    python benchmarks/lookup.py [--quick] [--json] [--seconds S] [--keys N]
        [--history-nodes N]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import logging
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repo root

from benchmarks import procs
from benchmarks.scale_nodes import redis_server
from kvdepot.apps.cluster import wait_ready
from kvdepot.metadata.index.redis_layout import DEFAULT_BUCKET_BITS, Buckets
from kvdepot.proto.gen import common_pb2, metadata_pb2, metadata_pb2_grpc
from kvdepot.wire.lookup import unpack_lookup

logger = logging.getLogger(__name__)

NODE_ID = "bench-node"
NODE_ADDRESS = "127.0.0.1:1"
CHUNK_BYTES = 2 << 20
PREFIX = "bench"
INVENTORY_WINDOWS = 32  # lookups rotate over this many distinct 128-key prefixes
HISTORY_PER_NODE = 65536  # the metadata service's default departures per node
HISTORY_BATCH = 4096  # keys per PutEnd / ReportRemoved that fill the history
ROUNDS = 4  # alternations of the history comparison
NAMESPACE = "ab" * 16  # the lookups of memory-history count in it


# -- helpers ------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def key_of(space: int, i: int) -> bytes:
    """A 16-byte chunk key; ``space`` keeps workers' new keys apart. Hashed,
    as real keys are (xxh3 digests): both indexes place a key by its bits, and
    counters as keys piled the memory index's rows onto one chain (90 ms a
    128-key lookup where it takes well under 1 ms)."""
    return hashlib.blake2b(
        space.to_bytes(4, "big") + i.to_bytes(12, "big"), digest_size=16
    ).digest()


def percentile(sorted_ms: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of already sorted samples, nearest rank."""
    if not sorted_ms:
        return 0.0
    return sorted_ms[min(len(sorted_ms) - 1, int(q * len(sorted_ms)))]


def row(backend: str, op: str, keys: int, lat_ms: list[float], elapsed_s: float) -> dict[str, Any]:
    """One result row from per-operation latencies measured over ``elapsed_s``."""
    lat = sorted(lat_ms)
    return {
        "backend": backend,
        "op": op,
        "keys": keys,
        "p50_ms": round(percentile(lat, 0.50), 3),
        "p99_ms": round(percentile(lat, 0.99), 3),
        "ops_per_s": round(len(lat) / elapsed_s, 1) if elapsed_s > 0 else 0.0,
    }


def timed_loop(
    op: Callable[[int], None], seconds: float, warmup_s: float, start_at: float = 0.0
) -> tuple[list[float], float]:
    """Run ``op(i)`` for ``warmup_s`` unmeasured, then ``seconds`` measured."""
    i = 0
    end = time.monotonic() + warmup_s
    while time.monotonic() < end:
        op(i)
        i += 1
    if start_at:
        time.sleep(max(0.0, start_at - time.time()))
    lat: list[float] = []
    t0 = time.perf_counter()
    end_pc = t0 + seconds
    while True:
        s = time.perf_counter()
        if s >= end_pc:
            break
        op(i)
        lat.append((time.perf_counter() - s) * 1000)
        i += 1
    return lat, time.perf_counter() - t0


# -- processes ----------------------------------------------------------------
@contextlib.contextmanager
def metadata_service(index: str, log: Path) -> Iterator[str]:
    """A ``kvdepot metadata`` process over ``index``; yields its ``host:port``."""
    with open(log, "wb") as err:
        proc = procs.popen(
            [sys.executable, "-m", "kvdepot.apps.cli", "--log-level", "WARNING", "metadata",
             "--host", "127.0.0.1", "--port", "0", "--index", index,
             "--lease-ttl", "10", "--heartbeat-interval", "1"],
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            death_signal=signal.SIGTERM,
        )  # fmt: skip
    try:
        info = wait_ready(proc, f"metadata ({index})", 60)
        yield f"127.0.0.1:{info['port']}"
    finally:
        stop(proc)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 10 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def tiers() -> list[common_pb2.TierStats]:
    """A fake node's tiers: room for everything the benchmark puts."""
    return [common_pb2.TierStats(name="cpu", capacity_bytes=1 << 50, used_bytes=0)]


def register(address: str, inventory: int) -> None:
    """Register the fake node with ``inventory`` chunks through gRPC."""
    with grpc.insecure_channel(address) as ch:
        metadata_pb2_grpc.MetadataStub(ch).RegisterNode(
            metadata_pb2.RegisterNodeRequest(
                node_id=NODE_ID,
                address=NODE_ADDRESS,
                tiers=tiers(),
                inventory=[
                    common_pb2.ChunkRef(key=key_of(0, i), size=CHUNK_BYTES, tier="cpu")
                    for i in range(inventory)
                ],
            ),
            timeout=60,
        )


def fill_history(address: str, nodes: int) -> int:
    """Give the service ``nodes`` departed nodes, each with a full departure
    ring, and register ``NAMESPACE``; returns the departures recorded."""
    recorded = 0
    with grpc.insecure_channel(address) as ch:
        stub = metadata_pb2_grpc.MetadataStub(ch)
        stub.RegisterNamespace(
            metadata_pb2.RegisterNamespaceRequest(
                name=NAMESPACE,
                fields=[metadata_pb2.NamespaceField(name="model", value="bench")],
                client="client",
            ),
            timeout=10,
        )
        for n in range(nodes):
            node_id = f"departed-{n}"
            stub.RegisterNode(
                metadata_pb2.RegisterNodeRequest(
                    node_id=node_id, address=NODE_ADDRESS, tiers=tiers()
                ),
                timeout=60,
            )
            for start in range(0, HISTORY_PER_NODE, HISTORY_BATCH):
                keys = [key_of(1_000_000 + n, start + i) for i in range(HISTORY_BATCH)]
                sizes = [CHUNK_BYTES] * len(keys)
                stub.PutEnd(
                    metadata_pb2.PutEndRequest(keys=keys, node_id=node_id, sizes=sizes),
                    timeout=60,
                )
                reply = stub.ReportRemoved(
                    metadata_pb2.ReportRemovedRequest(
                        node_id=node_id, keys=keys, reason="evicted", tier="cpu"
                    ),
                    timeout=60,
                )
                recorded += reply.removed
    return recorded


class Heartbeats(threading.Thread):
    """Keeps the fake node's lease alive on each given metadata service."""

    def __init__(self, addresses: list[str], interval_s: float = 1.0) -> None:
        super().__init__(daemon=True)
        self._channels = [grpc.insecure_channel(a) for a in addresses]
        self._interval_s = interval_s
        self._done = threading.Event()

    def run(self) -> None:
        stubs = [metadata_pb2_grpc.MetadataStub(ch) for ch in self._channels]
        while not self._done.wait(self._interval_s):
            for stub in stubs:
                try:
                    stub.Heartbeat(metadata_pb2.HeartbeatRequest(node_id=NODE_ID), timeout=5)
                except grpc.RpcError as exc:
                    logger.warning("heartbeat failed: %s", exc.code())

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=5)
        for ch in self._channels:
            ch.close()


# -- measured operations --------------------------------------------------------
def grpc_worker(
    address: str, op: str, keys: int, space: int, seconds: float, warmup_s: float, start_at: float
) -> tuple[list[float], float]:
    """One client process: ``op`` over the gRPC sync stub, back to back."""
    channel = grpc.insecure_channel(
        address, options=[("grpc.max_receive_message_length", 64 << 20)]
    )
    stub = metadata_pb2_grpc.MetadataStub(channel)
    windows = [[key_of(0, w * keys + i) for i in range(keys)] for w in range(INVENTORY_WINDOWS)]
    sizes = [CHUNK_BYTES] * keys

    def lookup(i: int, namespace: str = "") -> None:
        # As KVDepotClient asks and decodes it (the packed answer).
        reply = stub.Lookup(
            metadata_pb2.LookupRequest(
                keys=windows[i % INVENTORY_WINDOWS],
                client_node_id=NODE_ID,
                tokens_per_key=256,
                packed=True,
                namespace=namespace,
            ),
            timeout=10,
        )
        result = unpack_lookup(reply)
        assert result.hits == keys, result.hits

    def lookup_ns(i: int) -> None:
        lookup(i, NAMESPACE)

    def put(i: int) -> None:
        new = [key_of(space, i * keys + j) for j in range(keys)]
        reply = stub.PutStart(
            metadata_pb2.PutStartRequest(keys=new, sizes=sizes, writer_node_id=NODE_ID),
            timeout=10,
        )
        assert all(a.action == metadata_pb2.Allocation.WRITE for a in reply.allocations)
        stub.PutEnd(metadata_pb2.PutEndRequest(keys=new, node_id=NODE_ID, sizes=sizes), timeout=10)

    health = health_pb2_grpc.HealthStub(channel)
    empty = health_pb2.HealthCheckRequest()

    def check(i: int) -> None:
        health.Check(empty, timeout=10)

    ops = {"lookup": lookup, "lookup-ns": lookup_ns, "put": put, "health": check}
    try:
        return timed_loop(ops[op], seconds, warmup_s, start_at)
    finally:
        channel.close()


def run_clients(
    pool: Any, addresses: list[str], op: str, keys: int, seconds: float, warmup_s: float
) -> tuple[list[float], float]:
    """One client process per address, measured over the same interval."""
    # Workers start measuring together, after their warm-up (and start-up).
    start_at = time.time() + warmup_s + 1.0
    jobs = [
        pool.apply_async(grpc_worker, (a, op, keys, next(_SPACES), seconds, warmup_s, start_at))
        for a in addresses
    ]
    results = [j.get(timeout=seconds + warmup_s + 120) for j in jobs]
    lat = [x for r, _ in results for x in r]
    return lat, max(e for _, e in results)


def alternating(
    pool: Any, memory: str, history: str, keys: int, seconds: float, warmup_s: float
) -> list[dict[str, Any]]:
    """Lookups of the plain memory index and of the one with a departure
    history (naming a namespace), in alternating rounds: two rows."""
    got: dict[str, tuple[list[float], float]] = {}
    for _ in range(ROUNDS):
        for name, address, op in (
            ("memory-a", memory, "lookup"),
            ("memory-history", history, "lookup-ns"),
        ):
            lat, elapsed = run_clients(pool, [address], op, keys, seconds / ROUNDS, warmup_s)
            had, took = got.get(name, ([], 0.0))
            got[name] = (had + lat, took + elapsed)
    return [row(name, "lookup", keys, lat, elapsed) for name, (lat, elapsed) in got.items()]


_SPACES = itertools.count(1)  # a fresh key space per worker run: puts never collide


def raw_redis(
    port: int, epoch: bytes, keys: int, seconds: float, warmup_s: float
) -> list[dict[str, Any]]:
    """The same work as plain pipelines from one redis-py client (hiredis), on
    the index's own layout: a chunk is a field of its bucket's hash."""
    r = redis.Redis(port=port)
    lease = f"{PREFIX}:n:{{{NODE_ID}}}"
    bits = int(r.hget(f"{PREFIX}:cfg", "bucket_bits") or DEFAULT_BUCKET_BITS)
    ours, theirs = Buckets(PREFIX, bits), Buckets("raw", bits)
    windows = [
        [(ours.bucket(k), ours.field(k)) for k in (key_of(0, w * keys + i) for i in range(keys))]
        for w in range(INVENTORY_WINDOWS)
    ]
    value = CHUNK_BYTES.to_bytes(6, "little") + int(epoch).to_bytes(6, "little") + b"\x01"

    def lookup(i: int) -> None:
        pipe = r.pipeline(transaction=False)
        for bucket, field in windows[i % INVENTORY_WINDOWS]:
            pipe.hget(bucket, field)
        pipe.hmget(lease, "epoch", "address")
        out = pipe.execute()
        assert all(out[:keys])

    def put(i: int) -> None:
        new = [key_of(99, i * keys + j) for j in range(keys)]
        pipe = r.pipeline(transaction=False)
        for k in new:
            pipe.set(theirs.pending(k), NODE_ID, nx=True, px=30_000)
        pipe.execute()
        pipe = r.pipeline(transaction=False)
        for k in new:
            pipe.hset(theirs.bucket(k), theirs.field(k), value)
            pipe.delete(theirs.pending(k))
        pipe.execute()

    rows = []
    for op, fn in (("lookup", lookup), ("put", put)):
        lat, elapsed = timed_loop(fn, seconds, warmup_s)
        rows.append(row("raw-redis", op, keys, lat, elapsed))
    r.close()
    return rows


# -- main ---------------------------------------------------------------------
def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Start everything, run every row, and return rows plus a summary."""
    keys, seconds, warmup = args.keys, args.seconds, args.warmup
    inventory = keys * INVENTORY_WINDOWS
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvdepot-bench-") as tmp_s:
        tmp = Path(tmp_s)
        with contextlib.ExitStack() as stack:
            port = stack.enter_context(redis_server(tmp))
            url = f"redis://127.0.0.1:{port}/0?prefix={PREFIX}"
            memory = stack.enter_context(metadata_service("memory://", tmp / "memory.log"))
            history = stack.enter_context(metadata_service("memory://", tmp / "history.log"))
            replica1 = stack.enter_context(metadata_service(url, tmp / "redis-1.log"))
            replica2 = stack.enter_context(metadata_service(url, tmp / "redis-2.log"))
            # (Filling takes longer than a lease: the bench node registers after.)
            departures = fill_history(history, args.history_nodes)
            register(memory, inventory)
            register(history, inventory)
            register(replica1, inventory)  # shared: replica 2 sees it too
            beats = Heartbeats([memory, history, replica1])
            beats.start()
            stack.callback(beats.stop)
            pool = stack.enter_context(procs.pool(mp.get_context("spawn"), 2))

            plan = [
                ("memory", [memory]),
                ("redis", [replica1]),
                ("redis-2-replicas", [replica1, replica2]),
            ]
            for op in ("lookup", "put"):
                for backend, addresses in plan:
                    lat, elapsed = run_clients(pool, addresses, op, keys, seconds, warmup)
                    rows.append(row(backend, op, keys, lat, elapsed))
                    log(args, rows[-1])
            lat, elapsed = run_clients(pool, [memory], "health", keys, seconds, warmup)
            rows.append(row("grpc-floor", "health", 0, lat, elapsed))
            log(args, rows[-1])
            for r in alternating(pool, memory, history, keys, seconds, warmup):
                rows.append(r)
                log(args, r)
            with redis.Redis(port=port) as rc:
                found = rc.hget(f"{PREFIX}:n:{{{NODE_ID}}}", "epoch")
            epoch = found if isinstance(found, bytes) else b"0"
            for r in raw_redis(port, epoch, keys, seconds, warmup):
                rows.append(r)
                log(args, r)

    summary = summarize(rows)
    summary["history"]["departures"] = departures
    return {
        "config": {
            "history_nodes": args.history_nodes,
            "keys": keys,
            "seconds": seconds,
            "warmup_s": warmup,
            "inventory": inventory,
            "cpus": os.cpu_count(),
        },
        "rows": rows,
        "summary": summary,
    }


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The ratios of the rows."""

    def get(backend: str, op: str) -> dict[str, Any]:
        return next(r for r in rows if r["backend"] == backend and r["op"] == op)

    floor = get("grpc-floor", "health")
    summary: dict[str, Any] = {"grpc_floor": {"p50_ms": floor["p50_ms"], "p99_ms": floor["p99_ms"]}}
    for op in ("lookup", "put"):
        redis_row, raw, mem = get("redis", op), get("raw-redis", op), get("memory", op)
        two = get("redis-2-replicas", op)
        summary[op] = {
            "redis_p99_over_raw_p99": round(redis_row["p99_ms"] / max(raw["p99_ms"], 1e-9), 2),
            "redis_p50_over_raw_p50": round(redis_row["p50_ms"] / max(raw["p50_ms"], 1e-9), 2),
            "memory_p99_ms": mem["p99_ms"],
            "throughput_2_replicas_over_1": round(
                two["ops_per_s"] / max(redis_row["ops_per_s"], 1e-9), 2
            ),
        }
    plain, kept = get("memory-a", "lookup"), get("memory-history", "lookup")
    summary["history"] = {
        "history_p50_over_plain_p50": round(kept["p50_ms"] / max(plain["p50_ms"], 1e-9), 3),
        "history_p99_over_plain_p99": round(kept["p99_ms"] / max(plain["p99_ms"], 1e-9), 3),
    }
    return summary


def log(args: argparse.Namespace, r: dict[str, Any]) -> None:
    """Progress on stderr (table mode only)."""
    if not args.json:
        print(f"  measured {r['backend']:>16} {r['op']:<6}", file=sys.stderr, flush=True)


def render(result: dict[str, Any]) -> str:
    """The result as a table and a summary, for humans."""
    head = f"{'backend':<18} {'op':<7} {'keys':>5} {'p50_ms':>8} {'p99_ms':>8} {'ops_per_s':>10}"
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        lines.append(
            f"{r['backend']:<18} {r['op']:<7} {r['keys']:>5} {r['p50_ms']:>8.3f} "
            f"{r['p99_ms']:>8.3f} {r['ops_per_s']:>10.1f}"
        )
    lines.append("")
    cpus = result["config"]["cpus"] or 0
    if cpus < 6:
        # Two replicas, their two client processes and Redis need ~5 cores.
        lines.append(f"note: {cpus} CPUs only: the redis-2-replicas rows cannot scale here")
    floor = result["summary"]["grpc_floor"]
    lines.append(
        f"grpc floor (empty health check, same process and client): "
        f"p50 {floor['p50_ms']} ms, p99 {floor['p99_ms']} ms"
    )
    h = result["summary"]["history"]
    lines.append(
        f"departure history ({h['departures']} departures) and a namespace on the request: "
        f"lookup p50 {h['history_p50_over_plain_p50']}x, p99 {h['history_p99_over_plain_p99']}x "
        f"the plain memory index's (alternating rounds)"
    )
    for op in ("lookup", "put"):
        s = result["summary"][op]
        lines.append(
            f"{op}: redis p99 / raw p99 = {s['redis_p99_over_raw_p99']}x, "
            f"p50 ratio {s['redis_p50_over_raw_p50']}x; memory p99 = {s['memory_p99_ms']} ms; "
            f"2 replicas / 1 = {s['throughput_2_replicas_over_1']}x ops/s"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line entry point."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="short runs (under a minute in all)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--seconds", type=float, help="measured seconds per row (default 10)")
    p.add_argument("--warmup", type=float, help="unmeasured seconds per row (default 1)")
    p.add_argument("--keys", type=int, default=128, help="keys per request (default 128)")
    p.add_argument(
        "--history-nodes",
        type=int,
        help="departed nodes with a full departure ring each (default 16; --quick 2)",
    )
    args = p.parse_args(argv)
    if args.history_nodes is None:
        args.history_nodes = 2 if args.quick else 16
    if args.seconds is None:
        args.seconds = 2.0 if args.quick else 10.0
    if args.warmup is None:
        args.warmup = 0.3 if args.quick else 1.0
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    procs.stop_on_sigterm()
    result = measure(args)
    print(json.dumps(result) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
