"""Chaos (issue 37): a Redis-indexed cluster under verifying clients and
random faults from a seeded RNG, bounded: about 55-75 s on a 2-core host.

The cluster: one redis-server, two metadata replicas on it (the first run by
LocalCluster, the second by the test), three stores that know both replicas.
The clients, threads of this process, each a KVDepotClient of its own over
both replicas: one per store's node (``node_id``) and one of no node. They
publish fresh prefixes (half of them sharing a head chunk with other
clients' ones), read back their own and each other's, and republish old
ones; every payload is derived from its key, so every chunk read is checked.
The node-0 client only publishes and reads its own fresh prefixes, each op
timed.

The faults, one at a time, each kind at least once, the rest drawn:
SIGKILL of a store or a metadata replica and its restart (a store comes back
empty, on new ports, under its node id; a replica on its port); SIGSTOP of a
store or a replica for a few seconds, then SIGCONT; Redis SIGKILLed and
restarted empty on its port after a few seconds.

What must hold:
1. No wrong byte is ever served: every chunk a ``get_into`` reports loaded
   is exactly its payload (a failed or corrupt read is a miss: allowed).
2. Every daemon runs at the end, and none exited but by the test's hand.
3. Once the faults stop, every store holds what the index names it for
   (held == indexed) within ``CONVERGE_S``.
4. While Redis is down, the node-0 client (its chunks on its own node) fails
   no operation: each put stored or pending, each lookup and ``get_into`` of
   its own chunks a full hit.
Besides, a client raises nothing but a KVDepotError (faults make calls fail,
never crash them), and the run's counts are printed (``-s``) and are in every
failure's message, with the daemons' log tails.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
import pytest

from kvdepot.apps.cluster import DaemonProcess, LocalCluster, exit_reason, wait_nodes
from kvdepot.connector.client import ClientConfig, KVDepotClient
from kvdepot.errors import KVDepotError
from kvdepot.keys import Namespace
from tests.conftest import _redis_binaries, _start_redis, _stop_redis, free_port
from tests.faults.chaos_support import (
    KeyPool,
    MetadataReplica,
    NodeWorker,
    Op,
    OpStats,
    Worker,
    grep_logs,
    log_tails,
)
from tests.faults.support import ReadTally, payload, sentinel_buffers, store_stats

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.redis]

SEED = 37
NS = Namespace("test/chaos", chunk_tokens=16)
CHUNK = 16 << 10
PREFIX_CHUNKS = 4
STORES = 3
CAPACITY = "16MiB"
"""1024 chunks a store: puts evict, Redis outages or not."""
LEASE_S = 2.0
HEARTBEAT_S = 0.3
RPC_TIMEOUT_S = 2.0
IO_TIMEOUT_S = 2.0
PACE_S = 0.02
"""A client's pause between cycles: 2 cores run the cluster and the clients."""
EXTRA_FAULTS = 8
"""Faults drawn besides one of each kind."""
PAUSE_S = (1.0, 3.0)
"""A SIGSTOP's length (the lease is 2 s: the longer ones lose it)."""
OUTAGE_S = (3.5, 5.0)
"""A Redis outage's length: a node-local cycle takes about 1.4 s meanwhile."""
GAP_S = (1.0, 2.0)
"""Time between one fault's recovery and the next fault."""
READY_S = 20.0
"""A (re)started daemon's time to be ready."""
NODE_READY_S = 15.0
"""The node-0 client's time to complete a cycle before Redis is killed."""
CONVERGE_S = 30.0
"""Held == indexed on every store within this, once the faults stopped."""
JOIN_S = 30.0
SWEEP_PREFIXES = 300
"""Published prefixes read back once more at the end (a seeded sample)."""
MIN_OUTAGE_CYCLES = 1
"""Whole node-0 cycles each Redis outage must see, to show anything."""

KINDS = ("kill-store", "kill-metadata", "pause-store", "pause-metadata", "redis-empty")
METADATA = ("metadata", "metadata-1")


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    target: str
    hold_s: float
    gap_s: float

    def __str__(self) -> str:
        return f"{self.kind} {self.target} {self.hold_s:.1f}s"


