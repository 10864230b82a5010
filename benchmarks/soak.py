"""Load and soak: N client processes x mixed publish / lookup / pull, every byte verified.

A real local cluster (a metadata service and two store daemons, as processes)
with arenas small enough that chunks are evicted all the time, and ``--clients``
client processes, each with its own ``KVDepotClient``, half of them over ``shm``
and half over ``tcp``. Each client runs a random mix for a bounded time:

* ``publish``: a prompt made of one of a few shared system prompts and a
  random suffix, keyed with ``kvdepot.keys.chunk_keys`` as the vLLM
  connector keys it; shared prefixes are deduplicated by the cluster;
* ``lookup``: how many leading chunks of a prompt are cached;
* ``pull``: ``get_into`` buffers poisoned beforehand, then every loaded chunk
  compared byte for byte with what its writer published.

A chunk's bytes are a pure function of its key, so any client verifies any
chunk, whoever published it. A miss (evicted, never published) is fine; a
wrong byte served is not, nor is an exception (``errors``) or a daemon that
died (``crashes``). The daemons' resident memory (``VmRSS`` from
``/proc/<pid>/status``) is sampled after the warm-up (arenas are faulted in
at start) and at the end: it must stay flat, as an arena and caches are all
a daemon holds. ``--ssd-capacity`` adds an SSD tier to each store, so evicted
chunks are demoted to it and promoted back on a hit.

Run: ``python benchmarks/soak.py --seconds 600 --clients 8 --json``. The
exit status is 1 if a wrong byte was served or a daemon crashed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repo root

from benchmarks import procs

KiB = 1 << 10
MiB = 1 << 20
CHUNK_TOKENS = 256
OPS = ("publish", "lookup", "pull")
MIX = (4, 2, 4)  # relative weights of OPS
STORES = 2
RECENT = 32  # prompts a client remembers publishing, to pull them back
ERROR_SAMPLES = 5


# -- workload -----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Workload:
    """The prompt space: prompts are ``(namespace, id)`` pairs any client can rebuild.

    One namespace (a "model") per chunk size, so stores hold chunks of mixed
    sizes, as they do when engines of several models share a cluster.
    """

    chunk_sizes: tuple[int, ...] = (256 * KiB, MiB)
    system_prompts: int = 4
    prefix_chunks: int = 3
    max_suffix_chunks: int = 3
    prompts: int = 4096  # prompt ids per namespace: far more bytes than the arenas hold

    def tokens(self, ns: int, prompt: int) -> np.ndarray:
        """Token ids of prompt ``prompt`` of namespace ``ns``: system prompt, then suffix."""
        system = np.random.default_rng((ns, 0, prompt % self.system_prompts))
        suffix = np.random.default_rng((ns, 1, prompt))
        n_suffix = 1 + prompt % self.max_suffix_chunks
        return np.concatenate(
            [
                system.integers(0, 32000, self.prefix_chunks * CHUNK_TOKENS, dtype=np.uint32),
                suffix.integers(0, 32000, n_suffix * CHUNK_TOKENS, dtype=np.uint32),
            ]
        )


def payload(key: bytes, size: int) -> np.ndarray:
    """A chunk's bytes: a function of its key only, so any reader can check them."""
    rng = np.random.default_rng(int.from_bytes(key, "little"))
    out = np.frombuffer(rng.bytes(size), dtype=np.uint8)
    out.flags.writeable = False
    return out


class PayloadCache:
    """Recently used payloads (system-prompt chunks recur in most prompts)."""

    def __init__(self, budget: int) -> None:
        self._budget = budget
        self._used = 0
        self._items: OrderedDict[bytes, np.ndarray] = OrderedDict()

    def get(self, key: bytes, size: int) -> np.ndarray:
        hit = self._items.get(key)
        if hit is not None:
            self._items.move_to_end(key)
            return hit
        data = payload(key, size)
        self._items[key] = data
        self._used += size
        while self._used > self._budget and len(self._items) > 1:
            _, old = self._items.popitem(last=False)
            self._used -= old.nbytes
        return data


# -- one client process -----------------------------------------------------------
@dataclass(slots=True)
class ClientStats:
    """What one client did in the measured window."""

    client: int
    transport: str
    lat_ms: dict[str, list[float]] = field(default_factory=lambda: {op: [] for op in OPS})
    bytes_put: int = 0
    bytes_got: int = 0
    chunks_stored: int = 0
    chunks_skipped: int = 0
    chunks_put_failed: int = 0
    chunks_hit: int = 0
    chunks_missed: int = 0
    chunks_verified: int = 0  # these three count the warm-up too: no wrong byte goes unseen
    bytes_verified: int = 0
    wrong_chunks: int = 0
    wrong_bytes: int = 0
    lookup_hits: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)


