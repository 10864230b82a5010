"""Tests of the chunk table over DRAM and SSD: demotion, promotion, leases, restart."""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvdepot.errors import CapacityExceeded, Unavailable
from kvdepot.keys import ChunkKey
from kvdepot.store.chunks import ChunkStore, checksum
from kvdepot.store.tiers import segments as fmt
from kvdepot.store.tiers.base import TierLimits
from kvdepot.store.tiers.policy import TieringOptions
from kvdepot.store.tiers.ssd import SsdTier

KiB = 1 << 10
MiB = 1 << 20
CHUNK = 64 * KiB


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def blob(i: int, size: int = CHUNK) -> bytes:
    return random.Random(i).randbytes(size)


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


class Events:
    """What the store reports: removed keys and moves."""

    def __init__(self) -> None:
        self.removed: list[ChunkKey] = []
        self.moved: list[tuple[ChunkKey, str]] = []

    def on_removed(self, keys: list[ChunkKey]) -> None:
        self.removed.extend(keys)

    def on_moved(self, moves: list[tuple[ChunkKey, str]]) -> None:
        self.moved.extend(moves)


def open_store(
    directory: Path,
    events: Events | None = None,
    *,
    dram: int = MiB,
    ssd: int = 8 * MiB,
    cpu_limits: TierLimits = TierLimits(0.95, 0.85),  # noqa: B008 - immutable
    tier: SsdTier | None = None,
    **options: object,
) -> ChunkStore:
    events = events or Events()
    return ChunkStore(
        dram,
        on_removed=events.on_removed,
        on_moved=events.on_moved,
        cpu_limits=cpu_limits,
        tiers=[tier or SsdTier(directory, ssd, segment_bytes=MiB)],
        options=TieringOptions(**options),  # type: ignore[arg-type]
    )


def put(cs: ChunkStore, k: ChunkKey, data: bytes) -> None:
    res = cs.reserve(k, len(data), checksum(data))
    assert res is not None
    res.view[:] = data
    cs.commit(res)


def get(cs: ChunkStore, k: ChunkKey, *, in_arena: bool = False) -> bytes | None:
    lease = cs.acquire(k, in_arena=in_arena)
    if lease is None:
        return None
    try:
        return bytes(lease.view)
    finally:
        cs.release(lease)


def tiers(cs: ChunkStore) -> dict[str, object]:
    return {t.name: t for t in cs.tier_stats()}


@pytest.fixture
def events() -> Events:
    return Events()


@pytest.fixture
def store(tmp_path: Path, events: Events) -> Iterator[ChunkStore]:
    cs = open_store(tmp_path / "ssd", events)
    yield cs
    cs.close()


def test_demotion_and_promotion_keep_every_byte(store: ChunkStore, events: Events) -> None:
    rng = random.Random(5)
    sizes = {key(i): rng.choice([1, 5000, CHUNK, 200 * KiB]) for i in range(80)}
    for k, size in sizes.items():  # ~5 MiB into 1 MiB of DRAM
        put(store, k, blob(k[-1], size))
    assert events.removed == []
    stats = tiers(store)
    assert stats["cpu"].demotions > 0 and stats["ssd"].chunks > 0  # type: ignore[attr-defined]
    for _ in range(2):
        for k in rng.sample(list(sizes), len(sizes)):
            assert get(store, k) == blob(k[-1], sizes[k])
    for k in list(sizes)[:10]:
        assert get(store, k, in_arena=True) == blob(k[-1], sizes[k])
    stats = tiers(store)
    assert stats["ssd"].promotions > 0 and stats["ssd"].hits > 0  # type: ignore[attr-defined]
    assert events.removed == []
    assert {t for _, t in events.moved} == {"cpu", "ssd"}
    assert sum(t.chunks for t in store.tier_stats()) == len(sizes)
    holdings = store.holdings()
    assert {h.key for h in holdings} == set(sizes)
    assert {h.tier for h in holdings} == {"cpu", "ssd"}


def test_a_leased_chunk_survives_pressure(store: ChunkStore) -> None:
    put(store, key(0), blob(0))
    lease = store.acquire(key(0))
    assert lease is not None and lease.in_arena
    for i in range(1, 60):
        put(store, key(i), blob(i))
    assert store.tier_of(key(0)) == "cpu"
    assert bytes(lease.view) == blob(0)
    store.release(lease)
    del lease
    for i in range(60, 80):
        put(store, key(i), blob(i))
    assert store.tier_of(key(0)) == "ssd"  # unleased, it is the coldest again
    assert get(store, key(0)) == blob(0)


