"""Commits into the cluster's index what the data plane stored for writers that asked.

A writer publishing into its own node's store sets ``HeaderFlags.INDEX`` on
its PUT or COMMIT (see :mod:`kvdepot.wire.protocol`): once the store has
committed the chunks locally (readable, verified), the connection's thread
hands their keys here and waits, for a bounded time, for the index's answer,
which goes back in the data-plane reply. The writer then makes no metadata
call of its own.

The data-plane threads call the metadata service themselves, synchronously
(gRPC's blocking calls release the GIL), batched across writers: the thread
that finds no call in flight sends, as one ``PutStart`` with ``written``
flags (writer: this node), every commit queued at that moment, its own
included; the threads that queue while that call is in flight wait for it to
end, and the first of them to wake sends all of theirs in the next call. A
single writer pays one round trip and no hand-off to another thread;
concurrent writers share round trips without any added wait.

Every wait is bounded (``timeout_s``, which also bounds each call's
deadline): a stalled or unreachable metadata service costs a put that long
at most, never a hung data-plane thread. A commit still queued when its
wait ends is taken out of the queue, never sent; its chunks are reported
NOT_INDEXED and the writer commits them itself (or raises ``Unavailable``,
as when it cannot reach the index). Only a call already in flight when a
wait ended may still commit its chunks: a later ``PutStart`` of the writer
then finds them stored.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvdepot.keys import ChunkKey
from kvdepot.proto.gen import metadata_pb2
from kvdepot.wire.protocol import IndexCode

logger = logging.getLogger(__name__)

IndexFn = Callable[[Sequence[ChunkKey], Sequence[int]], list[IndexCode]]
"""Commits chunks (keys, sizes) this store holds into the index; per key, the outcome."""

PutStartFn = Callable[[metadata_pb2.PutStartRequest, float], "metadata_pb2.PutStartResponse | None"]
"""Makes one PutStart (request, deadline in s); ``None`` when this store is not
registered now (nothing is indexed then). Raises what gRPC raises."""

MAX_KEYS_PER_CALL = 4096
"""Most keys one coalesced PutStart carries (the rest go in the next)."""

_MIN_DEADLINE_S = 0.01


@dataclass(slots=True)
class _Request:
    keys: Sequence[ChunkKey]
    sizes: Sequence[int]
    codes: list[IndexCode] | None = None  # the answer, once there is one


@dataclass(slots=True)
class IndexerStats:
    """What the committer did since the store started.

    Attributes:
        calls: PutStart calls made.
        requests: Writers' commits answered by them (more than ``calls``
            when commits were coalesced).
        timeouts: Commits whose wait ran out (reported NOT_INDEXED).
        failures: Calls that failed or were not committed (NOT_INDEXED).
    """

    calls: int = 0
    requests: int = 0
    timeouts: int = 0
    failures: int = 0


class IndexCommitter:
    """Batches the data-plane threads' index commits into PutStart calls.

    Args:
        node_id: This store's node id (the writer of the commits).
        put_start: Makes one call (see :data:`PutStartFn`).
        timeout_s: Longest a data-plane thread waits for the index; also
            the longest deadline of a call.
    """

    def __init__(self, node_id: str, put_start: PutStartFn, timeout_s: float) -> None:
        self._node_id = node_id
        self._put_start = put_start
        self._timeout_s = timeout_s
        self._cond = threading.Condition()
        self._queue: list[_Request] = []
        self._sending = False
        self._closed = False
        self.stats = IndexerStats()

    def commit(self, keys: Sequence[ChunkKey], sizes: Sequence[int]) -> list[IndexCode]:
        """Commit chunks the store holds into the index; waits at most ``timeout_s``.

        Returns:
            Per key NEW, ELSEWHERE or NOT_INDEXED (not committed by this call).
        """
        if not keys or self._closed:
            return [IndexCode.NOT_INDEXED] * len(keys)
        request = _Request(keys, sizes)
        deadline = time.monotonic() + self._timeout_s
        with self._cond:
            self._queue.append(request)
        while True:
            with self._cond:
                batch = self._next_batch(request, deadline)
            if batch is None:
                break
            self._send(batch, deadline)
        return request.codes or [IndexCode.NOT_INDEXED] * len(keys)

    def _next_batch(self, request: _Request, deadline: float) -> list[_Request] | None:
        """Under the lock: the batch this thread is to send now, or ``None``
        once ``request`` is answered or its wait ended."""
        while request.codes is None:
            left = deadline - time.monotonic()
            if left <= _MIN_DEADLINE_S or self._closed:
                if request in self._queue:
                    self._queue.remove(request)  # never sent
                    self.stats.timeouts += 1
                elif not self._closed:
                    self.stats.timeouts += 1  # in flight: it may still commit
                return None
            if not self._sending and self._queue:
                self._sending = True
                batch: list[_Request] = []
                n = 0
                while self._queue and (
                    not batch or n + len(self._queue[0].keys) <= MAX_KEYS_PER_CALL
                ):
                    batch.append(self._queue.pop(0))
                    n += len(batch[-1].keys)
                return batch
            self._cond.wait(left)
        return None

    def _send(self, batch: list[_Request], deadline: float) -> None:
        results: list[list[IndexCode]] | None = None
        try:
            results = self._call(batch, max(deadline - time.monotonic(), _MIN_DEADLINE_S))
        finally:
            # Every commit of the batch gets an answer, and the next sender its turn.
            with self._cond:
                for i, r in enumerate(batch):
                    r.codes = (
                        results[i] if results is not None else [IndexCode.NOT_INDEXED] * len(r.keys)
                    )
                self._sending = False
                self._cond.notify_all()

    def _call(self, batch: list[_Request], deadline_s: float) -> list[list[IndexCode]] | None:
        # One entry per distinct key: a key's bytes are in one reservation at
        # a time, but a duplicate must not confuse the answer.
        order: dict[ChunkKey, int] = {}
        sizes: list[int] = []
        for request in batch:
            for key, size in zip(request.keys, request.sizes, strict=True):
                if key not in order:
                    order[key] = len(sizes)
                    sizes.append(size)
        self.stats.calls += 1
        self.stats.requests += len(batch)
        try:
            reply = self._put_start(
                metadata_pb2.PutStartRequest(
                    keys=list(order),
                    sizes=sizes,
                    writer_node_id=self._node_id,
                    request_id=os.urandom(16),
                    written=[True] * len(sizes),
                ),
                deadline_s,
            )
        except Exception as exc:  # gRPC's errors, a closed channel: the writers commit
            self.stats.failures += 1
            code = getattr(exc, "code", None)
            logger.debug(
                "index commit of %d chunks failed: %s",
                len(sizes),
                code().name if callable(code) else repr(exc),
            )
            return None
        if reply is None:
            return None  # not registered now
        if not reply.written_committed or len(reply.allocations) != len(sizes):
            # This node is no live node of the index (or the service predates
            # written flags): the writers place the chunks themselves.
            self.stats.failures += 1
            return None
        new = metadata_pb2.Allocation.WRITE
        codes = [
            IndexCode.NEW if a.action == new else IndexCode.ELSEWHERE for a in reply.allocations
        ]
        return [[codes[order[k]] for k in request.keys] for request in batch]

    def close(self) -> None:
        """Answer NOT_INDEXED from now on; commits waiting give up at once."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