class _Mix:
    """One client's state for the op mix: its client, payloads, buffers and stats."""

    def __init__(self, client: Any, work: Workload, stats: ClientStats) -> None:
        from kvdepot.keys import Namespace, chunk_keys

        self.client = client
        self.work = work
        self.chunk_keys = chunk_keys
        self.namespaces = [
            Namespace(f"kvdepot-soak/model-{n}", chunk_tokens=CHUNK_TOKENS)
            for n in range(len(work.chunk_sizes))
        ]
        self.stats = stats
        self.rng = random.Random(1000 + stats.client)
        self.cache = PayloadCache(32 * MiB)
        self.recent: deque[tuple[int, int]] = deque(maxlen=RECENT)
        most = work.prefix_chunks + work.max_suffix_chunks
        self.bufs = [np.empty(max(work.chunk_sizes), dtype=np.uint8) for _ in range(most)]

    def pick(self, fresh: float) -> tuple[int, int]:
        if self.recent and self.rng.random() >= fresh:
            return self.rng.choice(self.recent)
        return self.rng.randrange(len(self.namespaces)), self.rng.randrange(self.work.prompts)

    def step(self, measured: bool) -> None:
        """One op of the mix; its latency counted when ``measured``."""
        op = self.rng.choices(OPS, MIX)[0]
        ns, prompt = self.pick(0.7 if op == "publish" else 0.4)
        size = self.work.chunk_sizes[ns]
        keys = self.chunk_keys(self.namespaces[ns], self.work.tokens(ns, prompt))
        stats = self.stats
        try:
            if op == "publish":
                dt = self.publish(keys, size, measured)
                self.recent.append((ns, prompt))
            elif op == "lookup":
                dt = self.lookup(keys, measured)
            else:
                dt = self.pull(keys, size, ns, measured)
            if measured:
                stats.lat_ms[op].append(dt * 1e3)
        except Exception as exc:
            stats.errors += 1
            if len(stats.error_samples) < ERROR_SAMPLES:
                stats.error_samples.append(f"{op}: {type(exc).__name__}: {exc}")
            time.sleep(0.05)  # a failing cluster must not turn into a busy loop

    def publish(self, keys: Sequence[bytes], size: int, measured: bool) -> float:
        data = [self.cache.get(k, size) for k in keys]
        t0 = time.perf_counter()
        put = self.client.put(keys, data)
        dt = time.perf_counter() - t0
        if measured:
            self.stats.bytes_put += put.bytes_sent
            self.stats.chunks_stored += put.stored
            self.stats.chunks_skipped += put.skipped
            self.stats.chunks_put_failed += put.failed
        return dt

    def lookup(self, keys: Sequence[bytes], measured: bool) -> float:
        t0 = time.perf_counter()
        hits = self.client.lookup(keys)
        dt = time.perf_counter() - t0
        if not 0 <= hits <= len(keys):
            raise AssertionError(f"lookup of {len(keys)} keys answered {hits} hits")
        if measured:
            self.stats.lookup_hits += hits
        return dt

    def pull(self, keys: Sequence[bytes], size: int, ns: int, measured: bool) -> float:
        stats = self.stats
        views = [b[:size] for b in self.bufs[: len(keys)]]
        for v in views:
            v.fill(0xA5)  # poison: a chunk reported loaded must have been written
        t0 = time.perf_counter()
        got = self.client.get_into(keys, views)
        dt = time.perf_counter() - t0
        for k, v, ok in zip(keys, views, got.loaded, strict=True):
            if not ok:
                stats.chunks_missed += measured
                continue
            stats.chunks_hit += measured
            want = self.cache.get(k, size)
            stats.chunks_verified += 1
            stats.bytes_verified += size
            if not np.array_equal(v, want):
                stats.wrong_chunks += 1
                stats.wrong_bytes += int(np.count_nonzero(v != want))
                if len(stats.error_samples) < ERROR_SAMPLES:
                    stats.error_samples.append(
                        f"wrong bytes in chunk {k.hex()} ({stats.transport}, ns {ns})"
                    )
        if measured:
            stats.bytes_got += got.bytes_received
        return dt


