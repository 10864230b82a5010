"""The ``tcp`` transport: kvdepot's framed binary protocol over plain sockets.

Payloads never pass through an intermediate buffer: a put hands the caller's
buffers to ``sendmsg``, a get ``recv_into``\\s each chunk straight into the
caller's destination. Checksums never cost a pass over memory of their own:
a reader hashes each block of a chunk right after it arrived (still in
cache), and a writer that did not compute its checksum beforehand
(``PutItem.checksum is None``) sends a PUT_TRAILED, hashing each block right
after the kernel copied it and sending the checksum after the payload.

A large batch is split over several connections to the same store that run
in parallel: one Python thread per connection spends its time in system calls
that release the GIL, so a single request no longer has to wait for one
connection's round trips, wake-ups and hashing in series.

A deferring writer's put (``put_indexed`` with a writer token) does not wait
for the store's answer: it returns once its bytes are handed to the kernel,
and the next exchange on the connection reads the answer (see
:mod:`kvdepot.connector.transport.tcp_pool`). Reads, deletes and syncs of the
same transport first wait, bounded, for the answers of every put sent before.

Connections are pooled per peer and reused across calls; a connection that saw
any error is closed, never returned to the pool, because after an error the
position in the byte stream is unknown. A pooled connection the store closed
while idle is detected before use (and, should the race still be lost, the
request is retried once on a fresh connection). A store that let an exchange
time out is recorded as stalled
(:class:`~kvdepot.connector.transport.stall.Stalls`): the rest of the call,
and later calls, fail at once until it answers a probe.

Connections, the work items and batches come from the stream layer
(:mod:`~kvdepot.connector.transport.stream`), which the arena transports
share; nothing here knows their control connections.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from kvdepot.connector.transport.base import (
    GetItem,
    GetOutcome,
    GetStatus,
    IndexingTransport,
    PutItem,
    PutStatus,
)
from kvdepot.connector.transport.pipeline import with_outcomes
from kvdepot.connector.transport.stall import Stalls, log_failure
from kvdepot.connector.transport.stream import (
    PUT_STATUS,
    GetWork,
    PutWork,
    check_get_items,
    check_put_items,
    parse_address,
    split_batches,
    whole_get_work,
    whole_put_work,
)
from kvdepot.connector.transport.tcp_pool import MAX_LATE, Stream, TcpPool
from kvdepot.errors import InvalidArgument, KVDepotError, Unauthenticated
from kvdepot.keys import ChunkKey, validate_key
from kvdepot.rpc.security_config import SecurityConfig
from kvdepot.wire.protocol import (
    GET_REPLY_ENTRY,
    HASH_BLOCK,
    IOV_MAX,
    DeleteCode,
    ErrorCode,
    GetCode,
    Header,
    IndexCode,
    IndexSettled,
    Opcode,
    PeerClosed,
    ProtocolError,
    ProtocolLimits,
    PutCode,
    drain,
    index_flags,
    pack_get_entries,
    pack_put_entries,
    recv_exact,
    recv_exact_into_many,
    recv_hashed_into,
    recv_index_codes,
    recv_reply_header,
    send_all,
    send_hashed,
    unpack_get_reply_rows,
    unpack_statuses,
)
from kvdepot.wire.xxh3 import xxh3_64

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_A = TypeVar("_A")

PARALLEL_MIN_BYTES = 8 << 20
"""A batch at least this large is spread over several connections."""

__all__ = ["TcpTransport"]


def _spread(items: list[_T], size: Callable[[_T], int], ways: int) -> list[list[_T]]:
    """Split ``items`` into at most ``ways`` consecutive runs of about equal bytes."""
    total = sum(size(t) for t in items)
    if ways <= 1 or len(items) <= 1 or total < PARALLEL_MIN_BYTES:
        return [items]
    ways = min(ways, len(items))
    share = total / ways
    runs: list[list[_T]] = [[]]
    acc = 0
    for item in items:
        if runs[-1] and acc >= share * len(runs) and len(runs) < ways:
            runs.append([])
        runs[-1].append(item)
        acc += size(item)
    return runs


def _plan(
    items: list[_T], sizes: list[int], limits: ProtocolLimits, ways: int
) -> list[list[list[_T]]]:
    """The requests of each parallel run: :func:`_spread` over ``ways``
    connections, then :func:`split_batches` within the limits."""
    total = sum(sizes)
    if total < PARALLEL_MIN_BYTES and (
        len(items) <= limits.max_batch and total <= limits.max_request_bytes
    ):
        return [[items]] if items else []  # the common case: one request
    size = sizes.__getitem__
    runs = _spread(list(range(len(items))), size, ways)
    return [[[items[i] for i in b] for b in split_batches(r, size, limits)] for r in runs if r]


SMALL_PAYLOAD = HASH_BLOCK // 4
"""Payloads of a GET_REPLY up to this size (128 KiB) are received together,
at most ``HASH_BLOCK`` bytes in one call, then hashed; larger ones one by one,
block by block. Measured on loopback, two cores, 8 chunks a get: together,
4 KiB chunks took about 10 us less a get and 128 KiB ones 20 us less, but
256 KiB ones in pairs took 100 us more than one by one."""

DEFAULT_STREAMS = min(4, max(1, (os.cpu_count() or 2) // 2))
"""Connections per large batch: each busy one keeps a core on either end
copying (and hashing); on two cores one stream beat two by 10-20 %."""


class TcpTransport(IndexingTransport):
    """The ``tcp`` data plane client.

    Args:
        connect_timeout_s: Time allowed to establish a connection.
        io_timeout_s: Time a send or receive may stall before the connection
            is declared dead (and its store stalled, see :meth:`stalled`).
        max_idle_per_peer: Idle connections kept per store for reuse.
        limits: The protocol limits of the stores; requests are split to stay
            within them.
        streams: Connections one large batch is spread over, in parallel.
        security: The token each new connection proves it holds (when set).
        stalls: The record of stores that stopped answering, shared with the
            other transports of a client (``auto``); by default its own.

    Raises:
        InvalidArgument: If a timeout is not positive, ``max_idle_per_peer``
            is negative or ``streams`` is below 1.
    """

    name = "tcp"

    def __init__(
        self,
        connect_timeout_s: float = 5.0,
        io_timeout_s: float = 30.0,
        max_idle_per_peer: int = 4,
        *,
        limits: ProtocolLimits | None = None,
        streams: int = DEFAULT_STREAMS,
        security: SecurityConfig | None = None,
        stalls: Stalls | None = None,
    ) -> None:
        if connect_timeout_s <= 0 or io_timeout_s <= 0:
            raise InvalidArgument("transport timeouts must be positive")
        if max_idle_per_peer < 0:
            raise InvalidArgument("max_idle_per_peer must not be negative")
        if streams < 1:
            raise InvalidArgument("streams must be at least 1")
        self._limits = limits or ProtocolLimits()
        self._io_timeout_s = io_timeout_s
        token = security.tokens().token if security is not None else ""
        self._pool = TcpPool(
            connect_timeout_s, io_timeout_s, max(max_idle_per_peer, streams), token, stalls
        )
        self._streams = streams
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()
        self._closed = False
        self._parsed: set[str] = set()  # addresses that parse_address took

    def stalled(self, address: str) -> bool:
        """Whether the store stopped answering; see :meth:`Transport.stalled`."""
        return self._pool.stalls.stalled(address)

    def put(self, address: str, items: Sequence[PutItem]) -> list[PutStatus]:
        """Write chunks; see :meth:`Transport.put`."""
        self._check_usable(address)
        return self._put(address, *check_put_items(items, self._limits), False)[0]

    def put_whole(
        self, address: str, keys: Sequence[ChunkKey], views: Sequence[memoryview]
    ) -> list[PutStatus]:
        """Write whole chunks, validated by the caller; see :meth:`Transport.put_whole`."""
        self._check_usable(address)
        return self._put(address, *whole_put_work(keys, views, self._limits), False)[0]

    def put_indexed(
        self, address: str, items: Sequence[PutItem], writer: int = 0
    ) -> tuple[list[PutStatus], list[IndexCode]]:
        """Write chunks, the store indexing them; see :meth:`IndexingTransport.put_indexed`."""
        self._check_usable(address)
        return self._put(address, *check_put_items(items, self._limits), True, writer)

    def put_whole_indexed(
        self,
        address: str,
        keys: Sequence[ChunkKey],
        views: Sequence[memoryview],
        writer: int = 0,
    ) -> tuple[list[PutStatus], list[IndexCode]]:
        """:meth:`put_indexed` of whole chunks validated by the caller."""
        self._check_usable(address)
        return self._put(address, *whole_put_work(keys, views, self._limits), True, writer)

    def sync_index(self, address: str, writer: int, wait_s: float) -> IndexSettled:
        """Ask the store about a writer's deferred chunks; see
        :meth:`IndexingTransport.sync_index`."""
        self._check_usable(address)
        # The late puts' chunks are in the store's count once it answered them.
        self._pool.settle(address)
        io_timeout_s = self._io_timeout_s

        def sync(stream: Stream, _: None) -> IndexSettled:
            return stream.sync(writer, wait_s, io_timeout_s)

        settled = self._exchange(address, sync, None)
        return with_outcomes(settled, self._pool.pipeline(address))

    def _put(
        self,
        address: str,
        statuses: list[PutStatus],
        todo: list[PutWork],
        index: bool,
        writer: int = 0,
    ) -> tuple[list[PutStatus], list[IndexCode]]:
        """Put ``todo`` (``statuses``: every item's, preset to FAILED)."""
        indexed = [IndexCode.NOT_INDEXED] * len(statuses)
        # A deferring writer learns the store's answer later (sync_index).
        late = index and writer != 0

        def request(stream: Stream, batch: list[PutWork]) -> list[tuple[PutCode, IndexCode]]:
            if late:
                return _put_late(stream, batch, writer)
            return _put_batch(stream.sock, batch, index, writer)

        def run(batches: list[list[PutWork]]) -> None:
            for batch in batches:
                try:
                    codes = self._exchange(address, request, batch, late=late)
                except Unauthenticated:
                    raise  # every later call would fail the same: the caller must know
                except KVDepotError as exc:
                    # This batch and the rest stay FAILED: the store is unreachable or broken.
                    log_failure(logger, f"put of {len(todo)} chunks", address, exc)
                    return
                for (i, _, _, _), (code, ix) in zip(batch, codes, strict=True):
                    statuses[i] = PUT_STATUS[code]
                    indexed[i] = ix

        plan = _plan(todo, [t[2].nbytes for t in todo], self._limits, self._streams)
        self._in_parallel(plan, run)
        return statuses, indexed

    def get_into(self, address: str, items: Sequence[GetItem]) -> list[GetOutcome]:
        """Read chunks into caller buffers; see :meth:`Transport.get_into`."""
        self._check_usable(address)
        todo = check_get_items(items)
        cap = self._limits.max_chunk_bytes
        sizes = [min(e.length or buf.nbytes, cap) for _, e, buf in todo]
        return self._get(address, todo, sizes)

    def get_whole(
        self, address: str, keys: Sequence[ChunkKey], views: Sequence[memoryview]
    ) -> list[GetOutcome]:
        """Read whole chunks, validated by the caller; see :meth:`Transport.get_whole`."""
        self._check_usable(address)
        todo = whole_get_work(keys, views)
        sizes = [v.nbytes for v in views]
        cap = self._limits.max_chunk_bytes
        if sizes and max(sizes) > cap:
            sizes = [min(n, cap) for n in sizes]
        return self._get(address, todo, sizes)

    def _get(self, address: str, todo: list[GetWork], sizes: list[int]) -> list[GetOutcome]:
        """Read ``todo`` (every item of a call, in order; ``sizes``: the bytes
        each may take, for planning)."""
        # Read-your-writes: chunks of late puts are committed first (or a
        # miss, when the wait runs out).
        self._pool.settle(address)
        plan = _plan(todo, sizes, self._limits, self._streams)
        if len(plan) == 1 and len(plan[0]) == 1:
            # One request on this thread, the common case: its outcomes are the call's.
            try:
                return self._exchange(address, self._get_batch, plan[0][0])
            except Unauthenticated:
                raise
            except KVDepotError as exc:
                return [_get_failed(address, len(todo), exc)] * len(todo)
        outcomes = [_NOT_ATTEMPTED] * len(todo)

        def run(batches: list[list[GetWork]]) -> None:
            for k, batch in enumerate(batches):
                try:
                    results = self._exchange(address, self._get_batch, batch)
                except Unauthenticated:
                    raise
                except KVDepotError as exc:
                    failed = _get_failed(address, len(todo), exc)
                    for rest in batches[k:]:
                        for i, _, _ in rest:
                            outcomes[i] = failed
                    return
                for (i, _, _), outcome in zip(batch, results, strict=True):
                    outcomes[i] = outcome

        self._in_parallel(plan, run)
        return outcomes

    def delete(self, address: str, keys: Sequence[ChunkKey]) -> list[bool]:
        """Delete chunks; see :meth:`Transport.delete`."""
        self._check_usable(address)
        todo = [(i, validate_key(k, i)) for i, k in enumerate(keys)]
        self._pool.settle(address)  # a late put of these keys comes first
        removed = [False] * len(keys)
        for batch in split_batches(todo, lambda _: 0, self._limits):
            try:
                codes = self._exchange(address, _delete_batch, batch)
            except Unauthenticated:
                raise
            except KVDepotError as exc:
                log_failure(logger, f"delete of {len(todo)} chunks", address, exc)
                break
            for (i, _), code in zip(batch, codes, strict=True):
                removed[i] = code == DeleteCode.OK
        return removed

    def close(self) -> None:
        """Close every pooled connection; later calls raise ``InvalidArgument``."""
        self._closed = True
        self._pool.close()
        with self._executor_lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    def _check_usable(self, address: str) -> None:
        if self._closed:
            raise InvalidArgument("transport is closed")
        if address not in self._parsed:
            parse_address(address)
            self._parsed.add(address)  # a set: adding under threads is atomic

    def _in_parallel(self, runs: list[list[_T]], fn: Callable[[list[_T]], None]) -> None:
        # The first run goes on the caller's thread, the others on helpers.
        runs = [r for r in runs if r]
        if not runs:
            return
        if len(runs) == 1:
            fn(runs[0])
            return
        with self._executor_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=max(1, self._streams - 1), thread_name_prefix="kvdepot-tcp"
                )
            executor = self._executor
        futures = [executor.submit(fn, r) for r in runs[1:]]
        try:
            fn(runs[0])
        finally:
            for f in futures:
                f.result()

    def _exchange(
        self,
        address: str,
        request: Callable[[Stream, _A], _T],
        batch: _A,
        *,
        late: bool = False,
    ) -> _T:
        """Run one request/reply on a pooled connection (``late``: a late put,
        which reads the connection's late answers after sending, not before).

        Raises:
            Stalled: The store stopped answering before (a timeout of this
                exchange is recorded so: the rest of the call fails at once).
            Unavailable: The store is unreachable or the connection failed.
            ProtocolError: The store answered ERROR or something unparsable.
        """
        for attempt in range(2):
            stream, reused = self._pool.checkout(address)
            try:
                if not late:
                    stream.settle()
                result = request(stream, batch)
            except PeerClosed:
                stream.close()
                # A pooled connection the store had just closed: one retry on
                # a fresh connection, which is not a judgement on the store.
                if reused and attempt == 0:
                    continue
                raise
            except BaseException as exc:
                stream.close()
                self._pool.stalls.record(address, exc)
                raise
            self._pool.checkin(address, stream)
            return result
        raise AssertionError("unreachable")

    def _get_batch(self, stream: Stream, batch: list[GetWork]) -> list[GetOutcome]:
        """One GET and its reply: each payload lands in its buffer and is
        hashed while in cache; consecutive small ones arrive in one call."""
        sock = stream.sock
        n = len(batch)
        send_all(sock, [Header(Opcode.GET, n).pack() + pack_get_entries(e for _, e, _ in batch)])
        recv_reply_header(sock, Opcode.GET_REPLY, n)
        rows = unpack_get_reply_rows(recv_exact(sock, n * GET_REPLY_ENTRY.size))
        outcomes: list[GetOutcome] = []
        small = _SmallPayloads(outcomes)
        cap = self._limits.max_chunk_bytes
        for (_, entry, buf), (status, length, checksum) in zip(batch, rows, strict=True):
            if status != GetCode.OK:
                outcomes.append(_MISSES[status])
                continue
            if length > cap:
                raise ProtocolError(ErrorCode.MALFORMED, f"reply of {length} bytes for one chunk")
            if length > buf.nbytes or (entry.length and length != entry.length):
                # Keep the stream in sync, but never hand out these bytes.
                small.receive(sock)
                drain(sock, length)
                why = _misfit(buf.nbytes, length, entry.length)
                outcomes.append(GetOutcome(GetStatus.MISFIT, 0, why))
                continue
            dest = buf[:length] if length < buf.nbytes else buf
            if length <= SMALL_PAYLOAD:
                if not small.fits(length):
                    small.receive(sock)
                small.add(dest, checksum)
                continue
            small.receive(sock)
            ok = recv_hashed_into(sock, dest) == checksum
            outcomes.append(GetOutcome(GetStatus.OK, length) if ok else _MISMATCH)
        small.receive(sock)
        return outcomes