def schedule(rng: random.Random) -> list[Fault]:
    """Each kind once and ``EXTRA_FAULTS`` drawn, in a drawn order; not a
    Redis outage last (the stores' registering again after it would make
    held == indexed whatever the reconciliation does)."""
    kinds = [*KINDS, *(rng.choice(KINDS) for _ in range(EXTRA_FAULTS))]
    rng.shuffle(kinds)
    last = max(i for i, k in enumerate(kinds) if k != "redis-empty")
    kinds[last], kinds[-1] = kinds[-1], kinds[last]
    faults = []
    for kind in kinds:
        if kind.endswith("store"):
            target = f"store-{rng.randrange(STORES)}"
        elif kind.endswith("metadata"):
            target = rng.choice(METADATA)
        else:
            target = "redis"
        hold = rng.uniform(*OUTAGE_S) if kind == "redis-empty" else rng.uniform(*PAUSE_S)
        faults.append(Fault(kind, target, hold if "kill" not in kind else 0.0, rng.uniform(*GAP_S)))
    return faults


@dataclass(slots=True)
class Chaos:
    """The daemons, and the faults dealt to them."""

    cl: LocalCluster
    replica: MetadataReplica
    start_redis: Callable[[], subprocess.Popen[bytes]]
    redis: list[subprocess.Popen[bytes]]
    node: NodeWorker
    t0: float
    events: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    unexpected_exits: list[str] = field(default_factory=list)
    redis_windows: list[tuple[float, float]] = field(default_factory=list)
    paused: set[int] = field(default_factory=set)
    given_up: set[str] = field(default_factory=set)
    restarted_once: set[str] = field(default_factory=set)
    recovered: list[tuple[str, float]] = field(default_factory=list)
    restarts: int = 0

    def note(self, what: str) -> None:
        self.events.append(f"{time.monotonic() - self.t0:6.1f}s {what}")

    def daemon(self, name: str) -> DaemonProcess:
        return next(d for d in self.cl.daemons() if d.name == name)

    def proc(self, name: str) -> subprocess.Popen[bytes]:
        if name == self.replica.name:
            assert self.replica.proc is not None
            return self.replica.proc
        if name == "redis":
            return self.redis[-1]
        return self.daemon(name).proc

    def names(self) -> list[str]:
        return [d.name for d in self.cl.daemons()] + [self.replica.name, "redis"]

    def restart(self, name: str) -> None:
        """Start ``name`` again; a failure to is a problem, not an exception
        (and the daemon is left down: ``given_up``)."""
        self.restarts += 1
        try:
            if name == self.replica.name:
                self.replica.start(READY_S)
            elif name == "redis":
                self.redis.append(self.start_redis())
            else:
                self.cl.restart(self.daemon(name))
        except (KVDepotError, AssertionError, pytest.fail.Exception) as exc:
            self.given_up.add(name)
            self.problems.append(f"restart of {name} failed: {exc}")
            self.note(f"restart of {name} FAILED: {exc}")

    def check_exits(self) -> None:
        """Record (and restart, once) a daemon that exited without a fault's doing."""
        for name in self.names():
            rc = self.proc(name).poll()
            if rc is not None and name not in self.given_up:
                self.unexpected_exits.append(f"{name} exited ({exit_reason(rc)})")
                self.note(f"{name} exited on its own ({exit_reason(rc)}): restarting it")
                if name in self.restarted_once:
                    self.given_up.add(name)
                else:
                    self.restarted_once.add(name)
                    self.restart(name)

    def signal(self, name: str, sig: signal.Signals) -> None:
        pid = self.proc(name).pid
        os.kill(pid, sig)
        if sig == signal.SIGSTOP:
            self.paused.add(pid)
        elif sig == signal.SIGCONT:
            self.paused.discard(pid)

    def resume_all(self) -> None:
        for pid in list(self.paused):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.paused.clear()

    def apply(self, fault: Fault) -> None:
        self.check_exits()
        self.note(f"fault: {fault}")
        if fault.kind.startswith("kill"):
            proc = self.proc(fault.target)
            proc.kill()
            proc.wait()
            self.restart(fault.target)
        elif fault.kind.startswith("pause"):
            self.signal(fault.target, signal.SIGSTOP)
            try:
                time.sleep(fault.hold_s)
            finally:
                self.signal(fault.target, signal.SIGCONT)
        else:
            self.redis_outage(fault.hold_s)
        self.note(f"recovered: {fault}")
        self.recovered.append((str(fault), time.monotonic()))
        time.sleep(fault.gap_s)
        self.check_exits()

    def redis_outage(self, hold_s: float) -> None:
        # The node-0 client knows its store's current address (it may have
        # been restarted, on new ports) once a cycle of it went through.
        since = time.monotonic()
        deadline = since + NODE_READY_S
        while not self.node.ok_cycle_since(since) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not self.node.ok_cycle_since(since):
            self.problems.append(
                f"the node-0 client completed no cycle in {NODE_READY_S:.0f} s before Redis "
                f"was killed (last ops: {self.node.log[-3:]})"
            )
        self.redis[-1].kill()
        self.redis[-1].wait()
        down = time.monotonic()
        self.note("redis killed")
        time.sleep(hold_s)
        self.redis_windows.append((down, time.monotonic()))
        self.restart("redis")


