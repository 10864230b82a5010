"""The chunk table's background thread, which moves chunks between tiers.

:class:`Mover` keeps every tier (but a lowest one in memory) under its high
watermark, down to its low one, by moving the tier's coldest chunks that no
one holds one tier down (the SSD tier drops them), and it moves DRAM chunks
that were read often enough up into the GPU tier. It works on the table's
:class:`~kvdepot.store.tier_placement.TierPlacement`, with its primitives
and under its lock, and knows nothing of the table itself. Its copies run
without the lock: the chunk is marked moving (not evictable, not moved by
anyone else) and its bytes held by a lease meanwhile, and the move is
abandoned if the chunk was deleted or moved when the copy ends.

It also takes a tier whose device failed out of service (its chunks leave
the store, in batches), and it outlives whatever a pass hits: a failing
device's errors are counted and logged per kind per interval, never a
traceback per pass.
"""

from __future__ import annotations

import logging
import threading
import time

from kvdepot.errors import CapacityExceeded, KVDepotError, Unavailable
from kvdepot.keys import ChunkKey
from kvdepot.repeat_log import RepeatLog
from kvdepot.store.tier_placement import Copy, Entry, Level, TierPlacement

logger = logging.getLogger(__name__)

FULL_BACKOFF_S = 1.0
"""How long the mover leaves a tier alone after it refused a chunk as full."""

TAKE_OUT_BATCH = 1024
"""Chunks of a failed tier dropped under one hold of the table's lock."""


