"""What the departure history and per-namespace counters cost a lookup.

In one process, one run: the metadata service's ``Lookup`` handler (request
validation, the embedded index, the packed answer; no network) on 128 keys
that all hit, in three settings, interleaved round by round so that the
machine's noise falls on all of them alike:

- ``baseline``: no namespace on the request, an empty history;
- ``history``: the request names a namespace (its counts tallied), and the
  history holds ``--nodes`` full rings of 65536 departures;
- ``recording``: as ``history``, with 256 departures recorded (a store's
  removal report) before each lookup, not timed.

Also measures the history's memory and one ``Explain`` of 128 absent keys
(half of them in the history) over it.

Usage::

    python benchmarks/departures.py [--rounds 20000] [--nodes 16] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from typing import Any

from kvdepot.keys import ChunkKey, Namespace
from kvdepot.metadata.config import MetadataConfig
from kvdepot.metadata.explain import explain
from kvdepot.metadata.index.base import IndexConfig
from kvdepot.metadata.index.departures import DepartureConfig, MemoryDepartures
from kvdepot.metadata.index.memory import MemoryIndex
from kvdepot.metadata.service import MetadataServicer
from kvdepot.proto.gen import metadata_pb2
from kvdepot.types import NodeInfo

PER_NODE = 65536


def _keys(n: int) -> list[ChunkKey]:
    return [ChunkKey(os.urandom(16)) for _ in range(n)]


async def measure(rounds: int, nodes: int) -> dict[str, Any]:
    index = MemoryIndex(IndexConfig(departures=DepartureConfig(per_node=PER_NODE)))
    servicer = MetadataServicer(index, MetadataConfig(port=0))
    keys = _keys(128)
    await index.register_node(NodeInfo("n0", "127.0.0.1:1"), [], time.monotonic())
    await index.put_end("n0", keys, [1 << 20] * len(keys))
    history = index.departures
    assert isinstance(history, MemoryDepartures)
    for n in range(nodes):
        await history.record(f"gone-{n}", _keys(PER_NODE), "evicted", "cpu")
    name = Namespace("bench").digest().hex()
    plain = metadata_pb2.LookupRequest(keys=keys, tokens_per_key=256, packed=True)
    tagged = metadata_pb2.LookupRequest(keys=keys, tokens_per_key=256, packed=True, namespace=name)
    removed = [_keys(256) for _ in range(64)]
    took: dict[str, list[float]] = {"baseline": [], "history": [], "recording": []}
    ctx: Any = None  # the handler touches its context only to advertise a port
    for i in range(rounds):
        for row, request in (("baseline", plain), ("history", tagged), ("recording", tagged)):
            if row == "recording":
                await history.record("n0-removed", removed[i % len(removed)], "evicted", "cpu")
            t0 = time.perf_counter()
            reply = await servicer.Lookup(request, ctx)
            took[row].append(time.perf_counter() - t0)
            assert reply.hits == len(keys)
    gone = removed[0][:64] + _keys(64)  # half in the history, half never stored
    t0 = time.perf_counter()
    await explain(index, gone, "")
    explain_ms = (time.perf_counter() - t0) * 1000
    await servicer.tally.flush()
    await index.close()
    return {
        "rounds": rounds,
        "history_nodes": nodes + 1,
        "history_bytes": history.nbytes,
        "bytes_per_entry": history.nbytes / ((nodes + 1) * PER_NODE),
        "explain_128_keys_ms": round(explain_ms, 2),
        **{f"{row}_p50_us": round(statistics.median(v) * 1e6, 1) for row, v in took.items()},
        **{
            f"{row}_p99_us": round(sorted(v)[int(0.99 * (len(v) - 1))] * 1e6, 1)
            for row, v in took.items()
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=20000)
    p.add_argument("--nodes", type=int, default=16, help="full rings in the history")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    out = asyncio.run(measure(args.rounds, args.nodes))
    if args.json:
        print(json.dumps(out))
        return
    for k, v in out.items():
        print(f"{k:24} {v}")


if __name__ == "__main__":
    main()
