"""Index URLs of the Redis backend: schemes, startup nodes, key prefix (no server needed)."""

from __future__ import annotations

import asyncio

import pytest

from kvdepot.errors import InvalidArgument
from kvdepot.metadata.index import IndexConfig, create_backend

pytest.importorskip("redis")

from redis.asyncio import Redis, RedisCluster

from kvdepot.metadata.index.redis import RedisIndex, connect, split_url


def test_prefix_is_split_off_and_other_options_kept() -> None:
    assert split_url("redis://h:1/2?prefix=t1&socket_timeout=3") == (
        "redis://h:1/2?socket_timeout=3",
        "t1",
    )
    assert split_url("redis://h:1/0") == ("redis://h:1/0", None)


def test_schemes_pick_the_client() -> None:
    async def go() -> None:
        single = connect("redis://127.0.0.1:6390/3")
        assert isinstance(single, Redis)
        assert single.connection_pool.connection_kwargs["db"] == 3
        await single.aclose()
        cluster = connect("redis+cluster://user:pw@10.0.0.1:7000,10.0.0.2,[::1]:7002")
        assert isinstance(cluster, RedisCluster)
        names = [n.name for n in cluster.startup_nodes]
        assert names == ["10.0.0.1:7000", "10.0.0.2:6379", "::1:7002"]
        await cluster.aclose()

    asyncio.run(go())


def test_backend_registry_and_bad_urls() -> None:
    async def go() -> None:
        index = create_backend(IndexConfig("redis://127.0.0.1:6390/0?prefix=abc"))
        assert isinstance(index, RedisIndex)
        assert index._p == "abc"
        await index.close()
        with pytest.raises(InvalidArgument):
            create_backend(IndexConfig("redis://h:port/0"))
        with pytest.raises(InvalidArgument):
            create_backend(IndexConfig("redis+cluster://"))
        with pytest.raises(InvalidArgument):
            create_backend(IndexConfig("redis://h:1/0?prefix=a{b}"))

    asyncio.run(go())
