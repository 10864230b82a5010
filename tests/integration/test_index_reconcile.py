"""Inventory digests and bucket reconciliation of the index backends (issue 37),
on the memory index, a Redis server and a Redis Cluster, through the backend API."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Awaitable, Callable

import pytest

from kvdepot.errors import StaleRegistration
from kvdepot.keys import ChunkKey
from kvdepot.metadata.index import IndexBackend, IndexConfig, create_backend
from kvdepot.metadata.index.base import Digest, InventoryPage
from kvdepot.store.inventory import Inventory
from kvdepot.types import InventoryItem, NodeInfo
from kvdepot.wire import digest as d

pytestmark = pytest.mark.integration

BACKENDS = ["memory", pytest.param("redis_server", marks=pytest.mark.redis)]
BACKENDS.append(pytest.param("redis_cluster", marks=pytest.mark.redis))


@pytest.fixture(params=BACKENDS)
def url(request: pytest.FixtureRequest) -> str:
    if request.param == "memory":
        return "memory://"
    server = request.getfixturevalue(request.param)
    return f"{server}?prefix=rc-{uuid.uuid4().hex[:12]}"


def run(url: str, test: Callable[[IndexBackend], Awaitable[None]]) -> None:
    async def go() -> None:
        index = create_backend(IndexConfig(url, lease_ttl_s=30.0))
        try:
            await test(index)
        finally:
            await index.close()

    asyncio.run(go())


def keys(n: int) -> list[ChunkKey]:
    return [ChunkKey(os.urandom(16)) for _ in range(n)]


def held(ks: list[ChunkKey]) -> Inventory:
    inv = Inventory()
    for k in ks:
        inv.add(k)
    return inv


async def differing(index: IndexBackend, epoch: int, inv: Inventory) -> list[int]:
    """The buckets whose digests differ, as a store finds them."""
    counts, sums = inv.cells()
    groups, cells = await index.reconcile_digests(
        "a", epoch, d.pack_cells(*d.group_cells(counts, sums))
    )
    ic, isums = d.unpack_cells(cells)
    return [
        g * 64 + j
        for i, g in enumerate(groups)
        for j in range(64)
        if (ic[i * 64 + j], isums[i * 64 + j]) != (counts[g * 64 + j], sums[g * 64 + j])
    ]


async def reconcile(
    index: IndexBackend, epoch: int, inv: Inventory, buckets: list[int]
) -> tuple[int, set[bytes]]:
    pages = [
        (b, InventoryPage.from_items([InventoryItem(k, 10) for k in inv.bucket(b)]))
        for b in buckets
    ]
    added, extra = await index.reconcile_buckets("a", epoch, pages)
    return len(added) // 16, {extra[i : i + 16] for i in range(0, len(extra), 16)}


async def beat(index: IndexBackend, epoch: int, inv: Inventory) -> Digest | None:
    sync = getattr(index, "_counters", None)
    if sync is not None:
        await sync.sync()  # the Redis index's digest deltas flushed
    known, indexed = await index.heartbeat_held("a", [], 0.0, None, epoch, (inv.count, inv.total))
    assert known
    return indexed


def test_drift_both_ways_is_found_and_mended(url: str) -> None:
    async def test(index: IndexBackend) -> None:
        ks = keys(600)
        epoch = await index.register_node(
            NodeInfo("a", "a:1"), [InventoryItem(k, 10) for k in ks[:500]], 0.0
        )
        inv = held(ks)
        assert await beat(index, epoch, inv) == (500, d.digest_of(b"".join(ks[:500]))[1])
        await index.remove_replicas("a", ks[:5])
        stale = keys(3)
        await index.put_end("a", stale, [10] * 3)
        assert await beat(index, epoch, inv) != (inv.count, inv.total)
        want = {d.key_bucket(k) for k in ks[:5] + ks[500:] + stale}
        buckets = await differing(index, epoch, inv)
        assert set(buckets) == want
        added, extra = await reconcile(index, epoch, inv, buckets)
        assert added == 105 and extra == set(stale)
        assert await reconcile(index, epoch, inv, buckets) == (0, set(stale))  # idempotent
        await index.remove_replicas("a", stale)
        assert await beat(index, epoch, inv) == (inv.count, inv.total)
        assert await differing(index, epoch, inv) == []
        (node,) = (await index.stats(0.0)).nodes
        assert (node.chunks_indexed, node.chunks_held, node.in_sync) == (600, 600, True)
        assert (await index.lookup(ks, "", 0)).hits == 600
        # A registration again starts from an empty digest.
        epoch2 = await index.register_node(NodeInfo("a", "a:1"), [], 0.0)
        assert await beat(index, epoch2, inv) == (0, 0)
        with pytest.raises(StaleRegistration):
            await index.reconcile_digests("a", epoch, bytes(1024))

    run(url, test)


def test_redis_chunks_lost_behind_the_index_and_a_drifted_digest(url: str) -> None:
    if url.startswith("memory"):
        pytest.skip("the memory index keeps its digest with its rows")
    import redis

    async def test(index: IndexBackend) -> None:
        ks = keys(300)
        epoch = await index.register_node(
            NodeInfo("a", "a:1"), [InventoryItem(k, 10) for k in ks], 0.0
        )
        inv = held(ks)
        assert await beat(index, epoch, inv) == (inv.count, inv.total)
        b = await index._layout()  # type: ignore[attr-defined]
        raw = url.split("?")[0]
        if raw.startswith("redis+cluster://"):
            host, port = raw.split("://")[1].split(",")[0].rsplit(":", 1)
            db: redis.Redis | redis.RedisCluster = redis.RedisCluster(host=host, port=int(port))
        else:
            db = redis.Redis.from_url(raw)
        with db:
            lost = ks[:4]
            for k in lost:
                assert db.hdel(b.bucket(k), b.field(k)) == 1
            # The digest cannot see it; a scrub of the buckets mends it.
            assert await beat(index, epoch, inv) == (inv.count, inv.total)
            assert (await index.lookup(lost[:1], "", 0)).hits == 0
            buckets = sorted({d.key_bucket(k) for k in lost})
            added, extra = await reconcile(index, epoch, inv, buckets)
            assert added == 4 and not extra
            assert (await index.lookup(ks, "", 0)).hits == 300
            assert await beat(index, epoch, inv) == (inv.count, inv.total)
            # A bucket's cells that drifted from its chunks are set right.
            bucket = d.key_bucket(ks[10])
            digest = index._keys3("a")[2]  # type: ignore[attr-defined]
            # A delta counted twice: the bucket's, its group's and the whole count.
            group = d.GROUP_CELL + 2 * (bucket // d.GROUP_BUCKETS)
            for cell in (d.BUCKET_CELL + 2 * bucket, group, 0):
                db.bitfield(digest).incrby("i64", f"#{cell}", 7).execute()
            db.hincrby(digest.removesuffix(":dg") + ":reg", "chunks", 7)
            assert await differing(index, epoch, inv) == [bucket]
            assert await reconcile(index, epoch, inv, [bucket]) == (0, set())
            assert await differing(index, epoch, inv) == []
            (node,) = (await index.stats(0.0)).nodes
            assert node.chunks_indexed == 300

    run(url, test)
