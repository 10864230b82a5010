"""The scheduler's lookups: a deadline that follows the host, and a breaker
that opens on failures, not on one slow call.

A fixed deadline of a few tens of milliseconds misses on a busy host where
nothing is wrong with the metadata service (7 of 64 lookups at 50 ms under
load), and a breaker that opened on the first miss then skipped kvdepot for
seconds: hits lost quietly. The deadline here is three times the 90th
percentile of the recent lookups, kept between ``lookup_timeout_s`` and
``lookup_timeout_max_s``; a lookup that misses it counts as one sample of
twice the deadline, so a slower host raises it. The breaker opens only after
``lookup_breaker_after`` failures in a row; each skipped request is counted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from kvdepot.connector.client import KVDepotClient
from kvdepot.connector.vllm.plan import PrefixKeys
from kvdepot.connector.vllm.stats import Counters
from kvdepot.errors import KVDepotError
from kvdepot.keys import ChunkKey
from kvdepot.repeat_log import RepeatLog
from kvdepot.types import LookupResult

logger = logging.getLogger(__name__)

_WINDOW = 64
_HEADROOM = 3.0


class LookupDeadline:
    """The deadline of the next lookup, from how long recent ones took."""

    def __init__(self, floor_s: float, ceiling_s: float) -> None:
        self._floor = floor_s
        self._ceiling = max(floor_s, ceiling_s)
        self._took: deque[float] = deque(maxlen=_WINDOW)
        self._lock = threading.Lock()
        self._current = floor_s

    @property
    def seconds(self) -> float:
        with self._lock:
            return self._current

    def answered(self, took_s: float) -> None:
        """A lookup answered after ``took_s``."""
        self._add(took_s)

    def missed(self) -> None:
        """A lookup ran out of its deadline: it would have taken longer."""
        self._add(2 * self.seconds)

    def _add(self, sample: float) -> None:
        with self._lock:
            self._took.append(sample)
            ordered = sorted(self._took)
            p90 = ordered[int(0.9 * (len(ordered) - 1))]
            self._current = min(self._ceiling, max(self._floor, _HEADROOM * p90))


class LookupBreaker:
    """Lookups with an adaptive deadline that stop being sent while they keep failing.

    Args:
        client: The scheduler's client.
        deadline: The lookups' deadline.
        cooldown_s: How long the breaker stays open after it opened; doubled
            for each further failure, up to 16 times.
        after: Failures in a row that open it.
        warn: Where a failure is logged (once per kind and interval).
        shards: The keys of a chunk's other parts (its KV heads after
            head 0), from its chain key.
    """

    def __init__(
        self,
        client: KVDepotClient,
        deadline: LookupDeadline,
        cooldown_s: float,
        after: int,
        warn: RepeatLog,
        shards: Sequence[Callable[[ChunkKey], ChunkKey]] = (),
    ) -> None:
        self._client = client
        self.deadline = deadline
        # A key hits only when every part of it is stored.
        self._shards = tuple(shards)
        self._cooldown = cooldown_s
        self._after = max(1, after)
        self._warn = warn
        self._lock = threading.Lock()
        self._open_until = 0.0
        self._failures = 0

    def lookup(
        self, keys: PrefixKeys, counters: Counters, *, repeat: bool = False
    ) -> LookupResult | None:
        """Leading hits of ``keys`` and where they live, or None when kvdepot
        cannot answer now. ``repeat``: the request was looked up before (the
        cluster counts it once)."""
        now = time.monotonic()
        with self._lock:
            if now < self._open_until:
                counters.add(lookups_skipped=1)
                return None
        limit = self.deadline.seconds
        try:
            found = self._client.lookup_where(
                keys.keys,
                key_tokens=keys.key_tokens,
                count="none" if repeat else "all",
                timeout_s=limit,
            )
            hits = self._every_shard(keys.keys, found.hits, limit)
        except KVDepotError as exc:
            self._failed(exc, time.monotonic() - now >= 0.9 * limit, counters, repeat)
            return None
        self.deadline.answered(time.monotonic() - now)
        counters.add(lookups=int(not repeat), lookups_repeated=int(repeat))
        with self._lock:
            if self._failures >= self._after:
                logger.info("kvdepot lookups answer again")
            self._failures = 0
            self._open_until = 0.0
        return LookupResult(hits, found.locations[:hits])

    def _failed(
        self, exc: KVDepotError, timed_out: bool, counters: Counters, repeat: bool = False
    ) -> None:
        counters.add(
            lookups=int(not repeat),
            lookups_repeated=int(repeat),
            lookup_errors=1,
            lookup_timeouts=int(timed_out),
        )
        if timed_out:
            self.deadline.missed()
        with self._lock:
            self._failures += 1
            if self._failures < self._after:
                return
            backoff = self._cooldown * 2 ** min(self._failures - self._after, 4)
            self._open_until = time.monotonic() + backoff
        self._warn.warn(
            "lookup",
            "kvdepot lookups failed %d times in a row (%s); new requests skip kvdepot for %.1f s",
            self._after,
            exc,
            backoff,
        )

    def lookup_more(self, keys: list[ChunkKey], tokens: int, *, repeat: bool = False) -> int:
        """The rest of a prompt's lookup (its hits are counted, not the call;
        nothing of a ``repeat``)."""
        if not keys or time.monotonic() < self._open_until:
            return 0
        limit = self.deadline.seconds
        try:
            hits = self._client.lookup(
                keys,
                key_tokens=[tokens] * len(keys),
                count="none" if repeat else "hits",
                timeout_s=limit,
            )
            return self._every_shard(keys, hits, limit)
        except KVDepotError:
            return 0

    def _every_shard(self, keys: Sequence[ChunkKey], hits: int, limit: float) -> int:
        """The leading ``hits`` of ``keys`` whose every other part is stored too."""
        if hits == 0 or not self._shards:
            return hits
        # One call for every part, key by key: its leading hits cover whole
        # keys' parts. The prompt was counted once, by the first part's lookup.
        parts = [part(k) for k in keys[:hits] for part in self._shards]
        found = self._client.lookup(parts, count="none", timeout_s=limit)
        return min(hits, found // len(self._shards))
