"""Tests of the DRAM chunk table: two-phase writes, leases, LRU eviction."""

from __future__ import annotations

import array
import os
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash

from kvdepot.errors import CapacityExceeded, InvalidArgument, Unavailable
from kvdepot.keys import ChunkKey
from kvdepot.store.arena import Arena
from kvdepot.store.chunks import ChunkStore, ChunkTooLarge, checksum

PAGE = 4096
MiB = 1 << 20


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


class Removed:
    """Records what ``on_removed`` reports."""

    def __init__(self) -> None:
        self.keys: list[ChunkKey] = []

    def __call__(self, keys: list[ChunkKey]) -> None:
        self.keys.extend(keys)


@pytest.fixture
def removed() -> Removed:
    return Removed()


@pytest.fixture
def store(removed: Removed) -> Iterator[ChunkStore]:
    cs = ChunkStore(16 * PAGE, on_removed=removed)
    yield cs
    cs.close()


def put(cs: ChunkStore, k: ChunkKey, size: int = PAGE, fill: int = 1) -> None:
    data = bytes([fill]) * size
    res = cs.reserve(k, size, checksum(data))
    assert res is not None
    res.view[:] = data
    cs.commit(res)


def test_checksum_is_xxh3_64_of_the_raw_bytes() -> None:
    data = os.urandom(1000)
    assert checksum(data) == xxhash.xxh3_64_intdigest(data)
    assert checksum(memoryview(data)) == checksum(bytearray(data))
    shorts = array.array("H", range(100))
    assert checksum(memoryview(shorts)) == xxhash.xxh3_64_intdigest(shorts.tobytes())


def test_reservation_is_invisible_until_commit(store: ChunkStore) -> None:
    res = store.reserve(key(1), 100, 42)
    assert res is not None
    assert (res.size, res.checksum, len(res.view)) == (100, 42, 100)
    assert not res.view.readonly
    assert not store.contains(key(1))
    assert store.acquire(key(1)) is None
    assert store.inventory() == []
    store.commit(res)
    assert store.contains(key(1))
    assert store.inventory() == [(key(1), 100)]
    lease = store.acquire(key(1))
    assert lease is not None
    assert (lease.size, lease.checksum) == (100, 42)
    assert lease.view.readonly
    store.release(lease)


def test_revoke_frees_and_never_shows(store: ChunkStore) -> None:
    res = store.reserve(key(1), 3 * PAGE, 0)
    assert res is not None
    assert store.stats().used_bytes == 3 * PAGE
    store.revoke(res)
    assert not store.contains(key(1))
    assert store.stats().used_bytes == 0
    store.revoke(res)  # idempotent for cleanup paths
    with pytest.raises(InvalidArgument):
        store.commit(res)
    # The key can be written again.
    put(store, key(1))
    assert store.contains(key(1))


def test_reserve_returns_none_for_existing_or_in_flight_keys(store: ChunkStore) -> None:
    res = store.reserve(key(1), PAGE, 0)
    assert res is not None
    assert store.reserve(key(1), PAGE, 0) is None
    store.commit(res)
    assert store.reserve(key(1), PAGE, 0) is None
    with pytest.raises(InvalidArgument):
        store.commit(res)
    store.revoke(res)  # already committed: no effect
    assert store.contains(key(1))


def test_invalid_sizes_and_keys(store: ChunkStore) -> None:
    with pytest.raises(InvalidArgument):
        store.reserve(key(1), 0, 0)
    with pytest.raises(InvalidArgument):
        store.reserve(ChunkKey(b"short"), PAGE, 0)
    with pytest.raises(CapacityExceeded, match="larger than the store"):
        store.reserve(key(1), 17 * PAGE, 0)
    # Too large for this store is both a capacity and an argument problem.
    with pytest.raises(InvalidArgument):
        store.reserve(key(1), 17 * PAGE, 0)
    assert issubclass(ChunkTooLarge, CapacityExceeded)
    limited = ChunkStore(16 * PAGE, max_chunk_bytes=2 * PAGE)
    try:
        with pytest.raises(InvalidArgument, match="limit"):
            limited.reserve(key(1), 2 * PAGE + 1, 0)
        assert limited.reserve(key(1), 2 * PAGE, 0) is not None
    finally:
        limited.close()


def test_lru_evicts_least_recently_used_first(store: ChunkStore, removed: Removed) -> None:
    for i in range(4):
        put(store, key(i), 4 * PAGE)
    # Reading 0 makes 1 the least recently used.
    lease = store.acquire(key(0))
    assert lease is not None
    store.release(lease)
    put(store, key(10), 4 * PAGE)
    assert removed.keys == [key(1)]
    assert [k for k, _ in store.inventory()] == [key(2), key(3), key(0), key(10)]
    put(store, key(11), 8 * PAGE)
    assert removed.keys == [key(1), key(2), key(3)]
    assert store.stats().evictions == 3