def client_main(
    idx: int,
    metadata: str,
    node_id: str,
    transport: str,
    work: Workload,
    window: Any,
    go: Any,
    results: Any,
) -> None:
    """Run the mix from the start signal until the window's end; put stats on ``results``."""
    from kvdepot.connector.client import ClientConfig, KVDepotClient

    stats = ClientStats(idx, transport)
    try:
        config = ClientConfig(
            metadata=metadata,
            node_id=node_id,
            transport=transport,
            tokens_per_chunk=CHUNK_TOKENS,
        )
        client = KVDepotClient(config)
        mix = _Mix(client, work, stats)
        if not go.wait(300):
            raise TimeoutError("no start signal")
        measure_from, end = window[0], window[1]
    except BaseException:
        stats.errors += 1
        stats.error_samples.append(traceback.format_exc(limit=3))
        results.put(asdict(stats))
        return

    with client:
        while (now := time.time()) < end:
            mix.step(now >= measure_from)
    results.put(asdict(stats))


# -- daemons' memory -----------------------------------------------------------------
def read_rss(pid: int) -> dict[str, float]:
    """VmRSS and its anonymous / shared-memory parts of ``pid``, in MiB ({} if gone)."""
    out: dict[str, float] = {}
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssShmem"):
                out[key] = int(value.split()[0]) / 1024
    return out


def slope_mb_per_min(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB) samples, in MiB per minute."""
    if len(samples) < 3:
        return 0.0
    t = np.array([s[0] for s in samples])
    y = np.array([s[1] for s in samples])
    if float(np.ptp(t)) == 0.0:
        return 0.0
    return float(np.polyfit(t, y, 1)[0] * 60)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank ``q`` quantile (0..1); 0 for no samples."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def log_problems(log_dir: Path, limit: int = 5) -> tuple[int, list[str]]:
    """Count ERROR / CRITICAL / Traceback lines in the daemons' logs; a few samples."""
    count = 0
    samples: list[str] = []
    for path in sorted(log_dir.glob("*.log")):
        with open(path, errors="replace") as f:
            for line in f:
                if "ERROR" in line or "CRITICAL" in line or line.startswith("Traceback"):
                    count += 1
                    if len(samples) < limit:
                        samples.append(f"{path.stem}: {line.strip()[:300]}")
    return count, samples


# -- the run ---------------------------------------------------------------------------
class _Daemons:
    """The cluster's daemons as the run watches them: crashes and resident memory."""

    def __init__(self, cluster: Any, say: Any) -> None:
        self.daemons = {"metadata": cluster.metadata, **{s.name: s for s in cluster.stores}}
        self.pids = {name: d.pid for name, d in self.daemons.items() if d is not None}
        self.say = say
        self.crashed: dict[str, int | None] = {}
        self.timeline: dict[str, list[tuple[float, float]]] = {n: [] for n in self.pids}
        self.rss_start: dict[str, float] = {}
        self.rss_end: dict[str, float] = {}
        self.rss_max: dict[str, float] = dict.fromkeys(self.pids, 0.0)

    def check(self) -> None:
        for name, d in self.daemons.items():
            if d is not None and name not in self.crashed and d.proc.poll() is not None:
                self.crashed[name] = d.proc.returncode
                self.say(f"soak: daemon {name} died with status {d.proc.returncode}")

    def sample(self, t: float) -> dict[str, float]:
        now = {}
        for name, pid in self.pids.items():
            rss = read_rss(pid).get("VmRSS", 0.0)
            now[name] = rss
            self.rss_max[name] = max(self.rss_max[name], rss)
            self.timeline[name].append((t, rss))
        return now


def _start_cluster(args: argparse.Namespace, log_dir: Path) -> tuple[Any, str]:
    """The metadata service and ``STORES`` stores, each with its own SSD directory."""
    from kvdepot.apps.cluster import wait_nodes

    cluster = procs.Cluster(
        nodes=0, capacity=args.capacity, log_dir=log_dir, lease_ttl_s=5.0, heartbeat_interval_s=1.0
    )
    cluster.start()
    ssd_root = tempfile.mkdtemp(prefix="kvdepot-soak-ssd-")
    try:
        for i in range(STORES):
            # Each store its own SSD directory, when there is an SSD tier.
            ssd = ["--ssd-dir", f"{ssd_root}/ssd-{i}", "--ssd-capacity", args.ssd_capacity]
            cluster.add_store(f"store-{i}", *(ssd if args.ssd_capacity else []))
        wait_nodes(cluster.metadata_address, STORES)
    except BaseException:
        cluster.stop()
        shutil.rmtree(ssd_root, ignore_errors=True)
        raise
    return cluster, ssd_root


