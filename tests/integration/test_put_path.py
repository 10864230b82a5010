"""The put path into a writer's own node: bytes first, the store commits them.

A client that knows its node's store writes the chunks there and asks the
store (``HeaderFlags.INDEX``) to commit them into the index itself, after its
own commit: the client makes no metadata call. What the store did not index
(it held the chunk already, or the index did not answer in time) goes the way
it went before: one PutStart with ``written`` flags. The invariants stay those
of the two-call path: nothing already stored is sent over the network, a
lookup names only readable chunks, the writer learns what was committed.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from kvdepot.apps.cluster import LocalCluster
from kvdepot.connector.client import ClientConfig, KVDepotClient
from kvdepot.connector.transport import PutItem, PutStatus
from kvdepot.keys import ChunkKey
from kvdepot.proto.gen import metadata_pb2, metadata_pb2_grpc
from kvdepot.wire.protocol import IndexCode, IndexSettled
from tests.integration.test_cluster import payload, store_stats
from tests.procs import freeze

SIZE = 64 << 10


class CallLog:
    """Records the metadata methods a client calls (the real calls go through)."""

    def __init__(self, client: KVDepotClient) -> None:
        self.methods: list[str] = []
        real = client._metadata.call

        def call(method: str, request: Any, **kw: Any) -> Any:
            self.methods.append(method)
            return real(method, request, **kw)

        client._metadata.call = call  # type: ignore[method-assign]


@pytest.fixture(params=["shm", "tcp"])
def writer(request: pytest.FixtureRequest, cluster: LocalCluster) -> Iterator[KVDepotClient]:
    node = cluster.stores[0].info["node_id"]
    config = ClientConfig(metadata=cluster.metadata_address, node_id=node, transport=request.param)
    with KVDepotClient(config) as c:
        yield c


def _keys(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


def _items(keys: list[bytes], data: list[Any]) -> list[PutItem]:
    return [PutItem(ChunkKey(k), memoryview(d)) for k, d in zip(keys, data, strict=True)]


def test_a_put_into_the_own_store_makes_no_metadata_call_and_is_readable_at_once(
    cluster: LocalCluster, writer: KVDepotClient
) -> None:
    calls = CallLog(writer)
    writer.put(_keys(2), [payload(k, SIZE) for k in _keys(2)])  # learns its node's store
    assert calls.methods == ["PutStart", "PutEnd"]  # the reference path, once
    keys = _keys(4)
    data = [payload(k, SIZE) for k in keys]
    calls.methods.clear()
    r = writer.put(keys, data)
    assert (r.stored, r.skipped, r.failed, r.bytes_sent) == (4, 0, 0, 4 * SIZE)
    assert calls.methods == []
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
        # A retried commit, its first attempt having committed: still committed.
        keys = _keys(2)
        for _ in range(2):
            reply = put_start(keys=keys, writer_node_id=node, written=[True, True])
            assert reply.written_committed
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


def test_the_store_reply_says_per_key_what_the_index_committed(
    cluster: LocalCluster, writer: KVDepotClient
) -> None:
    own = cluster.stores[0].info
    other = cluster.stores[1].info
    writer.put(_keys(1), [np.ones(SIZE, dtype=np.uint8)])  # learns its node's store
    # Stored by another node first: its bytes land here (no network), and
    # the index keeps this node as one more replica.
    there = _keys(2)
    with KVDepotClient(
        ClientConfig(metadata=cluster.metadata_address, node_id=other["node_id"])
    ) as first:
        assert first.put(there, [payload(k, SIZE) for k in there]).stored == 2
    new = _keys(2)
    keys = [new[0], there[0], new[1], there[1]]
    data = [payload(k, SIZE) for k in keys]
    statuses, indexed = writer._transport.put_indexed(own["address"], _items(keys, data))
    assert statuses == [PutStatus.OK] * 4
    assert indexed == [IndexCode.NEW, IndexCode.ELSEWHERE, IndexCode.NEW, IndexCode.ELSEWHERE]
    located = writer.lookup_locations(keys)
    assert located.hits == 4
    for i, loc in enumerate(located.locations):
        nodes = {r.node_id for r in loc.replicas}
        assert nodes == ({own["node_id"], other["node_id"]} if i % 2 else {own["node_id"]})
    # Held here already: not written, not indexed by this request.
    statuses, indexed = writer._transport.put_indexed(own["address"], _items(keys[:1], data[:1]))
    assert (statuses, indexed) == ([PutStatus.EXISTS], [IndexCode.NOT_INDEXED])
    # Through the client: stored elsewhere counts as skipped, with no metadata call.
    calls = CallLog(writer)
    more = _keys(1)
    with KVDepotClient(
        ClientConfig(metadata=cluster.metadata_address, node_id=other["node_id"])
    ) as first:
        assert first.put(more, [payload(more[0], SIZE)]).stored == 1
    r = writer.put([*_keys(1), *more], [np.ones(SIZE, dtype=np.uint8), payload(more[0], SIZE)])
    assert (r.stored, r.skipped, r.bytes_sent, r.bytes_skipped) == (1, 1, SIZE, SIZE)
    assert calls.methods == []


def test_a_stalled_metadata_service_costs_a_put_a_bounded_wait(tmp_path: Path) -> None:
    env = dict(os.environ, KVDEPOT_STORE_INDEX_COMMIT_TIMEOUT_S="0.5")
    with LocalCluster(nodes=1, capacity="32MiB", env=env, log_dir=tmp_path) as c:
        info = c.stores[0].info
        assert c.metadata is not None
        for transport in ("shm", "tcp"):
            config = ClientConfig(
                metadata=c.metadata_address,
                node_id=info["node_id"],
                transport=transport,
                rpc_timeout_s=1.0,
            )
            with KVDepotClient(config) as w:
                w.put(_keys(1), [np.ones(SIZE, dtype=np.uint8)])  # learns its node's store
                stalled, late = _keys(3), _keys(2)
                data = [payload(k, SIZE) for k in stalled + late]
                freeze(c.metadata.proc.pid)
                try:
                    t0 = time.monotonic()
                    statuses, indexed = w._transport.put_indexed(
                        info["address"], _items(stalled, data[:3])
                    )
                    # The store's wait for the index is bounded: written, not indexed.
                    assert time.monotonic() - t0 < 3.0
                    assert statuses == [PutStatus.OK] * 3
                    assert indexed == [IndexCode.NOT_INDEXED] * 3
                    # The client then commits itself, as when the index is
                    # unreachable: its PutStart fails, and the chunks its
                    # store took stay there, their index commits owed.
                    t0 = time.monotonic()
                    result = w.put(late, data[3:])
                    assert (result.pending, result.failed) == (2, 0)
                    assert time.monotonic() - t0 < 5.0
                finally:
                    c.metadata.proc.send_signal(signal.SIGCONT)
                # Nothing named by a lookup is unreadable (a commit in flight
                # when the wait ended may have landed after SIGCONT).
                keys = stalled + late
                with KVDepotClient(ClientConfig(metadata=c.metadata_address)) as reader:
                    hits = reader.lookup(keys)
                    out = [np.zeros(SIZE, dtype=np.uint8) for _ in keys]
                    got = reader.get_into(keys, out, count="none")
                    # More may be named by now: the store commits what it
                    # could not index as soon as the service answers again.
                    assert got.leading >= hits
                    for a, b in zip(out[:hits], data[:hits], strict=True):
                        assert np.array_equal(a, b)
                # The data plane is not stuck: the next put is indexed by the
                # store again, once its lease is back.
                fresh = _keys(2)
                deadline = time.monotonic() + 10
                while True:
                    statuses, indexed = w._transport.put_indexed(
                        info["address"], _items(fresh, [payload(k, SIZE) for k in fresh])
                    )
                    if indexed == [IndexCode.NEW] * 2 or time.monotonic() > deadline:
                        break
                    fresh = _keys(2)
                    time.sleep(0.2)
                assert indexed == [IndexCode.NEW] * 2


# --- deferred index commits (ClientConfig.defer_index_commit) -----------------


@pytest.fixture(params=["shm", "tcp"])
def deferring(request: pytest.FixtureRequest, cluster: LocalCluster) -> Iterator[KVDepotClient]:
    node = cluster.stores[0].info["node_id"]
    config = ClientConfig(
        metadata=cluster.metadata_address,
        node_id=node,
        transport=request.param,
        defer_index_commit=True,
    )
    with KVDepotClient(config) as c:
        yield c


def test_a_deferred_put_answers_before_the_index_and_the_writer_learns_what_it_did(
    cluster: LocalCluster, deferring: KVDepotClient
) -> None:
    own = cluster.stores[0].info["node_id"]
    other = cluster.stores[1].info["node_id"]
    deferring.put(_keys(1), [np.ones(SIZE, dtype=np.uint8)])  # learns its node's store
    there = _keys(2)
    with KVDepotClient(ClientConfig(metadata=cluster.metadata_address, node_id=other)) as first:
        assert first.put(there, [payload(k, SIZE) for k in there]).stored == 2
    keys = [*_keys(3), *there]
    data = [payload(k, SIZE) for k in keys]
    calls = CallLog(deferring)
    r = deferring.put(keys, data)
    assert (r.stored, r.skipped, r.failed, r.pending, r.bytes_pending) == (0, 0, 0, 5, 5 * SIZE)
    assert calls.methods == []
    settled = deferring.sync_index()
    assert (settled.new, settled.elsewhere, settled.not_indexed, settled.pending) == (3, 2, 0, 0)
    assert calls.methods == []  # asked of the store, not of the metadata service
    # Another process's view: indexed, byte-exact, this node one more replica.
    with KVDepotClient(ClientConfig(metadata=cluster.metadata_address)) as reader:
        located = reader.lookup_locations(keys)
        assert located.hits == 5
        for i, loc in enumerate(located.locations):
            nodes = {rep.node_id for rep in loc.replicas}
            assert nodes == ({own, other} if i >= 3 else {own})
        out = [np.zeros(SIZE, dtype=np.uint8) for _ in keys]
        assert reader.get_into(keys, out).leading == 5
        assert all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))
    # The writer's own lookup right after a put waits for its pending commits.
    more = _keys(4)
    assert deferring.put(more, [payload(k, SIZE) for k in more]).pending == 4
    assert deferring.lookup(more) == 4
    assert deferring.sync_index() == IndexSettled()  # told already, before the lookup
    again = deferring.put(more, [payload(k, SIZE) for k in more])
    # Republished: the put returned before the store's answer (pending); the
    # writer learns from the next sync that the store held them already.
    assert (again.stored, again.skipped, again.pending) == (0, 0, 4)
    assert deferring.sync_index() == IndexSettled(skipped=4)
    assert deferring.sync_index() == IndexSettled()


def test_a_deferred_shm_put_beyond_its_grants_reserves_and_returns_before_the_answer(
    cluster: LocalCluster,
) -> None:
    node = cluster.stores[0].info["node_id"]
    config = ClientConfig(
        metadata=cluster.metadata_address, node_id=node, transport="shm", defer_index_commit=True
    )
    with KVDepotClient(config) as w:
        w.put(_keys(1), [np.ones(SIZE, dtype=np.uint8)])  # learns its node's store
        size = 3 << 20  # three are more than this small store grants a connection
        keys = _keys(3)
        data = [payload(k, size) for k in keys]
        calls = CallLog(w)
        r = w.put(keys, data)
        assert (r.stored, r.skipped, r.failed, r.pending) == (0, 0, 0, 3)
        assert calls.methods == []
        # Sent, its answer unread: the next exchange on the connection reads it.
        pipeline = w._transport._pool.pipeline(cluster.stores[0].info["address"])  # type: ignore[attr-defined]
        assert pipeline.open_until(pipeline.issued())
        # Its own read waits for the COMMIT's answer (read-your-writes).
        out = [np.zeros(size, dtype=np.uint8) for _ in keys]
        assert w.get_into(keys, out).leading == 3
        assert all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))
        assert w.sync_index() == IndexSettled(new=3)
        assert calls.methods == []
        # Republished: RESERVE answers EXISTS, nothing is copied or committed again.
        assert w.put(keys, data).skipped == 3
        assert w.sync_index() == IndexSettled()
    with KVDepotClient(ClientConfig(metadata=cluster.metadata_address)) as reader:
        assert reader.lookup(keys) == 3


def test_a_stalled_metadata_service_never_holds_a_deferred_put(tmp_path: Path) -> None:
    env = dict(os.environ, KVDEPOT_STORE_INDEX_COMMIT_TIMEOUT_S="0.5")
    with LocalCluster(nodes=1, capacity="32MiB", env=env, log_dir=tmp_path) as c:
        info = c.stores[0].info
        assert c.metadata is not None
        for transport in ("shm", "tcp"):
            config = ClientConfig(
                metadata=c.metadata_address,
                node_id=info["node_id"],
                transport=transport,
                rpc_timeout_s=1.0,
                defer_index_commit=True,
            )
            with KVDepotClient(config) as w:
                w.put(_keys(1), [np.ones(SIZE, dtype=np.uint8)])  # learns its node's store
                keys = _keys(3)
                data = [payload(k, SIZE) for k in keys]
                freeze(c.metadata.proc.pid)
                try:
                    t0 = time.monotonic()
                    r = w.put(keys, data)  # a synchronous commit would raise Unavailable
                    assert r.pending == 3
                    assert time.monotonic() - t0 < 1.0
                    # The writer's question is bounded by the store's wait.
                    t0 = time.monotonic()
                    settled = w.sync_index(timeout_s=10.0)
                    assert time.monotonic() - t0 < 3.0
                    assert settled.new + settled.elsewhere == 0
                    assert settled.not_indexed + settled.pending == 3
                    # The node reads its own chunks without the metadata service.
                    out = [np.zeros(SIZE, dtype=np.uint8) for _ in keys]
                    assert w.get_into(keys, out).leading == 3
                    assert all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))
                finally:
                    c.metadata.proc.send_signal(signal.SIGCONT)
                # Nothing named by a lookup is unreadable.
                with KVDepotClient(ClientConfig(metadata=c.metadata_address)) as reader:
                    hits = reader.lookup(keys)
                    out = [np.zeros(SIZE, dtype=np.uint8) for _ in keys]
                    assert reader.get_into(keys, out, count="none").leading >= hits
                # Deferred commits go through again once the service answers.
                deadline = time.monotonic() + 10
                while True:
                    fresh = _keys(2)
                    assert w.put(fresh, [payload(k, SIZE) for k in fresh]).pending == 2
                    settled = w.sync_index(timeout_s=5.0)
                    if settled.new == 2 or time.monotonic() > deadline:
                        break
                    time.sleep(0.2)
                assert settled.new == 2