def test_a_pinned_chunk_stays_put(store: ChunkStore) -> None:
    put(store, key(0), blob(0))
    assert store.pin(key(0))
    for i in range(1, 60):
        put(store, key(i), blob(i))
    assert store.tier_of(key(0)) == "cpu"
    assert store.unpin(key(0)) and not store.unpin(key(0))
    assert not store.pin(key(999))


def test_promotion_threshold(tmp_path: Path) -> None:
    cs = open_store(tmp_path, promote_hits=2)
    try:
        for i in range(30):
            put(cs, key(i), blob(i))
        assert cs.tier_of(key(0)) == "ssd"
        lease = cs.acquire(key(0))
        assert lease is not None and (lease.tier, lease.in_arena) == ("ssd", False)
        assert bytes(lease.view) == blob(0)
        cs.release(lease)
        assert cs.tier_of(key(0)) == "ssd"
        assert get(cs, key(0)) == blob(0)  # the second read promotes
        assert cs.tier_of(key(0)) == "cpu"
    finally:
        cs.close()


def test_promote_hits_zero_serves_from_ssd_but_arena_readers_promote(tmp_path: Path) -> None:
    cs = open_store(tmp_path, promote_hits=0)
    try:
        for i in range(30):
            put(cs, key(i), blob(i))
        for _ in range(3):
            assert get(cs, key(0)) == blob(0)
        assert cs.tier_of(key(0)) == "ssd"
        lease = cs.acquire(key(0), in_arena=True)
        assert lease is not None and lease.in_arena and lease.tier == "cpu"
        assert bytes(cs.arena.view(lease.offset, lease.size)) == blob(0)
        cs.release(lease)
        del lease
        assert cs.tier_of(key(0)) == "cpu"
    finally:
        cs.close()


def corrupt_on_disk(directory: Path, k: ChunkKey) -> None:
    for seg_id in fmt.segment_ids(directory):
        path = directory / fmt.segment_name(seg_id)
        fd = os.open(path, os.O_RDWR)
        try:
            for item in fmt.scan(fd, os.fstat(fd).st_size, verify=False):
                if item.header.key == k and item.status == "ok":
                    os.pwrite(fd, b"\xde\xad", item.offset + fmt.HEADER.size + 100)
                    return
        finally:
            os.close(fd)
    raise AssertionError("chunk not on disk")


def test_a_corrupt_ssd_chunk_is_a_miss_and_reported(tmp_path: Path, events: Events) -> None:
    cs = open_store(tmp_path / "ssd", events, promote_hits=0)
    try:
        for i in range(30):
            put(cs, key(i), blob(i))
        wait_for(lambda: cs.tier_of(key(0)) == "ssd" and not cs.levels[1].pending_bytes)
        corrupt_on_disk(tmp_path / "ssd", key(0))
        assert get(cs, key(0)) is None
        assert get(cs, key(0), in_arena=True) is None
        assert events.removed == [key(0)]
        assert not cs.contains(key(0))
        assert cs.stats().corrupt == 1
        assert get(cs, key(1)) == blob(1)  # its neighbours are fine
    finally:
        cs.close()


def test_background_demotion_keeps_dram_under_its_watermark(tmp_path: Path) -> None:
    cs = open_store(tmp_path, cpu_limits=TierLimits(0.5, 0.25), maintenance_interval_s=0.05)
    try:
        for i in range(14):  # 14 x 68 KiB: ~93% of DRAM, nothing has to move yet
            put(cs, key(i), blob(i))
        wait_for(lambda: cs.stats().used_bytes <= 0.5 * cs.capacity)
        assert tiers(cs)["cpu"].demotions >= 6  # type: ignore[attr-defined]
        for i in range(14):
            assert get(cs, key(i)) == blob(i)
    finally:
        cs.close()


def test_restart_serves_ssd_chunks_again(tmp_path: Path) -> None:
    d = tmp_path / "ssd"
    cs = open_store(d)
    for i in range(40):
        put(cs, key(i), blob(i))
    on_ssd = {h.key for h in cs.holdings() if h.tier == "ssd"}
    assert len(on_ssd) > 20
    cs.close()  # DRAM is gone; the SSD chunks are not
    events = Events()
    cs = open_store(d, events)
    try:
        found = {h.key for h in cs.holdings()}
        assert found >= on_ssd  # and what the mover demoted since
        assert cs.stats().recovered == len(found)
        assert {h.tier for h in cs.holdings()} == {"ssd"}
        for k in found:
            assert get(cs, k) == blob(k[-1])
        assert events.removed == []
    finally:
        cs.close()


