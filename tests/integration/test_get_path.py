"""The get path of a client: one store read first (its own, or the one that
served the last read whole), else the index first.

A read one store serves whole makes no metadata call; a read of chunks
another node holds should not pay a miss on the own store each time. Either
way every chunk read is verified and byte-exact, and a node's own chunks stay
readable while the metadata service is unreachable.
"""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Iterator

import numpy as np
import pytest

from kvdepot.apps.cluster import LocalCluster
from kvdepot.connector.client import ClientConfig, KVDepotClient
from kvdepot.connector.transport import GetItem, PutItem, PutStatus, TcpTransport
from kvdepot.keys import ChunkKey
from kvdepot.store.chunks import ChunkStore
from kvdepot.store.dataplane import DataPlaneServer
from kvdepot.wire.xxh3 import _address
from tests.integration.test_cluster import payload, store_stats
from tests.integration.test_put_path import CallLog
from tests.procs import freeze

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
    got = client.get_into(keys, out, count="none")
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
    freeze(cluster.metadata.proc.pid)
    try:
        _exact(reader, own)  # the lookup times out; the own store serves them
    finally:
        cluster.metadata.proc.send_signal(signal.SIGCONT)
    # A read the own store cannot serve whole still needs the index.
    calls.methods.clear()
    out = [np.zeros(SIZE, dtype=np.uint8) for _ in range(3)]
    got = reader.get_into([*more, *own[:1]], out, count="none")
    assert calls.methods == ["Lookup"] and got.leading == 2


LARGE = 16 << 20


def test_a_large_chunk_corrupted_in_the_store_is_a_miss_over_tcp() -> None:
    # A chunk of many hash blocks, hashed block by block as it arrives: a
    # wrong byte past the first block must still make that chunk (only) a miss.
    chunks = ChunkStore(3 * LARGE)
    server = DataPlaneServer(chunks)
    server.start()
    try:
        host, port = server.address
        address = f"{host}:{port}"
        rng = np.random.default_rng(7)
        sizes = (LARGE, LARGE + 4096, SIZE)
        data = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
        keys = [ChunkKey(k) for k in _keys(3)]
        with TcpTransport() as t:
            items = [PutItem(k, memoryview(d)) for k, d in zip(keys, data, strict=True)]
            assert t.put(address, items) == [PutStatus.OK] * 3
            lease = chunks.acquire(keys[0])
            assert lease is not None
            # A byte flipped in the store's memory, past the first hash block.
            ctypes.memset(_address(lease.view) + 3_000_001, int(data[0][3_000_001]) ^ 0xFF, 1)
            chunks.release(lease)
            out = [np.zeros(n, dtype=np.uint8) for n in sizes]
            got = t.get_into(
                address, [GetItem(k, memoryview(o)) for k, o in zip(keys, out, strict=True)]
            )
            assert [g.ok for g in got] == [False, True, True]
            assert got[0].error == "checksum mismatch"
            assert all(np.array_equal(o, d) for o, d in zip(out[1:], data[1:], strict=True))
            # The connection stays in step: the next read on it is exact.
            again = t.get_into(address, [GetItem(keys[1], memoryview(out[1]))])
            assert again[0].ok and np.array_equal(out[1], data[1])
    finally:
        server.stop()
        chunks.close()
