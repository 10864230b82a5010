"""Failures that repeat on every call, logged once in a while with a count.

While the index backend is down every call of every client and store fails
the same way, several times a second: one log line per failure would bury
everything else in the log. :class:`RepeatedFailures` writes the first
failure of a kind at once, then at most one line per interval with the
number of failures since its last line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

REPORT_INTERVAL_S = 10.0
"""One line per kind of failure this often at most."""


@dataclass(slots=True)
class _Run:
    logged_at: float
    unreported: int = 0
    last_message: str = ""


class RepeatedFailures:
    """Logs failures of each kind with backoff and a count.

    The first failure of a kind is logged at once; later ones at most once per
    ``interval_s``, as the latest message and the number of failures since
    the kind's last line. :meth:`flush`, called now and then, writes the
    failures not reported yet once that interval is over, so a count is not
    lost when the failures stop.

    Args:
        logger: Where the lines go (as warnings).
        what: What failed, the start of each line, e.g. ``"metadata calls failing"``.
        interval_s: At most one line per kind this often.
        clock: Monotonic seconds (for tests).
    """

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        interval_s: float = REPORT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._what = what
        self._interval_s = interval_s
        self._clock = clock
        # One per kind ever seen: kinds are few (error classes), never per call.
        self._runs: dict[str, _Run] = {}

    def failed(self, kind: str, message: str) -> None:
        """Count one failure of ``kind``; log it if no line of that kind is recent."""
        now = self._clock()
        run = self._runs.get(kind)
        if run is None:
            self._runs[kind] = _Run(now)
            self._logger.warning("%s: %s", self._what, message, extra=self._extra(kind, 1))
            return
        run.unreported += 1
        run.last_message = message
        if now - run.logged_at >= self._interval_s:
            self._report(kind, run, now)

    def flush(self) -> None:
        """Log the failures not reported yet of each kind whose interval is over."""
        now = self._clock()
        for kind, run in self._runs.items():
            if run.unreported and now - run.logged_at >= self._interval_s:
                self._report(kind, run, now)

    def _report(self, kind: str, run: _Run, now: float) -> None:
        n = run.unreported
        self._logger.warning(
            "%s: %s (%d %s in the last %.0f s)",
            self._what,
            run.last_message,
            n,
            "failure" if n == 1 else "failures",
            now - run.logged_at,
            extra=self._extra(kind, n),
        )
        run.logged_at = now
        run.unreported = 0

    @staticmethod
    def _extra(kind: str, count: int) -> dict[str, object]:
        return {"event": "repeated_failure", "kind": kind, "count": count}
