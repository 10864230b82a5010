"""Commits into the cluster's index what the data plane stored for writers that asked.

A writer publishing into its own node's store sets ``HeaderFlags.INDEX`` on
its PUT or COMMIT (see :mod:`kvdepot.wire.protocol`): once the store has
committed the chunks locally (readable, verified), the connection's thread
hands their keys here and waits, for a bounded time, for the index's answer,
which goes back in the data-plane reply. The writer then makes no metadata
call of its own.

The data-plane threads call the metadata service themselves, synchronously
(gRPC's blocking calls release the GIL), through the store's
:class:`~kvdepot.metadata_client.MetadataClient` (its token, its failover
across replicas, its injected retry: :data:`INDEX_RETRY`), batched across
writers: the thread that finds no call in flight sends, as one ``PutStart``
with ``written`` flags (writer: this node), every commit queued at that
moment, its own included; the threads that queue while that call is in
flight wait for it to end, and the first of them to wake sends all of theirs
in the next call. A single writer pays one round trip and no hand-off to
another thread; concurrent writers share round trips without any added wait.

Every wait is bounded (``timeout_s``, which also bounds each call's
deadline): a stalled or unreachable metadata service costs a put that long
at most, never a hung data-plane thread. A commit still queued when its
wait ends is taken out of the queue, never sent; its chunks are reported
NOT_INDEXED and the writer commits them itself (or raises ``Unavailable``,
as when it cannot reach the index). Only a call already in flight when a
wait ended may still commit its chunks: a later ``PutStart`` of the writer
then finds them stored.

A writer may instead defer (``HeaderFlags.DEFER``): its reply goes out right
after the store's own commit and the chunks are queued here for a committer
thread of their own, which sends everything queued as one ``PutStart`` and,
while that call is in flight, gathers the next. A writer's put then costs no
index round trip at all, and back-to-back puts share calls. What the index
did is counted per writer until it asks (:meth:`IndexCommitter.sync`). A
deferred commit is tried until ``timeout_s`` after it was queued (a failed
call is retried after a backoff); what is still not committed then, or what
the store no longer holds when its turn comes, is counted not indexed: it
stays readable in this store.

What the store holds but could not index in time (a deferred commit out of
time, a waiting commit that was NOT_INDEXED) is owed to the index: its keys
are kept (at most :data:`MAX_OWED_KEYS`) and committed, in calls of at most
:data:`MAX_KEYS_PER_CALL`, by the committer thread once the metadata service
answers again (:meth:`IndexCommitter.answered`: a heartbeat of the lease, or
a commit that went through). Otherwise a chunk stored while the service
stalled would take capacity and never be hit until the store registers
again. Committing a key already indexed for this node (its writer's own
``PutStart`` committed it meanwhile) changes nothing; a key the store no
longer holds is not sent; keys beyond the bound wait for the store's next
registration, whose inventory is authoritative.
"""

from __future__ import annotations

import abc
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Protocol

from kvdepot.keys import ChunkKey
from kvdepot.proto.gen import metadata_pb2
from kvdepot.repeat_log import RepeatLog
from kvdepot.retry import Backoff, RetryPolicy
from kvdepot.wire.protocol import IndexCode, IndexSettled

logger = logging.getLogger(__name__)

WriterId = tuple[str, int]
"""A deferring writer: its tenant ("" for none) and the token it picked."""


class Indexer(abc.ABC):
    """Commits chunks this store holds into the cluster's index, for the data plane."""

    @abc.abstractmethod
    def commit(self, keys: Sequence[ChunkKey], sizes: Sequence[int]) -> list[IndexCode]:
        """Commit now, waiting a bounded time; per key NEW, ELSEWHERE or NOT_INDEXED."""

    def defer(self, writer: WriterId, keys: Sequence[ChunkKey], sizes: Sequence[int]) -> bool:
        """Queue for a commit after the reply; whether queued (by default never)."""
        return False

    def sync(self, writer: WriterId, wait_s: float) -> IndexSettled:
        """The writer's deferred outcomes, once settled or after ``wait_s``."""
        return IndexSettled()


