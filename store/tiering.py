"""How the chunk table places chunks in its tiers, and the thread that moves them.

The records here are the chunk table's own (:class:`Level` per tier,
:class:`Entry` per chunk, :class:`Copy` per chunk's bytes in one tier); they
are only touched under the table's lock.

:class:`Mover` is the table's background thread. It keeps every tier (but a
lowest one in memory) under its high watermark, down to its low one, by
moving the tier's coldest chunks that no one holds one tier down (the SSD
tier drops them), and it moves
DRAM chunks that were read often enough up into the GPU tier. Its copies run
without the table's lock: the chunk is marked moving (not evictable, not
moved by anyone else) and its bytes held by a lease meanwhile, and the move
is abandoned if the chunk was deleted or moved when the copy ends.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from typing import TYPE_CHECKING

from kvdepot.errors import CapacityExceeded, KVDepotError, Unavailable
from kvdepot.keys import ChunkKey
from kvdepot.records import TierStats
from kvdepot.store.tiers.base import Tier
from kvdepot.store.tiers.policy import create_policy

if TYPE_CHECKING:
    from kvdepot.store.chunks import ChunkStore

logger = logging.getLogger(__name__)

FULL_BACKOFF_S = 1.0
"""How long the mover leaves a tier alone after it refused a chunk as full."""

LOG_EVERY_S = 10.0
"""How often at most the mover logs a failing maintenance pass."""


class State(enum.Enum):
    """Where a chunk is in its two-phase write."""

    WRITING = "writing"
    COMMITTED = "committed"


class Level:
    """One tier as the table sees it: its policy, accounting and counters."""

    __slots__ = (
        "committed_bytes",
        "demotions",
        "draining",
        "evictions",
        "held_bytes",
        "hits",
        "misses",
        "name",
        "pending_bytes",
        "policy",
        "promotions",
        "rank",
        "shadow_bytes",
        "shadows",
        "tier",
    )

    def __init__(self, tier: Tier, rank: int, policy: str) -> None:
        self.tier = tier
        self.name = tier.name
        self.rank = rank  # position, fastest first
        self.policy = create_policy(policy)
        self.committed_bytes = 0  # allocated bytes of committed chunks
        self.held_bytes = 0  # of those, leased, pinned, moving or pending
        self.pending_bytes = 0  # chunk bytes waiting to be written to this tier
        # Copies of chunks promoted out of this (persistent) tier, oldest first:
        # still valid (chunks never change), so demoting the chunk again costs
        # no write. The first thing given up when the tier needs room.
        self.shadows: dict[ChunkKey, Copy] = {}
        self.shadow_bytes = 0
        self.draining = False  # between the high and the low watermark
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.promotions = 0
        self.demotions = 0

    def snapshot(self) -> TierStats:
        """The tier's usage and counters."""
        return TierStats(
            name=self.name,
            capacity_bytes=self.tier.capacity,
            used_bytes=self.tier.used_bytes,
            chunks=len(self.policy),
            hits=self.hits,
            misses=self.misses,
            evictions=self.evictions,
            promotions=self.promotions,
            demotions=self.demotions,
        )

    def over(self, fraction: float) -> bool:
        """Whether the tier uses more than ``fraction`` of its capacity."""
        return self.tier.used_bytes > fraction * self.tier.capacity


class Copy:
    """The bytes of a chunk in one tier.

    A copy outlives its chunk's stay in the tier while leases or a pending
    write hold it (``orphan``): it is freed when the last of them ends.
    """

    __slots__ = ("alloc_size", "freed", "handle", "leases", "level", "orphan", "pending")

    def __init__(self, level: Level, handle: int, alloc_size: int) -> None:
        self.level = level
        self.handle = handle
        self.alloc_size = alloc_size
        self.leases = 0
        self.orphan = False
        self.freed = False
        # Bytes on their way to a slow tier: served from here until written.
        self.pending: bytes | None = None


class Entry:
    """The table's record of one chunk."""

    __slots__ = (
        "checksum",
        "copy",
        "held",
        "hits",
        "key",
        "moving",
        "pins",
        "shadow",
        "size",
        "state",
    )

    def __init__(self, key: ChunkKey, size: int, checksum: int, copy: Copy) -> None:
        self.key = key
        self.size = size
        self.checksum = checksum
        self.copy = copy
        self.state = State.WRITING
        self.hits = 0  # reads since it entered its tier
        self.pins = 0
        self.moving = False
        # Whether its bytes count in its tier's held_bytes.
        self.held = False
        # A still valid copy in a slower, persistent tier (see Level.shadows).
        self.shadow: Copy | None = None

    @property
    def committed(self) -> bool:
        return self.state is State.COMMITTED


