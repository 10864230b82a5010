"""Index semantics, the same for every backend: memory, Redis and Redis Cluster.

Time is real here (``time.monotonic()`` for the memory index, Redis's own TTLs
for the Redis one), so expiry tests use short TTLs and sleeps.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from kvdepot.errors import CapacityExceeded, NodeIdTaken, StaleRegistration, Unavailable
from kvdepot.keys import ChunkKey
from kvdepot.metadata.index import IndexBackend, IndexConfig, create_backend
from kvdepot.records import TierStats
from kvdepot.types import (
    COUNT_HITS,
    COUNT_NONE,
    Action,
    InventoryItem,
    LookupCounting,
    NodeInfo,
)
from tests.conftest import _redis_binaries, _start_redis, _stop_redis, free_port

BACKENDS = [
    "memory",
    pytest.param("redis", marks=pytest.mark.redis),
    pytest.param("redis+cluster", marks=pytest.mark.redis),
]
REDIS_BACKENDS = [
    pytest.param("redis", marks=pytest.mark.redis),
    pytest.param("redis+cluster", marks=pytest.mark.redis),
]

MakeIndex = Callable[..., IndexBackend]


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def node(name: str, cap: int = 1 << 30, used: int = 0) -> NodeInfo:
    return NodeInfo(name, f"{name}:1", "", (TierStats("cpu", cap, used),))


def now() -> float:
    return time.monotonic()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture()
def index_url(backend: str, request: pytest.FixtureRequest) -> str:
    """The backend's URL with a key prefix of this test's own."""
    if backend == "memory":
        return "memory://"
    server = request.getfixturevalue("redis_server" if backend == "redis" else "redis_cluster")
    return f"{server}?prefix=t-{uuid.uuid4().hex[:12]}"


@pytest.fixture()
def make_index(index_url: str) -> MakeIndex:
    """Builds indexes over one store: two calls are two metadata replicas."""

    def make(lease_ttl_s: float = 5.0, allocation_ttl_s: float = 10.0) -> IndexBackend:
        return create_backend(IndexConfig(index_url, lease_ttl_s, allocation_ttl_s))

    return make


def run(
    make_index: MakeIndex,
    body: Callable[[IndexBackend], Awaitable[None]],
    **config: float,
) -> None:
    """Run ``body`` on a fresh index on its own event loop, then close it."""

    async def go() -> None:
        index = make_index(**config)
        try:
            await body(index)
        finally:
            await index.close()

    asyncio.run(go())


def test_put_then_lookup_counts_leading_hits(make_index: MakeIndex) -> None:
    async def body(index: IndexBackend) -> None:
        await index.register_node(node("a"), [], now())
        allocs = await index.put_start([key(1), key(2)], [10, 10], "a", now())
        assert [a.action for a in allocs] == [Action.WRITE, Action.WRITE]
        assert allocs[0].node is not None and allocs[0].node.node_id == "a"
        # Uncommitted chunks are invisible.
        assert (await index.lookup([key(1)], "", 0)).hits == 0
        assert await index.put_end("a", [key(1), key(2)], [10, 10]) == 2
        assert await index.put_end("a", [key(1)], [10]) == 0  # already committed
        r = await index.lookup([key(1), key(2), key(3), key(2)], "", 256)
        assert r.hits == 2
        assert r.locations[0].replicas[0].address == "a:1"
        assert r.locations[0].size == 10
        s = await index.stats(now())
        assert (s.hit_keys, s.miss_keys, s.hit_tokens, s.miss_tokens) == (2, 3, 512, 512)
        assert (s.lookups, s.puts_committed, s.bytes_committed, s.chunks) == (2, 2, 20, 2)
        assert [(n.info.node_id, n.chunks_indexed) for n in s.nodes] == [("a", 2)]
        assert 0 < s.nodes[0].lease_remaining_s <= 5
        assert s.nodes[0].info.tiers == node("a").tiers

    run(make_index, body)


def test_lookups_count_what_they_are_told(make_index: MakeIndex) -> None:
    """A prompt's lookup counts once, in the tokens each key covers; the rest
    of it counts its hits only; a load's own lookup counts nothing."""

    async def body(index: IndexBackend) -> None:
        await index.register_node(node("a"), [], now())
        await index.put_start([key(1), key(2), key(3)], [10] * 3, "a", now())
        await index.put_end("a", [key(1), key(2), key(3)], [10] * 3)
        keys = [key(1), key(2), key(3), key(4)]
        r = await index.lookup(keys, "", LookupCounting(256, (256, 256, 128, 128)))
        assert r.hits == 3
        await index.lookup([key(3)], "", LookupCounting(128, (), COUNT_HITS))
        await index.lookup(keys, "", LookupCounting(256, (), COUNT_NONE))
        s = await index.stats(now())
        assert (s.lookups, s.hit_keys, s.miss_keys) == (1, 4, 1)
        assert (s.hit_tokens, s.miss_tokens) == (256 + 256 + 128 + 128, 128)

    run(make_index, body)


