"""Deadlines of data-plane requests: a client too slow inside one is cut off.

The kernel timeouts of a data-plane socket (``SO_RCVTIMEO``/``SO_SNDTIMEO``)
bound each system call, not a request: a client that trickles one byte just
before every timeout (or reads a reply that slowly) would hold its
connection thread, its reservations and its read leases forever. So each
request also gets a deadline, a grace plus its payload at a minimum rate, and
one thread cuts off the requests that pass theirs: first the receiving side
of the socket, so that the connection's thread fails in its ``recv``, answers
ERROR and cleans up as for any broken connection (reservations revoked, leases
released); if that thread is still stuck a moment later, sending to a reader
that slow, both sides.

Deadlines cover the time a request waits on its client only: the serving
thread disarms its deadline around work of its own (reading chunks off SSD,
hashing reserved bytes) and arms a new one before it waits on the client again.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from kvdepot.errors import InvalidArgument

_MAX_TICK_S = 0.5
_HARD_CUT_S = 1.0
"""After cutting a request's receiving side, how long until both sides are cut."""


class RequestWatchdog:
    """Shuts down connections whose current request passed its deadline.

    Args:
        grace_s: Seconds every request gets on top of its payload time.
        min_rate: Bytes per second a client must at least move within a request.

    Raises:
        InvalidArgument: If ``grace_s`` or ``min_rate`` is not positive.
    """

    def __init__(self, grace_s: float, min_rate: int) -> None:
        if grace_s <= 0 or min_rate <= 0:
            raise InvalidArgument("request grace and minimum rate must be positive")
        self.grace_s = grace_s
        self.min_rate = min_rate
        self._tick_s = min(_MAX_TICK_S, grace_s / 4)
        self._lock = threading.Lock()
        self._deadlines: dict[socket.socket, float] = {}
        self._expired: set[socket.socket] = set()
        self._hard: dict[socket.socket, float] = {}
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread that enforces the deadlines."""
        self._stopping.clear()
        self._thread = threading.Thread(
            target=self._run, name="kvdepot-dataplane-watchdog", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread; deadlines armed now are no longer enforced."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None

    def arm(self, conn: socket.socket, payload_bytes: int = 0) -> None:
        """Give ``conn``'s request from now the grace plus ``payload_bytes`` at the minimum rate."""
        deadline = time.monotonic() + self.grace_s + payload_bytes / self.min_rate
        with self._lock:
            if conn not in self._expired:
                self._deadlines[conn] = deadline

    def disarm(self, conn: socket.socket) -> None:
        """The request no longer waits on its client (done, or the store's own work)."""
        with self._lock:
            self._deadlines.pop(conn, None)
            self._hard.pop(conn, None)

    def expired(self, conn: socket.socket) -> bool:
        """Whether ``conn`` was shut down for passing a deadline."""
        with self._lock:
            return conn in self._expired

    def forget(self, conn: socket.socket) -> None:
        """Drop every record of ``conn``; called before the connection is closed."""
        with self._lock:
            self._deadlines.pop(conn, None)
            self._hard.pop(conn, None)
            self._expired.discard(conn)

    def _run(self) -> None:
        while not self._stopping.wait(self._tick_s):
            now = time.monotonic()
            # Under the lock: the serving thread forgets its socket before
            # closing it, so a shutdown here never reaches a reused fd.
            with self._lock:
                late = [conn for conn, deadline in self._deadlines.items() if deadline <= now]
                for conn in late:
                    del self._deadlines[conn]
                    self._expired.add(conn)
                    self._hard[conn] = now + _HARD_CUT_S
                    with contextlib.suppress(OSError):
                        conn.shutdown(socket.SHUT_RD)
                stuck = [conn for conn, deadline in self._hard.items() if deadline <= now]
                for conn in stuck:
                    del self._hard[conn]
                    with contextlib.suppress(OSError):
                        conn.shutdown(socket.SHUT_RDWR)
