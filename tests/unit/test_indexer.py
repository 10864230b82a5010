"""The store's index committer: data-plane threads' commits, batched, bounded."""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc
import pytest

from kvdepot.errors import Unavailable
from kvdepot.keys import ChunkKey
from kvdepot.metadata_client import MetadataClient
from kvdepot.proto.gen import metadata_pb2
from kvdepot.store.indexer import INDEX_RETRY, IndexCommitter
from kvdepot.wire.protocol import IndexCode

WRITE = metadata_pb2.Allocation.WRITE
SKIP = metadata_pb2.Allocation.SKIP_EXISTS


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


class FakeMetadata:
    """A metadata client that answers PutStart as the service would; keys in
    ``elsewhere`` were stored by another node. While ``gate`` is clear a call
    waits for it (at most ``hold_s``, else its deadline), as a stalled service
    would. A call that finds no answer raises as the client does."""

    def __init__(self) -> None:
        self.requests: list[metadata_pb2.PutStartRequest] = []
        self.deadlines: list[float] = []
        self.elsewhere: set[bytes] = set()
        self.committed = True
        self.gate = threading.Event()
        self.gate.set()
        self.hold_s: float | None = None
        self.fail = False
        self.registered = True

    def put_start(
        self, request: metadata_pb2.PutStartRequest, *, timeout_s: float | None = None
    ) -> metadata_pb2.PutStartResponse:
        assert timeout_s is not None, "every commit's call has a deadline"
        self.requests.append(request)
        self.deadlines.append(timeout_s)
        if not self.gate.wait(self.hold_s or timeout_s):
            raise Unavailable("metadata: no answer within the deadline")
        if self.fail:
            raise Unavailable("metadata unavailable")
        actions = [SKIP if k in self.elsewhere else WRITE for k in request.keys]
        return metadata_pb2.PutStartResponse(
            allocations=[metadata_pb2.Allocation(action=a) for a in actions],
            written_committed=self.committed,
        )


def test_a_commit_is_one_put_start_with_written_flags_for_the_node() -> None:
    fake = FakeMetadata()
    fake.elsewhere.add(key(2))
    ix = IndexCommitter("node-a", fake, 5.0)
    got = ix.commit([key(1), key(2), key(3)], [10, 20, 30])
    assert got == [IndexCode.NEW, IndexCode.ELSEWHERE, IndexCode.NEW]
    (req,) = fake.requests
    assert list(req.keys) == [key(1), key(2), key(3)]
    assert list(req.sizes) == [10, 20, 30]
    assert req.writer_node_id == "node-a"
    assert list(req.written) == [True] * 3
    assert len(req.request_id) == 16
    assert 0 < fake.deadlines[0] <= 5.0


def test_concurrent_writers_share_a_call() -> None:
    fake = FakeMetadata()
    fake.elsewhere.add(key(7))
    fake.gate.clear()
    ix = IndexCommitter("node-a", fake, 5.0)
    results: dict[int, list[IndexCode]] = {}

    def writer(i: int) -> None:
        results[i] = ix.commit([key(i)], [i + 1])

    first = threading.Thread(target=writer, args=(0,))
    first.start()
    while not fake.requests:  # the first call is in flight, held
        time.sleep(0.001)
    others = [threading.Thread(target=writer, args=(i,)) for i in range(1, 9)]
    for t in others:
        t.start()
    time.sleep(0.1)  # all of them queued behind the call in flight
    fake.gate.set()
    for t in [first, *others]:
        t.join(5)
    assert len(fake.requests) == 2  # the first alone, then the eight others together
    assert sorted(fake.requests[1].keys) == sorted(key(i) for i in range(1, 9))
    assert results[7] == [IndexCode.ELSEWHERE]
    assert all(results[i] == [IndexCode.NEW] for i in range(9) if i != 7)
    assert (ix.stats.calls, ix.stats.requests) == (2, 9)


def test_a_stalled_index_costs_the_bounded_wait_then_not_indexed() -> None:
    fake = FakeMetadata()
    fake.gate.clear()  # the service does not answer
    fake.hold_s = 1.0  # nor does the call give up at its deadline
    ix = IndexCommitter("node-a", fake, 0.3)
    results: dict[int, list[IndexCode]] = {}
    t0 = time.monotonic()
    first = threading.Thread(target=lambda: results.update({1: ix.commit([key(1)], [1])}))
    first.start()
    while not fake.requests:
        time.sleep(0.001)
    # Queued behind the stalled call, this one's wait ends too; it is never
    # sent afterwards (its writer was told NOT_INDEXED and commits itself).
    assert ix.commit([key(2)], [1]) == [IndexCode.NOT_INDEXED]
    assert time.monotonic() - t0 < 0.9
    first.join(5)
    assert results[1] == [IndexCode.NOT_INDEXED]
    assert [list(r.keys) for r in fake.requests] == [[key(1)]]
    assert ix.stats.timeouts == 1 and ix.stats.failures == 1
    fake.gate.set()
    assert ix.commit([key(3)], [1]) == [IndexCode.NEW]


