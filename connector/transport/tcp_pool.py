"""Pooled ``tcp`` connections, and the put answers they have not read yet.

A deferring writer's put over ``tcp`` returns once its bytes are handed to
the kernel (:meth:`Stream.sent_late`): the store's answer is read by the next
exchange on the connection, which is usually the writer's next put, sent
before the answer is read so the store's last receive, verification and
commit of one put overlap the writer's next. Each such put holds a ticket of
its store's :class:`~kvdepot.connector.transport.pipeline.Pipeline`.
"""

from __future__ import annotations

import socket

from kvdepot.connector.transport.pipeline import Pipeline
from kvdepot.connector.transport.pool import IdlePool
from kvdepot.connector.transport.stream import Connection, Owed
from kvdepot.wire.protocol import (
    Opcode,
    PutCode,
    recv_exact,
    recv_index_codes,
    recv_reply_header,
    unpack_statuses,
)


class _LatePut(Owed):
    """The PUT_REPLY of a late put of ``n`` chunks, holding a pipeline ticket."""

    __slots__ = ("_n", "_pipeline", "_ticket")

    def __init__(self, n: int, pipeline: Pipeline) -> None:
        self._n = n
        self._pipeline = pipeline
        self._ticket = pipeline.sent(n)

    def read(self, sock: socket.socket) -> None:
        header = recv_reply_header(sock, Opcode.PUT_REPLY, self._n)
        statuses = unpack_statuses(recv_exact(sock, self._n), PutCode)
        codes = recv_index_codes(sock, header)
        self._pipeline.answered(self._ticket, statuses, codes)

    def lost(self) -> None:
        self._pipeline.answered(self._ticket, None)

    def withdrawn(self) -> None:
        self._pipeline.withdraw(self._ticket)


class Stream(Connection):
    """One ``tcp`` connection to a store and the late put answers it awaits.

    Not thread-safe: used by one caller at a time (checked out of a :class:`TcpPool`).
    """

    __slots__ = ("_pipeline",)

    def __init__(self, sock: socket.socket, pipeline: Pipeline) -> None:
        super().__init__(sock)
        self._pipeline = pipeline

    def sent_late(self, n: int) -> None:
        """A PUT of ``n`` chunks was just sent; its answer is read later."""
        self.owe(_LatePut(n, self._pipeline))


MAX_LATE = 4
"""Late answers one connection may await: a writer's put past them waits
(bounded by the I/O timeout) for the oldest, as a put would without them."""


class TcpPool(IdlePool[Stream]):
    """Idle ``tcp`` connections per store, with their late answers; see
    :class:`~kvdepot.connector.transport.pool.IdlePool` for the arguments."""

    def checkout(self, address: str) -> tuple[Stream, bool]:
        """A connection to ``address`` and whether it was reused from the pool.

        A reused one has read the late answers that arrived; one still
        awaiting some is in use by the store, alive.

        Raises:
            Stalled: The store stopped answering before.
            Unavailable: If a new connection cannot be made.
            InvalidArgument: The pool is closed.
        """
        stream = self._reuse(address)
        if stream is not None:
            return stream, True
        return Stream(self._connect(address), self.pipeline(address)), False