_MISSES: dict[int, GetOutcome] = {
    GetCode.NOT_FOUND: GetOutcome(GetStatus.NOT_FOUND, 0, "not found"),
    GetCode.INVALID: GetOutcome(GetStatus.INVALID, 0, "invalid range"),
}
_MISMATCH = GetOutcome(GetStatus.CORRUPT, 0, "checksum mismatch")
_NOT_ATTEMPTED = GetOutcome(GetStatus.FAILED, 0, "transport: not attempted")


def _get_failed(address: str, n: int, exc: KVDepotError) -> GetOutcome:
    """The outcome of the items of a GET that failed, and of the ones after
    it: misses (the store is unreachable or broken)."""
    log_failure(logger, f"get of {n} chunks", address, exc)
    return GetOutcome(GetStatus.FAILED, 0, f"transport: {exc}")


def _misfit(room: int, length: int, asked: int) -> str:
    if length > room:
        return f"buffer of {room} bytes too small for {length}"
    return f"store sent {length} bytes for a range of {asked}"


class _SmallPayloads:
    """Consecutive payloads of a GET_REPLY of at most ``SMALL_PAYLOAD`` bytes
    each and ``HASH_BLOCK`` in all, received with one system call and then
    hashed, still in cache.

    Their outcomes are appended to ``outcomes`` in reply order, as
    placeholders until :meth:`receive` fills them in (misses of the same
    reply may be appended between them: each payload keeps its own place).
    """

    __slots__ = ("_at", "_bytes", "_outcomes", "_sums", "_views")

    def __init__(self, outcomes: list[GetOutcome]) -> None:
        self._outcomes = outcomes
        self._views: list[memoryview] = []
        self._sums: list[int] = []
        self._at: list[int] = []
        self._bytes = 0

    def fits(self, length: int) -> bool:
        """Whether a payload of ``length`` bytes joins the pending ones."""
        return self._bytes + length <= HASH_BLOCK and len(self._views) < IOV_MAX

    def add(self, dest: memoryview, checksum: int) -> None:
        self._at.append(len(self._outcomes))
        self._views.append(dest)
        self._sums.append(checksum)
        self._bytes += dest.nbytes
        self._outcomes.append(_MISMATCH)

    def receive(self, sock: socket.socket) -> None:
        """Receive the pending payloads and settle their outcomes."""
        if not self._views:
            return
        recv_exact_into_many(sock, self._views)
        ok = _MISMATCH
        for at, view, checksum in zip(self._at, self._views, self._sums, strict=True):
            if xxh3_64(view) != checksum:
                continue  # the placeholder: a checksum mismatch
            if ok.length != view.nbytes or not ok.ok:
                ok = GetOutcome(GetStatus.OK, view.nbytes)  # shared by the payloads of one size
            self._outcomes[at] = ok
        self._views, self._sums, self._at, self._bytes = [], [], [], 0