def test_eviction_skips_leased_chunks(store: ChunkStore, removed: Removed) -> None:
    for i in range(4):
        put(store, key(i), 4 * PAGE)
    leases = [store.acquire(key(0)), store.acquire(key(1))]
    put(store, key(10), 8 * PAGE)
    assert removed.keys == [key(2), key(3)]
    assert store.contains(key(0)) and store.contains(key(1))
    for lease in leases:
        assert lease is not None
        store.release(lease)


def test_capacity_exceeded_when_everything_is_leased(store: ChunkStore, removed: Removed) -> None:
    for i in range(4):
        put(store, key(i), 4 * PAGE)
    leases = [store.acquire(key(i)) for i in range(4)]
    with pytest.raises(CapacityExceeded, match="no room"):
        store.reserve(key(10), PAGE, 0)
    # Failing fast: nothing was evicted for a put that could not succeed.
    assert removed.keys == []
    assert store.stats().rejected == 1
    for lease in leases:
        assert lease is not None
        store.release(lease)
    put(store, key(10), PAGE)
    assert removed.keys == [key(0)]


def test_in_flight_writes_are_never_evicted(store: ChunkStore) -> None:
    res = store.reserve(key(1), 12 * PAGE, 0)
    assert res is not None
    with pytest.raises(CapacityExceeded):
        store.reserve(key(2), 8 * PAGE, 0)
    store.revoke(res)


def test_delete_while_leased_frees_at_last_release(store: ChunkStore, removed: Removed) -> None:
    put(store, key(1), 4 * PAGE, fill=7)
    a = store.acquire(key(1))
    b = store.acquire(key(1))
    assert a is not None and b is not None
    assert store.delete(key(1))
    assert removed.keys == [key(1)]
    assert not store.contains(key(1))
    assert store.acquire(key(1)) is None
    assert not store.delete(key(1))
    # The memory stays pinned for the readers: neither evicted nor reused.
    with pytest.raises(CapacityExceeded):
        store.reserve(key(5), 16 * PAGE, 0)
    put(store, key(1), 4 * PAGE, fill=9)
    put(store, key(2), 8 * PAGE, fill=8)
    put(store, key(3), 8 * PAGE, fill=6)  # evicts the new key(1) and key(2)
    assert bytes(a.view) == b"\x07" * 4 * PAGE
    store.release(a)
    assert store.stats().used_bytes == 12 * PAGE
    store.release(b)
    assert store.stats().used_bytes == 8 * PAGE
    with pytest.raises(InvalidArgument):
        store.release(b)
    put(store, key(5), 16 * PAGE)
    assert store.inventory() == [(key(5), 16 * PAGE)]


def test_delete_does_not_touch_writes_in_flight(store: ChunkStore) -> None:
    res = store.reserve(key(1), PAGE, 0)
    assert res is not None
    assert not store.delete(key(1))
    store.commit(res)
    assert store.delete(key(1))
    assert store.stats().used_bytes == 0


def test_failing_callback_does_not_break_puts() -> None:
    def boom(keys: list[ChunkKey]) -> None:
        raise RuntimeError("listener down")

    cs = ChunkStore(4 * PAGE, on_removed=boom)
    try:
        put(cs, key(1), 4 * PAGE)
        put(cs, key(2), 4 * PAGE)
        assert cs.contains(key(2)) and not cs.contains(key(1))
    finally:
        cs.close()


def test_callback_runs_outside_the_lock() -> None:
    seen: list[bool] = []
    cs: ChunkStore

    def reenter(keys: list[ChunkKey]) -> None:
        # Would deadlock if called under the store's lock.
        seen.append(cs.contains(keys[0]))

    cs = ChunkStore(4 * PAGE, on_removed=reenter)
    try:
        put(cs, key(1), 4 * PAGE)
        put(cs, key(2), 4 * PAGE)
        assert seen == [False]
    finally:
        cs.close()


def test_stats_count_hits_misses_puts(store: ChunkStore) -> None:
    put(store, key(1), 100)
    assert store.acquire(key(2)) is None
    lease = store.acquire(key(1))
    assert lease is not None
    store.release(lease)
    s = store.stats()
    assert (s.capacity_bytes, s.used_bytes, s.chunks) == (16 * PAGE, PAGE, 1)
    assert (s.hits, s.misses, s.puts, s.evictions, s.rejected) == (1, 1, 1, 0, 0)