def test_existing_and_pending_keys_are_skipped(make_index: MakeIndex) -> None:
    async def body(index: IndexBackend) -> None:
        await index.register_node(node("a"), [], now())
        await index.put_start([key(1)], [100], "a", now())
        await index.put_end("a", [key(1)], [100])
        await index.put_start([key(2)], [100], "a", now())
        allocs = await index.put_start([key(1), key(2), key(3), key(3)], [100] * 4, "a", now())
        assert [a.action for a in allocs] == [
            Action.SKIP_EXISTS,
            Action.SKIP_PENDING,
            Action.WRITE,
            Action.SKIP_PENDING,
        ]
        s = await index.stats(now())
        assert s.chunks_deduplicated == 3 and s.bytes_saved == 300

    run(make_index, body)


def test_uncommitted_allocations_expire_and_revoke(make_index: MakeIndex) -> None:
    async def body(index: IndexBackend) -> None:
        await index.register_node(node("a"), [], now())
        await index.put_start([key(1), key(2)], [1, 1], "a", now())
        assert await index.put_revoke("a", [key(2)]) == 1
        assert await index.put_revoke("b", [key(1)]) == 0  # not b's allocation
        # Explain names the revoked put, on its node; the other key left nothing.
        gone = await index.departures.find([key(2), key(1)])
        assert gone[0] is not None and (gone[0].reason, gone[0].node_id) == ("revoked", "a")
        assert gone[1] is None
        assert (await index.put_start([key(2)], [1], "a", now()))[0].action is Action.WRITE
        # Key 1 still pending until its allocation expires.
        assert (await index.put_start([key(1)], [1], "a", now()))[0].action is Action.SKIP_PENDING
        await asyncio.sleep(0.45)
        assert await index.heartbeat("a", [], now())
        assert await index.expire(now()) == (0, 2)
        # Explain names the expired allocations, on their node (both backends).
        gone = await index.departures.find([key(1), key(2)])
        assert [(g.reason, g.node_id) if g else None for g in gone] == [("expired", "a")] * 2
        assert (await index.put_start([key(1)], [1], "a", now()))[0].action is Action.WRITE
        # An expired allocation that no reaper has seen yet is free as well,
        # and then not counted as expired: it was taken over.
        await index.put_start([key(5)], [1], "a", now())
        await asyncio.sleep(0.45)
        assert (await index.put_start([key(5)], [1], "a", now()))[0].action is Action.WRITE
        assert await index.expire(now()) == (0, 1)  # key 1's second allocation
        assert (await index.stats(now())).allocations_expired == 3

    run(make_index, body, lease_ttl_s=5.0, allocation_ttl_s=0.3)


