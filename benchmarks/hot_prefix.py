"""Hot prefix: 16 readers on 4 nodes pull one shared prefix, with and without hot replication.

A :class:`~kvdepot.apps.cluster.LocalCluster` of 4 stores is started once per
mode (fresh each time, in the same run): ``replicated`` (the metadata
service's hot-chunk replication on: ``KVDEPOT_METADATA_HOT_READS`` =
``--hot-reads``, ``KVDEPOT_METADATA_HOT_MAX_REPLICAS`` = ``--hot-max-replicas``)
and ``single`` (``KVDEPOT_METADATA_HOT_READS=0``: the prefix keeps its one
replica). A writer on ``store-0`` publishes the prefix (``--chunks`` chunks of
``--chunk-kib`` KiB); then 16 reader processes, 4 per node, each with
``ClientConfig(node_id="store-<n>")`` (the readers on ``store-0`` read their
own node's copy), ``get_into`` the whole prefix over and over: unmeasured for
``--warmup`` seconds (the replicas are made then), then measured for
``--seconds``, all readers in the same wall-clock window. Each read is
checked: every chunk loaded, and a sample of bytes of each chunk (poisoned
before the read) equal to the published ones; after its window each reader
compares its last read whole.

Per mode: aggregate GB/s (bytes loaded in the window by all readers / the
window's wall time, up to the end of the last read), p50/p99 latency of one
read of the whole prefix, replicas per chunk at the window's start and end
(``lookup_locations``), and the bytes each store sent during the window. All
processes share this host's CPUs (16 readers and 5 daemons): both modes see
the same contention, which the output states. On one host every read, a
local one too, crosses loopback (``tcp``) or shared memory (``shm``):
replication spreads the serving over stores; it moves no fewer bytes.

Usage::

    python benchmarks/hot_prefix.py [--quick] [--json] [--seconds S] [--transport tcp]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import signal
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repo root

from benchmarks import procs
from kvdepot.apps.cluster import LocalCluster
from kvdepot.connector.client import ClientConfig, KVDepotClient
from kvdepot.proto.gen import store_pb2, store_pb2_grpc

NODES = 4
READERS_PER_NODE = 4
WRITER_NODE = "store-0"
SAMPLE_STRIDE = 4093  # bytes of each chunk checked per read: one every this many
READY_TIMEOUT_S = 180.0
MODES = ("replicated", "single")


@dataclass(frozen=True, slots=True)
class Job:
    """What one reader process does."""

    metadata: str
    node: str
    transport: str
    chunks: int
    chunk_bytes: int
    seed: int
    seconds: float


# -- data -----------------------------------------------------------------------
def prefix(chunks: int, chunk_bytes: int, seed: int) -> tuple[list[bytes], np.ndarray]:
    """The prefix's keys and its bytes (one row per chunk), the same in every process."""
    rng = np.random.default_rng(seed)
    keys = [rng.bytes(16) for _ in range(chunks)]
    data = np.frombuffer(rng.bytes(chunks * chunk_bytes), dtype=np.uint8)
    return keys, data.reshape(chunks, chunk_bytes)


