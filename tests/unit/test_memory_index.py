"""The embedded index: leases, two-phase puts, leading-hit lookups."""

from __future__ import annotations

import asyncio

import pytest

from kvdepot.errors import Unavailable
from kvdepot.keys import ChunkKey
from kvdepot.metadata.index import IndexConfig, create_backend
from kvdepot.records import TierStats
from kvdepot.types import Action, InventoryItem, NodeInfo


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def node(name: str, cap: int = 1 << 30, used: int = 0) -> NodeInfo:
    return NodeInfo(name, f"{name}:1", "", (TierStats("cpu", cap, used),))


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


@pytest.fixture()
def index():  # type: ignore[no-untyped-def]
    return create_backend(IndexConfig(lease_ttl_s=5.0, allocation_ttl_s=10.0))


def test_put_then_lookup_counts_leading_hits(index) -> None:  # type: ignore[no-untyped-def]
    async def go() -> None:
        await index.register_node(node("a"), [], now=0)
        allocs = await index.put_start([key(1), key(2)], [10, 10], "a", now=0)
        assert [a.action for a in allocs] == [Action.WRITE, Action.WRITE]
        assert allocs[0].node.node_id == "a"
        # Uncommitted chunks are invisible.
        assert (await index.lookup([key(1)], "", 0)).hits == 0
        assert await index.put_end("a", [key(1), key(2)], [10, 10]) == 2
        r = await index.lookup([key(1), key(2), key(3), key(2)], "", 256)
        assert r.hits == 2
        assert r.locations[0].replicas[0].address == "a:1"
        s = await index.stats(now=0)
        assert (s.hit_keys, s.miss_keys, s.hit_tokens, s.miss_tokens) == (2, 3, 512, 512)

    run(go())


def test_existing_and_pending_keys_are_skipped(index) -> None:  # type: ignore[no-untyped-def]
    async def go() -> None:
        await index.register_node(node("a"), [], now=0)
        await index.put_start([key(1)], [100], "a", now=0)
        await index.put_end("a", [key(1)], [100])
        await index.put_start([key(2)], [100], "a", now=0)
        allocs = await index.put_start([key(1), key(2), key(3), key(3)], [100] * 4, "a", now=1)
        assert [a.action for a in allocs] == [
            Action.SKIP_EXISTS, Action.SKIP_PENDING, Action.WRITE, Action.SKIP_PENDING,
        ]
        s = await index.stats(now=1)
        assert s.chunks_deduplicated == 3 and s.bytes_saved == 300

    run(go())


def test_uncommitted_allocations_expire_and_revoke(index) -> None:  # type: ignore[no-untyped-def]
    async def go() -> None:
        await index.register_node(node("a"), [], now=0)
        await index.put_start([key(1), key(2)], [1, 1], "a", now=0)
        assert await index.put_revoke("a", [key(2)]) == 1
        # Key 1 still pending until its allocation expires.
        assert (await index.put_start([key(1)], [1], "a", now=5))[0].action is Action.SKIP_PENDING
        await index.heartbeat("a", [], now=9)
        assert await index.expire(now=11) == (0, 1)
        assert (await index.put_start([key(1)], [1], "a", now=11))[0].action is Action.WRITE

    run(go())


def test_dead_node_is_dropped_with_its_chunks(index) -> None:  # type: ignore[no-untyped-def]
    async def go() -> None:
        await index.register_node(node("a"), [InventoryItem(key(1), 5)], now=0)
        await index.register_node(node("b"), [InventoryItem(key(1), 5)], now=0)
        assert len((await index.lookup([key(1)], "b", 0)).locations[0].replicas) == 2
        assert (await index.lookup([key(1)], "b", 0)).locations[0].replicas[0].node_id == "b"
        assert await index.heartbeat("a", [], now=4)
        assert await index.expire(now=6) == (1, 0)
        r = await index.lookup([key(1)], "", 0)
        assert [x.node_id for x in r.locations[0].replicas] == ["a"]
        assert not await index.heartbeat("b", [], now=6)
        await index.expire(now=10)
        assert (await index.lookup([key(1)], "", 0)).hits == 0
        with pytest.raises(Unavailable):
            await index.put_start([key(2)], [1], "a", now=10)

    run(go())


