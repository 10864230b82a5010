"""A tier whose device fails: its I/O errors counted, and the tier given up on.

A disk that starts answering EIO seldom fails one request only: the reads
and writes after it fail too, and what it took may not read back. A store
that kept believing it would keep chunks in its index that it can no longer
serve (a lookup names them, a read misses: phantom hits), and log a line per
chunk. So a tier counts the I/O errors of its device (a full device is not
one: space comes back) and, after :data:`FAIL_AFTER_ERRORS` of them within
:data:`FAIL_WINDOW_S`, has *failed*: it refuses allocations, reads and writes
from then on, and the chunk table drops its chunks (reported as removals, so
lookups stop naming them) and stops moving chunks into it. The store serves
on from its other tiers, degraded, and says so (its stats, one log line)
until it is restarted on a working device: a device that failed that way is
not trusted again on the strength of a request that happened to succeed.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from kvdepot.errors import CapacityExceeded, Unavailable
from kvdepot.repeat_log import RepeatLog

logger = logging.getLogger(__name__)

FAIL_AFTER_ERRORS = 3
"""I/O errors within :data:`FAIL_WINDOW_S` that fail a tier: one bad sector
costs a chunk, a dying device the tier."""
FAIL_WINDOW_S = 10.0

FULL_ERRNOS = frozenset((errno.ENOSPC, errno.EDQUOT, errno.EFBIG))
"""A full device's errors: space comes back, the device did not fail."""


def device_full(exc: BaseException) -> bool:
    """Whether ``exc`` says the device is full rather than failing."""
    if isinstance(exc, CapacityExceeded):
        return True
    return isinstance(exc, OSError) and exc.errno in FULL_ERRNOS


class TierIOError(Unavailable):
    """A tier's device failed an operation (a full one raises ``CapacityExceeded``)."""


class TierFailed(TierIOError):
    """The tier is out of service: its device failed too often (see the module)."""


class IoFaults:
    """The I/O errors of one tier's device, and whether it failed.

    Thread-safe: a tier's I/O runs on several threads.

    Args:
        tier: The tier's name, for lines and the failure's reason.
        where: Where its device is (a directory), for the failure's line.
        errors: Errors within ``window_s`` that fail the tier.
        window_s: See ``errors``.
        clock: Monotonic seconds (a test may pass its own).
    """

    def __init__(
        self,
        tier: str,
        where: str,
        *,
        errors: int = FAIL_AFTER_ERRORS,
        window_s: float = FAIL_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._tier = tier
        self._where = where
        self._errors = errors
        self._window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._recent: deque[float] = deque()
        self._failure: str | None = None
        self.total = 0
        # Errors the tier swallows (background syncs, compaction): logged
        # here, once per kind per interval. Those it raises, its caller logs.
        self.log = RepeatLog(logger)

    @property
    def failure(self) -> str | None:
        """Why the tier failed, or ``None`` while it works."""
        return self._failure

    def check(self) -> None:
        """Raise :class:`TierFailed` once the tier failed."""
        failure = self._failure
        if failure is not None:
            raise TierFailed(failure)

    def error(self, exc: BaseException, kind: str | None = None) -> bool:
        """Count one failed operation of the device.

        Args:
            exc: What it raised; a full device's error is logged, not counted.
            kind: Log it under this kind (an error the tier swallows); an
                error raised to the caller is logged by the caller.

        Returns:
            Whether this error failed the tier.
        """
        if device_full(exc):
            if kind is not None:
                self.log.warn(f"{self._tier} full", "%s tier: cannot %s: %s", self._tier, kind, exc)
            return False
        now = self._clock()
        with self._lock:
            self.total += 1
            if self._failure is not None:
                return False
            self._recent.append(now)
            while self._recent and now - self._recent[0] > self._window_s:
                self._recent.popleft()
            failed = len(self._recent) >= self._errors
            if failed:
                span = now - self._recent[0]
                last = f"cannot {kind}: {exc}" if kind is not None else str(exc)
                self._failure = (
                    f"{self._tier} tier failed: {len(self._recent)} I/O errors in {span:.1f} s, "
                    f"the last: {last}"
                )
        if kind is not None and not failed:
            self.log.warn(f"{self._tier} {kind}", "%s tier: cannot %s: %s", self._tier, kind, exc)
        if failed:
            logger.error(
                "%s (device of %s); taken out of service until the store restarts: its "
                "chunks are dropped, and chunks leaving faster tiers are not moved to it",
                self._failure,
                self._where,
                extra={"event": "tier_failed", "tier": self._tier, "reason": self._failure},
            )
        return failed