def test_dead_node_is_dropped_with_its_chunks(make_index: MakeIndex, backend: str) -> None:
    async def body(index: IndexBackend) -> None:
        await index.register_node(node("a"), [InventoryItem(key(1), 5)], now())
        await index.register_node(node("b"), [InventoryItem(key(1), 5, "ssd")], now())
        r = await index.lookup([key(1)], "b", 0)
        assert [x.node_id for x in r.locations[0].replicas] == ["b", "a"]
        r = await index.lookup([key(1)], "", 0)
        assert [x.node_id for x in r.locations[0].replicas] == ["a", "b"]  # cpu before ssd
        await asyncio.sleep(0.45)
        assert await index.heartbeat("a", [], now())
        await asyncio.sleep(0.45)  # b's lease has run out, a's has not
        if backend != "memory":
            # Gone with the lease, before any reaper ran.
            r = await index.lookup([key(1)], "", 0)
            assert [x.node_id for x in r.locations[0].replicas] == ["a"]
        assert await index.expire(now()) == (1, 0)
        assert await index.expire(now()) == (0, 0)
        r = await index.lookup([key(1)], "", 0)
        assert [x.node_id for x in r.locations[0].replicas] == ["a"]
        assert not await index.heartbeat("b", [], now())
        s = await index.stats(now())
        assert [n.info.node_id for n in s.nodes] == ["a"] and s.nodes_expired == 1
        await asyncio.sleep(0.5)
        await index.expire(now())
        assert (await index.lookup([key(1)], "", 0)).hits == 0
        assert (await index.stats(now())).chunks == 0
        with pytest.raises(Unavailable):
            await index.put_start([key(2)], [1], "a", now())

    run(make_index, body, lease_ttl_s=0.8)


def test_removed_replicas_leave_the_index(make_index: MakeIndex) -> None:
    async def body(index: IndexBackend) -> None:
        await index.register_node(node("a"), [InventoryItem(key(i), 5) for i in range(4)], now())
        assert await index.remove_replicas("a", [key(1), key(9)]) == 1
        assert await index.remove_replicas("zz", [key(2)]) == 0
        assert (await index.lookup([key(0), key(1), key(2)], "", 0)).hits == 1
        assert (await index.stats(now())).chunks == 3
        # Re-registration replaces the inventory.
        await index.register_node(node("a"), [InventoryItem(key(7), 5)], now())
        assert (await index.lookup([key(0)], "", 0)).hits == 0
        assert (await index.lookup([key(7)], "", 0)).hits == 1
        s = await index.stats(now())
        assert s.chunks == 1 and s.nodes[0].chunks_indexed == 1

    run(make_index, body)


def test_placement_prefers_writer_then_free_space(make_index: MakeIndex) -> None:
    async def body(index: IndexBackend) -> None:
        await index.register_node(node("a", 100, 90), [], now())
        await index.register_node(node("b", 100, 10), [], now())
        await index.register_node(node("tiny", 4, 0), [], now())
        allocs = await index.put_start([key(1)], [50], "a", now())
        assert allocs[0].node is not None and allocs[0].node.node_id == "a"
        allocs = await index.put_start([key(2), key(3)], [50, 50], "", now())
        assert [a.node.node_id for a in allocs if a.node] == ["b", "b"]
        allocs = await index.put_start([key(4)], [50], "tiny", now())
        assert allocs[0].node is not None and allocs[0].node.node_id != "tiny"
        with pytest.raises(CapacityExceeded):
            await index.put_start([key(5)], [1000], "a", now())
        # Heartbeats update what placement sees.
        assert await index.heartbeat("b", [TierStats("cpu", 100, 100)], now())
        allocs = await index.put_start([key(6)], [50], "", now())
        assert [a.node.node_id for a in allocs if a.node] == ["a"]

    run(make_index, body)


@pytest.mark.parametrize("backend", REDIS_BACKENDS, indirect=True)
def test_index_loss_is_rebuilt_by_registering_again(make_index: MakeIndex, backend: str) -> None:
    async def body(index: IndexBackend) -> None:
        from kvdepot.metadata.index.redis import RedisIndex

        assert isinstance(index, RedisIndex)
        inventory = [InventoryItem(key(i), 5) for i in range(3)]
        await index.register_node(node("a"), inventory, now())
        assert (await index.lookup([key(0), key(1), key(2)], "", 0)).hits == 3
        await index._r.flushall()  # every primary of a cluster
        assert (await index.lookup([key(0)], "", 0)).hits == 0
        assert not await index.heartbeat("a", [], now())
        await index.register_node(node("a"), inventory, now())
        assert await index.heartbeat("a", [], now())
        assert (await index.lookup([key(0), key(1), key(2)], "", 0)).hits == 3

    run(make_index, body)


