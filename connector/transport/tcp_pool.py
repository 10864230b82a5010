"""Pooled ``tcp`` connections, and the put answers they have not read yet.

A deferring writer's put over ``tcp`` returns once its bytes are handed to
the kernel (:meth:`Stream.sent_late`): the store's answer is read by the next
exchange on the connection, which is usually the writer's next put, sent
before the answer is read so the store's last receive, verification and
commit of one put overlap the writer's next. Each such put holds a ticket of
its store's :class:`~kvdepot.connector.transport.pipeline.Pipeline`.
"""

from __future__ import annotations

import select
import socket
from collections import deque

from kvdepot.connector.transport.control import connect
from kvdepot.connector.transport.pipeline import Pipeline
from kvdepot.connector.transport.pool import IdlePool
from kvdepot.errors import KVDepotError
from kvdepot.wire.protocol import (
    Opcode,
    PutCode,
    recv_exact,
    recv_index_codes,
    recv_reply_header,
    unpack_statuses,
)


class Stream:
    """One connection to a store and the late put answers it awaits, oldest first.

    Not thread-safe: used by one caller at a time (checked out of a :class:`TcpPool`).
    """

    __slots__ = ("_arrival", "_late", "_pipeline", "sock")

    def __init__(self, sock: socket.socket, pipeline: Pipeline) -> None:
        self.sock = sock
        self._pipeline = pipeline
        self._late: deque[tuple[int, int]] = deque()  # (chunks, ticket)
        # poll, not select: an engine's process may hold more than 1024 fds.
        # One poller for the connection's life: each reuse checks it.
        self._arrival = select.poll()
        self._arrival.register(sock, select.POLLIN)

    @property
    def awaits(self) -> int:
        """Late answers not read yet."""
        return len(self._late)

    def sent_late(self, n: int) -> None:
        """A PUT of ``n`` chunks was just sent; its answer is read later."""
        self._late.append((n, self._pipeline.sent(n)))

    def withdraw_last(self, k: int) -> None:
        """Forget the last ``k`` late puts: their caller reports them failed itself."""
        for _ in range(k):
            _, ticket = self._late.pop()
            self._pipeline.withdraw(ticket)

    def settle(self, keep: int = 0) -> None:
        """Read the late answers, all but the newest ``keep``.

        Raises:
            ProtocolError: The store answered ERROR or something unparsable.
            Unavailable: The connection failed.
        """
        while len(self._late) > keep:
            self._read_oldest()

    def settle_arrived(self, keep: int = 0) -> None:
        """Read the late answers that have arrived, all but the newest ``keep``:
        never waits for one the store has not sent yet.

        Raises:
            ProtocolError: The store answered ERROR or something unparsable.
            Unavailable: The connection failed.
        """
        while len(self._late) > keep and self.readable():
            self._read_oldest()

    def _read_oldest(self) -> None:
        # The store sends an answer in one piece: once its first byte is
        # here, the rest is (or is about to be).
        n, ticket = self._late[0]
        header = recv_reply_header(self.sock, Opcode.PUT_REPLY, n)
        statuses = unpack_statuses(recv_exact(self.sock, n), PutCode)
        codes = recv_index_codes(self.sock, header)
        self._late.popleft()
        self._pipeline.answered(ticket, statuses, codes)

    def readable(self) -> bool:
        """Whether bytes, EOF or an error are here to read, without waiting.

        An idle connection has nothing to read: EOF means the store closed it
        (idle timeout, restart), data means the stream is out of sync.
        """
        try:
            return bool(self._arrival.poll(0))
        except OSError:
            return True  # let the read report what is wrong

    def close(self) -> None:
        """Close the socket; the answers it awaited never come (their chunks count lost)."""
        self.sock.close()
        late, self._late = self._late, deque()
        for _, ticket in late:
            self._pipeline.answered(ticket, None)


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
            Unavailable: If a new connection cannot be made.
            InvalidArgument: The pool is closed.
        """
        while True:
            stream = self._take(address)
            if stream is None:
                sock = connect(address, self._connect_timeout_s, self._io_timeout_s, self._token)
                return Stream(sock, self.pipeline(address)), False
            try:
                stream.settle_arrived()
            except (KVDepotError, OSError):
                stream.close()
                continue
            if stream.awaits or not stream.readable():
                # One still awaiting an answer is in use by the store: alive.
                return stream, True
            stream.close()