class IndexClient(Protocol):
    """What the committer calls: :meth:`kvdepot.metadata_client.MetadataClient.put_start`."""

    def put_start(
        self, request: metadata_pb2.PutStartRequest, *, timeout_s: float | None = None
    ) -> metadata_pb2.PutStartResponse:
        """One PutStart, its attempts and failovers all within ``timeout_s``.

        Raises:
            KVDepotError: No replica answered, or the one that did refused.
        """
        ...


INDEX_RETRY = RetryPolicy(rounds=3, backoff=Backoff(base_s=0.02, cap_s=0.5))
"""How the store's metadata client for index commits tries the replicas: a
call's deadline (the commit's ``timeout_s``) ends it sooner. A deferred
commit whose call failed is queued again after this backoff."""

MAX_KEYS_PER_CALL = 4096
"""Most keys one coalesced PutStart carries (the rest go in the next)."""

MAX_DEFERRED_KEYS = 1 << 16
"""Most keys queued or in flight for deferred commits; beyond, a writer's
commit is not deferred (its reply says NOT_INDEXED; it commits itself)."""

MAX_WRITERS = 4096
"""Most writers whose deferred outcomes are kept until they ask; beyond,
the oldest settled one's counts (else the oldest one's) are forgotten."""

MAX_OWED_KEYS = 1 << 16
"""Most keys held but not indexed that are kept for a later commit; beyond,
a key is dropped from them (counted) and left to the next registration."""

_MIN_DEADLINE_S = 0.01


@dataclass(slots=True)
class _Request:
    keys: Sequence[ChunkKey]
    sizes: Sequence[int]
    codes: list[IndexCode] | None = None  # the answer, once there is one
    writer: WriterId = ("", 0)  # deferred commits: whose outcome it is
    deadline: float = 0.0  # deferred commits: tried until then


@dataclass(slots=True)
class _Writer:
    """A deferring writer's chunks still pending, and outcomes since its last sync."""

    pending: int = 0
    new: int = 0
    elsewhere: int = 0
    not_indexed: int = 0


@dataclass(slots=True)
class IndexerStats:
    """What the committer did since the store started.

    Attributes:
        calls: PutStart calls made.
        requests: Writers' commits answered by them (more than ``calls``
            when commits were coalesced).
        timeouts: Commits whose wait ran out (reported NOT_INDEXED).
        failures: Calls that failed or were not committed (NOT_INDEXED).
        deferred: Chunks queued for a deferred commit.
        deferred_not_indexed: Of them, those not committed in their time
            (or no longer held when their turn came).
        owed: Keys held but not indexed now, kept for a later commit.
        owed_committed: Owed keys committed once the service answered.
        owed_dropped: Keys not kept as owed (the bound was reached).
    """

    calls: int = 0
    requests: int = 0
    timeouts: int = 0
    failures: int = 0
    deferred: int = 0
    deferred_not_indexed: int = 0
    owed: int = 0
    owed_committed: int = 0
    owed_dropped: int = 0