@pytest.mark.parametrize("backend", REDIS_BACKENDS, indirect=True)
def test_two_replicas_allocate_each_key_once(make_index: MakeIndex) -> None:
    async def go() -> None:
        a, b = make_index(), make_index()
        try:
            await a.register_node(node("s0"), [], now())
            await b.register_node(node("s1"), [], now())
            for round_ in range(3):  # a few rounds to give the race a chance
                keys = [key(1000 * round_ + i) for i in range(128)]
                ra, rb = await asyncio.gather(
                    a.put_start(keys, [10] * 128, "s0", now()),
                    b.put_start(keys, [10] * 128, "s1", now()),
                )
                writes = [
                    (x.action is Action.WRITE) + (y.action is Action.WRITE)
                    for x, y in zip(ra, rb, strict=True)
                ]
                assert writes == [1] * 128
                assert all(x.action is not Action.SKIP_EXISTS for x in ra + rb)
            # Commits through one replica are visible through the other.
            await a.put_end("s0", [key(0)], [10])
            r = await b.lookup([key(0)], "s1", 16)
            assert r.hits == 1 and r.locations[0].replicas[0].node_id == "s0"
            assert (await b.put_start([key(0)], [10], "s1", now()))[0].action is Action.SKIP_EXISTS
            await a.stats(now())  # each flushes the counters it buffered
            await b.stats(now())
            sa, sb = await a.stats(now()), await b.stats(now())
            assert sa.lookups == sb.lookups == 1
            assert sa.chunks_deduplicated == sb.chunks_deduplicated == 3 * 128 + 1
        finally:
            await a.close()
            await b.close()

    asyncio.run(go())


@pytest.mark.parametrize("backend", REDIS_BACKENDS, indirect=True)
def test_odd_node_ids_stay_on_one_slot(make_index: MakeIndex) -> None:
    async def body(index: IndexBackend) -> None:
        for name in ("we{ird}", "}", "{", "%7B"):
            await index.register_node(node(name), [InventoryItem(key(1), 5)], now())
        r = await index.lookup([key(1)], "}", 0)
        assert sorted(x.node_id for x in r.locations[0].replicas) == ["%7B", "we{ird}", "{", "}"]
        assert r.locations[0].replicas[0].node_id == "}"
        assert await index.remove_replicas("{", [key(1)]) == 1
        assert len((await index.lookup([key(1)], "", 0)).locations[0].replicas) == 3

    run(make_index, body)


@pytest.mark.redis
def test_unreachable_redis_is_unavailable() -> None:
    async def go() -> None:
        index = create_backend(IndexConfig(f"redis://127.0.0.1:{free_port()}/0"))
        try:
            with pytest.raises(Unavailable):
                await index.register_node(node("a"), [], now())
            with pytest.raises(Unavailable):
                await index.lookup([key(1)], "", 0)
        finally:
            await index.close()

    asyncio.run(go())


@pytest.mark.redis
def test_a_restarted_redis_breaks_no_call_on_the_dead_pooled_connections(tmp_path: Path) -> None:
    """Each pooled connection dies with the server; its next command runs
    again on a new connection instead of failing (a fault run found PutStart
    Unavailable long after Redis was back, on a connection idle since)."""
    binary = _redis_binaries("redis-server")["redis-server"]
    port = free_port()
    procs = [_start_redis(binary, tmp_path, port)]

    async def go() -> None:
        index = create_backend(IndexConfig(f"redis://127.0.0.1:{port}/0"))
        try:
            await index.register_node(node("a"), [], now())
            # Eight calls at once hold eight connections of the pool.
            await asyncio.gather(*(index.lookup([key(i)], "", 0) for i in range(8)))
            procs[0].kill()
            procs[0].wait()
            procs.append(_start_redis(binary, tmp_path, port))
            await index.register_node(node("a"), [], now())
            hits = await asyncio.gather(*(index.lookup([key(i)], "", 0) for i in range(8)))
            assert [h.hits for h in hits] == [0] * 8
        finally:
            await index.close()

    try:
        asyncio.run(go())
    finally:
        _stop_redis(procs)