def held_and_indexed(client: KVDepotClient, stores: list[DaemonProcess]) -> dict[str, str]:
    """Per store, ``held/indexed`` (and the store's reconcile counters), or
    why it could not be told; equal ones end in ``=``."""
    out: dict[str, str] = {}
    try:
        nodes = {n.node_id: n for n in client.stats().nodes}
    except KVDepotError as exc:
        return {"metadata": f"stats failed: {exc}"}
    for s in stores:
        node_id = s.info["node_id"]
        try:
            st = store_stats(s.info["grpc_address"])
        except grpc.RpcError as exc:
            out[node_id] = f"store stats failed: {exc.code()}"
            continue
        held = sum(t.chunks for t in st.tiers)
        listed = nodes.get(node_id)
        if listed is None:
            out[node_id] = f"held {held}, not listed by the metadata service"
            continue
        rec = st.reconcile if st.HasField("reconcile") else None
        extra = (
            f" (reconcile: chunks {rec.chunks}, mismatches {rec.mismatches}, added {rec.added}, "
            f"removed {rec.removed})"
            if rec is not None
            else ""
        )
        mark = "=" if held == listed.chunks_indexed else "!="
        out[node_id] = f"held {held} {mark} indexed {listed.chunks_indexed}{extra}"
    return out


def converged(state: dict[str, str]) -> bool:
    return len(state) == STORES and all(" = indexed" in v for v in state.values())


