"""The GPU tier's logic on torch's ``cpu`` device (where torch is installed).

The same code runs on ``cuda`` in ``benchmarks/gpu_tier_check.py``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvdepot.keys import ChunkKey
from kvdepot.store.chunks import ChunkStore, checksum
from kvdepot.store.tiers.policy import TieringOptions
from kvdepot.store.tiers.ssd import SsdTier

torch = pytest.importorskip("torch")

from kvdepot.store.tiers.gpu import GpuTier  # noqa: E402 - after the skip

KiB = 1 << 10
MiB = 1 << 20
CHUNK = 64 * KiB


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def blob(i: int) -> bytes:
    return random.Random(i).randbytes(CHUNK)


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def put(cs: ChunkStore, i: int) -> None:
    data = blob(i)
    res = cs.reserve(key(i), len(data), checksum(data))
    assert res is not None
    res.view[:] = data
    cs.commit(res)
    del res


def get(cs: ChunkStore, i: int, *, in_arena: bool = False) -> tuple[bytes, str] | None:
    lease = cs.acquire(key(i), in_arena=in_arena)
    if lease is None:
        return None
    try:
        return bytes(lease.view), lease.tier
    finally:
        cs.release(lease)
        del lease


def test_gpu_tier_round_trip_on_the_cpu_device() -> None:
    tier = GpuTier(MiB, device="cpu")
    try:
        assert tier.device == "cpu" and tier.capacity == MiB
        h = tier.allocate(5000)
        assert h is not None and tier.used_bytes == 8 * KiB
        data = bytes(random.Random(1).randbytes(5000))
        tier.write(h, memoryview(data), key=key(1), checksum=0)  # a read-only source
        out = bytearray(5000)
        tier.read_into(h, memoryview(out))
        assert out == data
        tier.free(h)
        assert tier.used_bytes == 0
    finally:
        tier.close()


def test_hot_chunks_move_up_to_the_gpu_and_back_down_intact(tmp_path: Path) -> None:
    cs = ChunkStore(
        MiB,
        tiers=[GpuTier(256 * KiB, device="cpu"), SsdTier(tmp_path, 8 * MiB)],
        options=TieringOptions(gpu_promote_hits=2, maintenance_interval_s=0.02),
    )
    try:
        assert cs.tiers == ("gpu", "cpu", "ssd")
        for i in range(8):
            put(cs, i)
        for _ in range(2):
            assert get(cs, 0) == (blob(0), "cpu")
        wait_for(lambda: cs.tier_of(key(0)) == "gpu")
        assert get(cs, 0) == (blob(0), "gpu")  # copied out for a tcp reader
        # A reader that maps DRAM moves it down.
        assert get(cs, 0, in_arena=True) == (blob(0), "cpu")
        assert cs.tier_of(key(0)) == "cpu"
        # More hot chunks than the GPU holds: the coldest go back to DRAM.
        for i in range(1, 8):
            for _ in range(2):
                assert get(cs, i) is not None
        wait_for(lambda: sum(1 for h in cs.holdings() if h.tier == "gpu") == 3)
        for i in range(40, 80):  # and DRAM pressure pushes to SSD
            put(cs, i)
        for i in [*range(8), *range(40, 80)]:
            got = get(cs, i)
            assert got is not None and got[0] == blob(i)
        stats = {t.name: t for t in cs.tier_stats()}
        assert stats["cpu"].promotions >= 8 and stats["gpu"].demotions >= 5
        assert stats["cpu"].demotions > 0
    finally:
        cs.close()
