"""The floor of an ``shm`` put under raw-shm: copying with the writer's checksums.

``python benchmarks/shm_floor.py [--size-kib 1024] [--batch 8] [--rounds 200]``

In one process, alternating batch by batch: the time of copying ``batch``
chunks into a mapped /dev/shm file (as raw-shm does), and of copying them
with the xxh3 block checksums the ``shm`` transport computes while it copies
(:func:`kvdepot.connector.transport.shm.copy_hashed`, one thread, as for a
batch under ``PARALLEL_COPY_BYTES``). Puts rotate over 512 MiB of the file,
as a store's land in arena space not recently written. The ratio of the two
medians bounds kvdepot-shm/raw-shm put before any control message or
metadata call.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time

import numpy as np

from kvdepot.connector.transport.shm import copy_hashed

MiB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-kib", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    size, batch = args.size_kib << 10, args.batch
    slots = max(2, (512 * MiB) // (size * batch))
    path = f"/dev/shm/kvbench-floor-{os.getpid()}"
    with open(path, "wb") as f:
        f.truncate(size * batch * slots)
    try:
        with open(path, "r+b") as f:
            mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        seg = memoryview(mm)
        rng = np.random.default_rng(1)
        src = [memoryview(rng.integers(0, 256, size, dtype=np.uint8)) for _ in range(batch)]
        times: dict[str, list[float]] = {"raw": [], "hashed": []}
        nxt = 0
        for r in range(args.rounds + 10):
            for how in ("raw", "hashed") if r % 2 else ("hashed", "raw"):
                nxt = (nxt + 1) % slots
                base = nxt * size * batch
                dst = [seg[base + i * size : base + (i + 1) * size] for i in range(batch)]
                t0 = time.perf_counter()
                if how == "raw":
                    for s, d in zip(src, dst, strict=True):
                        np.copyto(np.frombuffer(d, dtype=np.uint8), np.frombuffer(s, np.uint8))
                else:
                    for s, d in zip(src, dst, strict=True):
                        copy_hashed(d, s, hash_dst=False)
                took = time.perf_counter() - t0
                del dst
                if r >= 10:
                    times[how].append(took)
        raw = statistics.median(times["raw"]) * 1e3
        hashed = statistics.median(times["hashed"]) * 1e3
        gb = size * batch / 1e9
        print(
            f"{batch} x {size >> 10} KiB, {args.rounds} rounds: copy {raw:.3f} ms "
            f"({gb / raw * 1e3:.2f} GB/s), copy + checksums {hashed:.3f} ms "
            f"({gb / hashed * 1e3:.2f} GB/s): ratio {raw / hashed:.2f}"
        )
    finally:  # the mapping goes with the process
        os.unlink(path)


if __name__ == "__main__":
    main()
