"""The embedded index: leases, two-phase puts, leading-hit lookups."""

from __future__ import annotations

import asyncio

import pytest

from kvdepot.errors import Unavailable
from kvdepot.metadata.index import IndexConfig, create_backend
from kvdepot.metadata.keys import ChunkKey
from kvdepot.metadata.types import Action, InventoryItem, NodeInfo, TierUsage


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def node(name: str, cap: int = 1 << 30, used: int = 0) -> NodeInfo:
    return NodeInfo(name, f"{name}:1", "", (TierUsage("cpu", cap, used),))


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