def test_removed_replicas_leave_the_index(index) -> None:  # type: ignore[no-untyped-def]
    async def go() -> None:
        await index.register_node(node("a"), [InventoryItem(key(i), 5) for i in range(4)], now=0)
        assert await index.remove_replicas("a", [key(1), key(9)]) == 1
        assert (await index.lookup([key(0), key(1), key(2)], "", 0)).hits == 1
        # Re-registration replaces the inventory.
        await index.register_node(node("a"), [InventoryItem(key(7), 5)], now=1)
        assert (await index.lookup([key(0)], "", 0)).hits == 0
        assert (await index.lookup([key(7)], "", 0)).hits == 1

    run(go())


def test_placement_prefers_writer_then_free_space(index) -> None:  # type: ignore[no-untyped-def]
    async def go() -> None:
        await index.register_node(node("a", 100, 90), [], now=0)
        await index.register_node(node("b", 100, 10), [], now=0)
        await index.register_node(node("tiny", 4, 0), [], now=0)
        allocs = await index.put_start([key(1)], [50], "a", now=0)
        assert allocs[0].node.node_id == "a"
        allocs = await index.put_start([key(2), key(3)], [50, 50], "", now=0)
        assert [a.node.node_id for a in allocs] == ["b", "b"]
        allocs = await index.put_start([key(4)], [50], "tiny", now=0)
        assert allocs[0].node.node_id != "tiny"

    run(go())


def test_a_retried_put_start_gets_its_allocation_again(index) -> None:  # type: ignore[no-untyped-def]
    async def go() -> None:
        await index.register_node(node("a"), [], now=0)
        await index.register_node(node("b"), [], now=0)
        first = await index.put_start([key(1), key(2)], [10, 10], "a", now=0, request_id=b"X")
        assert [(x.action, x.node.node_id) for x in first] == [(Action.WRITE, "a")] * 2
        # The retry of that put (its reply lost) gets the same node, even
        # where placement would now choose another (writer "b").
        again = await index.put_start(
            [key(1), key(3), key(1)], [10, 10, 10], "b", now=1, request_id=b"X"
        )
        assert again[0] == first[0]
        assert again[1].action is Action.WRITE and again[1].node.node_id == "b"
        assert again[2].action is Action.SKIP_PENDING  # repeated within the put
        # Another put, or one without an id, finds the keys pending as before.
        for other in (b"Y", b""):
            got = await index.put_start([key(2)], [10], "b", now=1, request_id=other)
            assert got[0].action is Action.SKIP_PENDING
        # The allocation is the first one, not a second: PutEnd commits it.
        assert await index.put_end("a", [key(1), key(2)], [10, 10]) == 2
        got = await index.put_start([key(1)], [10], "a", now=2, request_id=b"X")
        assert got[0].action is Action.SKIP_EXISTS
        assert (await index.stats(now=2)).chunks_deduplicated == 4

    run(go())


def test_a_put_start_without_an_id_never_matches_another(index) -> None:  # type: ignore[no-untyped-def]
    async def go() -> None:
        await index.register_node(node("a"), [], now=0)
        await index.put_start([key(1)], [10], "a", now=0)
        got = await index.put_start([key(1)], [10], "a", now=1)
        assert got[0].action is Action.SKIP_PENDING
        # An id never matches an allocation made without one.
        got = await index.put_start([key(1)], [10], "a", now=1, request_id=b"X")
        assert got[0].action is Action.SKIP_PENDING

    run(go())


def test_a_retry_whose_node_died_is_placed_anew(index) -> None:  # type: ignore[no-untyped-def]
    async def go() -> None:
        await index.register_node(node("a"), [], now=0)
        await index.register_node(node("b"), [], now=0)
        await index.put_start([key(1)], [10], "a", now=0, request_id=b"X")
        await index.heartbeat("b", [], now=4)
        assert await index.expire(now=6) == (1, 0)  # a is gone, its allocation not yet
        got = await index.put_start([key(1)], [10], "a", now=6, request_id=b"X")
        assert got[0].action is Action.WRITE and got[0].node.node_id == "b"
        assert await index.put_end("b", [key(1)], [10]) == 1
        # The new allocation replaced the old one: nothing is left to expire.
        await index.heartbeat("b", [], now=18)
        assert await index.expire(now=20) == (0, 0)

    run(go())


