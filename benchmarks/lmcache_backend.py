"""LMCache with kvdepot as its remote backend, against LMCache's own ``lm://`` server.

Both run in one process, driven the way LMCache's ``RemoteBackend`` drives
them, with real LMCache objects on the CPU: a ``LocalCPUBackend`` allocates
the chunks, its event loop runs the connector coroutines.

* ``kvdepot``: a local cluster (metadata service and one store daemon as
  processes on 127.0.0.1), loaded through LMCache's ``remote_storage_plugins``
  framework; the engine's store is ``node_id`` (a store on every host, as
  deployed). Rows for kvdepot's default transport (``auto``: shared memory to
  the store on this host) and for ``tcp``.
* ``lm-server``: ``python -m lmcache.v1.server 127.0.0.1 PORT cpu`` (the
  ``lmcache_server`` entry point) and ``remote_url: lm://127.0.0.1:PORT``.

Ops, per batch of ``--batch`` 256-token chunks (one prompt's worth):

* ``put``: the connector's ``batched_put`` where it has one (kvdepot), else
  one ``put`` per chunk run concurrently on the loop (lm-server), as
  ``RemoteBackend`` does. A kvdepot put returns once the chunks are committed
  in the index; an lm-server put once the bytes are handed to the socket
  (its protocol has no acknowledgement). Every put trial uses new keys, as
  kvdepot would skip chunks it already holds.
* ``get``: ``RemoteBackend.batched_get_blocking`` (LMCache's retrieval call),
  memory objects allocated from the ``LocalCPUBackend``; the bytes of the
  first read are checked against what was put.

Chunk shapes are LMCache's ``[2, layers, 256, kv_heads * head_dim]`` in
bfloat16 for a few model shapes. Backends run round-robin within each trial,
so a ratio compares runs made under the same load. GB/s is a batch's bytes
over the median batch time. ``--quick`` runs in well under a minute.

Run: ``python benchmarks/lmcache_backend.py --json --quick``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.remote_backend import RemoteBackend

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repo root

from benchmarks import procs

CHUNK_TOKENS = 256
DTYPE = torch.bfloat16


@dataclass(frozen=True, slots=True)
class Shape:
    """A model's KV shape as one LMCache worker holds it."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int

    @property
    def chunk_bytes(self) -> int:
        return 2 * self.layers * CHUNK_TOKENS * self.kv_heads * self.head_dim * DTYPE.itemsize


SHAPES = (
    Shape("tiny-4L", 4, 2, 64),  # 512 KiB
    Shape("qwen2.5-0.5b", 24, 2, 64),  # 3 MiB
    Shape("llama-3.2-1b", 16, 8, 64),  # 8 MiB
)


@dataclass(frozen=True, slots=True)
class Row:
    """One result: a backend's put or get of batches of ``size``-byte chunks."""

    backend: str
    op: str
    size: int
    gbps: float
    p50_ms: float
    model: str
    transport: str
    batch: int