def _watch(args: argparse.Namespace, watched: _Daemons, window: Any) -> None:
    """Sample the daemons through the measured window; progress once a minute."""
    time.sleep(max(0.0, window[0] - time.time()))
    watched.check()
    watched.rss_start = watched.sample(0.0)
    next_report = time.time() + 60
    while (left := window[1] - time.time()) > 0:
        time.sleep(min(args.sample_s, left))
        watched.check()
        watched.sample(time.time() - window[0])
        if time.time() >= next_report:
            next_report += 60
            rss = ", ".join(f"{n} {watched.timeline[n][-1][1]:.0f}" for n in watched.pids)
            watched.say(f"soak: {time.time() - window[0]:.0f} s, RSS MiB {rss}")


def _collect(args: argparse.Namespace, clients: list[Any], results: Any) -> list[dict[str, Any]]:
    """The clients' reports, waiting a bounded time for the slow ones."""
    reports: list[dict[str, Any]] = []
    deadline = time.time() + 120 + 2 * args.seconds / 60
    while len(reports) < len(clients) and time.time() < deadline:
        with contextlib.suppress(Exception):
            reports.append(results.get(timeout=1.0))
        if all(not p.is_alive() for p in clients) and results.empty():
            break
    return reports


def _tier_moves(metadata: str, moves: dict[str, int]) -> dict[str, int]:
    """Evictions, demotions and promotions summed over stores and tiers (``moves`` if none)."""
    from kvdepot.connector.client import ClientConfig, KVDepotClient

    with (
        contextlib.suppress(Exception),
        KVDepotClient(ClientConfig(metadata=metadata)) as c,
    ):
        tiers = [t for n in c.stats().nodes for t in n.tiers]
        moves = {k: sum(getattr(t, k) for t in tiers) for k in moves}
    return moves


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the cluster and the clients, run, and return the report."""
    from kvdepot.config import parse_size

    work = Workload(chunk_sizes=tuple(parse_size(s) for s in args.chunk_sizes.split(",")))
    transports = args.transports.split(",")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvdepot-soak-"))

    def say(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    cluster, ssd_root = _start_cluster(args, log_dir)
    watched = _Daemons(cluster, say)
    ctx = mp.get_context("spawn")
    go, results = ctx.Event(), ctx.Queue()
    window = ctx.Array("d", 2)
    clients = []
    reports: list[dict[str, Any]] = []
    moves = {"evictions": 0, "demotions": 0, "promotions": 0}  # summed over stores and tiers
    try:
        for i in range(args.clients):
            store = cluster.stores[i % len(cluster.stores)]
            p = procs.process(
                ctx, client_main,
                (i, cluster.metadata_address, store.info["node_id"],
                 transports[i % len(transports)], work, window, go, results),
                daemon=True,
            )  # fmt: skip
            p.start()
            clients.append(p)
        say(f"soak: {args.clients} clients, {args.seconds:.0f} s after {args.warmup:.0f} s "
            f"warm-up, arenas {args.capacity} x {STORES}, logs in {log_dir}")  # fmt: skip
        start = time.time() + 2.0  # clients finish importing meanwhile
        window[0], window[1] = start + args.warmup, start + args.warmup + args.seconds
        go.set()
        _watch(args, watched, window)
        reports = _collect(args, clients, results)
        watched.check()
        watched.rss_end = watched.sample(time.time() - window[0])
        moves = _tier_moves(cluster.metadata_address, moves)
    finally:
        for p in clients:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        watched.check()
        cluster.stop()
        shutil.rmtree(ssd_root, ignore_errors=True)
    result = _report(args, work, transports, reports, len(clients), watched, moves, log_dir)
    clean = not (watched.crashed or result["wrong_bytes"] or result["daemon_log_errors"])
    if not args.log_dir and clean:
        shutil.rmtree(log_dir, ignore_errors=True)
        result["log_dir"] = None
    return result


def _memory_verdict(
    args: argparse.Namespace, watched: _Daemons
) -> tuple[dict[str, float], bool, str]:
    """Each daemon's RSS growth over the window, whether that is flat, and why."""
    pids, rss_start, rss_end = watched.pids, watched.rss_start, watched.rss_end
    growth = {n: round(rss_end.get(n, 0.0) - rss_start.get(n, 0.0), 1) for n in pids}
    # Flat: an arena and bounded caches. Allow the allocator's slack, not a trend.
    allowed = {n: max(args.rss_slack_mb, 0.05 * rss_start.get(n, 0.0)) for n in pids}
    flat = all(growth[n] <= allowed[n] for n in pids)
    if flat:
        verdict = "flat: each daemon within " + ", ".join(f"{n} {allowed[n]:.0f}" for n in pids)
        verdict += " MiB of its start"
    else:
        verdict = "GROWING: " + ", ".join(
            f"{n} +{growth[n]:.0f} MiB" for n in pids if growth[n] > allowed[n]
        )
    return growth, flat, verdict