def test_big_batches_span_several_calls(make_index: MakeIndex) -> None:
    async def body(index: IndexBackend) -> None:
        n = 2500  # more items than one script call or pipeline takes
        await index.register_node(node("a"), [InventoryItem(key(i), 7) for i in range(n)], now())
        assert (await index.lookup([key(i) for i in range(n)], "", 1)).hits == n
        assert await index.remove_replicas("a", [key(i) for i in range(0, n, 2)]) == n // 2
        assert (await index.lookup([key(1), key(3)], "", 0)).hits == 2
        fresh = [key(10_000 + i) for i in range(n)]
        allocs = await index.put_start(fresh, [7] * n, "a", now())
        assert all(a.action is Action.WRITE for a in allocs)
        assert await index.put_end("a", fresh, [7] * n) == n
        await index.register_node(node("a"), [InventoryItem(k, 7) for k in fresh[:10]], now())
        s = await index.stats(now())
        assert s.chunks == 10 and s.nodes[0].chunks_indexed == 10
        assert (await index.lookup(fresh, "", 0)).hits == 10

    run(make_index, body)


@pytest.mark.parametrize("backend", REDIS_BACKENDS, indirect=True)
def test_two_reapers_count_a_dead_node_once(make_index: MakeIndex) -> None:
    async def go() -> None:
        a, b = make_index(0.5, 0.3), make_index(0.5, 0.3)
        try:
            await a.register_node(node("x"), [InventoryItem(key(i), 5) for i in range(300)], now())
            await a.put_start([key(1000 + i) for i in range(10)], [5] * 10, "x", now())
            await asyncio.sleep(0.7)
            ra, rb = await asyncio.gather(a.expire(now()), b.expire(now()))
            assert (ra[0] + rb[0], ra[1] + rb[1]) == (1, 10)
            assert (await b.lookup([key(0)], "", 0)).hits == 0
            s = await b.stats(now())
            assert (s.nodes, s.chunks, s.nodes_expired, s.allocations_expired) == ((), 0, 1, 10)
        finally:
            await a.close()
            await b.close()

    asyncio.run(go())


@pytest.mark.parametrize("backend", REDIS_BACKENDS, indirect=True)
def test_scripts_flushed_from_the_server_are_loaded_again(make_index: MakeIndex) -> None:
    async def body(index: IndexBackend) -> None:
        from kvdepot.metadata.index.redis import RedisIndex

        assert isinstance(index, RedisIndex)
        await index.register_node(node("a"), [InventoryItem(key(1), 5)], now())
        await index._r.script_flush()  # as after a restart or failover
        allocs = await index.put_start([key(2)], [5], "a", now())
        assert allocs[0].action is Action.WRITE
        assert await index.put_end("a", [key(2)], [5]) == 1
        assert (await index.lookup([key(1), key(2)], "", 0)).hits == 2

    run(make_index, body)


