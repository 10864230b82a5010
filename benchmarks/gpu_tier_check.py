"""GPU tier check on a CUDA device: correctness of the tier logic, and figures.

What the unit tests run on torch's ``cpu`` device, run on ``cuda``:

1. **Copies through the tier**: chunks of 1, 4 and 16 MiB written into the
   GPU tier from the DRAM arena (host to device) and read back into it
   (device to host), with the arena page-locked (``pin_memory``) and not;
   GB/s of each, and every chunk checked against its checksum on the way back.
2. **The tiered store on the GPU**: a chunk table with GPU, DRAM and SSD
   tiers. Chunks read often enough are promoted up to the GPU in the
   background, the GPU tier demotes its coldest to DRAM when it fills, DRAM
   demotes to SSD, a reader that maps DRAM moves a GPU chunk back down, and
   every read is byte-exact. Reports the tiers' counters and read GB/s by tier.

Run on a CUDA machine: ``python benchmarks/gpu_tier_check.py [--json]``
(about a minute; ``--gpu-capacity`` and ``--device`` to change the defaults).
Exits non-zero if anything read back differs or CUDA is not there.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvdepot.config import parse_size
from kvdepot.keys import ChunkKey
from kvdepot.store.chunks import ChunkStore, checksum
from kvdepot.store.tiers.cpu import CpuTier
from kvdepot.store.tiers.gpu import GpuTier
from kvdepot.store.tiers.policy import TieringOptions
from kvdepot.store.tiers.ssd import SsdTier

MiB = 1 << 20


def _key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def _sync(torch: Any) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_figures(device: str, sizes: list[int], per_size_bytes: int) -> list[dict[str, Any]]:
    """H2D and D2H GB/s through the GPU tier, from a pinned and an unpinned arena."""
    import torch

    rows: list[dict[str, Any]] = []
    for pinned in (True, False):
        arena_bytes = max(sizes) * 2
        cpu = CpuTier(arena_bytes, pin=pinned)
        gpu = GpuTier(per_size_bytes + max(sizes), device=device)
        try:
            src = cpu.allocate(max(sizes))
            dst = cpu.allocate(max(sizes))
            assert src is not None and dst is not None
            rng = random.Random(1)
            cpu.view(src, max(sizes))[:] = rng.randbytes(max(sizes))
            for size in sizes:
                count = max(4, per_size_bytes // size)
                handles: list[int] = []
                for _ in range(count):
                    h = gpu.allocate(size)
                    if h is None:
                        raise SystemExit(f"gpu tier too small for {count} x {size} bytes")
                    handles.append(h)
                source = cpu.view(src, size)
                expected = checksum(source)
                _sync(torch)
                t0 = time.perf_counter()
                for h in handles:
                    gpu.write(h, source, key=_key(0), checksum=expected)
                _sync(torch)
                t1 = time.perf_counter()
                dest = cpu.view(dst, size)
                bad = 0
                read_s = 0.0
                for h in handles:
                    t = time.perf_counter()
                    gpu.read_into(h, dest)
                    _sync(torch)
                    read_s += time.perf_counter() - t
                    bad += checksum(dest) != expected
                if bad:
                    raise SystemExit(f"{bad} chunks of {size} bytes came back wrong")
                for h in handles:
                    gpu.free(h)
                del source, dest  # views of the arena, closed below
                rows.append(
                    {
                        "chunk_bytes": size,
                        "pinned": cpu.pinned,
                        "asked_pinned": pinned,
                        "chunks": count,
                        "h2d_gbps": round(count * size / (t1 - t0) / 1e9, 2),
                        "d2h_gbps": round(count * size / read_s / 1e9, 2),
                    }
                )
        finally:
            gpu.close()
            cpu.close()
    return rows


class _CheckedStore:
    """A chunk store whose chunk ``i`` holds known bytes, so every read is checked."""

    def __init__(self, cs: ChunkStore, chunk: int, base: bytes) -> None:
        self.cs = cs
        self.chunk = chunk
        self.base = base

    def data(self, i: int) -> bytes:
        return i.to_bytes(16, "big") + self.base[16:]

    def fill(self, n: int) -> float:
        """Put chunks ``0..n-1``; the seconds it took."""
        t0 = time.perf_counter()
        for i in range(n):
            d = self.data(i)
            res = self.cs.reserve(_key(i), self.chunk, checksum(d))
            assert res is not None
            res.view[:] = d
            self.cs.commit(res)
            del res
        return time.perf_counter() - t0

    def read(self, i: int, in_arena: bool = False) -> str:
        """Read chunk ``i``, check every byte, and say which tier served it."""
        lease = self.cs.acquire(_key(i), in_arena=in_arena)
        if lease is None:
            raise SystemExit(f"chunk {i} missing")
        try:
            if bytes(lease.view[:16]) != i.to_bytes(16, "big") or checksum(lease.view) != (
                checksum(self.data(i))
            ):
                raise SystemExit(f"chunk {i} came back wrong from {lease.tier}")
            return lease.tier
        finally:
            self.cs.release(lease)
            del lease

    def promote(self, hot: list[int]) -> None:
        """Read ``hot`` until a third of it has been promoted to the GPU tier."""
        for _ in range(3):  # from SSD into DRAM, then 2 hits in DRAM: hot for the GPU
            for i in hot:
                self.read(i)
        deadline = time.monotonic() + 60
        while sum(1 for h in self.cs.holdings() if h.tier == "gpu") < len(hot) // 3:
            if time.monotonic() > deadline:
                raise SystemExit("chunks were not promoted to the GPU tier")
            time.sleep(0.05)

    def tier_counters(self) -> dict[str, dict[str, int]]:
        return {
            t.name: {
                "capacity_bytes": t.capacity_bytes,
                "used_bytes": t.used_bytes,
                "chunks": t.chunks,
                "hits": t.hits,
                "misses": t.misses,
                "promotions": t.promotions,
                "demotions": t.demotions,
                "evictions": t.evictions,
            }
            for t in self.cs.tier_stats()
        }


def store_check(device: str, gpu_bytes: int, chunk: int, directory: Path) -> dict[str, Any]:
    """GPU + DRAM + SSD store: promotion, demotion, moves down; every byte checked."""
    dram = 4 * gpu_bytes
    cs = ChunkStore(
        dram,
        pin_memory=True,
        tiers=[
            GpuTier(gpu_bytes, device=device),
            SsdTier(directory, 16 * gpu_bytes + 256 * MiB),
        ],
        options=TieringOptions(gpu_promote_hits=2, maintenance_interval_s=0.01),
    )
    rng = random.Random(2)
    store = _CheckedStore(cs, chunk, rng.randbytes(chunk))
    n = 3 * dram // chunk  # working set: 3x DRAM, most of it on SSD
    hot = list(range(gpu_bytes // chunk * 2))  # twice what the GPU holds
    try:
        put_s = store.fill(n)
        store.promote(hot)
        by_tier: dict[str, list[float]] = {}
        for i in rng.sample(range(n), min(n, 400)):
            t = time.perf_counter()
            tier = store.read(i)
            by_tier.setdefault(tier, []).append(time.perf_counter() - t)
        on_gpu = [h.key for h in cs.holdings() if h.tier == "gpu"]
        moved_down = 0
        for key in on_gpu[:4]:
            if store.read(int.from_bytes(key, "big"), in_arena=True) == "cpu":
                moved_down += 1
        return {
            "chunks": n,
            "chunk_bytes": chunk,
            "put_gbps": round(n * chunk / put_s / 1e9, 2),
            "read_gbps_by_tier": {
                tier: round(chunk / statistics.median(times) / 1e9, 2)
                for tier, times in by_tier.items()
            },
            "reads_by_tier": {tier: len(times) for tier, times in by_tier.items()},
            "moved_down_for_arena_readers": moved_down,
            "arena_pinned": cs.pinned,
            "tiers": store.tier_counters(),
            "byte_exact": True,
        }
    finally:
        cs.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda", help="torch device (default cuda)")
    ap.add_argument("--gpu-capacity", default="256MiB", help="GPU tier of the store check")
    ap.add_argument("--copy-bytes", default="1GiB", help="bytes per size in the copy figures")
    ap.add_argument("--chunk", default="4MiB", help="chunk size of the store check")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("torch is not installed", file=sys.stderr)
        return 2
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("CUDA is not available", file=sys.stderr)
        return 2
    result: dict[str, Any] = {
        "device": args.device,
        "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
    }
    started = time.perf_counter()
    result["copies"] = copy_figures(
        args.device, [MiB, 4 * MiB, 16 * MiB], parse_size(args.copy_bytes)
    )
    directory = Path(tempfile.mkdtemp(prefix="kvdepot-gpu-check-"))
    try:
        result["store"] = store_check(
            args.device, parse_size(args.gpu_capacity), parse_size(args.chunk), directory
        )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    result["seconds"] = round(time.perf_counter() - started, 1)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['device_name']} ({args.device}), torch {result['torch']}")
        for r in result["copies"]:
            print(
                f"  {r['chunk_bytes'] // MiB:>3} MiB chunks, arena pinned {r['pinned']!s:5}: "
                f"H2D {r['h2d_gbps']:6.2f} GB/s  D2H {r['d2h_gbps']:6.2f} GB/s"
            )
        s = result["store"]
        print(f"  store: {s['chunks']} x {s['chunk_bytes'] // MiB} MiB, byte-exact, pinned "
              f"{s['arena_pinned']}, reads by tier {s['reads_by_tier']}, "
              f"GB/s by tier {s['read_gbps_by_tier']}")  # fmt: skip
        for name, t in s["tiers"].items():
            print(f"    {name}: {t}")
        print(f"  {result['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
