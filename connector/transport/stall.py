"""Stores that stopped answering: one deadline per call, and no store tried
again before it answers.

A store that is frozen (SIGSTOP, a host swapping, a hung disk under its
event loop) still accepts connections, so nothing fails fast: each exchange
waits out the I/O timeout. A call that tried such a store once must not wait
for it again, neither over another transport nor over the same one (a
pooled connection's late answers, a new connection's ATTACH, the client's
second attempt at the same address in one call). :class:`Stalls` records the
address at the first timeout; from then on every attempt of the transports
sharing the record fails at once (:class:`Stalled`) until a probe in the
background, a fresh connection and a PING with a short timeout, shows the
store answers again. No call ever waits for a probe.
"""

from __future__ import annotations

import logging
import threading
import time

from kvdepot.connector.transport.stream import Connection, connect
from kvdepot.errors import KVDepotError, Unavailable
from kvdepot.wire.protocol import TimedOut

logger = logging.getLogger(__name__)

PROBE_INTERVAL_S = 0.5
"""Pause between two probes of a stalled store: how late the transports
notice it answers again, against one connection per probe left in a frozen
store's listen backlog (it accepts them, and sees them closed, once it runs)."""

PROBE_TIMEOUT_S = 1.0
"""Longest wait of a probe for its PONG (less where the I/O timeout is)."""


class Stalled(Unavailable):
    """The store stopped answering within the I/O timeout; it is not tried
    again until it answers a probe."""


def log_failure(log: logging.Logger, what: str, address: str, exc: BaseException) -> None:
    """Log a failed exchange with ``address``: a warning, but only at debug
    level for one that failed at once because the store stalled before (the
    stall itself was logged once)."""
    level = logging.DEBUG if isinstance(exc, Stalled) else logging.WARNING
    log.log(level, "%s at %s failed: %s", what, address, str(exc))


class Stalls:
    """Data plane addresses whose store stopped answering, and their probes.

    Thread-safe. Shared by the transports of one client (an ``auto`` and
    those it routes to), so a store that timed out over one is not tried
    over another.

    Args:
        probe_timeout_s: Time a probe may take to connect and to be answered.
        token: Proven by each probe connection (when set).
        interval_s: Time between two probes of a stalled store.
    """

    def __init__(
        self, probe_timeout_s: float, token: str = "", interval_s: float = PROBE_INTERVAL_S
    ) -> None:
        self._probe_timeout_s = probe_timeout_s
        self._token = token
        self._interval_s = interval_s
        self._cond = threading.Condition()
        self._since: dict[str, float] = {}  # address -> when it stalled (monotonic)
        self._prober: threading.Thread | None = None
        self._closed = False

    def stalled(self, address: str) -> bool:
        """Whether ``address`` is stalled: every attempt fails at once."""
        return address in self._since  # a dict lookup: atomic

    def check(self, address: str) -> None:
        """Fail at once when ``address`` is stalled.

        Raises:
            Stalled: It is.
        """
        since = self._since.get(address)
        if since is not None:
            raise Stalled(
                f"data plane {address} has not answered for {time.monotonic() - since:.1f} s"
            )

    def record(self, address: str, exc: BaseException | None = None) -> None:
        """Record that the store at ``address`` stalled: ``exc`` is what an
        attempt raised (only a timeout counts), ``None`` a wait that ran out."""
        if exc is not None and not isinstance(exc, TimedOut):
            return
        with self._cond:
            if self._closed or address in self._since:
                return
            self._since[address] = time.monotonic()
            logger.warning(
                "data plane %s stopped answering%s; failing calls to it until it answers again",
                address,
                f" ({exc})" if exc is not None else "",
            )
            if self._prober is None:
                self._prober = threading.Thread(
                    target=self._probe_loop, name="kvdepot-stall-probe", daemon=True
                )
                self._prober.start()

    def close(self) -> None:
        """Stop probing; nothing is recorded after. A probe in flight ends
        on its own (within the probe timeout): closing never waits for a
        frozen store."""
        with self._cond:
            self._closed = True
            self._since.clear()
            self._cond.notify_all()

    def _probe_loop(self) -> None:
        while True:
            with self._cond:
                if self._closed or not self._since:
                    self._prober = None
                    return
                addresses = list(self._since)
            for address in addresses:
                if not self._still_stalled(address):
                    with self._cond:
                        since = self._since.pop(address, None)
                    if since is not None:
                        # The end of an outage already warned about is news, not a warning.
                        logger.info(
                            "data plane %s is no longer stalled (after %.1f s)",
                            address,
                            time.monotonic() - since,
                        )
            with self._cond:
                if self._since and not self._closed:
                    self._cond.wait(self._interval_s)

    def _still_stalled(self, address: str) -> bool:
        """Whether a probe of ``address`` timed out. A store that answers, or
        refuses (it is gone: a call fails at once without the record, and a
        store that comes back there is a new one), is no longer stalled."""
        timeout = self._probe_timeout_s
        try:
            conn = Connection(connect(address, timeout, timeout, self._token))
            try:
                conn.ping()
            finally:
                conn.close()
        except (KVDepotError, OSError) as exc:
            logger.debug("probe of data plane %s: %s", address, str(exc))
            return isinstance(exc, TimedOut)
        return False
