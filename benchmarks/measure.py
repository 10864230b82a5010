"""Timing the systems of :mod:`benchmarks.systems`, as the user waits.

Two timings, each system in turn within every trial (the order rotated from
one trial to the next), so that ratios compare runs under the same load:

* ``throughput``: puts in runs of ``burst`` batches back to back, then the
  system's :meth:`~benchmarks.systems.System.settle` (a kvdepot put's
  deferred store work: receiving, verifying, committing), all inside the
  timed region, nothing left running into the next system's. A sample is
  the run's time over ``burst``; GB/s is a batch's bytes over the median
  sample, p50/p99 are over the samples. Gets are timed one batch at a time
  (a get is done when it returns; the untimed ``quiesce`` after each is a
  no-op for every system here).
* ``visible``: a put of ``k`` chunks (1 and 8 by default, of 256 KiB) from its
  start until another process's lookup names every chunk (see
  :mod:`benchmarks.visible`); ``quiesce`` after each, untimed.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

from benchmarks.systems import KiB, Row, System, cpu_seconds, percentile


def _rotated(systems: list[System], trial: int) -> list[System]:
    k = trial % len(systems) if systems else 0
    return systems[k:] + systems[:k]


def _row(
    name: str, op: str, size: int, count: int, ts: list[float], timing: str,
    cpu: list[tuple[float, float]] | None = None,
) -> Row:  # fmt: skip
    med = statistics.median(ts)
    client = statistics.median(c for c, _ in cpu) * 1e3 if cpu else 0.0
    server = statistics.median(s for _, s in cpu) * 1e3 if cpu else 0.0
    return Row(name, op, size, size * count / med / 1e9,
               percentile(ts, 0.5) * 1e3, percentile(ts, 0.99) * 1e3, timing, count,
               client, server)  # fmt: skip


class _Cpu:
    """CPU seconds of this process and of a system's processes over a span."""

    def __init__(self, s: System) -> None:
        self._pids = s.server_pids()
        # Reading /proc is outside this process's span: it is not the system's work.
        self._server = cpu_seconds(self._pids)
        self._client = time.process_time()

    def per(self, n: int) -> tuple[float, float]:
        """(client, server) CPU seconds since the start, over ``n``."""
        client = time.process_time() - self._client
        server = cpu_seconds(self._pids) - self._server
        return client / n, server / n


def _prepared(
    systems: Iterable[System], size: int, batch: int, log: Callable[[str], None]
) -> list[System]:
    ready: list[System] = []
    for s in systems:
        try:
            s.prepare(size, batch)
            ready.append(s)
        except Exception as exc:
            log(f"  {s.name}: skipped at {size // KiB} KiB ({exc})")
    return ready


def _run(s: System, burst: int) -> tuple[float, tuple[float, float]]:
    """Seconds per batch of ``burst`` puts back to back, the system's own
    work included, and the (client, server) CPU seconds per batch."""
    cpu = _Cpu(s)
    t0 = time.perf_counter()
    for _ in range(burst):
        s.put()
    s.settle()
    elapsed = time.perf_counter() - t0
    used = cpu.per(burst)
    s.release()
    return elapsed / burst, used


def put_throughput(
    ready: list[System], size: int, batch: int, trials: int, burst: int
) -> list[Row]:
    times: dict[str, list[float]] = {s.name: [] for s in ready}
    cpu: dict[str, list[tuple[float, float]]] = {s.name: [] for s in ready}
    for s in ready:  # warm-up
        _run(s, 1)
    for t in range(trials):
        for s in _rotated(ready, t):
            seconds, used = _run(s, burst)
            times[s.name].append(seconds)
            cpu[s.name].append(used)
    return [
        _row(s.name, "put", size, batch, times[s.name], "throughput", cpu[s.name]) for s in ready
    ]


def gets(ready: list[System], size: int, batch: int, trials: int) -> list[Row]:
    """Gets as they have always been timed: one batch at a time."""
    times: dict[str, list[float]] = {s.name: [] for s in ready}
    cpu: dict[str, list[tuple[float, float]]] = {s.name: [] for s in ready}
    for s in ready:  # warm-up
        s.before_get()
        s.get()
        s.quiesce()
    for t in range(trials):
        for s in _rotated(ready, t):
            used = _Cpu(s)
            t0 = time.perf_counter()
            s.get()
            times[s.name].append(time.perf_counter() - t0)
            cpu[s.name].append(used.per(1))
            s.quiesce()
    return [
        _row(s.name, "get", size, batch, times[s.name], "throughput", cpu[s.name]) for s in ready
    ]


def measure(
    systems: list[System],
    sizes: tuple[int, ...],
    batch_of: Callable[[int], int],
    trials: int,
    burst: int,
    log: Callable[[str], None],
) -> list[Row]:
    """Throughput rows: puts (runs of ``burst`` batches) and gets, per chunk size."""
    rows: list[Row] = []
    for size in sizes:
        batch = batch_of(size)
        ready = _prepared(systems, size, batch, log)
        for r in put_throughput(ready, size, batch, trials, burst) + gets(
            ready, size, batch, trials
        ):
            rows.append(r)
            log(f"  {r.system:18s} {r.op} {size // KiB:6d} KiB  {r.gbps:6.2f} GB/s")
    return rows


