"""The DRAM tier's allocator under the churn of a cache: it does not fragment into failure.

A cache allocates chunks of a few sizes and frees them in LRU order, forever.
Best fit with coalescing keeps the arena usable: an allocation only fails
when the arena is nearly full (so evicting a few more chunks makes room),
and when everything is freed the arena is one extent again.
"""

from __future__ import annotations

import random
import statistics
from collections import OrderedDict
from pathlib import Path

from kvdepot.keys import ChunkKey
from kvdepot.store.chunks import ChunkStore, checksum
from kvdepot.store.tiers.base import TierLimits
from kvdepot.store.tiers.cpu import CpuTier
from kvdepot.store.tiers.policy import TieringOptions
from kvdepot.store.tiers.ssd import SsdTier

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
# Mixed chunk sizes of several models and their partial last chunks.
SIZES = (4 * KiB, 5000, 64 * KiB, 130 * KiB, 256 * KiB, 700 * KiB, MiB, 1536 * KiB, 2 * MiB)


def test_churn_of_100k_mixed_size_puts_and_evictions_does_not_fragment() -> None:
    tier = CpuTier(64 * MiB)
    rng = random.Random(7)
    lru: OrderedDict[int, int] = OrderedDict()  # handle -> size, least recent first
    used_when_full: list[float] = []
    evicted_for: list[int] = []
    try:
        for _ in range(100_000):
            size = rng.choice(SIZES)
            handle = tier.allocate(size)
            if handle is None:
                used_when_full.append(tier.used_bytes / tier.capacity)
                evictions = 0
                while handle is None:
                    assert lru, "failed with nothing left to evict: fragmented"
                    victim, _ = lru.popitem(last=False)
                    tier.free(victim)
                    evictions += 1
                    handle = tier.allocate(size)
                evicted_for.append(evictions)
            lru[handle] = size
            if rng.random() < 0.2 and len(lru) > 1:  # a read makes a chunk recent
                lru.move_to_end(rng.choice(list(lru)[: len(lru) // 2]))
        # An allocation only fails when the arena is nearly full (90% on
        # average, measured; the worst case is bounded by the largest chunk
        # being 1/32 of the arena)...
        used_when_full.sort()
        assert statistics.mean(used_when_full) > 0.88
        assert used_when_full[len(used_when_full) // 100] > 0.7
        assert used_when_full[0] > 0.55
        # ...and then a few evictions make room (about 5 on average, mostly
        # small chunks making room for a large one), never a flush.
        assert statistics.mean(evicted_for) < 8
        assert max(evicted_for) < 100
        for handle in list(lru):
            tier.free(handle)
        assert tier.used_bytes == 0 and tier.free_extents == 1
    finally:
        tier.close()


def test_churn_through_the_tiered_store_keeps_dram_full_and_usable(tmp_path: Path) -> None:
    # DRAM over SSD, no background demotion: every put that finds DRAM full
    # moves the coldest chunks down on its own path. The SSD and the demotion
    # buffer hold all 3000 chunks (~570 MiB), so how fast this disk writes
    # cannot turn a demotion into a drop (with a 64 MiB SSD, a slow CI disk
    # left 1755 of ~2900 chunks dropped).
    cs = ChunkStore(
        16 * MiB,
        cpu_limits=TierLimits(1.0, 1.0),
        tiers=[SsdTier(tmp_path, GiB, limits=TierLimits(1.0, 1.0), fsync="never")],
        options=TieringOptions(demotion_buffer_bytes=GiB),
    )
    rng = random.Random(3)
    payload = rng.randbytes(MiB)
    fill: list[float] = []
    try:
        for i in range(3000):
            data = payload[: rng.choice(SIZES[:6])]
            res = cs.reserve(ChunkKey(i.to_bytes(16, "big")), len(data), checksum(data))
            assert res is not None
            res.view[:] = data
            cs.commit(res)
            del res
            fill.append(cs.stats().used_bytes / cs.capacity)
        stats = {t.name: t for t in cs.tier_stats()}
        assert stats["cpu"].demotions > 2000
        assert stats["cpu"].evictions == 0
        assert cs.stats().rejected == 0
        assert statistics.mean(fill[500:]) > 0.9  # DRAM stays (nearly) full
    finally:
        cs.close()
