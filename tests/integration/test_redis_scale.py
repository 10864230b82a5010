"""The Redis index at scale: compact buckets, paged registration, bounded cleanup.

Each test runs on a real redis-server (``tests/conftest.py``); the memory test
starts one of its own, so that what it measures is its own and the million
chunks it leaves do not slow other tests' sweeps.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvdepot.errors import NotFound, StaleRegistration
from kvdepot.keys import ChunkKey
from kvdepot.metadata.explain import explain
from kvdepot.metadata.index import IndexConfig, create_backend
from kvdepot.metadata.index import redis_scripts as scripts
from kvdepot.metadata.index.base import MAX_PAGE_CHUNKS, InventoryPage
from kvdepot.metadata.index.departures import DepartureConfig
from kvdepot.metadata.index.redis import RedisIndex
from kvdepot.metadata.index.redis_client import Connection
from kvdepot.metadata.index.redis_layout import replicas
from kvdepot.records import TierStats
from kvdepot.types import NodeInfo
from tests.conftest import _redis_binaries, _start_redis, _stop_redis, free_port

pytestmark = pytest.mark.redis

REDIS_BACKENDS = ["redis", "redis+cluster"]


def node(name: str) -> NodeInfo:
    return NodeInfo(name, f"{name}:1", "", (TierStats("cpu", 1 << 40, 0),))


def now() -> float:
    return time.monotonic()


def random_keys(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).bytes(16 * n)


def page_of(keys: bytes, start: int, end: int, size: int = 1 << 20) -> InventoryPage:
    n = end - start
    return InventoryPage(
        keys[16 * start : 16 * end],
        np.full(n, size, dtype=np.uint64),
        np.ones(n, dtype=np.uint8),  # cpu
    )


def key_at(keys: bytes, i: int) -> ChunkKey:
    return ChunkKey(keys[16 * i : 16 * i + 16])


async def register(index: RedisIndex, name: str, keys: bytes, n: int) -> int:
    epoch = await index.register_begin(node(name), now())
    for start in range(0, n, MAX_PAGE_CHUNKS):
        end = min(n, start + MAX_PAGE_CHUNKS)
        await index.register_page(name, epoch, page_of(keys, start, end), now(), end == n)
    return epoch


def make(url: str, lease_ttl_s: float = 5.0) -> RedisIndex:
    index = create_backend(IndexConfig(url, lease_ttl_s, 10.0))
    assert isinstance(index, RedisIndex)
    return index


@pytest.fixture(params=REDIS_BACKENDS)
def index_url(request: pytest.FixtureRequest) -> str:
    server = request.getfixturevalue(
        "redis_server" if request.param == "redis" else "redis_cluster"
    )
    return f"{server}?prefix=s-{uuid.uuid4().hex[:12]}"


@pytest.fixture()
def own_server(tmp_path: Path) -> Iterator[int]:
    binary = _redis_binaries("redis-server")["redis-server"]
    port = free_port()
    proc = _start_redis(binary, tmp_path, port)
    try:
        yield port
    finally:
        _stop_redis([proc])


class TripLog:
    """Records the chunk items of every round trip of a connection."""

    def __init__(self, db: Connection, script: scripts.Script) -> None:
        self.items: list[int] = []
        pipeline = db.pipeline

        async def logged(cmds: Any) -> list[Any]:
            n = sum(int(c[2]) for c in cmds if c[0] == "EVALSHA" and c[1] == script.sha)
            if n:
                self.items.append(n)
            return await pipeline(cmds)

        db.pipeline = logged  # type: ignore[method-assign]


def test_a_million_chunks_take_at_most_80_bytes_each(own_server: int) -> None:
    n = 1_000_000

    async def go() -> None:
        index = make(f"redis://127.0.0.1:{own_server}/0")
        try:
            await index.register_begin(node("warm"), now())  # the scripts, the layout
            before = (await index._r.info("memory"))["used_memory"]
            keys = random_keys(n, 1)
            await register(index, "a", keys, n)
            grown = (await index._r.info("memory"))["used_memory"] - before
            assert grown / n <= 80, f"{grown / n:.1f} bytes a chunk"
            s = await index.stats(now())
            assert {x.info.node_id: x.chunks_indexed for x in s.nodes}["a"] == n
            probe = [key_at(keys, i) for i in range(0, n, n // 64)]
            assert (await index.lookup(probe, "", 0)).hits == len(probe)
        finally:
            await index.close()

    asyncio.run(go())


def test_a_long_registration_lets_lookups_and_heartbeats_through(index_url: str) -> None:
    """A registration of many pages runs in bounded round trips; meanwhile
    another node's heartbeats keep its short lease and lookups answer."""
    n = 3 * MAX_PAGE_CHUNKS

    async def go() -> None:
        index = make(index_url, lease_ttl_s=1.0)
        trips = TripLog(index._db, scripts.PAGE_ADD)
        try:
            small = random_keys(64, 2)
            await register(index, "small", small, 64)
            probe = [key_at(small, i) for i in range(64)]
            done = asyncio.Event()
            latencies: list[float] = []
            beats: list[bool] = []

            async def lookups() -> None:
                while not done.is_set():
                    t = time.perf_counter()
                    assert (await index.lookup(probe, "small", 0)).hits == 64
                    latencies.append(time.perf_counter() - t)
                    await asyncio.sleep(0.01)

            async def heartbeats() -> None:
                while not done.is_set():
                    beats.append(await index.heartbeat("small", [], now()))
                    await asyncio.sleep(0.2)

            async def registration() -> None:
                try:
                    await register(index, "big", random_keys(n, 3), n)
                finally:
                    done.set()

            t = time.perf_counter()
            await asyncio.gather(lookups(), heartbeats(), registration())
            took = time.perf_counter() - t
            assert beats and all(beats), "the small node lost its lease"
            assert len(latencies) > 10 and max(latencies) < max(1.0, took / 4)
            assert max(trips.items) <= 4096 and sum(trips.items) >= n
            s = await index.stats(now())
            counts = {x.info.node_id: x.chunks_indexed for x in s.nodes}
            assert counts == {"small": 64, "big": n}
        finally:
            await index.close()

    asyncio.run(go())


