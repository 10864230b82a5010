"""How the chunk table places chunks in its tiers: room, demotion, shadows.

:class:`TierPlacement` holds the table's primitives that the write path, the
read path and the background :class:`~kvdepot.store.tiering.Mover` share:
making room in a tier (the coldest chunks no one holds move one tier down,
or leave the store from the lowest), moving a chunk's bytes between copies,
and the bookkeeping of each tier's committed, held and shadow bytes. Every
method is called with the table's lock held, except where it says otherwise,
and none of them waits for a disk: a chunk leaving DRAM for SSD on the write
path is copied aside and written by the SSD tier's threads
(:meth:`TierPlacement._write_back`).

A *shadow* is the copy a chunk leaves in a persistent tier when it is
promoted out of it: chunks never change, so it stays valid, and demoting the
chunk again costs no write (nor a new hole in a segment). Shadows are the
first thing a tier gives up when it needs room, and they keep promoted
chunks across a restart.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvdepot.errors import CapacityExceeded, KVDepotError, Unavailable
from kvdepot.keys import ChunkKey
from kvdepot.store.tiering import Copy, Entry, Level
from kvdepot.store.tiers.cpu import CpuTier
from kvdepot.store.tiers.policy import TieringOptions

logger = logging.getLogger(__name__)

RemovedListener = Callable[[list[ChunkKey]], None]
"""Told the keys of committed chunks that left the store."""

MovedListener = Callable[[list[tuple[ChunkKey, str]]], None]
"""Told the chunks that changed tier, each with the tier it is in now."""


class TierPlacement:
    """The chunk table's placement primitives (the table derives from it)."""

    _entries: dict[ChunkKey, Entry]
    _levels: list[Level]
    _cpu: Level
    _cpu_tier: CpuTier
    _options: TieringOptions
    _lock: threading.Lock
    _moved_cv: threading.Condition
    _on_removed: RemovedListener | None
    _on_moved: MovedListener | None
    _write_errors: int
    _closing: bool

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
            entry = self._entries[key]
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
        self.drop(entry)
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
            self._closing
            or self._pending_bytes() + entry.size > self._options.demotion_buffer_bytes
        ):
            return False
        try:
            handle = self.allocate(below, entry.size, removed, moved)
        except CapacityExceeded:
            return False
        except KVDepotError as exc:  # a failing device: drop rather than fail the put
            logger.warning("cannot demote chunk %s to %s: %s", entry.key.hex(), below.name, exc)
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
        return sum(lv.pending_bytes for lv in self._levels)

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
        with self._lock:
            copy.pending = None
            copy.level.pending_bytes -= len(data)
            if error is not None:
                logger.warning("chunk %s lost: %s", entry.key.hex(), error)
                self._write_errors += 1
                if entry.shadow is copy:
                    self._forget_shadow(entry)  # the chunk itself is in DRAM
                elif not copy.orphan:
                    self.drop(entry)
                    removed.append(entry.key)
            if copy.orphan:
                self.release_copy(copy)
            else:
                self.sync_held(entry)
            self._moved_cv.notify_all()
        self.notify(removed, [])

    def below(self, level: Level) -> Level | None:
        """The next slower tier, if any."""
        i = level.rank + 1
        return self._levels[i] if i < len(self._levels) else None

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

    def drop(self, entry: Entry) -> None:
        """Remove a committed chunk from the table; its copies go when unheld."""
        copy = self.detach(entry)
        del self._entries[entry.key]
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
        shadow = self._forget_shadow(self._entries[next(iter(level.shadows))])
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
