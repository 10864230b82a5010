"""Log lines about a failure that repeats: one now, then one per interval, with a count.

A store retries the metadata service a few times a second while it is away
(an outage, a Redis index that does not answer): a line per attempt buries
the rest of the log, and one line per outage hides that it is still going
on. So the first failure of a kind is logged at once, later ones at most
once per interval with the number of attempts since the last line, and the
end of the outage in one line with the total.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

REPEAT_LOG_S = 10.0
"""Least time between two lines about one kind of failure."""


@dataclass(slots=True)
class _Kind:
    logged_at: float
    since_line: int = 0  # attempts not logged since the last line
    total: int = 1
    first_at: float = 0.0


class RepeatLog:
    """Rate-limited lines per kind of failure, each with the attempts it stands for.

    Not thread-safe: used from one event loop.

    Args:
        logger: Where the lines go.
        interval_s: Least time between two lines of one kind.
        clock: Monotonic seconds (a test may pass its own).
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = REPEAT_LOG_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._clock = clock
        self._kinds: dict[str, _Kind] = {}

    def failed(
        self,
        kind: str,
        level: int,
        msg: str,
        *args: object,
        extra: Mapping[str, Any] | None = None,
    ) -> bool:
        """Count one attempt of ``kind`` that failed; log it unless one was lately.

        Returns:
            Whether a line was written.
        """
        now = self._clock()
        state = self._kinds.get(kind)
        if state is None:
            self._kinds[kind] = _Kind(logged_at=now, first_at=now)
            self._logger.log(level, msg, *args, extra=extra)
            return True
        state.total += 1
        if now - state.logged_at < self._interval_s:
            state.since_line += 1
            return False
        attempts, state.since_line, state.logged_at = state.since_line + 1, 0, now
        self._logger.log(
            level,
            msg + " (%d attempts since the last line; %d in %.0f s)",
            *args,
            attempts,
            state.total,
            now - state.first_at,
            extra=extra,
        )
        return True

    def ended(self, kind: str) -> tuple[int, float] | None:
        """Forget ``kind``: its failures are over. Returns how many there were
        and over how many seconds, or ``None`` if it was not failing."""
        state = self._kinds.pop(kind, None)
        if state is None:
            return None
        return state.total, self._clock() - state.first_at

    def failing(self) -> bool:
        """Whether any kind failed since it last :meth:`ended`."""
        return bool(self._kinds)