@pytest.mark.parametrize("how", ["refused", "not committed", "not registered", "closed"])
def test_what_the_index_did_not_commit_is_not_indexed(how: str) -> None:
    fake = FakeMetadata()
    ix = IndexCommitter("node-a", fake, 5.0, registered=lambda: fake.registered)
    if how == "refused":
        fake.fail = True
    elif how == "not committed":
        fake.committed = False  # the node is no live node of the index
    elif how == "not registered":
        fake.registered = False
    else:
        ix.close()
    assert ix.commit([key(1), key(2)], [1, 1]) == [IndexCode.NOT_INDEXED] * 2
    assert ix.commit([], []) == []
    if how in ("not registered", "closed"):
        assert fake.requests == []  # nothing is sent that the index would not take


def test_a_key_twice_in_a_batch_is_sent_once() -> None:
    fake = FakeMetadata()
    ix = IndexCommitter("node-a", fake, 5.0)
    assert ix.commit([key(1), key(1)], [5, 5]) == [IndexCode.NEW] * 2
    assert list(fake.requests[0].keys) == [key(1)]


# --- deferred commits (HeaderFlags.DEFER) -------------------------------------

W = ("", 7)


def test_a_deferred_commit_is_sent_behind_the_answer_and_counted_for_its_writer() -> None:
    fake = FakeMetadata()
    fake.elsewhere.add(key(2))
    ix = IndexCommitter("node-a", fake, 5.0)
    assert ix.defer(W, [key(1), key(2), key(3)], [10, 20, 30])
    got = ix.sync(W, 5.0)
    assert (got.new, got.elsewhere, got.not_indexed, got.pending) == (2, 1, 0, 0)
    (req,) = fake.requests
    assert list(req.keys) == [key(1), key(2), key(3)]
    assert list(req.written) == [True] * 3 and req.writer_node_id == "node-a"
    # Counted once: the next sync has nothing new to say.
    again = ix.sync(W, 5.0)
    assert (again.new, again.elsewhere, again.not_indexed, again.pending) == (0, 0, 0, 0)
    # Another writer's outcomes are its own.
    assert ix.defer(("tenant-b", 7), [key(4)], [1])
    assert ix.sync(W, 0.01).new == 0
    assert ix.sync(("tenant-b", 7), 5.0).new == 1


def test_deferred_commits_queued_behind_a_call_share_the_next_one() -> None:
    fake = FakeMetadata()
    fake.gate.clear()
    ix = IndexCommitter("node-a", fake, 5.0)
    assert ix.defer(W, [key(0)], [1])
    while not fake.requests:  # the first call is in flight, held
        time.sleep(0.001)
    for i in range(1, 9):
        assert ix.defer(("", 100 + i), [key(i)], [1])  # none of these waits
    held = ix.sync(W, 0.05)
    assert (held.new, held.pending) == (0, 1)
    fake.gate.set()
    assert ix.sync(W, 5.0).new == 1
    assert all(ix.sync(("", 100 + i), 5.0).new == 1 for i in range(1, 9))
    assert len(fake.requests) == 2
    assert sorted(fake.requests[1].keys) == sorted(key(i) for i in range(1, 9))


def test_a_failed_deferred_call_is_tried_again_within_its_time() -> None:
    fake = FakeMetadata()
    fake.fail = True
    ix = IndexCommitter("node-a", fake, 5.0)
    assert ix.defer(W, [key(1)], [1])
    while len(fake.requests) < 2:  # tried, failed, tried again
        time.sleep(0.001)
    fake.fail = False
    got = ix.sync(W, 5.0)
    assert (got.new, got.not_indexed) == (1, 0)
    assert ix.stats.failures >= 2 and ix.stats.deferred_not_indexed == 0


def test_a_deferred_commit_not_made_in_its_time_is_counted_not_indexed() -> None:
    fake = FakeMetadata()
    fake.gate.clear()  # the service does not answer
    ix = IndexCommitter("node-a", fake, 0.3)
    t0 = time.monotonic()
    assert ix.defer(W, [key(1), key(2)], [1, 1])
    # The writer's wait is bounded by the store's too.
    got = ix.sync(W, 10.0)
    assert time.monotonic() - t0 < 1.5
    if got.pending:  # the last call ends at its deadline
        got = got + ix.sync(W, 10.0)
    assert (got.new, got.not_indexed, got.pending) == (0, 2, 0)
    assert ix.stats.deferred_not_indexed == 2