def test_acquire_many_leases_each_found_chunk_once_per_asking(store: ChunkStore) -> None:
    put(store, key(1), 100, fill=1)
    put(store, key(2), 2 * PAGE, fill=2)
    got = store.acquire_many([key(1), key(3), key(2), key(1)])
    first, missing, second, again = got
    assert missing is None and first is not None and second is not None and again is not None
    assert first is not again and bytes(again.view) == bytes(first.view) == b"\x01" * 100
    assert bytes(second.view) == b"\x02" * (2 * PAGE) and second.view.readonly
    s = store.stats()
    assert (s.hits, s.misses) == (3, 1)
    # Leased: a delete waits for the last release to free the bytes.
    assert store.delete(key(1))
    store.release_many([first, second])
    assert store.stats().used_bytes == 3 * PAGE
    store.release(again)
    assert store.stats().used_bytes == 2 * PAGE
    with pytest.raises(InvalidArgument):
        store.release(first)


def test_churn_of_mixed_sizes_does_not_leak() -> None:
    rng = random.Random(11)
    cs = ChunkStore(4 * MiB)
    try:
        leases = []
        for i in range(3000):
            op = rng.random()
            if op < 0.6:
                size = rng.choice([1, 5000, 64 << 10, 256 << 10, 1 * MiB])
                try:
                    res = cs.reserve(key(rng.randrange(400)), size, 0)
                except CapacityExceeded:
                    continue
                if res is None:
                    continue
                if rng.random() < 0.1:
                    cs.revoke(res)
                else:
                    cs.commit(res)
            elif op < 0.8:
                lease = cs.acquire(key(rng.randrange(400)))
                if lease is not None:
                    leases.append(lease)
            elif op < 0.9 and leases:
                cs.release(leases.pop(rng.randrange(len(leases))))
            else:
                cs.delete(key(rng.randrange(400)))
            if i % 100 == 0:
                s = cs.stats()
                assert s.used_bytes <= s.capacity_bytes
        for lease in leases:
            cs.release(lease)
        leases.clear()
        for k, _ in cs.inventory():
            assert cs.delete(k)
        s = cs.stats()
        assert (s.used_bytes, s.chunks) == (0, 0)
        assert s.evictions > 0
    finally:
        cs.close()


def test_concurrent_writers_and_readers_do_not_leak() -> None:
    cs = ChunkStore(2 * MiB)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(400):
                k = key(rng.randrange(64))
                size = rng.choice([PAGE, 32 << 10, 128 << 10])
                data = bytes([seed]) * size
                try:
                    res = cs.reserve(k, size, checksum(data))
                except CapacityExceeded:
                    continue
                if res is not None:
                    res.view[:] = data
                    cs.commit(res)
                lease = cs.acquire(k)
                if lease is not None:
                    # A leased chunk's bytes never change under the reader.
                    first = bytes(lease.view)
                    assert checksum(first) == lease.checksum
                    cs.release(lease)
                if rng.random() < 0.2:
                    cs.delete(k)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert errors == []
        for k, _ in cs.inventory():
            cs.delete(k)
        assert cs.stats().used_bytes == 0
    finally:
        cs.close()


def test_closed_store_refuses_work() -> None:
    cs = ChunkStore(4 * PAGE)
    put(cs, key(1))
    lease = cs.acquire(key(1))
    assert lease is not None
    del lease
    cs.close()
    with pytest.raises(Unavailable):
        cs.reserve(key(2), PAGE, 0)
    with pytest.raises(Unavailable):
        cs.acquire(key(1))
    assert not cs.delete(key(1))
    cs.close()


def test_shared_arena_file_is_mapped_and_unlinked(tmp_path: Path) -> None:
    path = tmp_path / "arena"
    arena = Arena(8 * PAGE, path=str(path))
    try:
        assert arena.path == str(path) and arena.capacity == 8 * PAGE
        view = arena.view(PAGE, 4)
        view[:] = b"kvdp"
        view.release()
        with open(path, "rb") as f:
            f.seek(PAGE)
            assert f.read(4) == b"kvdp"
        with pytest.raises(InvalidArgument):
            arena.view(7 * PAGE, PAGE + 1)
    finally:
        arena.close()
    assert not path.exists()
    with pytest.raises(Unavailable):
        arena.view(0, 1)


def test_store_on_a_shared_arena(tmp_path: Path) -> None:
    path = tmp_path / "store.arena"
    cs = ChunkStore(4 * PAGE, arena_path=str(path))
    put(cs, key(1), 10, fill=3)
    assert path.stat().st_size == 4 * PAGE
    cs.close()
    assert not path.exists()