class Mover:
    """The background thread of one chunk table.

    Args:
        store: The table; the mover uses its lock and its table primitives.
    """

    def __init__(self, store: ChunkStore) -> None:
        self._store = store
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._promote: set[ChunkKey] = set()  # under the table's lock
        self._gpu = next((lv for lv in store.levels if lv.name == "gpu"), None)
        self._full_until: dict[str, float] = {}  # tier -> until when it is left alone
        self._thread = threading.Thread(target=self._run, name="kvdepot-tier-mover", daemon=True)
        self._thread.start()

    def poke_if_over(self, level: Level) -> None:
        """Wake the thread if ``level`` went above its high watermark."""
        if level.over(level.tier.limits.high_watermark):
            self._wake.set()

    def consider_promotion(self, entry: Entry) -> None:
        """Under the table's lock: queue a DRAM chunk for the GPU tier if it is hot."""
        threshold = self._store.options.gpu_promote_hits
        if self._gpu is not None and threshold and entry.hits >= threshold and not entry.moving:
            self._promote.add(entry.key)
            self._wake.set()

    def stop(self) -> None:
        """Stop the thread (a move in progress finishes first)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(30)

    def _run(self) -> None:
        interval = self._store.options.maintenance_interval_s
        last_logged = 0.0
        while not self._stop.is_set():
            self._wake.wait(interval)
            self._wake.clear()
            try:
                self.run_once()
            except Exception as exc:  # keep maintaining whatever one pass hit
                if isinstance(exc, Unavailable) and self._store.closed:
                    return
                # A failing device (Unavailable) must not end tiering for good;
                # said at most every few seconds, not every pass.
                if time.monotonic() - last_logged > LOG_EVERY_S:
                    last_logged = time.monotonic()
                    logger.exception("tier maintenance pass failed")

    def run_once(self) -> None:
        """One pass: drain tiers above their watermark, promote hot chunks."""
        for level in self._store.levels:
            self._drain(level)
        self._promote_queued()

    def _drain(self, level: Level) -> None:
        # A lowest tier in memory makes room on demand only: dropping early
        # would lose hits and save nothing. A lowest slow tier (SSD) keeps
        # headroom, so that a write does not wait for a segment to empty.
        if self._store.below(level) is None and level.tier.executor is None:
            return
        limits = level.tier.limits
        if level.over(limits.high_watermark):
            level.draining = True
        while level.draining and not self._stop.is_set():
            if not level.over(limits.low_watermark) or not self._demote_one(level):
                level.draining = False

    def _full(self, level: Level | None) -> bool:
        return level is not None and self._full_until.get(level.name, 0.0) > time.monotonic()

    def _demote_one(self, level: Level) -> bool:
        store = self._store
        removed: list[ChunkKey] = []
        moved: list[tuple[ChunkKey, str]] = []
        with store.lock:
            store.check_open()
            if store.shed_shadow(level):
                return True
            victim = store.coldest(level)
            if victim is None:
                return False
            below = store.below(level)
            if self._full(below):
                return False
            if (
                below is None
                or below.tier.executor is None
                or not level.tier.host_memory
                or victim.shadow is not None
            ):
                # Dropped (lowest tier), copied between memory tiers, or
                # switched to its shadow: quick.
                store.make_room(victim, removed, moved)
                target = None
            else:
                target = self._begin(victim, below, removed, moved)
        store.notify(removed, moved)
        if target is None:
            return bool(removed or moved)
        return self._finish(victim, target)

    def _begin(
        self,
        entry: Entry,
        dest: Level,
        removed: list[ChunkKey],
        moved: list[tuple[ChunkKey, str]],
    ) -> Copy | None:
        # Under the lock: hold the chunk's bytes, take room in ``dest``.
        store = self._store
        source = entry.copy
        source.leases += 1
        store.sync_held(entry)
        try:
            handle = store.allocate(dest, entry.size, removed, moved)
        except CapacityExceeded as exc:
            logger.debug("cannot move chunk %s to %s: %s", entry.key.hex(), dest.name, exc)
            store.unhold(entry, source)
            return None
        entry.moving = True
        store.sync_held(entry)
        return Copy(dest, handle, dest.tier.size_of(handle))

    def _finish(self, entry: Entry, target: Copy) -> bool:
        # Copy without the lock, then switch the chunk over if it is still there.
        store = self._store
        source = entry.copy
        error: Exception | None = None
        try:
            data = store.host_bytes(source, entry.size)
            target.level.tier.write(target.handle, data, key=entry.key, checksum=entry.checksum)
        except (KVDepotError, OSError) as exc:
            error = exc
            if isinstance(exc, CapacityExceeded):
                # A full device: give it a moment rather than a write per pass.
                self._full_until[target.level.name] = time.monotonic() + FULL_BACKOFF_S
        moved: list[tuple[ChunkKey, str]] = []
        with store.lock:
            entry.moving = False
            store.unhold(entry, source)
            store.moved_cv.notify_all()
            current = store.entry(entry.key) is entry and entry.copy is source
            if error is not None or not current:
                target.level.tier.free(target.handle)
                if error is not None:
                    logger.warning(
                        "cannot move chunk %s to %s: %s", entry.key.hex(), target.level.name, error
                    )
            else:
                store.switch(entry, target)
                if target.level.rank > source.level.rank:
                    source.level.demotions += 1
                else:
                    source.level.promotions += 1
                moved.append((entry.key, target.level.name))
        store.notify([], moved)
        return error is None

    def _promote_queued(self) -> None:
        gpu = self._gpu
        if gpu is None:
            return
        store = self._store
        with store.lock:
            keys, self._promote = self._promote, set()
        for key in keys:
            if self._stop.is_set():
                return
            removed: list[ChunkKey] = []
            moved: list[tuple[ChunkKey, str]] = []
            with store.lock:
                store.check_open()
                entry = store.entry(key)
                if (
                    entry is None
                    or not entry.committed
                    or entry.moving
                    or entry.pins
                    or entry.copy.level is not store.cpu_level
                ):
                    continue
                target = self._begin(entry, gpu, removed, moved)
            store.notify(removed, moved)
            if target is not None:
                self._finish(entry, target)