class Side:
    """One backend as an LMCache worker sees it: CPU backend, loop, RemoteBackend."""

    def __init__(self, name: str, transport: str, config: Any, shape: Shape, batch: int) -> None:
        self.name = name
        self.transport = transport
        self.shape = shape
        self.metadata = LMCacheMetadata(
            # Each side its own model name: kvdepot would skip chunks another side put.
            model_name=f"bench/{shape.name}/{name}/{transport}",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=DTYPE,
            kv_shape=(shape.layers, 2, CHUNK_TOKENS, shape.kv_heads, shape.head_dim),
            role="worker",
        )
        self.cpu = LocalCPUBackend(config, self.metadata, dst_device="cpu")
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        plugin = "kvdepot" if config.remote_storage_plugins else None
        self.remote = RemoteBackend(
            config, self.metadata, self.loop, self.cpu, "cpu", plugin_name=plugin
        )
        if self.remote.connection is None:
            raise RuntimeError(f"LMCache could not connect {name}")
        self.objs = [self._chunk(i) for i in range(batch)]
        self._next = 0

    def _chunk(self, seed: int) -> Any:
        obj = self.cpu.allocate(self.metadata.get_shapes(), self.metadata.get_dtypes())
        gen = torch.Generator().manual_seed(seed)
        obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=gen, dtype=torch.float32))
        return obj

    def fresh_keys(self) -> list[Any]:
        self._next += 1
        return [
            CacheEngineKey(self.metadata.model_name, 1, 0, self._next * 10_000 + i, DTYPE)
            for i in range(len(self.objs))
        ]

    def put(self, keys: list[Any]) -> float:
        conn = self.remote.connection
        assert conn is not None
        for obj in self.objs:
            obj.ref_count_up()  # the connector wrapper drops one per put

        async def run() -> None:
            if conn.support_batched_put():
                await conn.batched_put(keys, self.objs)
            else:
                await asyncio.gather(
                    *(conn.put(k, o) for k, o in zip(keys, self.objs, strict=True))
                )

        t0 = time.perf_counter()
        asyncio.run_coroutine_threadsafe(run(), self.loop).result(120)
        return time.perf_counter() - t0

    def get(self, keys: list[Any], check: bool = False) -> float:
        t0 = time.perf_counter()
        got = self.remote.batched_get_blocking(keys)
        dt = time.perf_counter() - t0
        try:
            if any(g is None for g in got):
                raise RuntimeError(f"{self.name}: {sum(g is None for g in got)} misses")
            if check:
                for g, o in zip(got, self.objs, strict=True):
                    if bytes(g.byte_array) != bytes(o.byte_array):
                        raise RuntimeError(f"{self.name}: read bytes differ from what was put")
        finally:
            for g in got:
                if g is not None:
                    g.ref_count_down()
        return dt

    def close(self) -> None:
        self.remote.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        for obj in self.objs:
            obj.ref_count_down()


def _config(batch: int, shape: Shape, **kw: Any) -> Any:
    # Room for the batch that is put and the batch being read, and spare.
    gb = 3 * batch * shape.chunk_bytes / 2**30 + 0.05
    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK_TOKENS, local_cpu=False, max_local_cpu_size=gb, **kw
    )


