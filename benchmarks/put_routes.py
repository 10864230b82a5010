"""Which route a tcp put should take, by size: the case behind ``LOCAL_FIRST_STREAM_BYTES``.

A client with its own store puts over one of two routes (docs/write-path.md):

* ``local``: the bytes go to its own store at once (one round trip), the
  store then says which keys it held already. Over tcp the bytes cross before
  the store can say so: a republished prefix is sent only to be discarded.
* ``reference``: ``PutStart`` first (the index says which keys exist), then
  only the new chunks' bytes, then ``PutEnd``: a round trip more, no byte of
  a republished chunk sent.

For one put of 8 chunks per size, on a real local cluster, as the user
waits (the store answers once the index committed the chunks), each route
times a **fresh** put (new keys) and a **republished** one (every key held
already), alternating in every trial. The plan's rule takes the local route
up to ``LOCAL_FIRST_STREAM_BYTES`` per put over tcp and the reference route
beyond: worth it where ``local`` saves less on a fresh put than it wastes
on a republished one. ``--json`` rows: ``{route, kind, size, batch,
p50_ms, p99_ms}``; ``saved_ms`` / ``wasted_ms`` per size in the summary.

    python benchmarks/put_routes.py [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from benchmarks import procs
from benchmarks.kvsystems import cluster
from benchmarks.systems import percentile

KiB = 1 << 10
BATCH = 8


def _client(address: str, node: str) -> Any:
    from kvdepot.connector.client import ClientConfig, KVDepotClient

    return KVDepotClient(ClientConfig(metadata=address, node_id=node, transport="tcp"))


def _put(client: Any, route: str, keys: list[bytes], chunks: list[np.ndarray]) -> float:
    from kvdepot.connector import put_plan

    limit = put_plan.LOCAL_FIRST_STREAM_BYTES
    local = client._local_address
    if route == "reference":
        client._local_address = None  # no own store known: PutStart first
    else:
        put_plan.LOCAL_FIRST_STREAM_BYTES = 1 << 62  # the local route at any size
    try:
        t0 = time.perf_counter()
        result = client.put(keys, chunks)
        elapsed = time.perf_counter() - t0
    finally:
        put_plan.LOCAL_FIRST_STREAM_BYTES = limit
        client._local_address = local
    if result.stored + result.skipped != len(keys):
        raise RuntimeError(f"{route} put: {result}")
    return elapsed


def measure(address: str, node: str, sizes: list[int], trials: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    client = _client(address, node)
    try:
        client.put([os.urandom(16)], [np.ones(4096, dtype=np.uint8)])  # learns its store
        for size in sizes:
            chunks = [
                np.random.default_rng(i).integers(0, 256, size, np.uint8) for i in range(BATCH)
            ]
            times: dict[tuple[str, str], list[float]] = {}
            for trial in range(trials):
                routes = ("local", "reference") if trial % 2 else ("reference", "local")
                for route in routes:
                    keys = [os.urandom(16) for _ in range(BATCH)]
                    times.setdefault((route, "fresh"), []).append(_put(client, route, keys, chunks))
                    times.setdefault((route, "republished"), []).append(
                        _put(client, route, keys, chunks)
                    )
            for (route, kind), ts in sorted(times.items()):
                rows.append({"route": route, "kind": kind, "size": size, "batch": BATCH,
                             "p50_ms": percentile(ts, 0.5) * 1e3,
                             "p99_ms": percentile(ts, 0.99) * 1e3})  # fmt: skip
    finally:
        client.close()
    return rows


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """Per size: what the local route saves on a fresh put, wastes on a republished one."""
    by = {(r["route"], r["kind"], r["size"]): r["p50_ms"] for r in rows}
    lines = ["size x 8   fresh: local / reference ms   republished: local / reference ms   "
             "saved / wasted ms   republished share where equal"]  # fmt: skip
    for size in sorted({r["size"] for r in rows}):
        lf, rf = by[("local", "fresh", size)], by[("reference", "fresh", size)]
        lr, rr = by[("local", "republished", size)], by[("reference", "republished", size)]
        saved, wasted = rf - lf, lr - rr
        # A mix with share p republished costs the local route p*wasted - (1-p)*saved more.
        even = saved / (saved + wasted) if saved + wasted > 0 and saved > 0 else 0.0
        lines.append(
            f"{size // KiB:>6} KiB   {lf:8.3f} / {rf:8.3f}        {lr:8.3f} / {rr:8.3f}"
            f"        {saved:7.3f} / {wasted:7.3f}     {even:6.1%}"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer trials (about 30 s)")
    ap.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    ap.add_argument("--sizes", default="64,256,1024,2048,4096", help="chunk sizes in KiB")
    ap.add_argument("--trials", type=int, help="samples per route, kind and size (default 30)")
    args = ap.parse_args()
    procs.stop_on_sigterm()
    trials = args.trials or (8 if args.quick else 30)
    sizes = [int(s) * KiB for s in args.sizes.split(",")]
    t0 = time.monotonic()
    with cluster("1GiB", None) as c:
        node = c.stores[0].info["node_id"]
        rows = measure(c.metadata_address, node, sizes, trials)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    for line in summary(rows):
        print(line)
    print(f"elapsed {time.monotonic() - t0:.1f} s")


if __name__ == "__main__":
    main()