class Mover:
    """The background thread of one chunk table.

    Args:
        placement: The table's tiers and records; the mover takes its lock
            and moves chunks with its primitives.
    """

    def __init__(self, placement: TierPlacement) -> None:
        self._placement = placement
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._promote: set[ChunkKey] = set()  # under the table's lock
        self._gpu = next((lv for lv in placement.levels if lv.name == "gpu"), None)
        self._full_until: dict[str, float] = {}  # tier -> until when it is left alone
        self._failures = RepeatLog(logger)  # of whole passes
        self._traced: set[str] = set()  # kinds of unexpected errors logged with a traceback
        self._thread = threading.Thread(target=self._run, name="kvdepot-tier-mover", daemon=True)
        self._thread.start()

    def poke_if_over(self, level: Level) -> None:
        """Wake the thread if ``level`` went above its high watermark."""
        if level.over(level.tier.limits.high_watermark):
            self._wake.set()

    def consider_promotion(self, entry: Entry) -> None:
        """Under the table's lock: queue a DRAM chunk for the GPU tier if it is hot."""
        threshold = self._placement.options.gpu_promote_hits
        if self._gpu is not None and threshold and entry.hits >= threshold and not entry.moving:
            self._promote.add(entry.key)
            self._wake.set()

    def stop(self) -> None:
        """Stop the thread (a move in progress finishes first)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(30)

    def _run(self) -> None:
        interval = self._placement.options.maintenance_interval_s
        while not self._stop.is_set():
            self._wake.wait(interval)
            self._wake.clear()
            try:
                self.run_once()
            except Exception as exc:  # keep maintaining whatever one pass hit
                p = self._placement
                if isinstance(exc, Unavailable) and (p.closed or p.closing):
                    return
                self._pass_failed(exc)

    def _pass_failed(self, exc: Exception) -> None:
        # A device's error (a kvdepot error) is said in a line; anything else
        # is a bug, whose traceback is worth one line per kind. Either way
        # once per kind per interval, never per pass.
        kind = type(exc).__name__
        if not isinstance(exc, KVDepotError | OSError) and kind not in self._traced:
            self._traced.add(kind)
            logger.error("tier maintenance pass failed", exc_info=exc)
        else:
            self._failures.warn(kind, "tier maintenance pass failed: %s", exc)

    def run_once(self) -> None:
        """One pass: take failed tiers out, drain tiers above their
        watermark, promote hot chunks."""
        for level in self._placement.levels:
            if level.failed is not None or level.tier.failure is not None:
                self._take_out(level)
            else:
                self._drain(level)
        self._promote_queued()
        self._placement.losses.flush()
        self._failures.flush()

    def _take_out(self, level: Level) -> None:
        """Drop the chunks of a tier whose device failed, a batch at a time."""
        placement = self._placement
        first = level.failed is None
        dropped = 0
        while not self._stop.is_set():
            removed: list[ChunkKey] = []
            with placement.lock:
                placement.check_open()
                n = placement.take_out(level, removed, TAKE_OUT_BATCH)
            placement.notify(removed, [])
            dropped += n
            if n < TAKE_OUT_BATCH:
                break
        if first:
            logger.warning(
                "%s: %d chunks dropped from the store (and the index); it goes on with %s",
                level.failed,
                dropped,
                ", ".join(lv.name for lv in placement.levels if lv.failed is None),
                extra={"event": "tier_taken_out", "tier": level.name, "chunks": dropped},
            )

    def _drain(self, level: Level) -> None:
        # A lowest tier in memory makes room on demand only: dropping early
        # would lose hits and save nothing. A lowest slow tier (SSD) keeps
        # headroom, so that a write does not wait for a segment to empty.
        if self._placement.below(level) is None and level.tier.executor is None:
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
        placement = self._placement
        removed: list[ChunkKey] = []
        moved: list[tuple[ChunkKey, str]] = []
        with placement.lock:
            placement.check_open()
            if placement.shed_shadow(level):
                return True
            victim = placement.coldest(level)
            if victim is None:
                return False
            below = placement.below(level)
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
                placement.make_room(victim, removed, moved)
                target = None
            else:
                target = self._begin(victim, below, removed, moved)
        placement.notify(removed, moved)
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
        placement = self._placement
        source = entry.copy
        source.leases += 1
        placement.sync_held(entry)
        try:
            handle = placement.allocate(dest, entry.size, removed, moved)
        except KVDepotError as exc:
            if isinstance(exc, CapacityExceeded):
                logger.debug("cannot move chunk %s to %s: %s", entry.key.hex(), dest.name, exc)
            else:  # a failing device: the chunk stays where it is
                self._cannot_move(entry, dest, exc)
            placement.unhold(entry, source)
            return None
        entry.moving = True
        placement.sync_held(entry)
        return Copy(dest, handle, dest.tier.size_of(handle))

    def _finish(self, entry: Entry, target: Copy) -> bool:
        # Copy without the lock, then switch the chunk over if it is still there.
        placement = self._placement
        source = entry.copy
        error: Exception | None = None
        try:
            data = placement.host_bytes(source, entry.size)
            target.level.tier.write(target.handle, data, key=entry.key, checksum=entry.checksum)
        except (KVDepotError, OSError) as exc:
            error = exc
            if isinstance(exc, CapacityExceeded):
                # A full device: give it a moment rather than a write per pass.
                self._full_until[target.level.name] = time.monotonic() + FULL_BACKOFF_S
        moved: list[tuple[ChunkKey, str]] = []
        with placement.lock:
            entry.moving = False
            placement.unhold(entry, source)
            placement.moved_cv.notify_all()
            current = placement.entries.get(entry.key) is entry and entry.copy is source
            if error is not None or not current:
                target.level.tier.free(target.handle)
                if error is not None:
                    self._cannot_move(entry, target.level, error)
            else:
                placement.switch(entry, target)
                if target.level.rank > source.level.rank:
                    source.level.demotions += 1
                else:
                    source.level.promotions += 1
                moved.append((entry.key, target.level.name))
        placement.notify([], moved)
        return error is None

    def _cannot_move(self, entry: Entry, dest: Level, error: Exception) -> None:
        self._placement.losses.warn(
            f"move {dest.name}",
            "cannot move chunk %s to the %s tier: %s",
            entry.key.hex(),
            dest.name,
            error,
        )

    def _promote_queued(self) -> None:
        gpu = self._gpu
        if gpu is None:
            return
        placement = self._placement
        with placement.lock:
            keys, self._promote = self._promote, set()
        for key in keys:
            if self._stop.is_set():
                return
            removed: list[ChunkKey] = []
            moved: list[tuple[ChunkKey, str]] = []
            with placement.lock:
                placement.check_open()
                entry = placement.entries.get(key)
                if (
                    entry is None
                    or not entry.committed
                    or entry.moving
                    or entry.pins
                    or entry.copy.level is not placement.cpu
                ):
                    continue
                target = self._begin(entry, gpu, removed, moved)
            placement.notify(removed, moved)
            if target is not None:
                self._finish(entry, target)
