"""The put path into a writer's own node: bytes first, then one metadata call.

A client that knows its node's store writes the chunks there and lets
PutStart commit them (``written``); the invariants stay those of the
two-call path: nothing already stored is sent over the network, a lookup
names only readable chunks, the writer learns what was committed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from kvdepot.apps.cluster import LocalCluster
from kvdepot.connector.client import ClientConfig, KVDepotClient
from kvdepot.proto.gen import metadata_pb2, metadata_pb2_grpc
from tests.integration.test_cluster import payload, store_stats

SIZE = 64 << 10


class CallLog:
    """Records the metadata methods a client calls (the real calls go through)."""

    def __init__(self, client: KVDepotClient) -> None:
        self.methods: list[str] = []
        real = client._metadata.call

        def call(method: str, request: Any) -> Any:
            self.methods.append(method)
            return real(method, request)

        client._metadata.call = call  # type: ignore[method-assign]


@pytest.fixture(params=["shm", "tcp"])
def writer(request: pytest.FixtureRequest, cluster: LocalCluster) -> Iterator[KVDepotClient]:
    node = cluster.stores[0].info["node_id"]
    config = ClientConfig(metadata=cluster.metadata_address, node_id=node, transport=request.param)
    with KVDepotClient(config) as c:
        yield c


def _keys(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


def test_a_put_into_the_own_store_is_one_metadata_call_and_readable_at_once(
    cluster: LocalCluster, writer: KVDepotClient
) -> None:
    calls = CallLog(writer)
    writer.put(_keys(2), [payload(k, SIZE) for k in _keys(2)])  # learns its node's store
    keys = _keys(4)
    data = [payload(k, SIZE) for k in keys]
    calls.methods.clear()
    r = writer.put(keys, data)
    assert (r.stored, r.skipped, r.failed, r.bytes_sent) == (4, 0, 0, 4 * SIZE)
    assert calls.methods == ["PutStart"]
    # Another process's view: every chunk is indexed and reads back exact.
    with KVDepotClient(ClientConfig(metadata=cluster.metadata_address)) as reader:
        out = [np.zeros(SIZE, dtype=np.uint8) for _ in keys]
        got = reader.get_into(keys, out)
        assert got.leading == 4
        assert all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))
    # The same chunks again: nothing moves, nothing is committed twice.
    calls.methods.clear()
    again = writer.put(keys, data)
    assert (again.stored, again.skipped, again.bytes_sent) == (0, 4, 0)
    assert calls.methods == ["PutStart"]


def test_chunks_on_another_node_are_not_sent_there_again(
    cluster: LocalCluster, writer: KVDepotClient
) -> None:
    other = cluster.stores[1].info
    keys = _keys(3)
    data = [payload(k, SIZE) for k in keys]
    with KVDepotClient(
        ClientConfig(metadata=cluster.metadata_address, node_id=other["node_id"])
    ) as first:
        assert first.put(keys, data).stored == 3
    writer.put(_keys(1), [np.ones(SIZE, dtype=np.uint8)])  # learns its node's store
    before = store_stats(other["grpc_address"]).bytes_in
    r = writer.put(keys, data)
    assert (r.stored, r.skipped, r.failed, r.bytes_sent) == (0, 3, 0, 0)
    assert store_stats(other["grpc_address"]).bytes_in == before
    out = [np.zeros(SIZE, dtype=np.uint8) for _ in keys]
    assert writer.get_into(keys, out).leading == 3
    assert all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))
    assert writer.stats().chunks_deduplicated >= 3


def test_put_start_checks_its_written_flags(cluster: LocalCluster) -> None:
    node = cluster.stores[0].info["node_id"]
    with grpc.insecure_channel(cluster.metadata_address) as ch:
        stub = metadata_pb2_grpc.MetadataStub(ch)

        def put_start(**kw: Any) -> metadata_pb2.PutStartResponse:
            keys = kw.pop("keys", _keys(2))
            return stub.PutStart(
                metadata_pb2.PutStartRequest(keys=keys, sizes=[SIZE] * len(keys), **kw),
                timeout=10,
            )

        for bad in (
            {"writer_node_id": node, "written": [True]},  # one flag for two keys
            {"written": [True, True]},  # written where? no writer node
        ):
            with pytest.raises(grpc.RpcError) as err:
                put_start(**bad)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # A writer that is no registered node: nothing of it enters the index.
        keys = _keys(2)
        reply = put_start(keys=keys, writer_node_id="nobody", written=[True, True])
        assert not reply.written_committed
        hits = stub.Lookup(metadata_pb2.LookupRequest(keys=keys), timeout=10).hits
        assert hits == 0


def test_a_large_tcp_put_of_chunks_its_store_holds_sends_nothing(cluster: LocalCluster) -> None:
    # Over a stream transport a chunk's bytes would go before the store could
    # say it holds them: a large batch asks the metadata service first.
    node = cluster.stores[0].info
    config = ClientConfig(
        metadata=cluster.metadata_address, node_id=node["node_id"], transport="tcp"
    )
    size = 3 << 20
    keys = _keys(3)
    data = [payload(k, size) for k in keys]
    with KVDepotClient(config) as c:
        c.put(_keys(1), [np.ones(SIZE, dtype=np.uint8)])  # learns its node's store
        assert c.put(keys, data).stored == 3
        before = store_stats(node["grpc_address"]).bytes_in
        r = c.put(keys, data)
        assert (r.stored, r.skipped, r.bytes_sent) == (0, 3, 0)
        assert store_stats(node["grpc_address"]).bytes_in == before
