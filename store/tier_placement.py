"""Where a store's chunks are: its tiers, its chunks' records, and moving them.

:class:`TierPlacement` owns the chunk table's state: a :class:`Level` per
tier (fastest first), an :class:`Entry` per chunk (with a :class:`Copy` of
its bytes in one tier), and the one lock that guards them. The table
(:class:`~kvdepot.store.chunks.ChunkStore`: writes, reads, leases) and the
background :class:`~kvdepot.store.tiering.Mover` are each given it and share
its primitives: making room in a tier (the coldest chunks no one holds move
one tier down, or leave the store from the lowest), moving a chunk's bytes
between copies, and the bookkeeping of each tier's committed, held and
shadow bytes. Every method is called with :attr:`TierPlacement.lock` held,
except where it says otherwise, and none of them waits for a disk: a chunk
leaving DRAM for SSD on the write path is copied aside and written by the
SSD tier's threads (:meth:`TierPlacement._write_back`).

A *shadow* is the copy a chunk leaves in a persistent tier when it is
promoted out of it: chunks never change, so it stays valid, and demoting the
chunk again costs no write (nor a new hole in a segment). Shadows are the
first thing a tier gives up when it needs room, and they keep promoted
chunks across a restart.

A tier whose device failed (:mod:`kvdepot.store.tiers.faults`) is taken out
(:meth:`TierPlacement.take_out`): its chunks leave the store, reported like
evictions, and chunks leaving the tier above it are dropped rather than moved
to it. A chunk a tier could not write or read back is lost the same way. Each
such loss is counted, and logged once per kind per interval with a count: a
failing disk costs a few lines, not one per chunk.
"""

from __future__ import annotations

import enum
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence

from kvdepot.errors import CapacityExceeded, Corrupt, InvalidArgument, KVDepotError, Unavailable
from kvdepot.keys import ChunkKey
from kvdepot.records import TierStats
from kvdepot.repeat_log import RepeatLog
from kvdepot.store.inventory import Inventory
from kvdepot.store.tiers.base import Tier
from kvdepot.store.tiers.faults import TierIOError
from kvdepot.store.tiers.policy import TieringOptions, create_policy
from kvdepot.types import TIER_RANK

logger = logging.getLogger(__name__)

_MAX_REASONS = 1 << 20
"""Removal reasons kept until reported; past it they are forgotten (reported as removed)."""

RemovedListener = Callable[[list[ChunkKey]], None]
"""Told the keys of committed chunks that left the store."""

MovedListener = Callable[[list[tuple[ChunkKey, str]]], None]
"""Told the chunks that changed tier, each with the tier it is in now."""


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
        "failed",
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
        self.failed: str | None = None  # why the tier was taken out (see take_out)
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
        "born",
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
        # When it was committed (Unix seconds; 0: found on SSD at start).
        self.born = 0

    @property
    def committed(self) -> bool:
        return self.state is State.COMMITTED


_second = [0]


def now_s() -> int:
    """Wall-clock whole seconds; entries committed in one second share one int
    object rather than holding one each (millions of chunks)."""
    now = int(time.time())
    if now != _second[0]:
        _second[0] = now
    return _second[0]


def check_tier_names(names: Sequence[str]) -> None:
    """Refuse tiers besides DRAM that are not distinct tiers of :data:`TIER_RANK`.

    Raises:
        InvalidArgument: If a name is ``cpu``, unknown or given twice.
    """
    if "cpu" in names or len(set(names)) != len(names) or not set(names) <= set(TIER_RANK):
        raise InvalidArgument(f"tiers must be distinct, from gpu and ssd; got {list(names)}")