@dataclass
class ChaosRun:
    """One chaos run: the cluster, its clients and faults, what they saw."""

    tmp_path: Path
    faults: list[Fault] = field(default_factory=list)
    redis: list[subprocess.Popen[bytes]] = field(default_factory=list)
    workers: list[Worker] = field(default_factory=list)
    chaos: Chaos | None = None
    stuck: list[str] = field(default_factory=list)
    alive: dict[str, str] = field(default_factory=dict)
    state: dict[str, str] = field(default_factory=dict)
    converge_s: float | None = None
    sweep: ReadTally = field(default_factory=ReadTally)
    sweep_lookups: list[int] = field(default_factory=lambda: [0, 0])
    """Prefixes looked up in the sweep, and of them named whole but not read whole."""
    chaos_s: float = 0.0
    wall_s: float = 0.0

    def __post_init__(self) -> None:
        self.binary = _redis_binaries("redis-server")["redis-server"]
        self.faults = schedule(random.Random(SEED))
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.log_dir = self.tmp_path / "logs"
        self.stop = threading.Event()
        self.pool = KeyPool()

    def start_redis(self) -> subprocess.Popen[bytes]:
        return _start_redis(self.binary, self.log_dir / "redis", self.port)  # empty: no persistence

    def run(self) -> None:
        t0 = time.monotonic()
        self.redis.append(self.start_redis())
        cl = LocalCluster(
            nodes=0,
            capacity=CAPACITY,
            lease_ttl_s=LEASE_S,
            heartbeat_interval_s=HEARTBEAT_S,
            log_dir=self.log_dir,
            index=self.url,
            ready_timeout_s=READY_S,
        )
        replica = MetadataReplica(
            "metadata-1", self.url, self.log_dir / "metadata-1.log", LEASE_S, HEARTBEAT_S
        )
        try:
            cl.start()
            replica.start(READY_S)
            both = f"{cl.metadata_address},{replica.address}"
            for i in range(STORES):
                cl.add_store(f"store-{i}", "--metadata", both)
            wait_nodes(cl.metadata_address, STORES, READY_S)
            config = ClientConfig(
                metadata=both,
                rpc_timeout_s=RPC_TIMEOUT_S,
                io_timeout_s=IO_TIMEOUT_S,
                connect_timeout_s=IO_TIMEOUT_S,
            )
            node = self._start_workers(config, [s.info["node_id"] for s in cl.stores])
            chaos = self.chaos = Chaos(cl, replica, self.start_redis, self.redis, node, t0)
            chaos.note(f"cluster up; faults: {', '.join(map(str, self.faults))}")
            began = time.monotonic()
            for fault in self.faults:
                chaos.apply(fault)
            self.chaos_s = time.monotonic() - began
            chaos.note("faults over")
            self._stop_workers()
            with KVDepotClient(config) as checker:
                self._converge(checker, cl.stores)
                self._sweep(checker)
        finally:
            self.stop.set()
            if self.chaos is not None:
                self.chaos.resume_all()
            for w in self.workers:
                w.thread.join(5)
                w.client.close()
            cl.stop()
            replica.stop()
            _stop_redis(self.redis)
        self.wall_s = time.monotonic() - t0

    def _start_workers(self, config: ClientConfig, ids: list[str]) -> NodeWorker:
        def make(cls: type[Worker], i: int, name: str, node_id: str) -> Worker:
            client = KVDepotClient(replace(config, node_id=node_id))
            return cls(
                name, client, NS, CHUNK, PREFIX_CHUNKS, SEED + i, self.pool, self.stop, PACE_S
            )

        node = make(NodeWorker, 0, "node-0", ids[0])
        assert isinstance(node, NodeWorker)
        self.workers = [
            node,
            make(Worker, 1, "client-1", ids[1]),
            make(Worker, 2, "client-2", ids[2]),
            make(Worker, 3, "client-none", ""),
        ]
        for w in self.workers:
            w.thread.start()
        return node

    def _stop_workers(self) -> None:
        assert self.chaos is not None
        self.stop.set()
        for w in self.workers:
            w.thread.join(JOIN_S)
        self.stuck = [w.name for w in self.workers if w.thread.is_alive()]
        self.chaos.check_exits()
        self.alive = {
            n: exit_reason(rc)
            for n in self.chaos.names()
            if (rc := self.chaos.proc(n).poll()) is not None
        }

    def _converge(self, checker: KVDepotClient, stores: list[DaemonProcess]) -> None:
        assert self.chaos is not None
        start = time.monotonic()
        while time.monotonic() - start < CONVERGE_S:
            self.state = held_and_indexed(checker, stores)
            if converged(self.state):
                self.converge_s = time.monotonic() - start
                break
            time.sleep(0.2)
        self.chaos.note(f"held vs indexed: {self.state}")

    def _sweep(self, checker: KVDepotClient) -> None:
        """Every published prefix of a seeded sample reads back exact or misses."""
        prefixes = self.pool.all()
        for keys in random.Random(SEED).sample(prefixes, min(SWEEP_PREFIXES, len(prefixes))):
            bufs = sentinel_buffers(len(keys), CHUNK)
            try:
                hits = checker.lookup(keys, count="none")
                got = checker.get_into(keys, bufs, count="none")
            except KVDepotError:
                continue
            loaded = self.sweep.add(keys, bufs, got, lambda k: payload(k, CHUNK))
            self.sweep_lookups[0] += 1
            self.sweep_lookups[1] += hits > loaded

    # -- what it saw ------------------------------------------------------------------
    @property
    def node(self) -> NodeWorker:
        node = self.workers[0]
        assert isinstance(node, NodeWorker)
        return node

    def totals(self) -> OpStats:
        total = OpStats()
        for w in self.workers:
            total.merge(w.stats)
        return total

    def in_outages(self) -> list[Op]:
        """The node-0 client's operations that began and ended while Redis was down."""
        assert self.chaos is not None
        windows = self.chaos.redis_windows
        return [o for o in self.node.log if any(a <= o.start and o.end <= b for a, b in windows)]

    def cycles_per_outage(self) -> list[int]:
        assert self.chaos is not None
        return [
            len(
                {
                    o.cycle
                    for o in self.node.log
                    if o.name == "get_into" and a <= o.start <= o.end <= b
                }
            )
            for a, b in self.chaos.redis_windows
        ]

    def _back_after(self, since: float) -> str:
        ops = self.node.log
        whole = {o.cycle for o in ops if o.name == "get_into" and o.ok and o.start >= since}
        ends = [o.end for o in ops if o.cycle in whole and o.name == "get_into"]
        return f"{min(ends) - since:.1f} s" if ends else "never"

    def report(self) -> str:
        chaos = self.chaos
        assert chaos is not None
        total = self.totals()
        in_window = self.in_outages()
        failures = [o for o in in_window if not o.ok]
        durations = {
            name: sorted(o.end - o.start for o in in_window if o.name == name)
            for name in ("put", "lookup", "get_into")
        }
        timing = ", ".join(
            f"{name} median {d[len(d) // 2]:.2f} s max {d[-1]:.2f} s"
            for name, d in durations.items()
            if d
        )
        lags = ", ".join(f"{what}: {self._back_after(at)}" for what, at in chaos.recovered)
        kinds = ", ".join(sorted({f.kind for f in self.faults}))
        equal = f"(equal {self.converge_s:.1f} s after the faults)" if self.converge_s else ""
        return "\n".join(
            [
                f"chaos: seed {SEED}, wall {self.wall_s:.1f} s (faults {self.chaos_s:.1f} s), "
                f"{len(self.faults)} faults ({kinds}), {chaos.restarts} restarts",
                f"operations: {dict(total.ops)}; put chunks: {dict(total.chunks)}",
                f"lookups: {total.lookup_hits} hits of {total.lookup_keys} keys",
                f"reads during the run: {total.tally}",
                f"final sweep of {self.sweep_lookups[0]} prefixes: {self.sweep}; named by a "
                f"lookup past what was read: {self.sweep_lookups[1]}",
                f"errors by class: {dict(total.errors)}",
                *(f"  first {k}: {v}" for k, v in total.samples.items()),
                f"node-0 ops while Redis was down: {len(in_window)} in "
                f"{len(chaos.redis_windows)} outages (whole cycles per outage: "
                f"{self.cycles_per_outage()}), failed: {len(failures)}; {timing}",
                *(f"  {o}" for o in failures[:10]),
                f"node-0's first whole cycle after each fault's recovery: {lags}",
                f"held vs indexed: {self.state} {equal}",
                "events:",
                *(f"  {e}" for e in chaos.events),
                "log lines with Traceback/ERROR:",
                *(f"  {x}" for x in grep_logs(self.log_dir, "Traceback", "ERROR", "CRITICAL")),
            ]
        )

    def problems(self) -> list[str]:
        chaos = self.chaos
        assert chaos is not None
        total = self.totals()
        problems = list(chaos.problems)
        if self.stuck:
            problems.append(
                f"client threads still running {JOIN_S:.0f} s after the stop: {self.stuck}"
            )
        if total.unexpected:
            problems.append(
                f"clients raised errors that are no KVDepotError: {total.unexpected[:5]}"
            )
        wrong = total.tally.wrong + self.sweep.wrong
        if wrong:
            problems.append(
                f"1. {wrong} chunks served with wrong bytes ({total.tally.wrong} during the run, "
                f"{self.sweep.wrong} in the final sweep)"
            )
        if self.alive or chaos.unexpected_exits:
            problems.append(
                f"2. daemons not running at the end: {self.alive or 'none'}; exited on their own "
                f"during the run: {chaos.unexpected_exits or 'none'}"
            )
        if self.converge_s is None:
            problems.append(
                f"3. held != indexed {CONVERGE_S:.0f} s after the faults stopped: {self.state}"
            )
        in_window = self.in_outages()
        failures = [o for o in in_window if not o.ok]
        if not chaos.redis_windows:
            problems.append("4. no Redis outage was run")
        if failures:
            problems.append(
                f"4. {len(failures)} of {len(in_window)} node-0 ops failed while Redis was "
                f"down, e.g. {failures[:3]}"
            )
        cycles = self.cycles_per_outage()
        if any(c < MIN_OUTAGE_CYCLES for c in cycles):
            problems.append(
                f"4. too few whole node-0 cycles while Redis was down: {cycles} "
                f"(at least {MIN_OUTAGE_CYCLES} each)"
            )
        if missing := set(KINDS) - {f.kind for f in self.faults}:
            problems.append(f"fault kinds not run: {missing}")
        return problems


def test_chaos(tmp_path: Path) -> None:
    run = ChaosRun(tmp_path)
    run.run()
    report = run.report()
    print(report)
    problems = run.problems()
    assert not problems, "\n".join(["", *problems, "", report, "", log_tails(run.log_dir)])