def kvdepot_config(metadata: str, node_id: str, transport: str, batch: int, shape: Shape) -> Any:
    return _config(
        batch,
        shape,
        remote_storage_plugins=["kvdepot"],
        extra_config={
            "remote_storage_plugin.kvdepot.module_path": "kvdepot.connector.lmcache",
            "remote_storage_plugin.kvdepot.class_name": "KVDepotConnectorAdapter",
            "remote_storage_plugin.kvdepot.url": (
                f"kvdepot://{metadata}?node_id={node_id}&transport={transport}"
            ),
        },
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def lm_server(log: Path) -> Iterator[int]:
    """LMCache's own remote server (``lmcache_server 127.0.0.1 PORT cpu``)."""
    port = _free_port()
    with open(log, "wb") as err:
        proc = procs.popen(
            [sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"],
            stdout=subprocess.DEVNULL,
            stderr=err,
            stdin=subprocess.DEVNULL,
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"lmcache server did not start: see {log}") from None
                time.sleep(0.1)
        yield port
    finally:
        procs.terminate(proc)


def bench_shape(shape: Shape, sides: list[Side], trials: int, batch: int) -> list[Row]:
    times: dict[tuple[str, str, str], list[float]] = {}
    get_keys = {s.name + s.transport: s.fresh_keys() for s in sides}
    for s in sides:  # warm up connections and fill what the gets read
        s.put(get_keys[s.name + s.transport])
        s.get(get_keys[s.name + s.transport], check=True)
    for _ in range(trials):
        for s in sides:
            times.setdefault((s.name, s.transport, "put"), []).append(s.put(s.fresh_keys()))
            times.setdefault((s.name, s.transport, "get"), []).append(
                s.get(get_keys[s.name + s.transport])
            )
    rows = []
    for (name, transport, op), ts in times.items():
        med = statistics.median(ts)
        rows.append(
            Row(
                backend=name,
                op=op,
                size=shape.chunk_bytes,
                gbps=round(batch * shape.chunk_bytes / med / 1e9, 3),
                p50_ms=round(med * 1e3, 3),
                model=shape.name,
                transport=transport,
                batch=batch,
            )
        )
    return rows


def summarize(rows: list[Row]) -> dict[str, Any]:
    """kvdepot / lm-server GB/s per op, size and kvdepot transport."""
    lm = {(r.op, r.size): r.gbps for r in rows if r.backend == "lm-server"}
    ratios = []
    for r in rows:
        if r.backend == "kvdepot" and lm.get((r.op, r.size)):
            ratios.append(
                {
                    "op": r.op,
                    "size": r.size,
                    "model": r.model,
                    "transport": r.transport,
                    "ratio": round(r.gbps / lm[(r.op, r.size)], 2),
                }
            )
    gets = [x["ratio"] for x in ratios if x["op"] == "get"]
    return {
        "ratios": ratios,
        "min_get_ratio": min(gets) if gets else None,
        "get_target_met": bool(gets) and min(gets) >= 1.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="fewer trials and shapes (< 60 s)")
    ap.add_argument("--batch", type=int, default=8, help="chunks per put/get (one prompt)")
    ap.add_argument("--trials", type=int, default=0, help="trials per backend (default 5/15)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    procs.stop_on_sigterm()
    trials = args.trials or (5 if args.quick else 15)
    shapes = SHAPES[:2] if args.quick else SHAPES
    started = time.monotonic()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="kvdepot-lmcache-bench-") as tmp:
        logs = Path(tmp)
        biggest = max(s.chunk_bytes for s in shapes)
        capacity = max(256 << 20, 4 * (trials + 2) * args.batch * biggest)
        with (
            procs.Cluster(nodes=1, capacity=f"{capacity >> 20}MiB", log_dir=logs) as cluster,
            lm_server(logs / "lm-server.log") as port,
        ):
            node = cluster.stores[0].info["node_id"]
            for shape in shapes:
                sides = [
                    Side(
                        "lm-server",
                        "tcp",
                        _config(args.batch, shape, remote_url=f"lm://127.0.0.1:{port}"),
                        shape,
                        args.batch,
                    ),
                    Side(
                        "kvdepot",
                        "auto",
                        kvdepot_config(cluster.metadata_address, node, "auto", args.batch, shape),
                        shape,
                        args.batch,
                    ),
                    Side(
                        "kvdepot",
                        "tcp",
                        kvdepot_config(cluster.metadata_address, node, "tcp", args.batch, shape),
                        shape,
                        args.batch,
                    ),
                ]
                try:
                    rows += bench_shape(shape, sides, trials, args.batch)
                finally:
                    for s in sides:
                        s.close()
    summary = summarize(rows)
    out = {
        "rows": [asdict(r) for r in rows],
        "summary": summary,
        "batch": args.batch,
        "trials": trials,
        "chunk_tokens": CHUNK_TOKENS,
        "elapsed_s": round(time.monotonic() - started, 1),
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(
        f"{'backend':<10} {'transport':<9} {'model':<14} {'op':<4} {'chunk':>9} "
        f"{'GB/s':>7} {'p50 ms':>8}"
    )
    for r in rows:
        print(
            f"{r.backend:<10} {r.transport:<9} {r.model:<14} {r.op:<4} "
            f"{r.size / 2**20:>6.2f}MiB {r.gbps:>7.2f} {r.p50_ms:>8.2f}"
        )
    for x in summary["ratios"]:
        print(
            f"kvdepot/{x['transport']} vs lm-server, {x['op']} of {x['model']}: {x['ratio']:.2f}x"
        )
    print(
        f"get target (>= 1.0x): {'met' if summary['get_target_met'] else 'NOT met'}"
        f" (min {summary['min_get_ratio']}x), {out['elapsed_s']} s"
    )


if __name__ == "__main__":
    main()
