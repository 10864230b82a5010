"""Tier benchmark: DRAM only vs DRAM + SSD, and the SSD tier against raw file I/O.

Two parts, in one run:

1. **Hit rate with a working set 4x the DRAM tier.** A store's chunk table
   (the same :class:`~kvdepot.store.chunks.ChunkStore` a daemon runs, in
   process, so the figures are the tiers' and not the network's) is filled
   with the whole working set, then serves requests for chunks drawn
   uniformly from it. A hit copies the chunk out to the requester (as a get
   does); a miss recomputes it, i.e. puts it again (as a prefill would).
   Run once with DRAM only and once with an SSD tier big enough for the
   working set. ``gbps`` is the bytes served by hits over the wall time of
   the request loop (misses' puts included).

2. **SSD tier vs raw file I/O of the same sizes.** ``count`` chunks of
   ``chunk`` bytes are written through the SSD tier (allocate + write: a
   64-byte header and the payload per chunk, appended to segment files), and
   written dd-style (``dd bs=chunk count=count conv=fdatasync``: sequential
   ``write`` calls to one file, then ``fdatasync``); both from one thread,
   both ending with their data synced. Then both are read back from one
   thread, chunk by chunk, the tier checking every chunk's checksum: first
   cold (``posix_fadvise(DONTNEED)`` drops the files' pages beforehand, so
   the bytes come off the device), then warm (from the page cache). Trials
   alternate which goes first; each figure is the median of the trials.
   The target is the tier at >= 0.8x raw for reads and writes off the
   device (``ssd_read_gbps``, ``ssd_write_gbps``). From the page cache the
   tier pays for its checksum (xxh3 over every byte read), which raw reads
   do not compute: ``ssd_read_warm_ratio`` shows that cost.

``--quick`` finishes in well under a minute; ``--json`` prints one object.

Run: ``python benchmarks/tiers.py --quick``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvdepot.config import parse_size
from kvdepot.keys import ChunkKey
from kvdepot.store.chunks import ChunkStore, checksum
from kvdepot.store.tiers.ssd import SsdTier

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class Workload:
    """One run of the request loop."""

    hit_rate: float
    gbps: float
    requests: int
    seconds: float
    tiers: dict[str, dict[str, int]]


def _key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def _chunk(i: int, base: bytes) -> bytes:
    # Distinct per key (the key up front) without generating fresh random bytes.
    return i.to_bytes(16, "big") + base[16:]


def _put(cs: ChunkStore, i: int, base: bytes) -> None:
    data = _chunk(i, base)
    res = cs.reserve(_key(i), len(data), checksum(data))
    if res is None:
        return
    res.view[:] = data
    cs.commit(res)
    del res


def run_workload(
    cs: ChunkStore, *, chunks: int, chunk_bytes: int, requests: int, seed: int
) -> Workload:
    """Fill ``cs`` with the working set, then serve ``requests`` uniform requests."""
    rng = random.Random(seed)
    base = rng.randbytes(chunk_bytes)
    for i in range(chunks):
        _put(cs, i, base)
    out = bytearray(chunk_bytes)
    hits = 0
    started = time.perf_counter()
    for _ in range(requests):
        i = rng.randrange(chunks)
        lease = cs.acquire(_key(i))
        if lease is None:
            _put(cs, i, base)  # recomputed
            continue
        try:
            out[:] = lease.view
        finally:
            cs.release(lease)
            del lease
        if out[:16] != i.to_bytes(16, "big"):
            raise SystemExit(f"chunk {i} came back wrong")
        hits += 1
    seconds = time.perf_counter() - started
    return Workload(
        hit_rate=hits / requests,
        gbps=hits * chunk_bytes / seconds / 1e9,
        requests=requests,
        seconds=round(seconds, 3),
        tiers={
            t.name: {
                "capacity_bytes": t.capacity_bytes,
                "chunks": t.chunks,
                "hits": t.hits,
                "promotions": t.promotions,
                "demotions": t.demotions,
                "evictions": t.evictions,
            }
            for t in cs.tier_stats()
        },
    )


def _drop_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def raw_file_io(directory: Path, chunk_bytes: int, count: int) -> dict[str, float]:
    """dd-style: sequential writes of ``chunk_bytes`` to one file, fdatasync; reads back."""
    path = directory / "raw.bin"
    buf = random.Random(1).randbytes(chunk_bytes)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        started = time.perf_counter()
        for _ in range(count):
            view = memoryview(buf)
            while view:
                view = view[os.write(fd, view) :]
        os.fdatasync(fd)
        write_s = time.perf_counter() - started
    finally:
        os.close(fd)
    out: dict[str, float] = {"write": _gbps(count * chunk_bytes, write_s)}
    dest = bytearray(chunk_bytes)
    for label in ("cold", "warm"):
        if label == "cold":
            _drop_cache([path])
        fd = os.open(path, os.O_RDONLY)
        try:
            started = time.perf_counter()
            for n in range(count):
                got = os.preadv(fd, [dest], n * chunk_bytes)
                if got != chunk_bytes:
                    raise SystemExit("short read of the raw file")
            out[label] = _gbps(count * chunk_bytes, time.perf_counter() - started)
        finally:
            os.close(fd)
    path.unlink()
    return out


def ssd_tier_io(directory: Path, chunk_bytes: int, count: int) -> dict[str, float]:
    """The same sizes through the SSD tier: appended records, checked reads."""
    buf = random.Random(1).randbytes(chunk_bytes)
    ck = checksum(buf)
    capacity = (count + 8) * (chunk_bytes + 2 * 4096) + (64 << 20)
    tier = SsdTier(directory, capacity, fsync="never", compact_ratio=0)
    try:
        handles = []
        started = time.perf_counter()
        for i in range(count):
            h = tier.allocate(chunk_bytes)
            if h is None:
                raise SystemExit("ssd tier full")
            tier.write(h, memoryview(buf), key=_key(i), checksum=ck)
            handles.append(h)
        segments = [directory / name for name in os.listdir(directory) if name.endswith(".kvs")]
        for path in segments:  # synced like dd's conv=fdatasync
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
        out: dict[str, float] = {"write": _gbps(count * chunk_bytes, time.perf_counter() - started)}
        dest = memoryview(bytearray(chunk_bytes))
        for label in ("cold", "warm"):
            if label == "cold":
                _drop_cache(segments)
            started = time.perf_counter()
            for h in handles:
                tier.read_into(h, dest)  # raises if a checksum fails
            out[label] = _gbps(count * chunk_bytes, time.perf_counter() - started)
        return out
    finally:
        tier.close()


def compare_io(
    directory: Path, chunk_bytes: int, count: int, trials: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Medians over ``trials`` of raw and tier I/O, run in alternating order."""
    raws: list[dict[str, float]] = []
    tiers: list[dict[str, float]] = []
    for trial in range(trials):
        runs = [
            lambda: raws.append(raw_file_io(directory, chunk_bytes, count)),
            lambda: tiers.append(ssd_tier_io(directory / "io", chunk_bytes, count)),
        ]
        for run in runs if trial % 2 == 0 else reversed(runs):
            run()
            shutil.rmtree(directory / "io", ignore_errors=True)

    def median(rows: list[dict[str, float]]) -> dict[str, float]:
        return {k: statistics.median(r[k] for r in rows) for k in rows[0]}

    return median(raws), median(tiers)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller sizes: well under a minute")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--dram", help="DRAM tier size (default 256MiB, quick 64MiB)")
    ap.add_argument("--chunk", default="1MiB", help="chunk size (default 1MiB)")
    ap.add_argument("--requests", type=int, help="requests per run (default 4x the chunks)")
    ap.add_argument("--io-bytes", help="bytes of the SSD vs raw comparison (default 4x DRAM)")
    ap.add_argument("--dir", type=Path, help="directory on the device to test (default: temp)")
    ap.add_argument("--trials", type=int, help="I/O comparison trials (default 5, quick 3)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)

    dram = parse_size(args.dram or ("64MiB" if args.quick else "256MiB"))
    chunk = parse_size(args.chunk)
    chunks = 4 * dram // chunk  # the working set: 4x DRAM
    requests = args.requests or 4 * chunks
    io_bytes = parse_size(args.io_bytes) if args.io_bytes else 4 * dram
    base = Path(tempfile.mkdtemp(prefix="kvdepot-tiers-", dir=args.dir))
    try:
        dram_only = ChunkStore(dram)
        try:
            only = run_workload(
                dram_only, chunks=chunks, chunk_bytes=chunk, requests=requests, seed=args.seed
            )
        finally:
            dram_only.close()
        ssd_capacity = 5 * dram + 64 * MiB  # the working set fits in DRAM + SSD
        tiered = ChunkStore(dram, tiers=[SsdTier(base / "ssd", ssd_capacity)])
        try:
            both = run_workload(
                tiered, chunks=chunks, chunk_bytes=chunk, requests=requests, seed=args.seed
            )
        finally:
            tiered.close()
        shutil.rmtree(base / "ssd")
        count = max(1, io_bytes // chunk)
        raw, tier = compare_io(base, chunk, count, args.trials or (3 if args.quick else 5))
    finally:
        shutil.rmtree(base, ignore_errors=True)

    result: dict[str, Any] = {
        "dram_bytes": dram,
        "chunk_bytes": chunk,
        "working_set_bytes": chunks * chunk,
        "requests": requests,
        "dram_only_hit_rate": round(only.hit_rate, 4),
        "with_ssd_hit_rate": round(both.hit_rate, 4),
        "dram_only_gbps": round(only.gbps, 3),
        "with_ssd_gbps": round(both.gbps, 3),
        "io_bytes": count * chunk,
        "ssd_write_gbps": round(tier["write"], 3),
        "raw_file_write_gbps": round(raw["write"], 3),
        "ssd_read_gbps": round(tier["cold"], 3),
        "raw_file_read_gbps": round(raw["cold"], 3),
        "ssd_read_warm_gbps": round(tier["warm"], 3),
        "raw_file_read_warm_gbps": round(raw["warm"], 3),
        "ssd_write_ratio": round(tier["write"] / raw["write"], 3),
        "ssd_read_ratio": round(tier["cold"] / raw["cold"], 3),
        "ssd_read_warm_ratio": round(tier["warm"] / raw["warm"], 3),
        "dram_only": asdict(only),
        "with_ssd": asdict(both),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"working set {chunks * chunk / MiB:.0f} MiB = 4x DRAM {dram / MiB:.0f} MiB, "
        f"{chunk / MiB:g} MiB chunks, {requests} uniform requests"
    )
    print(f"  DRAM only:  hit rate {only.hit_rate:6.1%}  {only.gbps:6.2f} GB/s served")
    print(f"  DRAM + SSD: hit rate {both.hit_rate:6.1%}  {both.gbps:6.2f} GB/s served")
    print(f"SSD tier vs dd-style raw file I/O, {count} x {chunk / MiB:g} MiB:")
    for label, t, r in (
        ("write (synced)", tier["write"], raw["write"]),
        ("read (cold)", tier["cold"], raw["cold"]),
        ("read (warm)", tier["warm"], raw["warm"]),
    ):
        print(f"  {label:15} tier {t:6.2f} GB/s  raw {r:6.2f} GB/s  ratio {t / r:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
