"""Recent transfer rates from cumulative byte counters, over a sliding window.

The data plane only counts bytes; the store daemon samples those counters once
a second into a :class:`ThroughputMeter`, which answers "how many bytes per
second moved over the last ``window_s`` seconds" without any bookkeeping on
the data path.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from kvdepot.errors import InvalidArgument
from kvdepot.records import TransferRate


@dataclass(frozen=True, slots=True)
class _Sample:
    t: float
    bytes_in: int
    bytes_out: int


class ThroughputMeter:
    """A sliding window over samples of two monotonically growing counters.

    Thread-safe: sampling and reading may happen on different threads.
    """

    def __init__(self, window_s: float = 10.0) -> None:
        if window_s <= 0:
            raise InvalidArgument(f"window_s must be positive, got {window_s}")
        self.window_s = window_s
        self._samples: deque[_Sample] = deque()
        self._lock = threading.Lock()

    def sample(self, now: float, bytes_in: int, bytes_out: int) -> None:
        """Record the counters as of ``now`` (a monotonic time in seconds)."""
        with self._lock:
            s = self._samples
            if s and now <= s[-1].t:
                return  # the clock did not move: nothing to learn
            s.append(_Sample(now, bytes_in, bytes_out))
            # Keep one sample at or before the window's start, so the rate
            # always spans the whole window once the meter is old enough.
            while len(s) > 2 and s[1].t <= now - self.window_s:
                s.popleft()

    def rate(self) -> TransferRate:
        """The rates between the oldest and the newest sample in the window."""
        with self._lock:
            if len(self._samples) < 2:
                return TransferRate()
            first, last = self._samples[0], self._samples[-1]
        span = last.t - first.t
        # A counter that went backwards (a restart) reads as no traffic.
        return TransferRate(
            bytes_in_per_s=max(0, last.bytes_in - first.bytes_in) / span,
            bytes_out_per_s=max(0, last.bytes_out - first.bytes_out) / span,
            window_s=span,
        )
