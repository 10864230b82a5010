"""A store counts a chunk read once, however many ranged reads it took.

The vLLM connector's in-step loads read a chunk range by range (its header,
then one layer at a time, each its own request); its asynchronous loads read
chunks whole. Either way a store's tier ``hits`` (and ``misses``) must say how
many chunk reads it served, not how many ranges: over TCP (GET) and over
shared memory (LEASE) alike.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvdepot.apps.cluster import LocalCluster
from kvdepot.connector.client import ClientConfig, KVDepotClient
from tests.integration.test_cluster import store_stats

pytestmark = pytest.mark.integration

SIZE = 64 << 10
HEADER = 1 << 10
LAYERS = 4


def _reads(cluster: LocalCluster) -> tuple[int, int]:
    """Tier hits and misses summed over the cluster's stores."""
    hits = misses = 0
    for s in cluster.stores:
        for t in store_stats(s.info["grpc_address"]).tiers:
            hits, misses = hits + t.hits, misses + t.misses
    return hits, misses


def _ranged(client: KVDepotClient, keys: list[bytes], replicas: list[list[str]]) -> list[bool]:
    """Read each chunk as the in-step loader does: its header, then layer by layer."""
    bufs = [np.zeros(SIZE, dtype=np.uint8) for _ in keys]
    ok = client.get_ranges_into(
        keys, [(0, HEADER)] * len(keys), [b[:HEADER] for b in bufs], replicas
    )
    layer = (SIZE - HEADER) // LAYERS
    for i in range(LAYERS):
        start = HEADER + i * layer
        views = [b[start : start + layer] for b in bufs]
        got = client.get_ranges_into(keys, [(start, layer)] * len(keys), views, replicas)
        ok = [a and b for a, b in zip(ok, got, strict=True)]
    return ok


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_chunk_read_range_by_range_counts_one_hit(cluster: LocalCluster, transport: str) -> None:
    node = cluster.stores[0].info["node_id"]
    config = ClientConfig(metadata=cluster.metadata_address, node_id=node, transport=transport)
    with KVDepotClient(config) as client:
        keys = [os.urandom(16) for _ in range(3)]
        data = [np.frombuffer(os.urandom(SIZE), dtype=np.uint8) for _ in keys]
        client.put(keys, data)
        reply = client.lookup_locations(keys, count="none")
        assert reply.hits == len(keys)
        replicas = [[r.address for r in loc.replicas] for loc in reply.locations]

        before = _reads(cluster)
        assert _ranged(client, keys, replicas) == [True] * len(keys)
        hits, misses = _reads(cluster)
        # 1 + LAYERS ranged reads of each chunk: one read each.
        assert (hits - before[0], misses - before[1]) == (len(keys), 0)

        # Whole reads count one each too.
        out = [np.zeros(SIZE, dtype=np.uint8) for _ in keys]
        assert client.get_into(keys, out, count="none").loaded == (True,) * len(keys)
        assert all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))
        assert _reads(cluster) == (hits + len(keys), misses)

        # A chunk the store does not have: one miss, where the read begins.
        gone = os.urandom(16)
        buf = np.zeros(SIZE, dtype=np.uint8)
        assert client.get_ranges_into([gone], [(0, HEADER)], [buf], [replicas[0]]) == [False]
        assert _reads(cluster) == (hits + len(keys), misses + 1)