class FullDisk(SsdTier):
    """An SSD tier whose disk is full."""

    def write(self, handle: int, data: memoryview, *, key: ChunkKey, checksum: int) -> None:
        from kvdepot.store.tiers.segments import io_error

        raise io_error(OSError(28, "No space left on device"), "write")


def test_a_full_disk_loses_the_chunks_it_could_not_take_not_the_store(
    tmp_path: Path, events: Events
) -> None:
    cs = open_store(tmp_path, events, tier=FullDisk(tmp_path, 8 * MiB))
    try:
        for i in range(40):
            put(cs, key(i), blob(i))
        wait_for(lambda: cs.stats().write_errors >= 20)
        wait_for(lambda: len(events.removed) == cs.stats().write_errors)
        assert all(not cs.contains(k) for k in events.removed)
        assert get(cs, key(39)) == blob(39)  # DRAM still serves
        assert cs.stats().rejected == 0
    finally:
        cs.close()


def test_a_full_store_refuses_puts_with_capacity_exceeded(tmp_path: Path) -> None:
    cs = open_store(tmp_path, ssd=MiB)
    try:
        for i in range(14):
            put(cs, key(i), blob(i))
        leases = [cs.acquire(key(i)) for i in range(14)]
        with pytest.raises(CapacityExceeded):
            cs.reserve(key(100), 200 * KiB, 0)
        for lease in leases:
            assert lease is not None
            cs.release(lease)
        del leases, lease  # their views of the arena
        put(cs, key(100), blob(100, 200 * KiB))
    finally:
        cs.close()


def test_deleting_a_chunk_on_ssd_frees_it_for_good(tmp_path: Path, events: Events) -> None:
    d = tmp_path / "ssd"
    cs = open_store(d, events)
    for i in range(30):
        put(cs, key(i), blob(i))
    assert cs.tier_of(key(0)) == "ssd"
    assert cs.delete(key(0))
    assert events.removed == [key(0)]
    cs.close()
    cs = open_store(d)
    try:
        assert not cs.contains(key(0))
    finally:
        cs.close()


def test_concurrent_readers_writers_and_deletes_leak_nothing(tmp_path: Path) -> None:
    cs = open_store(tmp_path, dram=512 * KiB, ssd=4 * MiB, maintenance_interval_s=0.01)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(300):
                i = rng.randrange(120)
                k = key(i)
                try:
                    res = cs.reserve(k, CHUNK, checksum(blob(i)))
                except CapacityExceeded:
                    res = None
                if res is not None:
                    res.view[:] = blob(i)
                    cs.commit(res)
                got = get(cs, k, in_arena=rng.random() < 0.3)
                assert got is None or got == blob(i)
                if rng.random() < 0.1:
                    cs.delete(k)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert errors == []
        for k, _ in cs.inventory():
            assert cs.delete(k)
        ssd = cs.levels[1].tier
        assert isinstance(ssd, SsdTier)
        # A move the mover began before the deletes still holds its source
        # copy until its write ends; then every byte must be back.
        wait_for(
            lambda: sum(lv.pending_bytes for lv in cs.levels) == 0
            and cs.stats().used_bytes == 0
            and ssd.live_bytes == 0
        )
    finally:
        cs.close()


def test_a_closed_store_refuses_work(tmp_path: Path) -> None:
    cs = open_store(tmp_path)
    put(cs, key(1), blob(1))
    cs.close()
    with pytest.raises(Unavailable):
        cs.acquire(key(1))
    cs.close()


class FlakySsd(SsdTier):
    """An SSD tier whose first allocations fail as a failing device does."""

    def __init__(self, *args: object, failures: int, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.failures = failures

    def allocate(self, size: int) -> int | None:
        if self.failures > 0:
            self.failures -= 1
            raise Unavailable("device went away for a moment")
        return super().allocate(size)


def test_a_failing_device_does_not_stop_tiering_for_good(tmp_path: Path) -> None:
    tier = FlakySsd(tmp_path, 8 * MiB, segment_bytes=MiB, failures=3)
    cs = open_store(
        tmp_path, dram=MiB, tier=tier, cpu_limits=TierLimits(0.3, 0.1), maintenance_interval_s=0.01
    )
    try:
        for i in range(8):  # 512 KiB, above the high watermark: the mover drains
            put(cs, key(i), blob(i))
        # Its first passes hit the failing device; later ones move the chunks.
        wait_for(lambda: tiers(cs)["ssd"].chunks >= 4)  # type: ignore[attr-defined]
        assert tier.failures == 0
        assert all(get(cs, key(i)) == blob(i) for i in range(8))
    finally:
        cs.close()