def test_a_chunk_the_store_no_longer_holds_is_not_sent() -> None:
    fake = FakeMetadata()
    gone = {key(2)}
    ix = IndexCommitter("node-a", fake, 5.0, holds=lambda k: k not in gone)
    assert ix.defer(W, [key(1), key(2)], [1, 1])
    got = ix.sync(W, 5.0)
    assert (got.new, got.not_indexed) == (1, 1)
    assert [list(r.keys) for r in fake.requests] == [[key(1)]]


def test_deferring_is_refused_when_closed_or_full(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvdepot.store import indexer

    fake = FakeMetadata()
    fake.gate.clear()
    monkeypatch.setattr(indexer, "MAX_DEFERRED_KEYS", 3)
    ix = IndexCommitter("node-a", fake, 5.0)
    assert ix.defer(W, [key(1), key(2)], [1, 1])
    # Full (queued and in flight): this writer commits synchronously instead.
    assert not ix.defer(W, [key(3), key(4)], [1, 1])
    assert ix.defer(W, [key(5)], [1])
    fake.gate.set()
    assert ix.sync(W, 5.0).new == 3
    ix.close()
    assert not ix.defer(W, [key(6)], [1])
    assert ix.defer(W, [], [])  # nothing to queue


def test_the_writers_kept_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvdepot.store import indexer

    monkeypatch.setattr(indexer, "MAX_WRITERS", 4)
    fake = FakeMetadata()
    ix = IndexCommitter("node-a", fake, 5.0)
    for i in range(10):
        assert ix.defer(("", i + 1), [key(i)], [1])
    deadline = time.monotonic() + 5
    while ix.stats.calls < 1 or ix._deferred_keys:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert len(ix._writers) <= 4
    # The newest writers' outcomes are kept.
    assert ix.sync(("", 10), 5.0).new == 1


# --- owed keys: held but not indexed in time ------------------------------------


def _wait(cond: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_what_was_not_indexed_in_time_is_committed_once_the_service_answers() -> None:
    fake = FakeMetadata()
    fake.fail = True
    gone: set[ChunkKey] = set()
    ix = IndexCommitter("node-a", fake, 0.2, holds=lambda k: k not in gone)
    assert ix.defer(W, [key(1), key(2)], [10, 20])
    got = ix.sync(W, 5.0)
    if got.pending:
        got = got + ix.sync(W, 5.0)
    assert got.not_indexed == 2
    assert ix.commit([key(3), key(4)], [30, 40]) == [IndexCode.NOT_INDEXED] * 2
    _wait(lambda: ix.stats.owed == 4)
    # Nothing is sent while the service does not answer.
    sent = len(fake.requests)
    time.sleep(0.1)
    assert len(fake.requests) == sent
    fake.fail = False
    gone.add(key(4))  # evicted meanwhile: never named by a lookup
    ix.answered()  # a heartbeat went through
    _wait(lambda: ix.stats.owed == 0)
    last = fake.requests[-1]
    assert list(last.keys) == [key(1), key(2), key(3)]
    assert list(last.sizes) == [10, 20, 30] and list(last.written) == [True] * 3
    assert last.writer_node_id == "node-a"
    assert (ix.stats.owed_committed, ix.stats.owed_dropped) == (3, 0)
    # A commit that goes through settles what is owed too, without a heartbeat.
    fake.fail = True
    assert ix.commit([key(5)], [1]) == [IndexCode.NOT_INDEXED]
    fake.fail = False
    assert ix.commit([key(6)], [1]) == [IndexCode.NEW]
    _wait(lambda: ix.stats.owed == 0)
    assert list(fake.requests[-1].keys) == [key(5)]


def test_owed_keys_wait_for_the_store_to_be_registered() -> None:
    fake = FakeMetadata()
    fake.registered = False
    ix = IndexCommitter("node-a", fake, 5.0, registered=lambda: fake.registered)
    assert ix.commit([key(1)], [1]) == [IndexCode.NOT_INDEXED]
    ix.answered()
    time.sleep(0.1)
    assert fake.requests == [] and ix.stats.owed == 1
    fake.registered = True
    ix.answered()
    _wait(lambda: ix.stats.owed == 0)
    assert [list(r.keys) for r in fake.requests] == [[key(1)]]


def test_the_owed_keys_are_bounded_and_the_drops_logged_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from kvdepot.store import indexer

    monkeypatch.setattr(indexer, "MAX_OWED_KEYS", 3)
    monkeypatch.setattr(indexer, "MAX_KEYS_PER_CALL", 2)
    fake = FakeMetadata()
    fake.fail = True
    ix = IndexCommitter("node-a", fake, 5.0)
    with caplog.at_level("INFO", logger=indexer.__name__):
        for i in range(0, 10, 2):
            assert ix.commit([key(i), key(i + 1)], [1, 1]) == [IndexCode.NOT_INDEXED] * 2
        assert ix.commit([key(0)], [1]) == [IndexCode.NOT_INDEXED]  # owed already
        assert (ix.stats.owed, ix.stats.owed_dropped) == (3, 7)
        failing = [r for r in caplog.records if "index commits are failing" in r.message]
        dropped = [r for r in caplog.records if "not kept for a later commit" in r.message]
        assert len(failing) == 1 and failing[0].levelname == "WARNING"
        assert len(dropped) == 1 and dropped[0].levelname == "WARNING"
        fake.fail = False
        sent = len(fake.requests)
        ix.answered()
        _wait(lambda: ix.stats.owed == 0)
        # In calls of at most MAX_KEYS_PER_CALL, oldest first.
        assert [list(r.keys) for r in fake.requests[sent:]] == [[key(0), key(1)], [key(2)]]
        done = [r for r in caplog.records if "indexed now" in r.message]
        assert len(done) == 1 and done[0].levelname == "INFO"
    assert ix.stats.owed_committed == 3


def test_nothing_is_owed_once_closed() -> None:
    fake = FakeMetadata()
    ix = IndexCommitter("node-a", fake, 5.0)
    ix.close()
    assert ix.commit([key(1)], [1]) == [IndexCode.NOT_INDEXED]
    assert ix.stats.owed == 0


# --- over the store's metadata client -------------------------------------------


class _Status(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._code.name

    def trailing_metadata(self) -> tuple[()]:
        return ()


class _Replica:
    """A replica's stub: PutStart fails with ``down`` while set, else answers WRITE."""

    def __init__(self, down: grpc.StatusCode | None = None, stall: bool = False) -> None:
        self.down, self.stall = down, stall
        self.timeouts: list[float] = []

    def PutStart(
        self, request: metadata_pb2.PutStartRequest, timeout: float
    ) -> metadata_pb2.PutStartResponse:
        self.timeouts.append(timeout)
        if self.stall:
            time.sleep(timeout)  # as a stalled replica: the deadline ends the attempt
        if self.down is not None:
            raise _Status(self.down)
        return metadata_pb2.PutStartResponse(
            allocations=[metadata_pb2.Allocation(action=WRITE) for _ in request.keys],
            written_committed=True,
        )


def _client(*replicas: _Replica) -> MetadataClient:
    spec = ",".join(f"127.0.0.1:{7700 + i}" for i in range(len(replicas)))
    client = MetadataClient(spec, 5.0, retry=INDEX_RETRY, frames=False)  # stubs: gRPC's
    stubs: list[Any] = list(replicas)
    client._stubs = stubs
    return client


def test_a_commit_fails_over_to_a_replica_that_answers() -> None:
    a, b = _Replica(grpc.StatusCode.UNAVAILABLE), _Replica()
    client = _client(a, b)
    try:
        ix = IndexCommitter("node-a", client, 1.0)
        assert ix.commit([key(1), key(2)], [1, 1]) == [IndexCode.NEW] * 2
        # The next commits go to the replica that answered.
        assert ix.commit([key(3)], [1]) == [IndexCode.NEW]
        assert (len(a.timeouts), len(b.timeouts)) == (1, 2)
        assert ix.stats.failures == 0
    finally:
        client.close()


def test_the_commit_deadline_bounds_every_attempt_of_the_client() -> None:
    a = _Replica(grpc.StatusCode.DEADLINE_EXCEEDED, stall=True)
    b = _Replica(grpc.StatusCode.DEADLINE_EXCEEDED, stall=True)
    client = _client(a, b)
    try:
        ix = IndexCommitter("node-a", client, 0.3)
        t0 = time.monotonic()
        assert ix.commit([key(1)], [1]) == [IndexCode.NOT_INDEXED]
        # Not the client's 5 s per attempt, nor its rounds: the commit's 0.3 s in all.
        assert time.monotonic() - t0 < 0.9
        assert all(t <= 0.3 for t in a.timeouts + b.timeouts)
        assert ix.stats.failures == 1
    finally:
        client.close()