def test_a_dead_node_vanishes_at_once_and_is_swept_in_steps(
    index_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    n = 20_000

    async def go() -> None:
        index = make(index_url, lease_ttl_s=1.0)
        trips = TripLog(index._db, scripts.SWEEP)
        try:
            dead = random_keys(n, 4)
            live = random_keys(100, 5) + dead[:16]  # a chunk on both nodes
            gone = await register(index, "dead", dead, n)
            await register(index, "live", live, 101)
            shared = [key_at(dead, 0), key_at(live, 0)]
            for _ in range(8):
                await asyncio.sleep(0.2)
                assert await index.heartbeat("live", [], now())
            # Gone with the lease, before any reaper ran; the live replica stays.
            probe = [key_at(dead, i) for i in range(1, n, n // 50)]
            assert (await index.lookup(probe, "", 0)).hits == 0
            r = await index.lookup(shared, "", 0)
            assert r.hits == 2 and [x.node_id for x in r.locations[0].replicas] == ["live"]

            assert index._sweeper is not None
            index._sweeper.grace_s = 0.0  # nothing in flight: forget it at the end
            index.sweep_budget_s = 0.0  # one step of about 64 buckets a call
            with caplog.at_level(logging.INFO, logger="kvdepot.metadata.index"):
                assert (await index.expire(now()))[0] == 1
                calls = 1
                # Until the pass that deleted them ends and forgets the registration.
                while await index._r.hlen(index._k_dead) and calls < 10_000:
                    assert await index.heartbeat("live", [], now())
                    await index.expire(now())
                    calls += 1
            assert not await leftovers(index, gone)
            assert calls > 3, "the sweep ran in one go"
            assert max(trips.items) <= 1024
            text = caplog.text
            assert f"node dead lease expired: dropped with {n} chunks" in text
            assert f"registration {gone} cleaned up, {n} replicas deleted ({n} indexed" in text
            r = await index.lookup(shared, "", 0)
            assert r.hits == 2 and [x.node_id for x in r.locations[0].replicas] == ["live"]
            assert (await index.stats(now())).chunks == 101
        finally:
            await index.close()

    asyncio.run(go())


def test_the_sweep_records_a_lost_chunk_before_it_deletes_it(index_url: str) -> None:
    """``Explain`` reads a chunk's record, then the history: a sweep between
    the two must not leave the chunk in neither."""
    n, keep = 3000, 500

    async def go() -> None:
        config = IndexConfig(index_url, 1.0, 10.0, departures=DepartureConfig(per_node=keep))
        index = create_backend(config)
        assert isinstance(index, RedisIndex)
        try:
            dead = random_keys(n, 6)
            await register(index, "dead", dead, n)
            await asyncio.sleep(1.2)
            await index._layout()
            sweeper = index._sweeper
            assert sweeper is not None and sweeper._on_lost is not None
            told: list[ChunkKey] = []
            tell = sweeper._on_lost

            async def checked(node_id: str, at: float, keys: list[ChunkKey]) -> None:
                still = await index.lost_with_node(keys)
                assert set(still) == set(keys), "told of after they were deleted"
                assert {v[0] for v in still.values()} == {node_id} == {"dead"}
                told.extend(keys)
                await tell(node_id, at, keys)

            sweeper._on_lost = checked
            sweeper.grace_s = 0.0
            index.sweep_budget_s = 0.0
            calls = 0
            await index.expire(now())
            while await index._r.hlen(index._k_dead) and calls < 10_000:
                await index.expire(now())
                calls += 1
            everything = [key_at(dead, i) for i in range(n)]
            assert not await index.lost_with_node(everything)
            # The history keeps its newest per node: told of that many, and
            # of fewer once the pass had told of a node's worth.
            assert keep <= len(told) < keep + sweeper._lost_per_step
            found = await index.departures.find(told[-keep:])
            assert all(
                d is not None and (d.node_id, d.reason) == ("dead", "node_lost") for d in found
            )
            answers = await explain(index, told[-keep:], "")
            assert {a.departure.node_id for a in answers} == {"dead"}
        finally:
            await index.close()

    asyncio.run(go())


async def leftovers(index: RedisIndex, epoch: int) -> int:
    """Replicas of the registration ``epoch`` still in the buckets."""
    assert index._b is not None
    found = 0
    client: Any = index._r
    async for bucket in client.scan_iter(match=index._b.pattern, count=1000):
        for value in (await client.hgetall(bucket)).values():
            found += sum(1 for e, _ in replicas(value) if e == epoch)
    return found


def test_pages_are_idempotent_and_belong_to_their_registration(index_url: str) -> None:
    async def go() -> None:
        index = make(index_url, lease_ttl_s=0.6)
        try:
            keys = random_keys(5000, 6)
            first = await index.register_begin(node("a"), now())
            page = page_of(keys, 0, 3000)
            assert await index.register_page("a", first, page, now()) == (3000, 3000)
            assert await index.register_page("a", first, page, now()) == (0, 3000)
            more = page_of(keys, 2000, 5000)
            assert await index.register_page("a", first, more, now(), True) == (2000, 5000)
            assert (await index.lookup([key_at(keys, i) for i in range(5000)], "", 0)).hits == 5000

            second = await index.register_begin(node("a"), now())
            assert second > first
            with pytest.raises(StaleRegistration):
                await index.register_page("a", first, page_of(keys, 0, 10), now())
            assert (await index.lookup([key_at(keys, 0)], "", 0)).hits == 0
            assert await index.register_page("a", second, page_of(keys, 0, 10), now()) == (10, 10)
            assert (await index.lookup([key_at(keys, i) for i in range(20)], "", 0)).hits == 10

            await asyncio.sleep(0.8)  # the lease runs out
            with pytest.raises(NotFound):
                await index.register_page("a", second, page_of(keys, 10, 20), now())
            assert (await index.lookup([key_at(keys, 0)], "", 0)).hits == 0
        finally:
            await index.close()

    asyncio.run(go())


def test_the_first_replica_sets_the_bucket_bits_for_all(
    redis_server: str, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"{redis_server}?prefix=s-{uuid.uuid4().hex[:12]}"

    async def go() -> None:
        first, other = make(f"{url}&bucket_bits=12"), make(f"{url}&bucket_bits=20")
        try:
            keys = random_keys(100, 7)
            await register(first, "a", keys, 100)
            with caplog.at_level(logging.WARNING, logger="kvdepot.metadata.index"):
                assert (
                    await other.lookup([key_at(keys, i) for i in range(100)], "", 0)
                ).hits == 100
            assert "bucket_bits=20 in the URL, but the index has 12" in caplog.text
            assert other._b is not None and other._b.bits == 12
            buckets = [k async for k in first._r.scan_iter(match=f"{first._p}:b:*")]
            assert 0 < len(buckets) <= 1 << 12
        finally:
            await first.close()
            await other.close()

    asyncio.run(go())
