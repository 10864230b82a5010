"""Idle data-plane connections per store, which may await answers read late.

The ``tcp`` pool (:class:`~kvdepot.connector.transport.tcp_pool.TcpPool`)
and the control pool of the arena transports
(:class:`~kvdepot.connector.transport.control.ControlPool`) share this: a
connection goes back to the pool with answers it has not read yet (late puts,
late commits, releases), the pool's :class:`Pipeline` per store counts them,
and a reader that must see every put sent before it reads the idle
connections' answers itself. Each pool says how a connection is made and
when a pooled one may be reused (``checkout``).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Generic, Protocol, TypeVar

from kvdepot.connector.transport.pipeline import Pipeline
from kvdepot.errors import InvalidArgument, KVDepotError
from kvdepot.wire.protocol import set_recv_timeout

RETIRE_WAIT_S = 1.0
"""How long closing a connection waits for the answers it awaits."""


class Awaiting(Protocol):
    """A connection that may await answers to requests it sent."""

    sock: socket.socket

    @property
    def awaits(self) -> int:
        """Answers not read yet."""
        ...

    def settle(self) -> None:
        """Read every answer it awaits."""

    def close(self) -> None:
        """Close it; the answers it awaited never come."""


C = TypeVar("C", bound=Awaiting)


class IdlePool(Generic[C]):
    """Idle connections per store and the late answers they hold; connections
    in use belong to their caller.

    Args:
        connect_timeout_s: Time allowed to establish a connection.
        io_timeout_s: Time an exchange may stall; also the bound of
            :meth:`settle`.
        max_idle: Idle connections kept per store.
        token: Proven to the store on each new connection (when set).
    """

    def __init__(
        self, connect_timeout_s: float, io_timeout_s: float, max_idle: int, token: str = ""
    ) -> None:
        self._token = token
        self._connect_timeout_s = connect_timeout_s
        self._io_timeout_s = io_timeout_s
        self._max_idle = max_idle
        self._lock = threading.Lock()
        self._idle: dict[str, list[C]] = {}
        self._pipelines: dict[str, Pipeline] = {}
        self._closed = False

    def pipeline(self, address: str) -> Pipeline:
        """The puts to ``address`` whose answers are read late."""
        with self._lock:
            p = self._pipelines.get(address)
            if p is None:
                p = self._pipelines[address] = Pipeline()
            return p

    def _take(self, address: str) -> C | None:
        """An idle connection to ``address``, if any (the caller checks it).

        Raises:
            InvalidArgument: The pool is closed.
        """
        with self._lock:
            if self._closed:
                raise InvalidArgument("transport is closed")
            idle = self._idle.get(address)
            return idle.pop() if idle else None

    def checkin(self, address: str, conn: C) -> None:
        """Return a healthy connection after a complete exchange (late
        answers may be unread)."""
        with self._lock:
            idle = self._idle.setdefault(address, [])
            if not self._closed and len(idle) < self._max_idle:
                idle.append(conn)
                return
        retire(conn)

    def settle(self, address: str) -> bool:
        """Wait (at most the I/O timeout) until the store at ``address`` has
        answered every late put sent so far: its chunks are readable then,
        or counted lost. Returns whether it has.

        The answers of idle connections are read here; a connection in use
        reads its own before its next exchange.
        """
        return self.pipeline(address).settle(lambda: self._settle_idle(address), self._io_timeout_s)

    def _settle_idle(self, address: str) -> None:
        with self._lock:
            idle = self._idle.pop(address, [])
        for conn in idle:
            try:
                conn.settle()
            except (KVDepotError, OSError):
                conn.close()
                continue
            self.checkin(address, conn)

    def close(self) -> None:
        """Close every idle connection once it read the answers it awaits;
        later checkouts raise."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                retire(conn)


def retire(conn: Awaiting) -> None:
    """Close a connection after reading the answers it awaits, waiting at most
    :data:`RETIRE_WAIT_S` (a frozen store must not hold up a client's close).

    Closing with an answer unread would reset the connection, and the store
    could drop a request it has not read yet; the answers read count the
    chunks as the store stored them. On a failure, what it awaited counts
    as lost.
    """
    with contextlib.suppress(KVDepotError, OSError):
        if conn.awaits:
            set_recv_timeout(conn.sock, RETIRE_WAIT_S)
            conn.settle()
    conn.close()