def percentile(sorted_ms: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of already sorted samples, nearest rank."""
    if not sorted_ms:
        return 0.0
    return sorted_ms[min(len(sorted_ms) - 1, int(q * len(sorted_ms)))]


# -- reader processes -----------------------------------------------------------
def reader(job: Job, idx: int, go: Any, start_at: Any, ready: Any, results: Any) -> None:
    """One reader: connect, wait for the common start, warm up, measure, report
    (started by :func:`benchmarks.procs.process`: it dies with the benchmark)."""
    try:
        results.put(_read_loop(job, idx, go, start_at, ready))
    except BaseException:
        failure = {"idx": idx, "node": job.node, "error": traceback.format_exc()}
        ready.put(failure)  # whichever the benchmark waits on
        results.put(failure)


def _read_loop(job: Job, idx: int, go: Any, start_at: Any, ready: Any) -> dict[str, Any]:
    keys, data = prefix(job.chunks, job.chunk_bytes, job.seed)
    expected = np.ascontiguousarray(data[:, ::SAMPLE_STRIDE])
    poison = ~expected
    buf = np.zeros_like(data)
    views = list(buf)
    config = ClientConfig(metadata=job.metadata, node_id=job.node, transport=job.transport)
    with KVDepotClient(config) as client:

        def read_once() -> tuple[bool, bool]:
            buf[:, ::SAMPLE_STRIDE] = poison
            got = client.get_into(keys, views)
            loaded = all(got.loaded)
            return loaded, loaded and np.array_equal(buf[:, ::SAMPLE_STRIDE], expected)

        ready.put(idx)
        if not go.wait(READY_TIMEOUT_S):
            raise TimeoutError("no start signal")
        t0 = start_at.value
        warm = 0
        while warm == 0 or time.time() < t0:  # at least one read before the window
            read_once()
            warm += 1
        lat: list[float] = []
        misses = bad = 0
        end = t0 + job.seconds
        while time.time() < end:
            s = time.perf_counter()
            loaded, ok = read_once()
            lat.append((time.perf_counter() - s) * 1000)
            misses += not loaded
            bad += loaded and not ok
        last_end = time.time()
        loaded, _ = read_once()
        whole_ok = loaded and np.array_equal(buf, data)
    return {
        "idx": idx,
        "node": job.node,
        "lat_ms": lat,
        "bytes": (len(lat) - misses - bad) * data.nbytes,
        "misses": misses,
        "bad": bad,
        "whole_ok": whole_ok,
        "warmup_reads": warm,
        "last_end": last_end,
    }


# -- cluster side ---------------------------------------------------------------
def publish(metadata: str, transport: str, keys: list[bytes], data: np.ndarray) -> None:
    """Put the prefix on ``store-0`` and check that it is there alone."""
    config = ClientConfig(metadata=metadata, node_id=WRITER_NODE, transport=transport)
    with KVDepotClient(config) as writer:
        stored = writer.put(keys, list(data)).stored
        if stored != len(keys):
            raise RuntimeError(f"the writer stored {stored} of {len(keys)} chunks")
        holders = replica_nodes(writer, keys)
    if any(h != [WRITER_NODE] for h in holders):
        raise RuntimeError(f"the prefix is not on {WRITER_NODE} alone: {holders}")


def replica_nodes(client: KVDepotClient, keys: list[bytes]) -> list[list[str]]:
    reply = client.lookup_locations(keys, count="none")
    found = [sorted(r.node_id for r in loc.replicas) for loc in reply.locations]
    return found + [[] for _ in range(len(keys) - len(found))]


def bytes_out(cluster: LocalCluster) -> dict[str, int]:
    """Bytes each store has sent so far."""
    out: dict[str, int] = {}
    for s in cluster.stores:
        with grpc.insecure_channel(s.info["grpc_address"]) as ch:
            stats = store_pb2_grpc.StoreStub(ch).GetStats(store_pb2.StoreStatsRequest(), timeout=5)
        out[s.name] = int(stats.bytes_out)
    return out


def collect(readers: list[Any], q: Any, count: int, timeout_s: float, what: str) -> list[Any]:
    """``count`` items from ``q``; fail if a process dies first or it takes too long."""
    got: list[Any] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: {len(got)} of {count} within {timeout_s:.0f} s")
        try:
            item = q.get(timeout=0.5)
        except queue.Empty:
            dead = [p.name for p in readers if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"{what}: reader processes died: {dead}") from None
            continue
        if isinstance(item, dict) and "error" in item:
            raise RuntimeError(f"{what}: reader {item['idx']} failed:\n{item['error']}")
        got.append(item)
    return got


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One fresh cluster, the prefix published, 16 readers measured; raw results."""
    hot_reads = args.hot_reads if mode == "replicated" else 0
    env = {
        **os.environ,
        "KVDEPOT_METADATA_HOT_READS": str(hot_reads),
        "KVDEPOT_METADATA_HOT_MAX_REPLICAS": str(args.hot_max_replicas),
    }
    chunk_bytes = args.chunk_kib << 10
    keys, data = prefix(args.chunks, chunk_bytes, args.seed)
    ctx = mp.get_context("spawn")
    go, start_at = ctx.Event(), ctx.Value("d", 0.0)
    ready, results = ctx.Queue(), ctx.Queue()
    readers: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="kvdepot-hot-") as tmp:
        cluster = procs.Cluster(
            nodes=NODES, capacity=args.capacity, log_dir=Path(tmp) / "logs", env=env
        )
        try:
            cluster.start()
            address = cluster.metadata_address
            publish(address, args.transport, keys, data)
            for n in range(NODES * READERS_PER_NODE):
                node = f"store-{n // READERS_PER_NODE}"
                job = Job(address, node, args.transport, args.chunks, chunk_bytes, args.seed,
                          args.seconds)  # fmt: skip
                p = procs.process(ctx, reader, (job, n, go, start_at, ready, results),
                                  name=f"reader-{n}@{node}", daemon=True)  # fmt: skip
                p.start()
                readers.append(p)
            collect(readers, ready, len(readers), READY_TIMEOUT_S, f"{mode}: readers ready")
            start_at.value = time.time() + args.warmup
            go.set()
            with KVDepotClient(ClientConfig(metadata=address, transport=args.transport)) as c:
                time.sleep(max(0.0, start_at.value - time.time()))
                at_start, sent0 = replica_nodes(c, keys), bytes_out(cluster)
                limit = args.warmup + args.seconds + 120
                outs = collect(readers, results, len(readers), limit, f"{mode}: reader results")
                at_end, sent1 = replica_nodes(c, keys), bytes_out(cluster)
        finally:
            for p in readers:
                if p.is_alive():
                    p.terminate()
            for p in readers:
                p.join(10)
            cluster.stop()
    return {
        "start_at": start_at.value,
        "readers": outs,
        "replicas_start": at_start,
        "replicas_end": at_end,
        "sent": {k: sent1[k] - sent0[k] for k in sent1},
    }


