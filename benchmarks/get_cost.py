"""Where the fixed cost of a kvdepot ``tcp`` get goes, layer by layer.

Four readers of batches of 8 chunks, each layer the one before it plus one
part of kvdepot, timed in turns (one get each, round-robin, as
``benchmarks/peers.py`` times its systems):

* ``raw-tcp-xxh3``: the floor of ``benchmarks/floors.py`` (a raw server
  sends the chunks; the reader hashes each block as it arrives);
* ``store-raw``: a minimal reader speaking kvdepot's GET to a real store and
  hashing each payload as it arrives: what the store adds to the floor;
* ``transport``: ``TcpTransport.get_whole``: what the transport adds;
* ``client``: ``KVDepotClient.get_into``, served whole by its own node's
  store: what the client adds.

Then each reader runs alone, back to back (2 s each), and the CPU per get of its server
(the store or the raw server, from ``/proc``) and of this process is
reported: on two cores a get's wall time is close to the sum of both ends'
work, so CPU shows where the fixed cost is spent.

``python benchmarks/get_cost.py [--sizes 4,256,1024] [--trials N] [--quick] [--json]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repo root

from benchmarks import procs
from benchmarks.floors import RawTcpXxh3
from benchmarks.kvsystems import KVDepot, cluster
from benchmarks.systems import KiB
from kvdepot.keys import ChunkKey
from kvdepot.wire.protocol import (
    GET_ENTRY,
    GET_REPLY_ENTRY,
    HEADER,
    GetCode,
    Header,
    Opcode,
    unpack_get_reply_rows,
)
from kvdepot.wire.sockets import recv_exact_into, recv_hashed_into

BATCH = 8
LAYERS = ("raw-tcp-xxh3", "store-raw", "transport", "client")


@dataclass(frozen=True, slots=True)
class Row:
    """One reader at one chunk size."""

    system: str
    size: int
    p10_us: float
    p50_us: float
    p90_us: float
    server_cpu_us: float
    client_cpu_us: float


def _cpu_s(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _readers(cluster: Any, size: int) -> tuple[dict[str, Callable[[], None]], dict[str, int], Any]:
    """The four readers of ``size``-byte chunks, their servers' pids, and what to close."""
    kv = KVDepot("tcp", cluster, cluster.stores[0].info["node_id"])
    kv.prepare(size, BATCH)
    raw = RawTcpXxh3()
    raw.prepare(size, BATCH)
    client = kv._client
    transport = client._transport
    keys = [ChunkKey(k) for k in kv._keys]
    views = [memoryview(b) for b in kv._dst]
    kv.get()  # learns the own store's address
    address = client._local_address
    stream, _ = transport._pool.checkout(address)
    sock = stream.sock
    request = Header(Opcode.GET, BATCH).pack() + b"".join(GET_ENTRY.pack(k, 0, 0) for k in keys)
    head = memoryview(bytearray(HEADER.size + BATCH * GET_REPLY_ENTRY.size))
    sums = [0] * BATCH

    def store_raw() -> None:
        sock.sendall(request)
        recv_exact_into(sock, head)
        rows = unpack_get_reply_rows(head[HEADER.size :])
        for i, view in enumerate(views):
            sums[i] = recv_hashed_into(sock, view)
        if any(st != GetCode.OK or s != ck for (st, _, ck), s in zip(rows, sums, strict=True)):
            raise RuntimeError("store-raw: a chunk missed or failed its checksum")

    def bare() -> None:
        if not all(o.ok for o in transport.get_whole(address, keys, views)):
            raise RuntimeError("transport: a chunk missed")

    readers = {"raw-tcp-xxh3": raw.get, "store-raw": store_raw, "transport": bare, "client": kv.get}
    servers = {"raw-tcp-xxh3": raw._proc.pid}
    servers.update(dict.fromkeys(("store-raw", "transport", "client"), cluster.stores[0].pid))

    def close() -> None:
        stream.close()
        raw.close()
        kv.close()

    return readers, servers, close


def _measure(cluster: Any, size: int, trials: int, cpu_s: float) -> list[Row]:
    readers, servers, close = _readers(cluster, size)
    try:
        times: dict[str, list[float]] = {name: [] for name in readers}
        for get in readers.values():  # warm-up
            for _ in range(10):
                get()
        for _ in range(trials):
            for name, get in readers.items():  # in turns: the others' work runs between
                t0 = time.perf_counter()
                get()
                times[name].append(time.perf_counter() - t0)
        rows = []
        for name, get in readers.items():
            # For as long as it takes /proc's clock ticks to count well.
            server0, client0 = _cpu_s(servers[name]), time.process_time()
            n, start = 0, time.perf_counter()
            while n < 20 or time.perf_counter() - start < cpu_s:
                get()
                n += 1
            server = (_cpu_s(servers[name]) - server0) / n
            client = (time.process_time() - client0) / n
            q = sorted(times[name])
            p10, p50, p90 = (q[int(len(q) * f)] * 1e6 for f in (0.1, 0.5, 0.9))
            rows.append(Row(name, size, p10, p50, p90, server * 1e6, client * 1e6))
        return rows
    finally:
        close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="300 gets per reader and size")
    ap.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    ap.add_argument("--trials", type=int, help="gets per reader and size (default 2000)")
    ap.add_argument("--sizes", default="4,256,1024", help="chunk sizes in KiB (default 4,256,1024)")
    args = ap.parse_args(argv)
    trials = args.trials or (300 if args.quick else 2000)
    sizes = [int(k) * KiB for k in args.sizes.split(",")]
    rows: list[Row] = []
    procs.stop_on_sigterm()
    with cluster("1GiB", None) as kv_cluster:
        for size in sizes:
            # Fewer gets of larger chunks: about the same time per size.
            n = max(50, trials * 256 * KiB // max(size, 256 * KiB))
            rows += _measure(kv_cluster, size, n, 0.5 if args.quick else 2.0)
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
        return 0
    print(f"gets of {BATCH} chunks; latency in turns, CPU per get back to back (us)")
    print(f"{'reader':13s} {'size':>8s} {'p10':>8s} {'p50':>8s} {'p90':>8s} {'server CPU':>11s} "
          f"{'client CPU':>11s}")  # fmt: skip
    for r in rows:
        print(f"{r.system:13s} {r.size // KiB:5d}KiB {r.p10_us:8.0f} {r.p50_us:8.0f} "
              f"{r.p90_us:8.0f} {r.server_cpu_us:11.0f} {r.client_cpu_us:11.0f}")  # fmt: skip
    by = {(r.system, r.size): r for r in rows}
    print("\np50 added by each layer (us):")
    for size in sizes:
        p = [by[(name, size)].p50_us for name in LAYERS]
        print(f"  {size // KiB:5d} KiB: store {p[1] - p[0]:+.0f}, transport {p[2] - p[1]:+.0f}, "
              f"client {p[3] - p[2]:+.0f} (floor {p[0]:.0f})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
