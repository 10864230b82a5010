"""The get path of a node's client: its own store first, or the index first
after reads its own store could not serve.

A read the own store serves whole makes no metadata call; a read of chunks
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


def test_reads_of_another_nodes_chunks_skip_the_own_store_until_it_serves_again(
    cluster: LocalCluster, clients: tuple[KVDepotClient, KVDepotClient]
) -> None:
    reader, holder = clients
    own_store = cluster.stores[0].info["grpc_address"]
    calls = CallLog(reader)
    first, second = _keys(3), _keys(3)
    _put(holder, first)
    _put(holder, second)
    misses = store_stats(own_store).get_misses
    _exact(reader, first)  # its own store first: three misses there, then the index
    assert store_stats(own_store).get_misses == misses + 3
    assert calls.methods == ["Lookup"]
    calls.methods.clear()
    _exact(reader, second)  # the index first: the own store is not asked
    assert store_stats(own_store).get_misses == misses + 3
    assert calls.methods == ["Lookup"]
    # Its own chunks: the lookup names this node first, it reads them there
    # and goes back to reading its own store first, without the index.
    own = _keys(2)
    _put(reader, own)
    calls.methods.clear()
    _exact(reader, own)
    assert calls.methods == ["Lookup"]
    calls.methods.clear()
    _exact(reader, own)
    assert calls.methods == []
    assert store_stats(own_store).get_misses == misses + 3


def test_own_chunks_the_index_does_not_name_stay_readable_with_the_index_first(
    cluster: LocalCluster, clients: tuple[KVDepotClient, KVDepotClient]
) -> None:
    reader, holder = clients
    remote = _keys(2)
    _put(holder, remote)
    _exact(reader, remote)  # from now on the index first
    # In the own store, never indexed (as after a put whose PutStart failed).
    own = _keys(2)
    local = cluster.stores[0].info["address"]
    items = [PutItem(ChunkKey(k), memoryview(payload(k, SIZE))) for k in own]
    assert reader._transport.put(local, items) == [PutStatus.OK] * 2
    calls = CallLog(reader)
    _exact(reader, own)  # the index names none of them: the own store is asked
    assert calls.methods == ["Lookup"]
    more = _keys(2)
    _put(holder, more)
    _exact(reader, more)  # the index first again
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