# -- results --------------------------------------------------------------------
def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's figures over its rounds."""
    readers = [o for r in rounds for o in r["readers"]]
    lat = sorted(x for o in readers for x in o["lat_ms"])
    window = sum(max(o["last_end"] for o in r["readers"]) - r["start_at"] for r in rounds)
    total = sum(o["bytes"] for o in readers)
    per_node: dict[str, list[float]] = {}
    for o in readers:
        per_node.setdefault(o["node"], []).extend(o["lat_ms"])
    last = rounds[-1]
    sent: dict[str, int] = {}
    for r in rounds:
        for k, v in r["sent"].items():
            sent[k] = sent.get(k, 0) + v
    return {
        "gbps": round(total / window / 1e9, 4) if window > 0 else 0.0,
        "bytes": total,
        "window_s": round(window, 3),
        "reads": len(lat),
        "p50_ms": round(percentile(lat, 0.50), 2),
        "p99_ms": round(percentile(lat, 0.99), 2),
        "mean_ms": round(statistics.fmean(lat), 2) if lat else 0.0,
        "p50_ms_by_node": {
            n: round(percentile(sorted(v), 0.5), 2) for n, v in sorted(per_node.items())
        },
        "reads_by_node": {n: len(v) for n, v in sorted(per_node.items())},
        "misses": sum(o["misses"] for o in readers),
        "bad_bytes": sum(o["bad"] for o in readers),
        "whole_ok": all(o["whole_ok"] for o in readers),
        "warmup_reads": sum(o["warmup_reads"] for o in readers),
        "replicas_start": [len(h) for h in last["replicas_start"]],
        "replicas_end": [len(h) for h in last["replicas_end"]],
        "holders_end": sorted({n for h in last["replicas_end"] for n in h}),
        "sent_gib_by_store": {k: round(v / (1 << 30), 2) for k, v in sorted(sent.items())},
    }


def _span(counts: list[int]) -> str:
    lo, hi = min(counts, default=0), max(counts, default=0)
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def _joined(by_node: dict[str, float], fmt: str) -> str:
    return "/".join(fmt.format(v) for _, v in sorted(by_node.items()))