class IndexCommitter(Indexer):
    """Batches the data-plane threads' index commits into PutStart calls.

    Args:
        node_id: This store's node id (the writer of the commits).
        client: The metadata client the calls go through.
        timeout_s: Longest a data-plane thread waits for the index; also
            the longest deadline of a call, and how long a deferred commit
            is tried.
        registered: Whether this store is registered now; while it is not,
            nothing is sent (the index would not take it) and every commit
            is NOT_INDEXED. By default, always.
        holds: Whether the store still holds a chunk (a deferred commit
            skips what left it meanwhile); by default, everything.
        backoff: The wait before a failed deferred call is tried again.
    """

    def __init__(
        self,
        node_id: str,
        client: IndexClient,
        timeout_s: float,
        *,
        registered: Callable[[], bool] | None = None,
        holds: Callable[[ChunkKey], bool] | None = None,
        backoff: Backoff = INDEX_RETRY.backoff,
    ) -> None:
        self._node_id = node_id
        self._client = client
        self._timeout_s = timeout_s
        self._registered = registered
        self._holds = holds
        self._backoff = backoff
        self._cond = threading.Condition()
        self._queue: list[_Request] = []
        self._sending = False
        self._closed = False
        # Deferred commits: their own lock, queue and thread.
        self._dcond = threading.Condition()
        self._deferred: deque[_Request] = deque()
        self._deferred_keys = 0  # queued or in flight
        self._writers: OrderedDict[WriterId, _Writer] = OrderedDict()
        self._thread: threading.Thread | None = None
        # Held but not indexed (key: size), oldest first; under the deferred lock.
        self._owed: OrderedDict[ChunkKey, int] = OrderedDict()
        self._kicked = False  # the service answered since the last owed call
        self._late = [0, 0]  # owed keys committed, and no longer held, since failing
        self._repeats = RepeatLog(logger)
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
        codes = request.codes or [IndexCode.NOT_INDEXED] * len(keys)
        missed = [i for i, c in enumerate(codes) if c == IndexCode.NOT_INDEXED]
        # The writer commits these itself if it can; if it cannot either, the
        # store still holds them.
        self._owe([keys[i] for i in missed], [sizes[i] for i in missed])
        return codes

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
        if self._registered is not None and not self._registered():
            return None
        # One entry per distinct key: a key's bytes are in one reservation at
        # a time, but a duplicate must not confuse the answer.
        order: dict[ChunkKey, int] = {}
        sizes: list[int] = []
        for request in batch:
            for key, size in zip(request.keys, request.sizes, strict=True):
                if key not in order:
                    order[key] = len(sizes)
                    sizes.append(size)
        self.stats.requests += len(batch)
        reply = self._put_start(list(order), sizes, deadline_s)
        if reply is None:
            return None
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

    def _put_start(
        self, keys: list[ChunkKey], sizes: list[int], deadline_s: float
    ) -> metadata_pb2.PutStartResponse | None:
        """One PutStart committing written chunks; its reply, or ``None``
        when no replica answered."""
        self.stats.calls += 1
        try:
            reply = self._client.put_start(
                metadata_pb2.PutStartRequest(
                    keys=keys,
                    sizes=sizes,
                    writer_node_id=self._node_id,
                    request_id=os.urandom(16),
                    written=[True] * len(sizes),
                ),
                timeout_s=deadline_s,
            )
        except Exception as exc:  # no replica answered, a closed client: the writers commit
            self.stats.failures += 1
            # The lease reports an outage (rate-limited), and the writers see NOT_INDEXED.
            logger.debug("index commit of %d chunks failed: %s", len(sizes), exc)
            return None
        self.answered()
        return reply

    # -- deferred commits ---------------------------------------------------
    def defer(self, writer: WriterId, keys: Sequence[ChunkKey], sizes: Sequence[int]) -> bool:
        """Queue chunks the store holds for the index, without waiting.

        Returns:
            Whether they were queued (their outcome counted for ``writer``);
            not when closed or when :data:`MAX_DEFERRED_KEYS` are pending.
        """
        if not keys:
            return True
        with self._dcond:
            if self._closed or self._deferred_keys + len(keys) > MAX_DEFERRED_KEYS:
                return False
            self._writer(writer).pending += len(keys)
            deadline = time.monotonic() + self._timeout_s
            self._deferred.append(_Request(keys, sizes, writer=writer, deadline=deadline))
            self._deferred_keys += len(keys)
            self.stats.deferred += len(keys)
            self._start_thread()
            self._dcond.notify_all()
        return True

    def _start_thread(self) -> None:
        """Under the deferred lock: the committer thread, started when first needed."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._commit_deferred, name="kvdepot-index", daemon=True
            )
            self._thread.start()

    def sync(self, writer: WriterId, wait_s: float) -> IndexSettled:
        """Wait (at most ``wait_s``, and ``timeout_s``) until none of the
        writer's deferred chunks is pending; its outcomes since the last sync."""
        deadline = time.monotonic() + min(wait_s, self._timeout_s)
        with self._dcond:
            w = self._writers.get(writer)
            if w is None:
                return IndexSettled()
            while w.pending and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._dcond.wait(left)
            out = IndexSettled(w.new, w.elsewhere, w.not_indexed, w.pending)
            w.new = w.elsewhere = w.not_indexed = 0
            if not w.pending:
                del self._writers[writer]
            return out

    def _writer(self, writer: WriterId) -> _Writer:
        """Under the deferred lock: the writer's counts, made when new."""
        w = self._writers.get(writer)
        if w is not None:
            self._writers.move_to_end(writer)
            return w
        if len(self._writers) >= MAX_WRITERS:
            idle = next((k for k, v in self._writers.items() if not v.pending), None)
            self._writers.pop(idle if idle is not None else next(iter(self._writers)))
        w = self._writers[writer] = _Writer()
        return w

    def _commit_deferred(self) -> None:
        """The committer thread: one call at a time, each carrying all that
        queued; owed keys once the service answered and nothing is queued."""
        failed = 0
        while True:
            with self._dcond:
                while not (self._deferred or self._closed or (self._owed and self._kicked)):
                    self._dcond.wait()
                if self._closed:
                    self._settle(list(self._deferred), None)
                    self._deferred.clear()
                    return
                owed: list[tuple[ChunkKey, int]] = []
                if not self._deferred:
                    self._kicked = False  # set again by this call's answer
                    owed = list(islice(self._owed.items(), MAX_KEYS_PER_CALL))
                else:
                    batch = self._take_deferred()
            if owed:
                self._commit_owed(owed)
            else:
                failed = self._commit_batch(batch, failed)

    def _commit_batch(self, batch: list[_Request], failed: int) -> int:
        """Send deferred commits (again after a backoff if the call failed,
        while their time lasts); returns the calls failed in a row."""
        now = time.monotonic()
        live, late = _split(batch, now + _MIN_DEADLINE_S)
        self._settle(late, None)
        live = self._still_held(live)
        if not live:
            return failed
        results = self._call(live, max(r.deadline for r in live) - now)
        if results is not None:
            self._settle(live, results)
            return 0
        failed += 1
        delay = self._backoff.delay(failed)
        now = time.monotonic()
        # Tried again after the backoff while their time lasts.
        retry, late = _split(live, now + delay)
        self._settle(late, None)
        with self._dcond:
            self._deferred.extendleft(reversed(retry))
            if not self._closed:
                self._dcond.wait(delay)
        return failed

    def _take_deferred(self) -> list[_Request]:
        """Under the deferred lock: the next call's commits."""
        batch: list[_Request] = []
        n = 0
        while self._deferred and (
            not batch or n + len(self._deferred[0].keys) <= MAX_KEYS_PER_CALL
        ):
            batch.append(self._deferred.popleft())
            n += len(batch[-1].keys)
        return batch

    def _still_held(self, batch: list[_Request]) -> list[_Request]:
        """The commits with only the chunks the store still holds (the rest
        settled not indexed): an evicted chunk is never named by a lookup."""
        holds = self._holds
        if holds is None:
            return batch
        out: list[_Request] = []
        for r in batch:
            held = [i for i, k in enumerate(r.keys) if holds(k)]
            if len(held) < len(r.keys):
                with self._dcond:
                    self._account(r.writer, len(r.keys) - len(held), None)
                    self._dcond.notify_all()
                if not held:
                    continue
                r = _Request(
                    [r.keys[i] for i in held],
                    [r.sizes[i] for i in held],
                    writer=r.writer,
                    deadline=r.deadline,
                )
            out.append(r)
        return out

    def _settle(self, batch: list[_Request], results: list[list[IndexCode]] | None) -> None:
        """Count what the index did with deferred commits; wake who syncs."""
        if not batch:
            return
        with self._dcond:
            for i, r in enumerate(batch):
                self._account(r.writer, len(r.keys), results[i] if results is not None else None)
            self._dcond.notify_all()
        if results is None:
            for r in batch:
                self._owe(r.keys, r.sizes)

    def _account(self, writer: WriterId, n: int, codes: list[IndexCode] | None) -> None:
        """Under the deferred lock: ``n`` of the writer's chunks settled
        (``codes`` per chunk; ``None``: none indexed)."""
        self._deferred_keys -= n
        missed = n if codes is None else codes.count(IndexCode.NOT_INDEXED)
        self.stats.deferred_not_indexed += missed
        w = self._writers.get(writer)
        if w is None:
            return  # forgotten (too many writers)
        w.pending -= n
        w.not_indexed += missed
        if codes is not None:
            w.new += codes.count(IndexCode.NEW)
            w.elsewhere += codes.count(IndexCode.ELSEWHERE)

    # -- owed keys: held but not indexed --------------------------------------
    def answered(self) -> None:
        """The metadata service answered (a heartbeat, a commit): what is
        owed to the index is committed now. Cheap; from any thread."""
        with self._dcond:
            if self._owed and not self._kicked:
                self._kicked = True
                self._dcond.notify_all()

    def _owe(self, keys: Sequence[ChunkKey], sizes: Sequence[int]) -> None:
        """Keep keys the store holds but could not index, for a later commit."""
        if not keys:
            return
        dropped = 0
        with self._dcond:
            if self._closed:
                return
            owed = self._owed
            for key, size in zip(keys, sizes, strict=True):
                if key in owed:
                    continue
                if len(owed) >= MAX_OWED_KEYS:
                    dropped += 1
                    continue
                owed[key] = size
            # A commit just failed: an answer from before it says nothing now.
            self._kicked = False
            self.stats.owed = n = len(owed)
            self.stats.owed_dropped += dropped
            total_dropped = self.stats.owed_dropped
            self._start_thread()
        extra = {"event": "index_owed", "node": self._node_id, "owed": n}
        self._repeats.warn(
            "owed",
            "index commits are failing: %d chunks held here are not indexed yet; "
            "they are committed once the metadata service answers",
            n,
            extra=extra,
        )
        if dropped:
            self._repeats.warn(
                "owed_full",
                "%d chunks not indexed were not kept for a later commit (%d kept at most, "
                "%d dropped in all): the store's next registration indexes them",
                dropped,
                MAX_OWED_KEYS,
                total_dropped,
                extra={**extra, "dropped": total_dropped},
            )

    def _commit_owed(self, owed: list[tuple[ChunkKey, int]]) -> None:
        """One call committing owed keys the store still holds; an answer of
        any kind settles them (not committed: this node is no live node of
        the index, and its next registration indexes what it holds)."""
        holds = self._holds
        gone = {k for k, _ in owed if holds is not None and not holds(k)}
        held = [(k, s) for k, s in owed if k not in gone]
        reply = None
        if held and (self._registered is None or self._registered()):
            reply = self._put_start([k for k, _ in held], [s for _, s in held], self._timeout_s)
        with self._dcond:
            for k in gone:
                self._owed.pop(k, None)
            if reply is not None:
                for k, _ in held:
                    self._owed.pop(k, None)
                self.stats.owed_committed += len(held)
                self._late[0] += len(held)
            self._late[1] += len(gone)
            self.stats.owed = len(self._owed)
            if self._owed:
                return
            committed, left = self._late
            self._late = [0, 0]
        ended = self._repeats.ended("owed")
        self._repeats.ended("owed_full")
        if ended is not None:
            logger.info(
                "the chunks this store could not index in time are indexed now: %d committed, "
                "%d no longer held (%d commits not made in time, over %.1f s)",
                committed,
                left,
                ended[0],
                ended[1],
                extra={"event": "index_owed_committed", "node": self._node_id},
            )

    def close(self) -> None:
        """Answer NOT_INDEXED from now on; commits waiting give up at once,
        deferred ones still queued are counted not indexed."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        with self._dcond:
            # The committer settles what is queued and ends; a call it has
            # in flight ends at its deadline.
            self._dcond.notify_all()


def _split(batch: list[_Request], until: float) -> tuple[list[_Request], list[_Request]]:
    """The commits still to be tried at ``until`` (monotonic), and the others."""
    yes: list[_Request] = []
    no: list[_Request] = []
    for r in batch:
        (yes if r.deadline > until else no).append(r)
    return yes, no