def _latency(reports: list[dict[str, Any]], elapsed: float) -> dict[str, Any]:
    """Op counts, rate and latency quantiles: over all ops and per op."""
    lat = {op: [x for r in reports for x in r["lat_ms"][op]] for op in OPS}
    every = [x for op in OPS for x in lat[op]]
    return {
        "ops": len(every),
        "ops_per_s": round(len(every) / elapsed, 1),
        "p50_ms": round(percentile(every, 0.50), 2),
        "p99_ms": round(percentile(every, 0.99), 2),
        "per_op": {
            op: {
                "ops": len(lat[op]),
                "ops_per_s": round(len(lat[op]) / elapsed, 1),
                "p50_ms": round(percentile(lat[op], 0.50), 2),
                "p99_ms": round(percentile(lat[op], 0.99), 2),
                "max_ms": round(max(lat[op], default=0.0), 2),
            }
            for op in OPS
        },
    }


def _run_config(args: argparse.Namespace, work: Workload, transports: list[str]) -> dict[str, Any]:
    return {
        "seconds": args.seconds,
        "warmup_s": args.warmup,
        "clients": args.clients,
        "transports": [transports[i % len(transports)] for i in range(args.clients)],
        "stores": STORES,
        "capacity_per_store": args.capacity,
        "ssd_capacity_per_store": args.ssd_capacity or None,
        "chunk_sizes": list(work.chunk_sizes),
        "chunk_tokens": CHUNK_TOKENS,
        "system_prompts": work.system_prompts,
        "prompt_ids_per_namespace": work.prompts,
        "mix": dict(zip(OPS, MIX, strict=True)),
        "cpus": os.cpu_count(),
    }


def _report(
    args: argparse.Namespace,
    work: Workload,
    transports: list[str],
    reports: list[dict[str, Any]],
    clients_started: int,
    watched: _Daemons,
    moves: dict[str, int],
    log_dir: Path,
) -> dict[str, Any]:
    """The run's report from the clients' stats and the daemons' watch."""
    elapsed = args.seconds
    total = {k: sum(r[k] for r in reports) for k in (
        "bytes_put", "bytes_got", "chunks_stored", "chunks_skipped", "chunks_put_failed",
        "chunks_hit", "chunks_missed", "chunks_verified", "bytes_verified", "wrong_chunks",
        "wrong_bytes",
        "lookup_hits", "errors")}  # fmt: skip
    lost_clients = clients_started - len(reports)
    samples = [s for r in reports for s in r["error_samples"]][:10]
    if lost_clients:
        samples.append(f"{lost_clients} client process(es) ended without a report")
    log_count, log_samples = log_problems(log_dir)
    growth, flat, verdict = _memory_verdict(args, watched)
    latency = _latency(reports, elapsed)
    return {
        "ops": latency["ops"],
        "ops_per_s": latency["ops_per_s"],
        "gbps": round((total["bytes_put"] + total["bytes_got"]) / elapsed / 1e9, 4),
        "put_gbps": round(total["bytes_put"] / elapsed / 1e9, 4),
        "get_gbps": round(total["bytes_got"] / elapsed / 1e9, 4),
        "p50_ms": latency["p50_ms"],
        "p99_ms": latency["p99_ms"],
        "per_op": latency["per_op"],
        "errors": total["errors"] + lost_clients,
        "error_samples": samples,
        "wrong_bytes": total["wrong_bytes"],
        "wrong_chunks": total["wrong_chunks"],
        "chunks_verified": total["chunks_verified"],
        "bytes_verified": total["bytes_verified"],
        "chunks_hit": total["chunks_hit"],
        "misses": total["chunks_missed"],
        "chunks_stored": total["chunks_stored"],
        "chunks_deduplicated": total["chunks_skipped"],
        "chunks_put_failed": total["chunks_put_failed"],
        "lookup_hit_chunks": total["lookup_hits"],
        **moves,
        "crashes": len(watched.crashed),
        "crashed_daemons": watched.crashed,
        "daemon_log_errors": log_count,
        "daemon_log_samples": log_samples,
        "daemon_rss_start_mb": {n: round(v, 1) for n, v in watched.rss_start.items()},
        "daemon_rss_end_mb": {n: round(v, 1) for n, v in watched.rss_end.items()},
        "daemon_rss_max_mb": {n: round(v, 1) for n, v in watched.rss_max.items()},
        "daemon_rss_growth_mb": growth,
        "daemon_rss_slope_mb_per_min": {
            n: round(slope_mb_per_min(watched.timeline[n]), 3) for n in watched.pids
        },
        "memory_flat": flat,
        "memory_verdict": verdict,
        "config": _run_config(args, work, transports),
        "log_dir": str(log_dir),
    }