def render(result: dict[str, Any]) -> str:
    cfg = result["config"]
    rows: list[tuple[str, Any]] = [
        ("aggregate GB/s", lambda m: f"{m['gbps']:.3f}"),
        ("read p50 (ms)", lambda m: f"{m['p50_ms']:.1f}"),
        ("read p99 (ms)", lambda m: f"{m['p99_ms']:.1f}"),
        ("reads measured", lambda m: f"{m['reads']:d}"),
        ("window (s)", lambda m: f"{m['window_s']:.2f}"),
        ("replicas/chunk start", lambda m: _span(m["replicas_start"])),
        ("replicas/chunk end", lambda m: _span(m["replicas_end"])),
        ("holders at end", lambda m: ",".join(h.removeprefix("store-") for h in m["holders_end"])),
        ("p50 by node 0/1/2/3 ms", lambda m: _joined(m["p50_ms_by_node"], "{:.0f}")),
        ("GiB sent by store", lambda m: _joined(m["sent_gib_by_store"], "{:.1f}")),
        ("misses / bad bytes", lambda m: f"{m['misses']} / {m['bad_bytes']}"),
        ("last read whole ok", lambda m: "yes" if m["whole_ok"] else "NO"),
    ]
    modes = result["modes"]
    lines = [
        f"hot prefix: {cfg['chunks']} x {cfg['chunk_kib']} KiB on {WRITER_NODE}, "
        f"{cfg['readers']} readers ({READERS_PER_NODE} per node x {NODES} nodes), "
        f"transport {cfg['transport']}, {cfg['seconds']:g} s measured after "
        f"{cfg['warmup']:g} s warm-up, {cfg['rounds']} round(s)",
        f"replicated: hot_reads={cfg['hot_reads']} max_replicas={cfg['hot_max_replicas']}; "
        "single: hot_reads=0",
        f"note: {cfg['cpus']} CPUs shared by {cfg['readers']} readers and {NODES + 1} daemons: "
        "they contend; both modes see the same",
        "",
        f"{'':22s} {'replicated':>16s} {'single':>16s}",
    ]
    for label, cell in rows:
        lines.append(f"{label:22s} {cell(modes['replicated']):>16s} {cell(modes['single']):>16s}")
    lines.append("")
    lines.append(
        f"ratio replicated/single: GB/s x{result['gbps_ratio']:.2f}, "
        f"p99 x{result['p99_ratio']:.2f} (below 1: lower tail latency)"
    )
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 s windows, 2 s warm-up")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--seconds", type=float, help="measured window per mode (default 10)")
    ap.add_argument("--warmup", type=float, help="unmeasured reads first (default 3)")
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--chunk-kib", type=int, default=1024)
    ap.add_argument("--capacity", default="256MiB", help="of each store")
    ap.add_argument("--transport", default="tcp", choices=("tcp", "shm", "auto"))
    ap.add_argument("--hot-reads", type=int, default=8, help="replicated mode's threshold")
    ap.add_argument("--hot-max-replicas", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1, help="alternating mode order per round")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.seconds is None:
        args.seconds = 3.0 if args.quick else 10.0
    if args.warmup is None:
        args.warmup = 2.0 if args.quick else 3.0
    if args.hot_reads < 1 or min(args.chunks, args.chunk_kib, args.rounds) < 1:
        ap.error("--hot-reads, --chunks, --chunk-kib and --rounds must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    # A SIGTERM unwinds like Ctrl-C: readers and daemons are stopped in finally.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    raw: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            print(f"round {r + 1}: {mode} ...", file=sys.stderr, flush=True)
            raw[mode].append(run_mode(mode, args))
    modes = {m: summarize(raw[m]) for m in MODES}
    on, off = modes["replicated"], modes["single"]
    result: dict[str, Any] = {
        "modes": modes,
        "gbps_ratio": round(on["gbps"] / off["gbps"], 3) if off["gbps"] else None,
        "p99_ratio": round(on["p99_ms"] / off["p99_ms"], 3) if off["p99_ms"] else None,
        "config": {
            "nodes": NODES,
            "readers": NODES * READERS_PER_NODE,
            "chunks": args.chunks,
            "chunk_kib": args.chunk_kib,
            "capacity": args.capacity,
            "transport": args.transport,
            "seconds": args.seconds,
            "warmup": args.warmup,
            "rounds": args.rounds,
            "hot_reads": args.hot_reads,
            "hot_max_replicas": args.hot_max_replicas,
            "cpus": os.cpu_count(),
            "quick": args.quick,
            "seed": args.seed,
        },
    }
    print(json.dumps(result) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