def measure_visible(
    systems: list[System],
    size: int,
    counts: tuple[int, ...],
    trials: int,
    log: Callable[[str], None],
) -> list[Row]:
    """Visible rows: puts of ``k`` chunks of ``size`` for each ``k`` in ``counts``."""
    ready: list[System] = []
    watched = [s for s in systems if type(s).visible is not System.visible]
    for s in _prepared(watched, size, max(counts), log):
        try:
            if s.visible(1) is None:  # warm-up (the watcher starts)
                continue
            s.quiesce()
            ready.append(s)
        except Exception as exc:
            log(f"  {s.name}: visible latency not measured ({exc})")
    rows: list[Row] = []
    for k in counts:
        times: dict[str, list[float]] = {s.name: [] for s in ready}
        for t in range(trials):
            for s in _rotated(ready, t):
                seconds = s.visible(k)
                assert seconds is not None
                times[s.name].append(seconds)
                s.quiesce()
        for s in ready:
            rows.append(_row(s.name, "put", size, k, times[s.name], "visible"))
            log(f"  {s.name:18s} visible {k} x {size // KiB} KiB  p50 {rows[-1].p50_ms:7.3f} ms")
    return rows


def over_rounds(per_round: list[list[Row]]) -> list[Row]:
    """Medians over rounds of each system/op/size/timing/batch."""
    keyed: dict[tuple[str, str, int, str, int], list[Row]] = {}
    for rows in per_round:
        for r in rows:
            keyed.setdefault((r.system, r.op, r.size, r.timing, r.batch), []).append(r)
    return [
        Row(s, op, size, statistics.median(r.gbps for r in rs),
            statistics.median(r.p50_ms for r in rs), statistics.median(r.p99_ms for r in rs),
            timing, batch, statistics.median(r.client_cpu_ms for r in rs),
            statistics.median(r.server_cpu_ms for r in rs))
        for (s, op, size, timing, batch), rs in keyed.items()
    ]  # fmt: skip


def table(rows: list[Row]) -> list[str]:
    """The rows as a text table, throughput first."""
    lines = [
        f"{'system':18s} {'timing':10s} {'op':3s} {'size':>8s} {'batch':>5s} "
        f"{'GB/s':>6s} {'p50 ms':>8s} {'p99 ms':>8s} {'cpu ms':>8s} {'srv ms':>8s}"
    ]
    order = sorted(rows, key=lambda r: (r.timing != "throughput", r.op, r.size, r.batch))
    for r in order:
        cpu = (f" {r.client_cpu_ms:8.3f} {r.server_cpu_ms:8.3f}"
               if r.timing == "throughput" else "")  # fmt: skip
        lines.append(
            f"{r.system:18s} {r.timing:10s} {r.op:3s} {r.size // KiB:>6d}Ki {r.batch:>5d} "
            f"{r.gbps:6.2f} {r.p50_ms:8.3f} {r.p99_ms:8.3f}{cpu}"
        )
    return lines


def cpu_bounds(rows: list[Row], pairs: list[tuple[Any, ...]]) -> list[str]:
    """For each ``(a, b, op, sizes, target)``: the best ratio ``a``'s CPU allows.

    A batch's work, ``a``'s client and server CPU, is done on this machine's
    cores whatever overlaps: over the cores it bounds ``a``'s time per batch
    from below, and so its ratio against ``b`` (same run) from above.
    """
    cores = len(os.sched_getaffinity(0))
    index = {(r.system, r.op, r.size): r for r in rows if r.timing == "throughput"}
    lines = []
    for a, b, op, sizes, target in pairs:
        for size in sizes:
            ra, rb = index.get((a, op, size)), index.get((b, op, size))
            if ra is None or rb is None or not (ra.client_cpu_ms or ra.server_cpu_ms):
                continue
            cpu = ra.client_cpu_ms + ra.server_cpu_ms
            bound, took = cpu / cores, ra.size * ra.batch / ra.gbps / 1e6
            other = rb.size * rb.batch / rb.gbps / 1e6
            lines.append(
                f"  {a} {op} {size // KiB} KiB: CPU {ra.client_cpu_ms:.2f} + "
                f"{ra.server_cpu_ms:.2f} ms a batch on {cores} cores >= {bound:.2f} ms "
                f"(took {took:.2f}); {b} {other:.2f} ms: at best {other / bound:.2f}x "
                f"(target >= {target})"
            )
    return lines


def visible_ratios(rows: list[Row], pairs: list[tuple[str, str]]) -> list[str]:
    """p50 visible latency of ``a`` over ``b`` for each pair and batch (below 1: ``a`` sooner)."""
    index = {(r.system, r.size, r.batch): r for r in rows if r.timing == "visible"}
    lines = []
    for size, k in sorted({(r.size, r.batch) for r in rows if r.timing == "visible"}):
        for a, b in pairs:
            ra, rb = index.get((a, size, k)), index.get((b, size, k))
            if ra and rb:
                label = f"{a}/{b} visible {k} x {size // KiB} KiB p50"
                lines.append(f"  {label:52s} {ra.p50_ms / rb.p50_ms:5.2f}  (latency: < 1 sooner)")
    return lines