def test_lookup_orders_replicas_and_follows_every_change(index) -> None:  # type: ignore[no-untyped-def]
    # Answers are built once per chunk and shared: each change must show.
    def order(r) -> list[tuple[str, str, str]]:  # type: ignore[no-untyped-def]
        return [(x.node_id, x.tier, x.address) for x in r.locations[0].replicas]

    async def go() -> None:
        for name in ("a", "b", "c"):
            await index.register_node(node(name), [], now=0)
        await index.put_end("a", [key(1)], [10])
        await index.put_end("b", [key(1)], [10])
        await index.put_end("c", [key(1)], [10])
        await index.set_replica_tier("b", [key(1)], "gpu")
        await index.set_replica_tier("c", [key(1)], "ssd")
        r = await index.lookup([key(1)], "", 0)
        assert order(r) == [("b", "gpu", "b:1"), ("a", "cpu", "a:1"), ("c", "ssd", "c:1")]
        r = await index.lookup([key(1)], "c", 0)
        assert order(r) == [("c", "ssd", "c:1"), ("b", "gpu", "b:1"), ("a", "cpu", "a:1")]
        # The shared answer was not reordered for that client.
        assert order(await index.lookup([key(1)], "", 0))[0][0] == "b"
        await index.set_replica_tier("a", [key(1)], "gpu")
        assert [x[0] for x in order(await index.lookup([key(1)], "", 0))] == ["a", "b", "c"]
        await index.remove_replicas("a", [key(1)])
        assert [x[0] for x in order(await index.lookup([key(1)], "", 0))] == ["b", "c"]
        # A node that comes back at another address (its chunks re-announced).
        moved = NodeInfo("b", "b:2", "", (TierStats("cpu", 1 << 30, 0),))
        await index.register_node(moved, [InventoryItem(key(1), 10, "gpu")], now=1)
        assert order(await index.lookup([key(1)], "", 0))[0] == ("b", "gpu", "b:2")
        # A node that dies takes its replicas along.
        await index.heartbeat("b", [], now=2)
        await index.expire(now=6.5)  # c's lease ran out, b's not
        assert [x[0] for x in order(await index.lookup([key(1)], "", 0))] == ["b"]
        await index.expire(now=7.5)
        assert (await index.lookup([key(1)], "", 0)).hits == 0

    run(go())


def test_a_commit_of_written_chunks_answers_and_acts_as_put_start_then_put_end() -> None:
    """The memory index's one-step commit of a store's chunks against the
    generic two steps, on twin indexes: the same answers, hits and counters."""

    async def scene(index, commit):  # type: ignore[no-untyped-def]
        for name in ("a", "b"):
            await index.register_node(node(name), [], now=0)
        await index.put_start([key(1)], [100], "b", now=0)
        await index.put_end("b", [key(1)], [100])  # stored elsewhere
        await index.put_start([key(2)], [100], "b", now=0)  # pending elsewhere
        await index.put_start([key(3)], [100], "a", now=0, request_id=b"r")  # this put's own
        keys = [key(1), key(2), key(3), key(4), key(4), key(5)]
        allocs, committed = await commit(index, "a", keys, [100] * 6, 1, b"r")
        located = await index.lookup(keys, "", 0)
        stats = await index.stats(now=1)
        # An unknown writer: placed on a live node, as put_start places.
        stray, none = await commit(index, "nobody", [key(6)], [100], 1, b"")
        return (
            [(a.action, a.node.node_id if a.node else None) for a in allocs],
            committed,
            [sorted(r.node_id for r in loc.replicas) for loc in located.locations],
            (stats.chunks, stats.chunks_deduplicated, stats.bytes_saved),
            [(a.action, a.node.node_id if a.node else None) for a in stray],
            none,
        )

    async def two_steps(index, writer, keys, sizes, now, rid):  # type: ignore[no-untyped-def]
        allocs = await index.put_start(keys, sizes, writer, now, rid)
        return allocs, await index.put_end(writer, keys, sizes)

    async def one_step(index, writer, keys, sizes, now, rid):  # type: ignore[no-untyped-def]
        return await index.commit_written(writer, keys, sizes, now, rid)

    def fresh():  # type: ignore[no-untyped-def]
        return create_backend(IndexConfig(lease_ttl_s=5.0, allocation_ttl_s=10.0))

    expected = run(scene(fresh(), two_steps))
    got = run(scene(fresh(), one_step))
    assert got == expected
    allocs, committed, replicas, _, stray, none = got
    assert [a for a, _ in allocs] == [
        Action.SKIP_EXISTS, Action.SKIP_PENDING, Action.WRITE, Action.WRITE,
        Action.SKIP_PENDING, Action.WRITE,
    ]  # fmt: skip
    assert committed == 5 and replicas[0] == ["a", "b"] and none == 0
    assert stray[0][0] is Action.WRITE