class TierPlacement:
    """The chunk table's tiers, records and lock, and the primitives that place chunks.

    Args:
        tiers: Every tier, DRAM (``cpu``) included, in any order: they are
            ranked by :data:`TIER_RANK`. Closed by the table, not here.
        options: How chunks move between tiers.
        on_removed: Told the keys of committed chunks that left the store.
        on_moved: Told the chunks that changed tier.

    Attributes:
        levels: The tiers as the table sees them, fastest first.
        cpu: The DRAM tier's level.
        entries: Every chunk's record, committed or being written.
        inventory: The committed keys by digest bucket, and their digest.
        lock: Guards all of the above and every record in it.
        moved_cv: Notified (under the lock) whenever a move ends.
        options: How chunks move between tiers.
        write_errors: Chunks lost because a tier could not write them.
        read_errors: Chunks lost because a tier could not read them back
            (an I/O error, or the tier failed and was taken out).
        corrupt: Chunks dropped because their bytes failed their checksum
            off a tier (or when a persistent tier was opened).
        losses: Lines about lost chunks, one per kind per interval.
        closing: Set when the table began closing: no new writes to slow tiers.
        closed: Set once the table closed: every operation is refused.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        options: TieringOptions,
        on_removed: RemovedListener | None = None,
        on_moved: MovedListener | None = None,
    ) -> None:
        ordered = sorted(tiers, key=lambda t: TIER_RANK[t.name])
        self.options = options
        self.levels = [Level(t, rank, options.policy) for rank, t in enumerate(ordered)]
        self.cpu = next(lv for lv in self.levels if lv.name == "cpu")
        self.entries: dict[ChunkKey, Entry] = {}
        # The committed keys by digest bucket (what heartbeats and
        # reconciliation with the index report): told of every commit here
        # (by the table) and of every drop.
        self.inventory = Inventory()
        self.lock = threading.Lock()
        self.moved_cv = threading.Condition(self.lock)
        self.write_errors = 0
        self.read_errors = 0
        self.corrupt = 0
        self.losses = RepeatLog(logger)
        self.closing = False
        self.closed = False
        self._on_removed = on_removed
        self._on_moved = on_moved
        # Why chunks left (reason, tier), until their removal is reported.
        self.reasons: dict[ChunkKey, tuple[str, str]] = {}

    def check_open(self) -> None:
        """Raise ``Unavailable`` once the table is closed."""
        if self.closed:
            raise Unavailable("chunk store is closed")

    def allocate(
        self,
        level: Level,
        size: int,
        removed: list[ChunkKey],
        moved: list[tuple[ChunkKey, str]],
    ) -> int:
        """Room for ``size`` bytes in ``level``, making room if needed (under the lock).

        Fails fast, before moving anything, when even evicting every chunk
        of the tier that no one holds could not free enough.

        Raises:
            CapacityExceeded: If it cannot fit.
        """
        tier = level.tier
        handle = tier.allocate(size)
        if handle is not None:
            return handle
        evictable = level.committed_bytes - level.held_bytes + level.shadow_bytes
        if not tier.can_make_room(size, evictable):
            raise CapacityExceeded(
                f"no room for a chunk of {size} bytes in the {level.name} tier: capacity "
                f"{tier.capacity} bytes, {tier.free_bytes} free, {evictable} evictable, "
                "the rest leased, pinned, moving or being written"
            )
        made = 0
        while handle is None and self.shed_shadow(level):
            handle = tier.allocate(size)
        while handle is None:
            victim = self.coldest(level)
            if victim is None:
                raise CapacityExceeded(
                    f"no room for a chunk of {size} bytes in the {level.name} tier after "
                    f"making room from {made} chunks: capacity {tier.capacity} bytes, "
                    f"{tier.free_bytes} free, the rest leased, pinned, moving or being written"
                )
            self.make_room(victim, removed, moved)
            made += 1
            handle = tier.allocate(size)
        return handle

    def coldest(self, level: Level) -> Entry | None:
        """The first chunk of ``level`` by its policy that no one holds (under the lock)."""
        for key in level.policy.coldest():
            entry = self.entries[key]
            if not entry.held:
                return entry
        return None

    def make_room(
        self, entry: Entry, removed: list[ChunkKey], moved: list[tuple[ChunkKey, str]]
    ) -> None:
        """Move a chunk nobody holds one tier down, or drop it (under the lock)."""
        level = entry.copy.level
        below = self.below(level)
        if below is not None and self._demote_now(entry, below, removed, moved):
            return
        self.drop(entry, "evicted")
        level.evictions += 1
        removed.append(entry.key)

    def _demote_now(
        self,
        entry: Entry,
        below: Level,
        removed: list[ChunkKey],
        moved: list[tuple[ChunkKey, str]],
    ) -> bool:
        # Under the lock, on the path of a write that needs room now.
        source = entry.copy
        shadow = entry.shadow
        if shadow is not None and shadow.level is below:
            # Its bytes are still there: no copy at all.
            self._forget_shadow(entry)
            self.switch(entry, shadow)
            source.level.demotions += 1
            moved.append((entry.key, below.name))
            return True
        slow = below.tier.executor is not None
        if slow and (
            self.closing or self._pending_bytes() + entry.size > self.options.demotion_buffer_bytes
        ):
            return False
        try:
            handle = self.allocate(below, entry.size, removed, moved)
        except CapacityExceeded:
            return False
        except KVDepotError as exc:  # a failing device: drop rather than fail the put
            self.losses.warn(
                f"demote {below.name}",
                "chunk %s dropped, not moved to the %s tier: %s",
                entry.key.hex(),
                below.name,
                exc,
            )
            return False
        target = Copy(below, handle, below.tier.size_of(handle))
        if slow:
            # Copied aside now (a memcpy), written by the tier's threads.
            data = bytes(self.host_bytes(source, entry.size))
            target.pending = data
            below.pending_bytes += len(data)
            self.switch(entry, target)
            executor = below.tier.executor
            assert executor is not None
            executor.submit(self._write_back, entry, target, data)
        else:
            self._copy_now(entry, source, target)
            self.switch(entry, target)
        source.level.demotions += 1
        moved.append((entry.key, below.name))
        return True

    def _pending_bytes(self) -> int:
        return sum(lv.pending_bytes for lv in self.levels)

    def host_bytes(self, copy: Copy, size: int) -> memoryview:
        """The bytes of a copy in host memory: DRAM, or a pending write's."""
        if copy.pending is not None:
            return memoryview(copy.pending)
        return copy.level.tier.view(copy.handle, size)

    def _copy_now(self, entry: Entry, source: Copy, target: Copy) -> None:
        # Between memory tiers (GPU and DRAM), under the lock: a device copy.
        if target.level.tier.host_memory:
            dest = target.level.tier.view(target.handle, entry.size)
            source.level.tier.read_into(source.handle, dest)
        else:
            data = self.host_bytes(source, entry.size)
            target.level.tier.write(target.handle, data, key=entry.key, checksum=entry.checksum)

    def _write_back(self, entry: Entry, copy: Copy, data: bytes) -> None:
        # On the slow tier's thread: write a demoted chunk's bytes.
        tier = copy.level.tier
        error: KVDepotError | None = None
        try:
            tier.write(copy.handle, memoryview(data), key=entry.key, checksum=entry.checksum)
        except KVDepotError as exc:
            error = exc
        except OSError as exc:
            error = Unavailable(str(exc))
        removed: list[ChunkKey] = []
        with self.lock:
            copy.pending = None
            copy.level.pending_bytes -= len(data)
            # An orphan's chunk left meanwhile (moved up, or dropped): nothing lost.
            if error is not None and not copy.orphan:
                self.write_errors += 1
                if entry.shadow is copy:
                    self._forget_shadow(entry)  # the chunk itself is in DRAM
                    copy.orphan = True  # freed below
                else:
                    self.lost(entry, copy.level, "write", error)
                    self.drop(entry, "tier_failed")
                    removed.append(entry.key)
            if copy.orphan:
                self.release_copy(copy)
            else:
                self.sync_held(entry)
            self.moved_cv.notify_all()
        self.notify(removed, [])

    def below(self, level: Level) -> Level | None:
        """The next slower tier in service, if any."""
        return next((lv for lv in self.levels[level.rank + 1 :] if lv.failed is None), None)

    def lost(self, entry: Entry, level: Level, what: str, error: BaseException) -> None:
        """Log a chunk ``level`` could not ``what`` (write, read): once per
        kind per interval, with a count (any thread)."""
        kind = "full" if isinstance(error, CapacityExceeded) else what
        self.losses.warn(
            f"{kind} {level.name}",
            "chunk %s lost: the %s tier could not %s it: %s",
            entry.key.hex(),
            level.name,
            what,
            error,
        )

    def lost_on_read(
        self, entry: Entry, level: Level, error: Exception, current: bool, removed: list[ChunkKey]
    ) -> None:
        """A read of the chunk from ``level`` failed (under the lock): a chunk
        whose bytes are bad or whose device failed them leaves the store,
        lest lookups go on naming it; other failures are a miss only."""
        if isinstance(error, Corrupt):
            self.corrupt += 1
            self.losses.warn("corrupt", "chunk %s dropped: %s", entry.key.hex(), error)
        elif isinstance(error, TierIOError):
            self.read_errors += 1
            self.lost(entry, level, "read", error)
        else:
            self.losses.warn("read", "cannot read chunk %s: %s", entry.key.hex(), error)
            return
        if current:
            self.drop(entry, "corrupt" if isinstance(error, Corrupt) else "tier_failed")
            removed.append(entry.key)

    def take_out(self, level: Level, removed: list[ChunkKey], limit: int) -> int:
        """Mark ``level`` failed (its tier's failure says why) and drop up to
        ``limit`` of its chunks and shadows from the store (under the lock);
        returns how many went. Called again until none are left, so that
        the lock is never held for a whole tier's chunks."""
        if level.failed is None:
            level.failed = level.tier.failure or f"{level.name} tier failed"
        keys = list(itertools.islice(level.policy.coldest(), limit))
        for key in keys:
            self.drop(self.entries[key], "tier_failed")
            removed.append(key)
        shadows = 0
        while shadows < limit - len(keys) and self.shed_shadow(level):
            shadows += 1
        self.read_errors += len(keys)
        return len(keys) + shadows

    def degraded(self) -> str:
        """Why the store runs on fewer tiers than it was opened with, or ``""``."""
        return "; ".join(lv.failed for lv in self.levels if lv.failed is not None)

    def attach(self, entry: Entry, copy: Copy) -> None:
        """Make ``copy`` the committed chunk's bytes, most recent in its tier."""
        entry.copy = copy
        level = copy.level
        level.committed_bytes += copy.alloc_size
        level.policy.insert(entry.key)
        entry.hits = 0
        self.sync_held(entry)

    def detach(self, entry: Entry) -> Copy:
        """Take the committed chunk out of its tier's accounting; returns its copy."""
        copy = entry.copy
        level = copy.level
        if entry.held:
            level.held_bytes -= copy.alloc_size
            entry.held = False
        level.committed_bytes -= copy.alloc_size
        level.policy.remove(entry.key)
        return copy

    def switch(self, entry: Entry, target: Copy) -> None:
        """Move the chunk's bytes to ``target`` (already filled or pending).

        The old copy is freed when unheld, except one in a slower persistent
        tier, which stays as the chunk's shadow.
        """
        old = self.detach(entry)
        self.attach(entry, target)
        if old.level.rank > target.level.rank and old.level.tier.persistent:
            if entry.shadow is not None:  # cannot be: one copy per tier
                self.shed_shadow(entry.shadow.level)
            entry.shadow = old
            old.level.shadows[entry.key] = old
            old.level.shadow_bytes += old.alloc_size
            return
        old.orphan = True
        self.release_copy(old)

    def drop(self, entry: Entry, reason: str = "") -> None:
        """Remove a committed chunk from the table; its copies go when unheld.
        ``reason`` (evicted, corrupt, tier_failed) is reported with its removal."""
        if reason:
            if len(self.reasons) >= _MAX_REASONS:
                self.reasons.clear()  # unreported for long: the metadata service is away
            self.reasons[entry.key] = (reason, entry.copy.level.name)
        copy = self.detach(entry)
        del self.entries[entry.key]
        self.inventory.remove(entry.key)
        copy.orphan = True
        self.release_copy(copy)
        if entry.shadow is not None:
            shadow = self._forget_shadow(entry)
            shadow.orphan = True
            self.release_copy(shadow)

    def _forget_shadow(self, entry: Entry) -> Copy:
        # Under the lock: the chunk no longer has its shadow (returned, not freed).
        shadow = entry.shadow
        assert shadow is not None
        entry.shadow = None
        del shadow.level.shadows[entry.key]
        shadow.level.shadow_bytes -= shadow.alloc_size
        return shadow

    def shed_shadow(self, level: Level) -> bool:
        """Free the oldest shadow copy in ``level``; whether there was one (under the lock)."""
        if not level.shadows:
            return False
        shadow = self._forget_shadow(self.entries[next(iter(level.shadows))])
        shadow.orphan = True
        self.release_copy(shadow)
        return True

    def release_copy(self, copy: Copy) -> None:
        """Free an orphaned copy if nothing holds it any more."""
        if copy.orphan and not copy.freed and copy.leases == 0 and copy.pending is None:
            copy.freed = True
            copy.level.tier.free(copy.handle)

    def sync_held(self, entry: Entry) -> None:
        """Recount whether the chunk's bytes are held (not evictable)."""
        if not entry.committed:
            return
        copy = entry.copy
        held = bool(copy.leases or entry.pins or entry.moving or copy.pending is not None)
        if held != entry.held:
            entry.held = held
            copy.level.held_bytes += copy.alloc_size if held else -copy.alloc_size

    def unhold(self, entry: Entry, source: Copy) -> None:
        """End a hold of ``source`` taken for a read or a move (under the lock)."""
        source.leases -= 1
        if source.orphan:
            self.release_copy(source)
        else:
            self.sync_held(entry)

    def notify(self, removed: list[ChunkKey], moved: list[tuple[ChunkKey, str]]) -> None:
        """Tell the listeners (outside the lock); failures are logged, not raised."""
        if removed and self._on_removed is not None:
            try:
                self._on_removed(removed)
            except Exception:
                # The removal already happened; a failing listener must not undo
                # it nor break the put that triggered it.
                logger.exception("on_removed callback failed for %d keys", len(removed))
        if moved and self._on_moved is not None:
            try:
                self._on_moved(moved)
            except Exception:
                logger.exception("on_moved callback failed for %d keys", len(moved))
