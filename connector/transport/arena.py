"""The common client side of transports that move bytes straight into and out
of a store's arena (``shm``, ``nixl``): reserve/commit and lease/release over
a control connection, the bytes by a mechanism each subclass supplies."""

from __future__ import annotations

import abc
import logging
from collections.abc import Sequence
from typing import Generic, TypeVar

from kvdepot.connector.transport.base import GetItem, GetOutcome, PutItem, PutStatus, Transport
from kvdepot.connector.transport.control import ControlConnection, ControlPool
from kvdepot.connector.transport.pipeline import with_outcomes
from kvdepot.connector.transport.tcp import (
    GetWork,
    PutWork,
    TcpTransport,
    check_get_items,
    check_put_items,
    split_batches,
)
from kvdepot.errors import KVDepotError, Unauthenticated
from kvdepot.keys import ChunkKey
from kvdepot.wire.protocol import IndexCode, IndexSettled, ProtocolLimits

logger = logging.getLogger(__name__)

PeerT = TypeVar("PeerT")


class ArenaTransport(Transport, Generic[PeerT], abc.ABC):
    """Batching, failure handling and connection reuse shared by arena transports.

    Subclasses say how to reach a store's arena (:meth:`_open`) and how to
    move one batch (:meth:`_put_batch`, :meth:`_get_batch`). A connection that
    saw an error is closed, never reused: the store then revokes its
    reservations and releases its leases.
    """

    name = "arena"
    indexes = False
    """Whether the class implements :meth:`_put_batch_indexed`."""
    _pool: ControlPool
    _tcp: TcpTransport
    _limits: ProtocolLimits
    _closed: bool

    @abc.abstractmethod
    def _open(self, address: str) -> tuple[ControlConnection, PeerT]:
        """A control connection to ``address`` and the arena it attached to."""

    @abc.abstractmethod
    def _put_batch(
        self, conn: ControlConnection, peer: PeerT, batch: list[PutWork], items: Sequence[PutItem]
    ) -> list[tuple[int, PutStatus]]:
        """Reserve, write and commit one batch."""

    def _put_batch_indexed(
        self,
        conn: ControlConnection,
        peer: PeerT,
        batch: list[PutWork],
        items: Sequence[PutItem],
        indexed: list[IndexCode],
        writer: int = 0,
    ) -> list[tuple[int, PutStatus]]:
        """As :meth:`_put_batch`, the store indexing what it commits (after
        answering, for a ``writer`` token); sets ``indexed`` (per item of
        ``items``). Only where the class ``indexes``."""
        raise NotImplementedError

    @abc.abstractmethod
    def _get_batch(
        self, conn: ControlConnection, peer: PeerT, batch: list[GetWork]
    ) -> list[tuple[int, GetOutcome]]:
        """Lease, read, verify and release one batch."""

    def put(self, address: str, items: Sequence[PutItem]) -> list[PutStatus]:
        """Write chunks into the store's arena; see :meth:`Transport.put`."""
        return self._put(address, items, None)

    def put_indexed(
        self, address: str, items: Sequence[PutItem], writer: int = 0
    ) -> tuple[list[PutStatus], list[IndexCode]]:
        """Write chunks into the store's arena, the store indexing them on
        commit; see :meth:`Transport.put_indexed`."""
        if not self.indexes:
            return super().put_indexed(address, items)
        indexed = [IndexCode.NOT_INDEXED] * len(items)
        return self._put(address, items, indexed, writer), indexed

    def sync_index(self, address: str, writer: int, wait_s: float) -> IndexSettled | None:
        """Ask over the store's socket, once the store answered the late
        commits sent to it (their chunks are pending in its index then, or
        counted ``skipped`` or ``lost``); see :meth:`Transport.sync_index`."""
        if not self.indexes:
            return None
        self._pool.settle(address)
        settled = self._tcp.sync_index(address, writer, wait_s)
        if settled is None:
            return None  # the outcomes wait for an answer that can carry them
        return with_outcomes(settled, self._pool.pipeline(address))

    def _put(
        self,
        address: str,
        items: Sequence[PutItem],
        indexed: list[IndexCode] | None,
        writer: int = 0,
    ) -> list[PutStatus]:
        statuses, todo = check_put_items(items, self._limits)
        if not todo:
            return statuses
        try:
            conn, peer = self._open(address)
        except Unauthenticated:
            raise
        except (KVDepotError, OSError) as exc:
            logger.warning("%s put to %s failed: %s", self.name, address, str(exc))
            return statuses
        try:
            for batch in split_batches(todo, lambda t: t[2].nbytes, self._limits):
                done = (
                    self._put_batch(conn, peer, batch, items)
                    if indexed is None
                    else self._put_batch_indexed(conn, peer, batch, items, indexed, writer)
                )
                for i, code in done:
                    statuses[i] = code
        except (KVDepotError, OSError) as exc:
            conn.close()  # the store revokes this connection's reservations
            logger.warning("%s put to %s failed: %s", self.name, address, str(exc))
            return statuses
        self._pool.checkin(address, conn)
        return statuses

    def get_into(self, address: str, items: Sequence[GetItem]) -> list[GetOutcome]:
        """Read chunks out of the store's arena; see :meth:`Transport.get_into`."""
        todo = check_get_items(items)
        outcomes = [GetOutcome(False, 0, "transport: not attempted")] * len(items)
        if not todo:
            return outcomes
        # Read-your-writes: chunks whose commit a put left unanswered are
        # committed first (or a miss, when the wait runs out).
        self._pool.settle(address)
        try:
            conn, peer = self._open(address)
        except Unauthenticated:
            raise
        except (KVDepotError, OSError) as exc:
            logger.warning("%s get from %s failed: %s", self.name, address, str(exc))
            return [GetOutcome(False, 0, f"transport: {exc}")] * len(items)
        try:
            for batch in split_batches(todo, lambda _: 0, self._limits):
                for i, outcome in self._get_batch(conn, peer, batch):
                    outcomes[i] = outcome
        except (KVDepotError, OSError) as exc:
            conn.close()  # the store releases this connection's leases
            logger.warning("%s get from %s failed: %s", self.name, address, str(exc))
            failed = GetOutcome(False, 0, f"transport: {exc}")
            return [o if o.ok else failed for o in outcomes]
        self._pool.checkin(address, conn)
        return outcomes

    def delete(self, address: str, keys: Sequence[ChunkKey]) -> list[bool]:
        """Delete chunks (over the store's socket); see :meth:`Transport.delete`."""
        return self._tcp.delete(address, keys)

    def close(self) -> None:
        """Close the control connections, then release what the subclass holds."""
        self._closed = True
        self._pool.close()
        self._tcp.close()
        self._release()

    def _release(self) -> None:
        """Release subclass resources (mappings, registrations)."""