def _parts(batch: list[PutWork]) -> Iterator[tuple[bool, list[PutWork]]]:
    """The items of a batch whose checksum is known (one PUT), then those whose
    checksum is computed while sending (one PUT_TRAILED); empty parts left out."""
    for trailed in (False, True):
        work = [t for t in batch if t[3] is trailed]
        if work:
            yield trailed, work


def _send_put(
    sock: socket.socket, work: list[PutWork], trailed: bool, writer: int, flags: int
) -> None:
    """Send one PUT, or one PUT_TRAILED whose checksums follow the payload."""
    opcode = Opcode.PUT_TRAILED if trailed else Opcode.PUT
    head = Header(opcode, len(work), writer, flags).pack() + pack_put_entries(
        e for _, e, _, _ in work
    )
    if trailed:
        send_hashed(sock, [head], [view for _, _, view, _ in work], short_is_stall=True)
    else:
        send_all(sock, [head, *(view for _, _, view, _ in work)], short_is_stall=True)


def _put_batch(
    sock: socket.socket, batch: list[PutWork], index: bool = False, writer: int = 0
) -> list[tuple[PutCode, IndexCode]]:
    # With ``index`` the store commits what it stored into the index too
    # (HeaderFlags.INDEX), after its reply where a ``writer`` token is given
    # (DEFER).
    flags = index_flags(index, writer)
    codes: dict[int, tuple[PutCode, IndexCode]] = {}
    for trailed, work in _parts(batch):
        _send_put(sock, work, trailed, writer, flags)
        codes.update(zip((t[0] for t in work), _put_reply(sock, len(work)), strict=True))
    return [codes[i] for i, _, _, _ in batch]