@pytest.mark.parametrize("backend", REDIS_BACKENDS, indirect=True)
def test_lookup_without_prefetched_leases(
    make_index: MakeIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With many nodes a lookup reads the leases its chunks name afterwards.
    from kvdepot.metadata.index import redis as redis_index

    monkeypatch.setattr(redis_index, "_PREFETCH_NODES", 0)

    async def body(index: IndexBackend) -> None:
        await index.register_node(node("a"), [InventoryItem(key(1), 5)], now())
        await index.register_node(node("b"), [InventoryItem(key(1), 5)], now())
        r = await index.lookup([key(1), key(2)], "b", 0)
        assert r.hits == 1 and [x.node_id for x in r.locations[0].replicas] == ["b", "a"]
        await asyncio.sleep(0.6)
        assert await index.heartbeat("a", [], now())
        await asyncio.sleep(0.6)
        r = await index.lookup([key(1)], "b", 0)
        assert [x.node_id for x in r.locations[0].replicas] == ["a"]

    run(make_index, body, lease_ttl_s=1.0)


def test_heartbeat_carries_transfer_rates(make_index: MakeIndex) -> None:
    from kvdepot.records import TransferRate

    async def body(index: IndexBackend) -> None:
        await index.register_node(node("a"), [], now())
        (status,) = (await index.stats(now())).nodes
        assert status.info.transfer == TransferRate()
        rate = TransferRate(bytes_in_per_s=1.5e9, bytes_out_per_s=2.5e8, window_s=10.0)
        assert await index.heartbeat("a", [], now(), rate)
        # Tiers only, as an older store sends: the rates stay.
        assert await index.heartbeat("a", [TierStats("cpu", 100, 7)], now())
        (status,) = (await index.stats(now())).nodes
        assert status.info.transfer == rate
        assert status.info.tiers == (TierStats("cpu", 100, 7),)

    run(make_index, body)


def test_a_retried_put_start_gets_its_allocations_again(make_index: MakeIndex) -> None:
    async def body(index: IndexBackend) -> None:
        await index.register_node(node("a"), [], now())
        await index.register_node(node("b"), [], now())
        first = await index.put_start([key(1), key(2)], [10, 10], "a", now(), b"X" * 16)
        assert [(x.action, x.node and x.node.node_id) for x in first] == [(Action.WRITE, "a")] * 2
        # The retry of that put (its reply lost) gets the same node, even
        # where placement would now choose another (writer "b").
        again = await index.put_start([key(1), key(3), key(1)], [10] * 3, "b", now(), b"X" * 16)
        assert again[0] == first[0]
        assert again[1].action is Action.WRITE and again[1].node and again[1].node.node_id == "b"
        assert again[2].action is Action.SKIP_PENDING  # repeated within the put
        # Another put, or one without an id (an older client), is told pending.
        for other in (b"Y" * 16, b""):
            got = await index.put_start([key(2)], [10], "b", now(), other)
            assert got[0].action is Action.SKIP_PENDING
        # One allocation, not two: PutEnd on "a" commits and clears it, and
        # PutRevoke of "b" (not its node) leaves it alone.
        assert await index.put_revoke("b", [key(2)]) == 0
        assert await index.put_end("a", [key(1), key(2)], [10, 10]) == 2
        got = await index.put_start([key(1), key(2)], [10, 10], "a", now(), b"X" * 16)
        assert [x.action for x in got] == [Action.SKIP_EXISTS] * 2
        assert await index.put_revoke("b", [key(3)]) == 1
        assert await index.expire(now()) == (0, 0)

    run(make_index, body)


def test_a_retry_whose_node_died_is_placed_anew(make_index: MakeIndex) -> None:
    async def body(index: IndexBackend) -> None:
        await index.register_node(node("a"), [], now())
        await index.register_node(node("b"), [], now())
        got = await index.put_start([key(1)], [10], "a", now(), b"X")
        assert got[0].node is not None and got[0].node.node_id == "a"
        await asyncio.sleep(0.45)
        assert await index.heartbeat("b", [], now())
        await asyncio.sleep(0.45)  # a's lease has run out, b's has not
        assert await index.expire(now()) == (1, 0)
        got = await index.put_start([key(1)], [10], "a", now(), b"X")
        assert got[0].action is Action.WRITE and got[0].node and got[0].node.node_id == "b"
        assert await index.put_end("b", [key(1)], [10]) == 1
        assert (await index.lookup([key(1)], "", 0)).hits == 1

    run(make_index, body, lease_ttl_s=0.8)


@pytest.mark.parametrize("backend", REDIS_BACKENDS, indirect=True)
def test_a_put_start_retried_on_another_replica_gets_the_same_allocation(
    make_index: MakeIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replica A allocated and its reply was lost; the client retries on B."""
    from kvdepot.metadata.index.redis import RedisIndex

    async def go() -> None:
        a, b = make_index(), make_index()
        try:
            await a.register_node(node("s0"), [], now())
            await a.register_node(node("s1"), [], now())
            keys = [key(i) for i in range(8)]
            first = await a.put_start(keys, [10] * 8, "s0", now(), b"X" * 16)
            assert {x.node.node_id for x in first if x.node} == {"s0"}
            assert await b.put_start(keys, [10] * 8, "s1", now(), b"X" * 16) == first
            got = await b.put_start(keys, [10] * 8, "s1", now(), b"Y" * 16)
            assert all(x.action is Action.SKIP_PENDING for x in got)
            assert await b.put_end("s0", keys, [10] * 8) == 8

            # A slow (not dead) A allocates after B read the index and before
            # B's own allocation: B still answers the same allocation.
            assert isinstance(b, RedisIndex)
            late = [key(100 + i) for i in range(4)]
            original = b._live_nodes
            first_late: list[Any] = []

            async def a_allocates_meanwhile(*args: Any) -> Any:
                first_late.extend(await a.put_start(late, [10] * 4, "s0", now(), b"Z" * 16))
                return await original(*args)

            monkeypatch.setattr(b, "_live_nodes", a_allocates_meanwhile)
            got = await b.put_start(late, [10] * 4, "s1", now(), b"Z" * 16)
            assert [x.node.node_id for x in first_late if x.node] == ["s0"] * 4
            assert got == first_late
        finally:
            await a.close()
            await b.close()

    asyncio.run(go())


def test_a_node_id_is_owned_by_the_instance_holding_its_lease(make_index: MakeIndex) -> None:
    async def body(index: IndexBackend) -> None:
        inventory = [InventoryItem(key(i), 5) for i in range(3)]
        e1 = await index.register_node(node("a"), inventory, now(), "inst-1")
        assert e1 > 0
        # Another instance is refused while the lease lives; nothing changes.
        with pytest.raises(NodeIdTaken, match=r"'a'.*held by another live store instance"):
            await index.register_node(node("a"), [], now(), "inst-2")
        assert (await index.lookup([key(0), key(1), key(2)], "", 0)).hits == 3
        assert await index.heartbeat("a", [], now(), epoch=e1)
        # The same instance (a restart on its SSD directory) takes it back at once.
        e2 = await index.register_node(node("a"), inventory[:2], now(), "inst-1")
        assert e2 > e1
        # A heartbeat of the replaced registration is refused and renews nothing.
        with pytest.raises(StaleRegistration, match=f"'a'.*epoch {e1}"):
            await index.heartbeat("a", [], now(), epoch=e1)
        assert await index.heartbeat("a", [], now(), epoch=e2)
        # Forced, another instance takes the id over; the old one is stale.
        e3 = await index.register_node(node("a"), [], now(), "inst-2", force=True)
        assert e3 > e2
        with pytest.raises(StaleRegistration):
            await index.heartbeat("a", [], now(), epoch=e2)
        assert (await index.lookup([key(0)], "", 0)).hits == 0
        s = await index.stats(now())
        assert [(n.info.node_id, n.chunks_indexed) for n in s.nodes] == [("a", 0)]
        # Once the lease has run out, any instance may register the id.
        await asyncio.sleep(0.9)
        assert await index.expire(now()) == (1, 0)
        e4 = await index.register_node(node("a"), inventory, now(), "inst-3")
        assert e4 > e3
        assert (await index.lookup([key(0), key(1), key(2)], "", 0)).hits == 3
        assert await index.heartbeat("a", [], now(), epoch=e4)

    run(make_index, body, lease_ttl_s=0.6)


def test_an_expired_lease_is_taken_over_before_any_reaper_ran(make_index: MakeIndex) -> None:
    async def body(index: IndexBackend) -> None:
        old = await index.register_node(node("a"), [InventoryItem(key(1), 5)], now(), "inst-1")
        await asyncio.sleep(0.9)
        new = await index.register_node(node("a"), [InventoryItem(key(2), 5)], now(), "inst-2")
        with pytest.raises(StaleRegistration):
            await index.heartbeat("a", [], now(), epoch=old)
        assert await index.heartbeat("a", [], now(), epoch=new)
        assert (await index.lookup([key(1)], "", 0)).hits == 0
        assert (await index.lookup([key(2)], "", 0)).hits == 1

    run(make_index, body, lease_ttl_s=0.6)
