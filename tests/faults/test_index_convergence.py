"""The index converges on what the stores hold (issue 37), on every backend.

A store's index entries drift behind its back in three ways, all at once:

(a) chunks dropped from the index only: a removal naming the node that the
    node never sent (an operator's ``ReportRemoved``), and on Redis chunks
    deleted in Redis itself (a shard that lost data), which the index's own
    digest cannot see: the store's slow scrub finds those;
(b) chunks held but never indexed: bytes written to the store by a writer
    that died before its ``PutEnd`` (a raw data-plane PUT);
(c) chunks indexed for the node but no longer held: a writer's ``PutEnd``
    that arrived after its chunks were deleted from the store (a data-plane
    DELETE) and their removal reported.

Within a few heartbeats the index names exactly what the store holds: the
stats show held == indexed and in sync, a lookup of each held key names the
store and a lookup of each dropped key names nothing; each round sent at
most the budget of keys (16 here, so the 60 drifted keys take several).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from kvdepot.apps.cluster import LocalCluster
from kvdepot.connector.client import ClientConfig, KVDepotClient
from kvdepot.connector.transport.base import PutItem, PutStatus
from kvdepot.connector.transport.tcp import TcpTransport
from kvdepot.keys import ChunkKey
from kvdepot.proto.gen import metadata_pb2, metadata_pb2_grpc
from tests.faults.support import payload, store_stats, wait_for

pytestmark = [pytest.mark.faults, pytest.mark.integration]

SIZE = 16 << 10
BUDGET = 16  # keys a reconciliation round sends at most
HEARTBEAT_S = 0.3
N = 20  # chunks per kind of drift


def _keys(n: int) -> list[ChunkKey]:
    return [ChunkKey(os.urandom(16)) for _ in range(n)]


def _named(stub: metadata_pb2_grpc.MetadataStub, key: bytes) -> list[str]:
    """The nodes a lookup of ``key`` names."""
    reply = stub.Lookup(metadata_pb2.LookupRequest(keys=[key], count=2), timeout=5)
    return [r.node_id for loc in reply.locations[: reply.hits] for r in loc.replicas]


def _node(stub: metadata_pb2_grpc.MetadataStub) -> metadata_pb2.NodeStats:
    (node,) = stub.GetStats(metadata_pb2.GetStatsRequest(), timeout=5).nodes
    return node


def _drift_and_converge(
    tmp_path: Path, index: str, lose_in_redis: Callable[[list[ChunkKey]], None] | None
) -> None:
    env = dict(
        os.environ,
        KVDEPOT_STORE_RECONCILE_KEYS=str(BUDGET),
        # Fast enough to find chunks lost in Redis in this test (default 30 s a bucket).
        KVDEPOT_STORE_RECONCILE_SCRUB_S="0.005" if lose_in_redis else "0",
    )
    with LocalCluster(
        nodes=1,
        capacity="32MiB",
        heartbeat_interval_s=HEARTBEAT_S,
        lease_ttl_s=5.0,
        env=env,
        log_dir=tmp_path,
        index=index,
    ) as c:
        store = c.stores[0].info
        node_id = store["node_id"]
        indexed = _keys(3 * N)  # published as usual: (a) drops some from the index
        with KVDepotClient(ClientConfig(metadata=c.metadata_address)) as client:
            assert client.put(indexed, [payload(k, SIZE) for k in indexed]).stored == len(indexed)
        unindexed, late = _keys(N), _keys(N)
        with grpc.insecure_channel(c.metadata_address) as ch, TcpTransport() as t:
            stub = metadata_pb2_grpc.MetadataStub(ch)
            wait_for(lambda: _node(stub).in_sync, 10, "in sync before the drift")
            # (b) bytes whose writer never committed them; (c) bytes deleted,
            # then committed by a late PutEnd.
            raw = unindexed + late
            put = t.put(store["address"], [PutItem(k, payload(k, SIZE).tobytes()) for k in raw])
            assert all(s is PutStatus.OK for s in put), put
            assert all(t.delete(store["address"], late))
            time.sleep(1.0)  # the store reports the removal (of chunks never indexed)
            stub.PutEnd(
                metadata_pb2.PutEndRequest(keys=late, node_id=node_id, sizes=[SIZE] * N), timeout=5
            )
            # (a) dropped from the index only.
            dropped = indexed[:N]
            stub.ReportRemoved(
                metadata_pb2.ReportRemovedRequest(node_id=node_id, keys=dropped), timeout=5
            )
            if lose_in_redis is not None:
                lose_in_redis(indexed[N : 2 * N])
            assert not _named(stub, dropped[0]) and _named(stub, late[0]) == [node_id]

            held = indexed + unindexed
            started = time.monotonic()

            def converged() -> bool:
                n = _node(stub)
                return (
                    n.in_sync
                    and n.chunks_held == n.chunks_indexed == len(held)
                    and all(_named(stub, k) == [node_id] for k in held)
                    and not any(_named(stub, k) for k in late)
                )

            wait_for(converged, 20, "the index converging on the store")
            took = time.monotonic() - started
        stats = store_stats(store["grpc_address"]).reconcile
        assert stats.chunks == len(held)
        assert 0 < stats.max_round_keys <= BUDGET, stats
        assert stats.added >= (3 if lose_in_redis else 2) * N - N, stats
        assert stats.removed >= N, stats
        # A few heartbeats: a mismatch seen twice, then rounds of 16 keys.
        assert took < 40 * HEARTBEAT_S, f"{took:.1f} s"


def test_memory_index_converges_on_the_store(tmp_path: Path) -> None:
    _drift_and_converge(tmp_path, "memory://", None)


def _redis_loser(url: str, prefix: str) -> Callable[[list[ChunkKey]], None]:
    """Deletes chunks in Redis itself, behind the index's back."""
    import redis

    from kvdepot.metadata.index.redis_layout import DEFAULT_BUCKET_BITS, Buckets

    def lose(keys: list[ChunkKey]) -> None:
        b = Buckets(prefix, DEFAULT_BUCKET_BITS)
        if url.startswith("redis+cluster://"):
            host, port = url.split("://", 1)[1].split(",")[0].rsplit(":", 1)
            db: redis.Redis | redis.RedisCluster = redis.RedisCluster(host=host, port=int(port))
        else:
            db = redis.Redis.from_url(url)
        with db:
            for k in keys:
                assert db.hdel(b.bucket(k), b.field(k)) == 1
        assert keys

    return lose


@pytest.mark.redis
@pytest.mark.parametrize("server", ["redis_server", "redis_cluster"])
def test_redis_index_converges_on_the_store(
    tmp_path: Path, server: str, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue(server)
    prefix = f"conv-{uuid.uuid4().hex[:12]}"
    _drift_and_converge(tmp_path, f"{url}?prefix={prefix}", _redis_loser(url, prefix))