def _put_late(stream: Stream, batch: list[PutWork], writer: int) -> list[tuple[PutCode, IndexCode]]:
    """A deferring writer's put, answered later: sent as :func:`_put_batch`
    sends it, then the connection's older late answers that arrived are read
    (usually all: they came while this one was sent), and this one's is left
    for the next exchange.
    Every chunk is reported OK and PENDING: the store's answer is counted in
    its pipeline (``skipped``, ``lost``) and its index in its sync."""
    flags = index_flags(True, writer)
    sent = 0
    for trailed, work in _parts(batch):
        _send_put(stream.sock, work, trailed, writer, flags)
        stream.sent_late(len(work))
        sent += 1
    try:
        # The older answers that came while this one was sent; past
        # MAX_LATE unanswered, this put waits for the oldest.
        stream.settle_arrived(keep=sent)
        stream.settle(keep=max(MAX_LATE, sent))
    except BaseException:
        # This put fails as a whole (its caller sends it again or reports
        # it): its answers are not counted as lost as well.
        stream.withdraw_last(sent)
        raise
    return [(PutCode.OK, IndexCode.PENDING)] * len(batch)


def _put_reply(sock: socket.socket, n: int) -> list[tuple[PutCode, IndexCode]]:
    """A PUT_REPLY's statuses and index codes (NOT_INDEXED where it has none)."""
    header = recv_reply_header(sock, Opcode.PUT_REPLY, n)
    got = unpack_statuses(recv_exact(sock, n), PutCode)
    return list(zip(got, recv_index_codes(sock, header), strict=True))


def _delete_batch(stream: Stream, batch: list[tuple[int, ChunkKey]]) -> list[DeleteCode]:
    return stream.delete([k for _, k in batch])
