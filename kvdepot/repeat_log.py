"""Log lines about a failure that repeats: one now, then one per interval, with a count.

A store retries an absent metadata service a few times a second, every call
to a metadata service whose index backend is down fails the same way, and a
vLLM engine hits the same unreachable store on every step from several
threads. A line per failure buries the rest of the log; one line per outage
hides that it is still going on. So the first failure of a kind is logged at
once, later ones at most once per interval with the attempts since the last
line and the total, and the caller writes the end of the outage in one line
with the total that :meth:`RepeatLog.ended` returns.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

REPEAT_LOG_S = 10.0
"""Least time between two lines about one kind of failure."""

_COUNTED = " (%d attempts since the last line; %d in %.0f s)"
# Frames from the caller's call to the logger's, so that a line names the
# caller's file and line rather than this module's.
_FROM_CALL = 4  # caller -> failed or warn -> _failed -> _write -> log
_FROM_FLUSH = 3  # caller -> flush -> _write -> log


@dataclass(slots=True)
class _Kind:
    first_at: float
    logged_at: float
    since_line: int = 0  # attempts not logged since the last line
    total: int = 1
    # The latest attempt not logged, for the line that :meth:`RepeatLog.flush` writes.
    level: int = logging.WARNING
    msg: str = ""
    args: tuple[object, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class _Line:
    level: int
    msg: str
    args: tuple[object, ...]
    extra: dict[str, Any]


class RepeatLog:
    """Rate-limited lines per kind of failure, each with the attempts it stands for.

    Thread-safe: the vLLM connector counts failures from its worker threads.
    A line's ``extra`` holds the caller's fields and ``kind`` and ``count``
    (the attempts the line stands for), so structured logs can sum them.

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
        self._lock = threading.Lock()
        # One per kind failing: kinds are few (a cause, an error class), never per call.
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
        return self._failed(kind, level, msg, args, extra, _FROM_CALL)

    def _failed(
        self,
        kind: str,
        level: int,
        msg: str,
        args: tuple[object, ...],
        extra: Mapping[str, Any] | None,
        stacklevel: int,
    ) -> bool:
        extra = extra or {}
        with self._lock:
            now = self._clock()
            state = self._kinds.get(kind)
            if state is None:
                self._kinds[kind] = _Kind(first_at=now, logged_at=now)
                line = _Line(level, msg, args, {**extra, "kind": kind, "count": 1})
            else:
                state.total += 1
                state.since_line += 1
                # An exception kept as is would hold its traceback's frames
                # (and what they refer to) until the next line; %s of it is its text.
                held = tuple(str(a) if isinstance(a, BaseException) else a for a in args)
                state.level, state.msg, state.args, state.extra = level, msg, held, extra
                if now - state.logged_at < self._interval_s:
                    return False
                line = self._counted(kind, state, now)
        self._write(line, stacklevel)
        return True

    def warn(
        self, kind: str, msg: str, *args: object, extra: Mapping[str, Any] | None = None
    ) -> bool:
        """:meth:`failed` at the warning level."""
        return self._failed(kind, logging.WARNING, msg, args, extra, _FROM_CALL)

    def flush(self) -> None:
        """Log the attempts not logged yet of each kind whose interval is over.

        Called now and then (a reaper's pass), so that the count of the last
        attempts of a run is not lost when they stop.
        """
        with self._lock:
            now = self._clock()
            lines = [
                self._counted(kind, state, now)
                for kind, state in self._kinds.items()
                if state.since_line and now - state.logged_at >= self._interval_s
            ]
        for line in lines:
            self._write(line, _FROM_FLUSH)

    def ended(self, kind: str) -> tuple[int, float] | None:
        """Forget ``kind``: its failures are over. Returns how many there were
        and over how many seconds, or ``None`` if it was not failing."""
        with self._lock:
            state = self._kinds.pop(kind, None)
            if state is None:
                return None
            return state.total, self._clock() - state.first_at

    def failing(self) -> bool:
        """Whether any kind failed since it last :meth:`ended`."""
        with self._lock:
            return bool(self._kinds)

    @staticmethod
    def _counted(kind: str, state: _Kind, now: float) -> _Line:
        """The line for the attempts of ``kind`` since its last; resets that count."""
        attempts, state.since_line, state.logged_at = state.since_line, 0, now
        return _Line(
            state.level,
            state.msg + _COUNTED,
            (*state.args, attempts, state.total, now - state.first_at),
            {**state.extra, "kind": kind, "count": attempts},
        )

    def _write(self, line: _Line, stacklevel: int) -> None:
        # Outside the lock: a slow handler must not hold up the threads that count.
        self._logger.log(line.level, line.msg, *line.args, extra=line.extra, stacklevel=stacklevel)