def render(r: dict[str, Any]) -> str:
    """The report, for humans."""
    lines = [
        f"ops {r['ops']} ({r['ops_per_s']}/s), {r['gbps']} GB/s "
        f"(put {r['put_gbps']}, get {r['get_gbps']}), p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms",
    ]
    for op, s in r["per_op"].items():
        lines.append(
            f"  {op:<8} {s['ops']:>8} ops  p50 {s['p50_ms']:>8} ms  p99 {s['p99_ms']:>8} ms"
        )
    lines += [
        f"verified {r['chunks_verified']} chunks ({r['bytes_verified'] / MiB:.0f} MiB): "
        f"wrong bytes {r['wrong_bytes']} in {r['wrong_chunks']} chunks; misses {r['misses']}",
        f"stored {r['chunks_stored']}, deduplicated {r['chunks_deduplicated']}, put failed "
        f"{r['chunks_put_failed']}, evictions {r['evictions']}, demotions {r['demotions']}, "
        f"promotions {r['promotions']}",
        f"errors {r['errors']}, daemon crashes {r['crashes']}, daemon log errors "
        f"{r['daemon_log_errors']}",
    ]
    for s in r["error_samples"] + r["daemon_log_samples"]:
        lines.append(f"  {s}")
    for n in r["daemon_rss_start_mb"]:
        lines.append(
            f"RSS {n:<9} start {r['daemon_rss_start_mb'][n]:7.1f} MiB  end "
            f"{r['daemon_rss_end_mb'].get(n, 0.0):7.1f} MiB  max {r['daemon_rss_max_mb'][n]:7.1f}"
            f"  slope {r['daemon_rss_slope_mb_per_min'][n]:+.2f} MiB/min"
        )
    lines.append(f"memory {r['memory_verdict']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line entry point; exit status 1 on a wrong byte served or a daemon crash."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--seconds", type=float, default=60.0, help="measured seconds (default 60)")
    p.add_argument("--clients", type=int, default=4, help="client processes (default 4)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--warmup", type=float, help="unmeasured seconds first (default 10%%, 2-30)")
    p.add_argument("--capacity", default="64MiB", help="DRAM arena per store (default 64MiB)")
    p.add_argument("--ssd-capacity", help="add an SSD tier of this size per store (default none)")
    p.add_argument("--chunk-sizes", default="256KiB,1MiB", help="one namespace per size")
    p.add_argument("--transports", default="shm,tcp", help="assigned to clients in turn")
    p.add_argument("--sample-s", type=float, default=5.0, help="RSS sampling period")
    p.add_argument("--rss-slack-mb", type=float, default=16.0, help="growth still called flat")
    p.add_argument("--log-dir", help="keep the daemons' logs here")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = p.parse_args(argv)
    if args.seconds <= 0 or args.clients < 1:
        p.error("--seconds must be positive and --clients at least 1")
    if args.warmup is None:
        args.warmup = min(30.0, max(2.0, args.seconds / 10))
    procs.stop_on_sigterm()
    result = run(args)
    print(json.dumps(result) if args.json else render(result))
    return 1 if result["wrong_bytes"] or result["crashes"] else 0


if __name__ == "__main__":
    sys.exit(main())
