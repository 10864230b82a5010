"""Idle data-plane connections per store, which may await answers read late.

The ``tcp`` pool (:class:`~kvdepot.connector.transport.tcp_pool.TcpPool`)
and the control pool of the arena transports
(:class:`~kvdepot.connector.transport.control.ControlPool`) share this: a
connection goes back to the pool with answers it has not read yet (late puts,
late commits, releases), the pool's :class:`Pipeline` per store counts them,
and a reader that must see every put sent before it reads the idle
connections' answers itself. Each pool says how a connection is made ready
(``checkout``). A store that timed out is recorded in the pool's
:class:`~kvdepot.connector.transport.stall.Stalls`: no connection to it is
handed out, and no wait for it begins, until it answers again.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from typing import Generic, TypeVar

from kvdepot.connector.transport.pipeline import Pipeline
from kvdepot.connector.transport.stall import PROBE_TIMEOUT_S, Stalls
from kvdepot.connector.transport.stream import Connection, connect
from kvdepot.errors import InvalidArgument, KVDepotError
from kvdepot.wire.protocol import set_recv_timeout

RETIRE_WAIT_S = 1.0
"""How long closing a connection waits for the answers it awaits."""


C = TypeVar("C", bound=Connection)


class IdlePool(Generic[C]):
    """Idle connections per store and the late answers they hold; connections
    in use belong to their caller.

    Args:
        connect_timeout_s: Time allowed to establish a connection.
        io_timeout_s: Time an exchange may stall; also the bound of
            :meth:`settle`.
        max_idle: Idle connections kept per store.
        token: Proven to the store on each new connection (when set).
        stalls: The record of stores that stopped answering, shared with
            other transports of the client; by default the pool's own.
    """

    def __init__(
        self,
        connect_timeout_s: float,
        io_timeout_s: float,
        max_idle: int,
        token: str = "",
        stalls: Stalls | None = None,
    ) -> None:
        self._own_stalls = stalls is None
        self.stalls = stalls or Stalls(min(io_timeout_s, PROBE_TIMEOUT_S), token)
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

    def _connect(self, address: str) -> socket.socket:
        """A new connection to ``address`` (its timeout recorded as a stall).

        Raises:
            Stalled: The store stopped answering before.
            Unavailable: If it cannot be reached.
        """
        self.stalls.check(address)
        try:
            sock = connect(address, self._connect_timeout_s, self._io_timeout_s, self._token)
        except KVDepotError as exc:
            self.stalls.record(address, exc)
            raise
        return sock

    def _reuse(self, address: str) -> C | None:
        """An idle connection to ``address`` that is still good, if any: one
        still owed answers is in use by the store, alive; one owed nothing
        must have nothing to read.

        Raises:
            Stalled: The store stopped answering before.
            InvalidArgument: The pool is closed.
        """
        self.stalls.check(address)
        while (conn := self._take(address)) is not None:
            try:
                conn.settle_arrived()
            except (KVDepotError, OSError):
                conn.close()
                continue
            if conn.awaits or not conn.readable():
                return conn
            conn.close()
        return None

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
        or counted lost. Returns whether it has; a store that has not is
        recorded as stalled, and one that stalled before is not waited for.

        The answers of idle connections are read here; a connection in use
        reads its own before its next exchange.
        """
        wait = 0.0 if self.stalls.stalled(address) else self._io_timeout_s
        done = self.pipeline(address).settle(lambda s: self._settle_idle(address, s), wait)
        if not done and wait:
            self.stalls.record(address)
        return done

    def _settle_idle(self, address: str, wait_s: float) -> bool:
        """Read the answers the idle connections to ``address`` hold, waiting
        up to ``wait_s`` for one to arrive; whether one still awaits some."""
        # Only answers that arrived: the caller's wait is the one bound, not
        # the I/O timeout of each idle connection in turn.
        with self._lock:
            idle = self._idle.pop(address, [])
        awaiting = [conn.sock for conn in idle if conn.awaits]
        if awaiting and wait_s > 0:
            with contextlib.suppress(OSError, ValueError):  # a closed socket: read below
                select.select(awaiting, [], [], wait_s)
        still = False
        for conn in idle:
            try:
                conn.settle_arrived()
            except (KVDepotError, OSError):
                conn.close()
                continue
            still = still or conn.awaits > 0
            self.checkin(address, conn)
        return still

    def close(self) -> None:
        """Close every idle connection once it read the answers it awaits;
        later checkouts raise."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                retire(conn)
        if self._own_stalls:
            self.stalls.close()


def retire(conn: Connection) -> None:
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
