"""The get path of a client: one store read first (its own, or the one that
served the last read whole), else the index first.

A read one store serves whole makes no metadata call; a read of chunks
another node holds should not pay a miss on the own store each time. Either
way every chunk read is verified and byte-exact, and a node's own chunks stay
readable while the metadata service is unreachable.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import numpy as np
import pytest

from kvdepot.apps.cluster import LocalCluster
from kvdepot.connector.client import ClientConfig, KVDepotClient
from kvdepot.connector.transport import PutItem, PutStatus
from kvdepot.keys import ChunkKey
from tests.integration.test_cluster import payload, store_stats
from tests.integration.test_put_path import CallLog

pytestmark = pytest.mark.integration

SIZE = 64 << 10


def _keys(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


@pytest.fixture()
def clients(cluster: LocalCluster) -> Iterator[tuple[KVDepotClient, KVDepotClient]]:
    """A client of node 0 (the reader, knowing its store) and one of node 1."""
    nodes = [s.info["node_id"] for s in cluster.stores]
    address = cluster.metadata_address
    with (
        KVDepotClient(ClientConfig(metadata=address, node_id=nodes[0], rpc_timeout_s=1)) as reader,
        KVDepotClient(ClientConfig(metadata=address, node_id=nodes[1])) as holder,
    ):
        reader.put(_keys(1), [np.ones(SIZE, dtype=np.uint8)])  # learns its node's store
        yield reader, holder


def _exact(client: KVDepotClient, keys: list[bytes]) -> None:
    out = [np.zeros(SIZE, dtype=np.uint8) for _ in keys]
    got = client.get_into(keys, out)
    assert got.loaded == (True,) * len(keys), got.reasons
    assert got.bytes_received == SIZE * len(keys)
    for k, buf in zip(keys, out, strict=True):
        assert np.array_equal(buf, payload(k, SIZE))


def _put(client: KVDepotClient, keys: list[bytes]) -> None:
    assert client.put(keys, [payload(k, SIZE) for k in keys]).stored == len(keys)


def test_reads_go_first_to_the_store_that_served_the_last_read_whole(
    cluster: LocalCluster, clients: tuple[KVDepotClient, KVDepotClient]
) -> None:
    reader, holder = clients
    own_store = cluster.stores[0].info["grpc_address"]
    other_store = cluster.stores[1].info["grpc_address"]
    calls = CallLog(reader)
    first, second = _keys(3), _keys(3)
    _put(holder, first)
    _put(holder, second)
    misses = store_stats(own_store).get_misses
    _exact(reader, first)  # its own store first: three misses there, then the index
    assert store_stats(own_store).get_misses == misses + 3
    assert calls.methods == ["Lookup"]
    calls.methods.clear()
    _exact(reader, second)  # node 1 served the last read: straight there, no lookup
    assert calls.methods == []
    assert store_stats(own_store).get_misses == misses + 3
    # Its own chunks: node 1 misses, the lookup names this node, and the
    # next read of them goes to its own store first, without the index.
    own = _keys(2)
    _put(reader, own)
    other_misses = store_stats(other_store).get_misses
    calls.methods.clear()
    _exact(reader, own)
    assert calls.methods == ["Lookup"]
    assert store_stats(other_store).get_misses == other_misses + 2
    calls.methods.clear()
    _exact(reader, own)
    assert calls.methods == []
    assert store_stats(own_store).get_misses == misses + 3


def test_after_a_read_no_single_store_served_the_index_is_asked_first(
    cluster: LocalCluster, clients: tuple[KVDepotClient, KVDepotClient]
) -> None:
    reader, holder = clients
    own_store = cluster.stores[0].info["grpc_address"]
    remote = _keys(2)
    _put(holder, remote)
    unknown = _keys(2)
    assert reader.get_into(unknown, [bytearray(SIZE) for _ in unknown]).leading == 0
    misses = store_stats(own_store).get_misses
    calls = CallLog(reader)
    _exact(reader, remote)  # the miss served nothing: the index first
    assert calls.methods == ["Lookup"]
    assert store_stats(own_store).get_misses == misses


def test_own_chunks_the_index_does_not_name_stay_readable_with_the_index_first(
    cluster: LocalCluster, clients: tuple[KVDepotClient, KVDepotClient]
) -> None:
    reader, holder = clients
    remote = _keys(2)
    _put(holder, remote)
    _exact(reader, remote)  # from now on node 1 first
    # In the own store, never indexed (as after a put whose PutStart failed).
    own = _keys(2)
    local = cluster.stores[0].info["address"]
    items = [PutItem(ChunkKey(k), memoryview(payload(k, SIZE))) for k in own]
    assert reader._transport.put(local, items) == [PutStatus.OK] * 2
    calls = CallLog(reader)
    # Node 1 misses, the index names none of them: the own store is asked.
    _exact(reader, own)
    assert calls.methods == ["Lookup"]
    more = _keys(2)
    _put(holder, more)
    _exact(reader, more)  # node 1 first again
    assert cluster.metadata is not None
    cluster.metadata.proc.send_signal(signal.SIGSTOP)
    try:
        _exact(reader, own)  # the lookup times out; the own store serves them
    finally:
        cluster.metadata.proc.send_signal(signal.SIGCONT)
    # A read the own store cannot serve whole still needs the index.
    calls.methods.clear()
    out = [np.zeros(SIZE, dtype=np.uint8) for _ in range(3)]
    got = reader.get_into([*more, *own[:1]], out)
    assert calls.methods == ["Lookup"] and got.leading == 2
