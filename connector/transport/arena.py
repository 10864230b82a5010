"""The common client side of transports that move bytes straight into and out
of a store's arena (``shm``, ``nixl``): reserve/commit and lease/release over
a control connection, the bytes by a mechanism each subclass supplies.

Everything else a store is asked goes over the same control connections
(DELETE, SYNC): an arena transport needs no ``tcp`` transport of its own.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from kvdepot.connector.transport.base import (
    GetItem,
    GetOutcome,
    GetStatus,
    IndexingTransport,
    PutItem,
    PutStatus,
)
from kvdepot.connector.transport.control import ControlConnection, ControlPool
from kvdepot.connector.transport.pipeline import with_outcomes
from kvdepot.connector.transport.stall import log_failure
from kvdepot.connector.transport.stream import (
    GetWork,
    PutWork,
    check_get_items,
    check_put_items,
    split_batches,
    whole_get_work,
    whole_put_work,
)
from kvdepot.errors import InvalidArgument, KVDepotError, Unauthenticated, Unavailable
from kvdepot.keys import ChunkKey, validate_key
from kvdepot.wire.protocol import (
    DeleteCode,
    ErrorCode,
    GetCode,
    GetEntry,
    IndexCode,
    IndexSettled,
    LeaseReplyEntry,
    ProtocolError,
    ProtocolLimits,
)

logger = logging.getLogger(__name__)

PeerT = TypeVar("PeerT")
PutOutcome = tuple[int, PutStatus, IndexCode]
"""What became of one item of a put batch: its index in the call, status, index code."""
_R = TypeVar("_R")


class ArenaUnusable(Unavailable):
    """The store's arena cannot be reached this way (another host, no shared
    arena, no NIXL agent): the store itself may well be."""


class ArenaTransport(IndexingTransport, Generic[PeerT], abc.ABC):
    """Batching, failure handling and connection reuse shared by arena transports.

    Subclasses say how to reach a store's arena from an attached connection
    (:meth:`_arena`) and how to move one batch (:meth:`_put_batch`,
    :meth:`_get_batch`). A connection that saw an error is closed, never
    reused: the store then revokes its reservations and releases its leases.
    """

    name = "arena"
    _pool: ControlPool
    _limits: ProtocolLimits
    _io_timeout_s: float
    _closed: bool

    @abc.abstractmethod
    def _arena(self, address: str, conn: ControlConnection) -> PeerT:
        """The arena ``conn`` attached to, ready for transfers.

        Raises:
            ArenaUnusable: It cannot be reached this way.
        """

    @abc.abstractmethod
    def _put_batch(
        self,
        conn: ControlConnection,
        peer: PeerT,
        batch: list[PutWork],
        index: bool,
        writer: int = 0,
    ) -> list[PutOutcome]:
        """Reserve, write and commit one batch: per item its index in the
        call, status and index code. With ``index`` the store indexes what it
        commits (after answering, for a ``writer`` token); else every code is
        NOT_INDEXED."""

    @abc.abstractmethod
    def _get_batch(
        self, conn: ControlConnection, peer: PeerT, batch: list[GetWork]
    ) -> list[tuple[int, GetOutcome]]:
        """Lease, read, verify and release one batch."""

    def _forget_peer(self, address: str) -> None:
        """The store at ``address`` is gone: drop what is kept of its arena."""

    def stalled(self, address: str) -> bool:
        """Whether the store stopped answering; see :meth:`Transport.stalled`."""
        return self._pool.stalls.stalled(address)

    def reserves_first(self, address: str) -> bool:
        """Always: a put RESERVEs before it copies; see :meth:`Transport.reserves_first`."""
        return True

    def usable(self, address: str) -> bool:
        """Whether the store at ``address`` has an arena this transport can
        reach; see :meth:`Transport.usable`.

        Raises:
            Unavailable: The store cannot be reached (or stalled).
            Unauthenticated: It refused this client's token.
        """
        try:
            conn = self._checkout(address)
        except ProtocolError as exc:
            if isinstance(exc, Unauthenticated):
                raise
            logger.debug("%s to %s not usable: %s", self.name, address, str(exc))
            return False
        try:
            self._arena(address, conn)
        except (KVDepotError, OSError) as exc:
            conn.close()
            if isinstance(exc, Unauthenticated):
                raise
            logger.debug("%s to %s not usable: %s", self.name, address, str(exc))
            return False
        self._pool.checkin(address, conn)
        return True

    def put(self, address: str, items: Sequence[PutItem]) -> list[PutStatus]:
        """Write chunks into the store's arena; see :meth:`Transport.put`."""
        return self._put(address, *check_put_items(items, self._limits), False)[0]

    def put_whole(
        self, address: str, keys: Sequence[ChunkKey], views: Sequence[memoryview]
    ) -> list[PutStatus]:
        """Write whole chunks, validated by the caller; see :meth:`Transport.put_whole`."""
        return self._put(address, *whole_put_work(keys, views, self._limits), False)[0]

    def put_indexed(
        self, address: str, items: Sequence[PutItem], writer: int = 0
    ) -> tuple[list[PutStatus], list[IndexCode]]:
        """Write chunks into the store's arena, the store indexing them on
        commit; see :meth:`IndexingTransport.put_indexed`."""
        return self._put(address, *check_put_items(items, self._limits), True, writer)

    def put_whole_indexed(
        self,
        address: str,
        keys: Sequence[ChunkKey],
        views: Sequence[memoryview],
        writer: int = 0,
    ) -> tuple[list[PutStatus], list[IndexCode]]:
        """:meth:`put_indexed` of whole chunks validated by the caller."""
        return self._put(address, *whole_put_work(keys, views, self._limits), True, writer)

    def sync_index(self, address: str, writer: int, wait_s: float) -> IndexSettled:
        """Ask over a control connection, once the store answered the late
        commits sent to it (their chunks are pending in its index then, or
        counted ``skipped`` or ``lost``); see :meth:`IndexingTransport.sync_index`."""
        self._pool.settle(address)
        settled = self._control(
            address, "sync", lambda conn: conn.sync(writer, wait_s, self._io_timeout_s)
        )
        return with_outcomes(settled, self._pool.pipeline(address))

    def _put(
        self,
        address: str,
        statuses: list[PutStatus],
        todo: list[PutWork],
        index: bool,
        writer: int = 0,
    ) -> tuple[list[PutStatus], list[IndexCode]]:
        """Put ``todo`` (``statuses``: every item's, preset to FAILED): every
        item's status and index code."""
        codes = [IndexCode.NOT_INDEXED] * len(statuses)
        if not todo:
            return statuses, codes

        def run(conn: ControlConnection, peer: PeerT) -> None:
            for batch in split_batches(todo, lambda t: t[2].nbytes, self._limits):
                for i, status, code in self._put_batch(conn, peer, batch, index, writer):
                    statuses[i], codes[i] = status, code

        self._session(address, "put", run)
        return statuses, codes

    def get_into(self, address: str, items: Sequence[GetItem]) -> list[GetOutcome]:
        """Read chunks out of the store's arena; see :meth:`Transport.get_into`."""
        return self._get(address, check_get_items(items), len(items))

    def get_whole(
        self, address: str, keys: Sequence[ChunkKey], views: Sequence[memoryview]
    ) -> list[GetOutcome]:
        """Read whole chunks, validated by the caller; see :meth:`Transport.get_whole`."""
        return self._get(address, whole_get_work(keys, views), len(keys))

    def _get(self, address: str, todo: list[GetWork], n: int) -> list[GetOutcome]:
        outcomes = [GetOutcome(GetStatus.FAILED, 0, "transport: not attempted")] * n
        if not todo:
            return outcomes
        # Read-your-writes: chunks whose commit a put left unanswered are
        # committed first (or a miss, when the wait runs out).
        self._pool.settle(address)

        def run(conn: ControlConnection, peer: PeerT) -> None:
            for batch in split_batches(todo, lambda _: 0, self._limits):
                for i, outcome in self._get_batch(conn, peer, batch):
                    outcomes[i] = outcome

        exc = self._session(address, "get", run)
        if exc is None:
            return outcomes
        failed = GetOutcome(GetStatus.FAILED, 0, f"transport: {exc}")
        return [o if o.ok else failed for o in outcomes]

    def delete(self, address: str, keys: Sequence[ChunkKey]) -> list[bool]:
        """Delete chunks over a control connection; see :meth:`Transport.delete`."""
        todo = [validate_key(k, i) for i, k in enumerate(keys)]
        removed: list[bool] = []
        self._pool.settle(address)  # a late commit of these keys comes first

        def run(conn: ControlConnection) -> None:
            for batch in split_batches(todo, lambda _: 0, self._limits):
                removed.extend(code == DeleteCode.OK for code in conn.delete(batch))

        try:
            self._control(address, "delete", run)
        except (Unauthenticated, InvalidArgument):
            raise
        except KVDepotError:
            pass  # logged; what was not removed stays False
        return removed + [False] * (len(keys) - len(removed))

    def _checkout(self, address: str) -> ControlConnection:
        if self._closed:
            raise InvalidArgument("transport is closed")
        try:
            return self._pool.checkout(address)
        except Unavailable:
            if not self._pool.stalls.stalled(address):
                self._forget_peer(address)  # refused or reset: not merely frozen
            raise

    def _open(self, address: str) -> tuple[ControlConnection, PeerT]:
        """A control connection to ``address`` and the arena it attached to."""
        conn = self._checkout(address)
        try:
            return conn, self._arena(address, conn)
        except BaseException:
            conn.close()
            raise

    def _session(
        self, address: str, what: str, run: Callable[[ControlConnection, PeerT], None]
    ) -> KVDepotError | OSError | None:
        """``run`` on a connection to ``address`` and its arena; what failed
        (logged, and a timeout recorded as a stall), or ``None``."""
        try:
            conn, peer = self._open(address)
        except (Unauthenticated, InvalidArgument):
            raise
        except (KVDepotError, OSError) as exc:
            log_failure(logger, f"{self.name} {what}", address, exc)
            return exc
        try:
            run(conn, peer)
        except (KVDepotError, OSError) as exc:
            conn.close()  # the store revokes its reservations, releases its leases
            self._pool.stalls.record(address, exc)
            log_failure(logger, f"{self.name} {what}", address, exc)
            return exc
        self._pool.checkin(address, conn)
        return None

    def _control(self, address: str, what: str, run: Callable[[ControlConnection], _R]) -> _R:
        """``run`` on a control connection to ``address`` (no arena needed).

        Raises:
            Unavailable: The store cannot be reached, stalled, or the
                connection failed (logged).
            ProtocolError: The store answered something unparsable.
        """
        try:
            conn = self._checkout(address)
        except (Unauthenticated, InvalidArgument):
            raise
        except KVDepotError as exc:
            log_failure(logger, f"{self.name} {what}", address, exc)
            raise
        try:
            result = run(conn)
        except (KVDepotError, OSError) as exc:
            conn.close()
            self._pool.stalls.record(address, exc)
            log_failure(logger, f"{self.name} {what}", address, exc)
            if isinstance(exc, OSError):
                raise Unavailable(f"{what} at {address} failed: {exc}") from exc
            raise
        self._pool.checkin(address, conn)
        return result

    def close(self) -> None:
        """Close the control connections, then release what the subclass holds."""
        self._closed = True
        self._pool.close()
        self._release()

    def _release(self) -> None:
        """Release subclass resources (mappings, registrations)."""


MISMATCH = GetOutcome(GetStatus.CORRUPT, 0, "checksum mismatch")
"""A read whose bytes did not match the checksum the store sent."""


def check_lease(
    arena_size: int, entry: GetEntry, buf: memoryview, reply: LeaseReplyEntry
) -> GetOutcome | None:
    """Why a leased range cannot be read into ``buf`` (``None`` when it can).

    Raises:
        ProtocolError: The lease lies outside the arena.
    """
    if reply.status is GetCode.NOT_FOUND:
        return GetOutcome(GetStatus.NOT_FOUND, 0, "not found")
    if reply.status is GetCode.INVALID:
        return GetOutcome(GetStatus.INVALID, 0, "invalid range")
    length = reply.length
    if reply.offset + length > arena_size:
        raise ProtocolError(ErrorCode.MALFORMED, "lease outside the arena")
    if length > buf.nbytes:
        why = f"buffer of {buf.nbytes} bytes too small for {length}"
        return GetOutcome(GetStatus.MISFIT, 0, why)
    if entry.length and length != entry.length:
        why = f"store leased {length} bytes for a range of {entry.length}"
        return GetOutcome(GetStatus.MISFIT, 0, why)
    return None
