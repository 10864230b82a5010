"""The chunk table of a store node: its tiers, two-phase writes, leases, moves.

Chunks live in one tier at a time, fastest first: ``gpu`` (optional), ``cpu``
(the DRAM arena, always) and ``ssd`` (optional); see
:mod:`kvdepot.store.tiers`. Every chunk is written into DRAM, in two phases
so a half-written chunk is never visible:

1. :meth:`ChunkStore.reserve` allocates its bytes in the arena (making room
   if needed) and hands the writer a :class:`Reservation` whose view is the
   chunk's slice of the arena: the data plane ``recv_into``\\s it directly.
2. :meth:`ChunkStore.commit` makes it readable; :meth:`ChunkStore.revoke`
   drops it (a failed or corrupt write), and it was never seen.

Readers take a :class:`ReadLease`. For a chunk in DRAM its view is the
arena itself, and while any lease is held those bytes are neither evicted,
moved away nor reused, so a reader sends straight from the arena. A chunk in
another tier is copied out for the reader (checked against its checksum when
it comes off SSD), or promoted into DRAM first (see
:class:`~kvdepot.store.tiers.TieringOptions`).

Making room in a tier takes its coldest chunks (by the tier's
:class:`~kvdepot.store.tiers.EvictionPolicy`) that no one leases, pins or is
moving, and moves them to the next tier down: GPU to DRAM, DRAM to SSD,
SSD out of the store. A chunk leaving DRAM for SSD on the write path is
copied aside and written by the SSD tier's threads, served from that copy
meanwhile, so a put never waits for the disk. A background thread
(:mod:`kvdepot.store.tiering`) keeps each tier under its high watermark and
moves hot chunks up, so that the write path rarely has to make room.

Every state change happens under one lock, that of the table's
:class:`~kvdepot.store.tier_placement.TierPlacement` (its tiers, its chunks'
records and the primitives that place them, which the table shares with the
mover). Nothing under it waits for a disk: reads
and writes of slow tiers run outside it (only a new SSD segment file is
created under it), and copies between GPU and DRAM are device copies. The
``on_removed`` and ``on_moved`` callbacks run outside it, so they may call
back into the store or block on the network.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

from kvdepot.errors import CapacityExceeded, Corrupt, InvalidArgument, Unavailable
from kvdepot.keys import ChunkKey, validate_key
from kvdepot.records import TierStats
from kvdepot.store.arena import Arena
from kvdepot.store.chunk_types import (
    ChunkStoreStats,
    ChunkTooLarge,
    Holding,
    ReadLease,
    Reservation,
)
from kvdepot.store.tier_placement import (
    Copy,
    Entry,
    Level,
    MovedListener,
    RemovedListener,
    State,
    TierPlacement,
    check_tier_names,
    now_s,
)
from kvdepot.store.tiering import Mover
from kvdepot.store.tiers.base import Tier, TierLimits
from kvdepot.store.tiers.cpu import CpuTier
from kvdepot.store.tiers.policy import TieringOptions
from kvdepot.wire.digest import I64, U64
from kvdepot.wire.xxh3 import checksum

__all__ = [
    "ChunkStore",
    "ChunkStoreStats",
    "ChunkTooLarge",
    "Holding",
    "MovedListener",
    "ReadLease",
    "RemovedListener",
    "Reservation",
    "checksum",
]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Read:
    """A read that needs I/O: from ``source`` into ``target`` (a promotion) or a copy."""

    entry: Entry
    source: Copy
    target: Copy | None
    buf: bytearray | None = None
    error: Exception | None = None


class ChunkStore:
    """Thread-safe table of the chunks a store node holds, across its tiers.

    Args:
        capacity: Bytes of the DRAM arena.
        arena_path: Back the arena with a shared file here (see :class:`Arena`).
        on_removed: Called with the keys of committed chunks that left the
            store (evicted, deleted, or found corrupt), outside the lock, so
            the daemon can tell the metadata service. Exceptions are logged.
        on_moved: Called with chunks that changed tier and their new tier,
            outside the lock. Exceptions are logged.
        max_chunk_bytes: Largest chunk accepted; defaults to ``capacity``.
        cpu_limits: Watermarks of the DRAM tier.
        pin_memory: Page-lock the arena for CUDA (see :class:`CpuTier`).
        tiers: Other tiers (``gpu``, ``ssd``); the store owns and closes them.
            Chunks a persistent tier recovers are in the table at once.
        options: How chunks move between tiers.

    Raises:
        InvalidArgument: If ``capacity`` or ``max_chunk_bytes`` is not
            positive, or two tiers have the same name.
    """

    def __init__(
        self,
        capacity: int,
        *,
        arena_path: str | None = None,
        on_removed: RemovedListener | None = None,
        on_moved: MovedListener | None = None,
        max_chunk_bytes: int | None = None,
        cpu_limits: TierLimits = TierLimits(),  # noqa: B008 - frozen, immutable default
        pin_memory: bool = False,
        tiers: Sequence[Tier] = (),
        options: TieringOptions = TieringOptions(),  # noqa: B008 - frozen, immutable default
    ) -> None:
        if max_chunk_bytes is not None and max_chunk_bytes <= 0:
            raise InvalidArgument(f"max_chunk_bytes must be positive, got {max_chunk_bytes}")
        check_tier_names([t.name for t in tiers])
        cpu = CpuTier(capacity, arena_path=arena_path, limits=cpu_limits, pin=pin_memory)
        placement = TierPlacement([cpu, *tiers], options, on_removed, on_moved)
        self._placement = placement
        # The placement's own objects, never rebound: held here too because
        # every read and write takes them.
        self._options = options
        self._levels = placement.levels
        self._cpu = placement.cpu
        self._cpu_tier = cpu
        self._lock = placement.lock
        self._moved_cv = placement.moved_cv
        self._entries = placement.entries
        self._max_chunk_bytes = max_chunk_bytes or capacity
        # Outstanding leases by identity; the lease object is kept so its id
        # cannot be reused while it is registered. Private copies hold no Copy.
        self._leases: dict[int, tuple[ReadLease, Copy | None]] = {}
        self._puts = 0
        self._rejected = 0
        try:
            self._recovered = self._recover()
            self._mover = Mover(placement) if len(self._levels) > 1 else None
        except BaseException:
            for level in self._levels:
                level.tier.close()
            raise

    def _recover(self) -> int:
        found = 0
        for level in self._levels:
            for rc in level.tier.recover():
                if rc.key in self._entries:
                    level.tier.free(rc.handle)
                    continue
                copy = Copy(level, rc.handle, level.tier.size_of(rc.handle))
                entry = Entry(rc.key, rc.size, rc.checksum, copy)
                entry.state = State.COMMITTED
                self._entries[rc.key] = entry
                self._placement.inventory.add(rc.key)
                self._placement.attach(entry, copy)
                found += 1
            self._placement.corrupt += getattr(level.tier, "dropped_on_open", 0)
        return found

    # -- properties -------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Bytes chunks can occupy in DRAM (the arena's capacity rounded down to pages)."""
        return self._cpu_tier.capacity

    @property
    def arena(self) -> Arena:
        """The arena holding the DRAM chunks (for transports that map it)."""
        return self._cpu_tier.arena

    @property
    def pinned(self) -> bool:
        """Whether the arena is page-locked for CUDA."""
        return self._cpu_tier.pinned

    @property
    def tiers(self) -> tuple[str, ...]:
        """Names of the store's tiers, fastest first."""
        return tuple(lv.name for lv in self._levels)

    @property
    def options(self) -> TieringOptions:
        """How chunks move between tiers."""
        return self._options

    @property
    def levels(self) -> list[Level]:
        """The tiers as the table sees them, fastest first."""
        return self._levels

    # -- writes -------------------------------------------------------------------------
    def reserve(self, key: ChunkKey, size: int, checksum: int) -> Reservation | None:
        """Allocate room in DRAM for a chunk about to be written.

        The coldest chunks of DRAM that no one holds are moved down (or
        dropped), one at a time, until the chunk fits.

        Args:
            key: The chunk's key (16 bytes).
            size: The chunk's size in bytes.
            checksum: The writer's checksum of the chunk, stored with it.

        Returns:
            The reservation to write into, or ``None`` if the key is already
            committed (in any tier) or being written (the caller skips the bytes).

        Raises:
            InvalidArgument: If the key is malformed, ``size`` is not positive
                or above ``max_chunk_bytes``.
            ChunkTooLarge: If ``size`` is above the arena's capacity (both a
                :class:`CapacityExceeded` and an :class:`InvalidArgument`).
            CapacityExceeded: If the chunk does not fit even after making room
                from every chunk that may be moved or evicted.
            Unavailable: If the store is closed.
        """
        key = validate_key(key)
        if size <= 0:
            raise InvalidArgument(f"chunk size must be positive, got {size}")
        if size > self.capacity:
            raise ChunkTooLarge(
                f"chunk of {size} bytes is larger than the store ({self.capacity} bytes)"
            )
        if size > self._max_chunk_bytes:
            raise InvalidArgument(
                f"chunk of {size} bytes is above the limit of {self._max_chunk_bytes} bytes"
            )
        removed: list[ChunkKey] = []
        moved: list[tuple[ChunkKey, str]] = []
        try:
            with self._lock:
                self._placement.check_open()
                if key in self._entries:
                    return None
                try:
                    handle = self._placement.allocate(self._cpu, size, removed, moved)
                except CapacityExceeded:
                    self._rejected += 1
                    raise
                copy = Copy(self._cpu, handle, self._cpu_tier.size_of(handle))
                self._entries[key] = Entry(key, size, checksum, copy)
                view = self._cpu_tier.view(handle, size)
        finally:
            self._placement.notify(removed, moved)
        return Reservation(key=key, offset=handle, size=size, checksum=checksum, view=view)

    def commit(
        self, res: Reservation, checksum: int | None = None, *, key: ChunkKey | None = None
    ) -> bool:
        """Make a reserved chunk readable and the most recently used in DRAM.

        Args:
            res: The reservation.
            checksum: The chunk's checksum, when the writer announced it only
                after the bytes (it replaces ``res.checksum``). The caller has
                verified the bytes against it.
            key: The chunk's key, for a reservation made under a placeholder
                key (a grant); when ``key`` is stored or being written
                already, the reservation is revoked instead.

        Returns:
            Whether the chunk was committed (False: ``key`` was there).

        Raises:
            InvalidArgument: If ``res`` is not an outstanding reservation or
                ``key`` is malformed.
        """
        if key is not None:
            key = validate_key(key)
        with self._lock:
            self._placement.check_open()
            entry = self._reserved_entry(res)
            if entry is None:
                raise InvalidArgument(
                    f"commit of a reservation that is not outstanding: {res.key.hex()}"
                )
            if key is not None and key != res.key:
                del self._entries[res.key]
                if key in self._entries:
                    self._cpu_tier.free(entry.copy.handle)
                    return False
                entry.key = key
                self._entries[key] = entry
            entry.state = State.COMMITTED
            entry.born = now_s()
            self._placement.inventory.add(entry.key)
            if checksum is not None:
                entry.checksum = checksum
            self._placement.attach(entry, entry.copy)
            self._puts += 1
        if self._mover is not None:
            self._mover.poke_if_over(self._cpu)
        return True

    def revoke(self, res: Reservation) -> None:
        """Drop a reserved chunk; it was never visible.

        Revoking a reservation that is no longer outstanding (already
        committed, revoked, or the store closed) does nothing, so cleanup
        paths can call it unconditionally.
        """
        with self._lock:
            entry = self._reserved_entry(res)
            if entry is None:
                logger.debug("revoke of a reservation that is not outstanding: %s", res.key.hex())
                return
            del self._entries[res.key]
            self._cpu_tier.free(entry.copy.handle)

    def _reserved_entry(self, res: Reservation) -> Entry | None:
        entry = self._entries.get(res.key)
        if entry is None or entry.committed or entry.copy.handle != res.offset:
            return None
        return entry

    # -- reads --------------------------------------------------------------------------
    def acquire(self, key: ChunkKey, *, in_arena: bool = False) -> ReadLease | None:
        """Lease a committed chunk for reading; it becomes the most recent in its tier.

        A chunk in DRAM is leased in place. One in another tier is promoted
        into DRAM first when ``in_arena`` (the reader maps the arena) or when
        it reached the promotion threshold; otherwise its bytes are copied
        out for this reader. Bytes from SSD are checked against the chunk's
        checksum first: a chunk that fails, or that its tier cannot read
        (an I/O error), is dropped from the store (reported to
        ``on_removed``) and this read is a miss.

        Returns:
            The lease, or ``None`` on a miss (absent, still being written,
            corrupt, or ``in_arena`` and DRAM has no room for it). Release it
            with :meth:`release`, always.

        Raises:
            Unavailable: If the store is closed.
        """
        return self.acquire_many([key], in_arena=in_arena)[0]

    def acquire_many(
        self,
        keys: Sequence[ChunkKey],
        *,
        in_arena: bool = False,
        continued: Sequence[bool] = (),
    ) -> list[ReadLease | None]:
        """:meth:`acquire` of each key; the reads from slow tiers run in parallel.

        Chunks on SSD are read on the SSD tier's threads, all at once, so a
        batch costs about one device round trip rather than one per chunk.

        ``continued[i]`` (when given) marks a read that continues one begun
        by an earlier request: a later range of a chunk read range by range
        (a header, then a layer at a time). It is served like any read but
        not counted again, as a hit or a miss or towards promotion, so a
        chunk read counts once whatever number of ranges it took.

        Raises:
            Unavailable: If the store is closed (leases already taken are
                released).
        """
        removed: list[ChunkKey] = []
        moved: list[tuple[ChunkKey, str]] = []
        out: list[ReadLease | _Read | None] = []
        seen: set[ChunkKey] = set()
        try:
            # One hold of the lock for the batch: a read of chunks in DRAM
            # is done here, and per-chunk locking cost as much as the lease.
            with self._lock:
                self._placement.check_open()
                dram = self._cpu if self._cpu.rank == 0 else None
                for i, key in enumerate(keys):
                    if key in seen:
                        out.append(None)  # a repeat: taken after the first is done
                        continue
                    seen.add(key)
                    count = not (continued and continued[i])
                    entry = self._entries.get(key)
                    if entry is not None and entry.copy.level is dram and entry.committed:
                        # In DRAM, the fastest tier: _begin_read's common case, inline.
                        if count:
                            self._count_hit(entry)
                        out.append(self._lease(entry, entry.copy))
                    else:
                        out.append(self._begin_read(key, in_arena, removed, moved, count))
            reads = [r for r in out if isinstance(r, _Read)]
            if not reads and len(seen) == len(keys):
                return cast(list[ReadLease | None], out)  # all in DRAM, or misses
            self._run_reads(reads)
            done = [self._end_read(r, removed, moved) if isinstance(r, _Read) else r for r in out]
            if len(seen) < len(keys):
                first = {key: i for i, key in reversed(list(enumerate(keys)))}
                for i, key in enumerate(keys):
                    if first[key] != i:
                        again = continued[i : i + 1] if continued else ()
                        done[i] = self.acquire_many([key], in_arena=in_arena, continued=again)[0]
            return done
        except BaseException as exc:
            for r in out:
                if isinstance(r, _Read) and r.error is None:
                    r.error = Unavailable(f"read abandoned: {exc}")
                    self._end_read(r, removed, moved)
                elif isinstance(r, ReadLease):
                    self.release(r)
            raise
        finally:
            self._placement.notify(removed, moved)

    def _begin_read(
        self,
        key: ChunkKey,
        in_arena: bool,
        removed: list[ChunkKey],
        moved: list[tuple[ChunkKey, str]],
        count: bool = True,
    ) -> ReadLease | _Read | None:
        # Under the lock (the caller's): a lease on DRAM, a miss, or a read
        # that needs I/O (its source held, its DRAM room taken if it is promoted).
        counted = not count
        while True:
            self._placement.check_open()
            entry = self._entries.get(key)
            if entry is None or not entry.committed:
                if not counted:
                    for level in self._levels:
                        level.misses += 1
                return None
            source = entry.copy
            level = source.level
            if not counted:
                counted = True
                self._count_hit(entry)
            if level is self._cpu:
                if self._mover is not None:
                    self._mover.consider_promotion(entry)
                return self._lease(entry, source)
            promote = in_arena or (
                level.rank > self._cpu.rank
                and self._options.promote_hits > 0
                and entry.hits >= self._options.promote_hits
            )
            if promote and entry.moving:
                if not in_arena:
                    promote = False  # another reader is promoting it: copy it out
                elif not self._moved_cv.wait(self._options.move_wait_s):
                    return None
                else:
                    continue  # it moved: look again
            # Held before making room, so making room cannot take it.
            source.leases += 1
            self._placement.sync_held(entry)
            target: Copy | None = None
            if promote:
                try:
                    handle = self._placement.allocate(self._cpu, entry.size, removed, moved)
                except CapacityExceeded:
                    if in_arena:
                        self._placement.unhold(entry, source)
                        return None
                else:
                    target = Copy(self._cpu, handle, self._cpu_tier.size_of(handle))
                    entry.moving = True
                    self._placement.sync_held(entry)
            return _Read(entry, source, target)

    def _run_reads(self, reads: list[_Read]) -> None:
        # Without the lock: fill each read's destination, in parallel on the
        # slow tier's threads where there are several.
        executor = next((lv.tier.executor for lv in self._levels if lv.tier.executor), None)
        if len(reads) > 1 and executor is not None:
            try:
                futures = [executor.submit(self._do_read, r) for r in reads[1:]]
            except RuntimeError:  # shutting down: read here
                futures = []
                for r in reads[1:]:
                    self._do_read(r)
            self._do_read(reads[0])
            for f in futures:
                f.result()
        else:
            for r in reads:
                self._do_read(r)

    def _do_read(self, read: _Read) -> None:
        entry, source = read.entry, read.source
        if read.target is not None:
            dest = self._cpu_tier.view(read.target.handle, entry.size)
        else:
            read.buf = bytearray(entry.size)
            dest = memoryview(read.buf)
        try:
            if source.pending is not None:
                dest[:] = source.pending
            else:
                source.level.tier.read_into(source.handle, dest)
        except (Corrupt, Unavailable, InvalidArgument) as exc:
            read.error = exc

    def _end_read(
        self, read: _Read, removed: list[ChunkKey], moved: list[tuple[ChunkKey, str]]
    ) -> ReadLease | None:
        entry, source, target, error = read.entry, read.source, read.target, read.error
        with self._lock:
            if target is not None:
                entry.moving = False
                self._moved_cv.notify_all()
            self._placement.unhold(entry, source)
            current = self._entries.get(entry.key) is entry and entry.copy is source
            if error is not None:
                if target is not None:
                    self._cpu_tier.free(target.handle)
                self._placement.lost_on_read(entry, source.level, error, current, removed)
                return None
            if target is None:
                # Copied out; valid even if the chunk moved or went meanwhile.
                assert read.buf is not None
                lease = ReadLease(
                    key=entry.key,
                    size=entry.size,
                    checksum=entry.checksum,
                    view=memoryview(read.buf).toreadonly(),
                    offset=-1,
                    tier=source.level.name,
                    in_arena=False,
                )
                self._leases[id(lease)] = (lease, None)
                return lease
            if not current:  # deleted meanwhile
                self._cpu_tier.free(target.handle)
                return None
            level = source.level
            self._placement.switch(entry, target)
            if level.rank > self._cpu.rank:
                level.promotions += 1
            else:
                level.demotions += 1
            moved.append((entry.key, self._cpu.name))
            return self._lease(entry, target)

    def _count_hit(self, entry: Entry) -> None:
        level = entry.copy.level
        for faster in self._levels[: level.rank]:
            faster.misses += 1
        level.hits += 1
        entry.hits += 1
        level.policy.touch(entry.key)

    def _lease(self, entry: Entry, copy: Copy) -> ReadLease:
        # Under the lock: a lease on a chunk's bytes in the arena.
        copy.leases += 1
        if not entry.held:  # held already: a lease more changes nothing
            self._placement.sync_held(entry)
        view = self._cpu_tier.view(copy.handle, entry.size).toreadonly()
        lease = ReadLease(
            key=entry.key,
            size=entry.size,
            checksum=entry.checksum,
            view=view,
            offset=copy.handle,
        )
        self._leases[id(lease)] = (lease, copy)
        return lease

    def release(self, lease: ReadLease) -> None:
        """End a read lease; frees the chunk's old bytes if it moved or was deleted meanwhile.

        Raises:
            InvalidArgument: If ``lease`` is not outstanding (released twice).
        """
        self.release_many((lease,))

    def release_many(self, leases: Iterable[ReadLease]) -> None:
        """:meth:`release` of each lease, under one hold of the lock.

        Raises:
            InvalidArgument: If a lease is not outstanding (released twice);
                the leases before it are released.
        """
        with self._lock:
            for lease in leases:
                self._release(lease)

    def _release(self, lease: ReadLease) -> None:
        # Under the lock.
        held = self._leases.pop(id(lease), None)
        if held is None:
            if self._placement.closed:
                return
            raise InvalidArgument(f"release of a lease that is not outstanding: {lease.key.hex()}")
        copy = held[1]
        if copy is None:
            return
        copy.leases -= 1
        if copy.orphan:
            self._placement.release_copy(copy)
            return
        entry = self._entries.get(lease.key)
        if entry is not None and entry.copy is copy:
            self._placement.sync_held(entry)

    # -- other operations -------------------------------------------------------------------
    def delete(self, key: ChunkKey) -> bool:
        """Remove a committed chunk, from whichever tier holds it.

        A leased chunk disappears from the table at once; its bytes are freed
        when the last lease is released. A chunk still being written is not
        touched (its writer owns it until commit or revoke).

        Returns:
            Whether a committed chunk was removed.
        """
        with self._lock:
            if self._placement.closed:
                return False
            entry = self._entries.get(key)
            if entry is None or not entry.committed:
                return False
            self._placement.drop(entry)
        self._placement.notify([key], [])
        return True

    def pin(self, key: ChunkKey) -> bool:
        """Keep a committed chunk in its tier: never moved nor evicted until :meth:`unpin`.

        Returns:
            Whether the chunk is held (pins count: unpin as often).
        """
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or not entry.committed:
                return False
            entry.pins += 1
            self._placement.sync_held(entry)
            return True

    def unpin(self, key: ChunkKey) -> bool:
        """Undo one :meth:`pin`; returns whether the chunk was pinned."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or not entry.pins:
                return False
            entry.pins -= 1
            self._placement.sync_held(entry)
            return True

    def contains(self, key: ChunkKey) -> bool:
        """Whether a committed chunk with this key is held (no LRU or hit effect)."""
        with self._lock:
            entry = self._entries.get(key)
            return entry is not None and entry.committed

    def removal_reasons(self, keys: Iterable[ChunkKey]) -> dict[ChunkKey, tuple[str, str]]:
        """Why each of ``keys`` left, where known: (reason, tier); forgotten after."""
        with self._lock:
            reasons = self._placement.reasons
            return {k: r for k in keys if (r := reasons.pop(k, None)) is not None}

    def describe(self, keys: Sequence[ChunkKey]) -> list[tuple[str, int] | None]:
        """Per key: (tier, commit time in Unix seconds; 0: not known), or None if not held."""
        with self._lock:
            got = [self._entries.get(k) for k in keys]
            return [(e.copy.level.name, e.born) if e and e.committed else None for e in got]

    def tier_of(self, key: ChunkKey) -> str | None:
        """The tier a committed chunk is in, or ``None`` if it is not held."""
        with self._lock:
            entry = self._entries.get(key)
            return entry.copy.level.name if entry is not None and entry.committed else None

    def inventory(self) -> list[tuple[ChunkKey, int]]:
        """Keys and sizes of every committed chunk, least recently used first
        (the slowest tier's chunks first)."""
        return [(h.key, h.size) for h in self.holdings()]

    def holdings(self) -> list[Holding]:
        """Every committed chunk with its tier, least recently used first."""
        with self._lock:
            return [
                Holding(key, self._entries[key].size, level.name)
                for level in reversed(self._levels)
                for key in level.policy.coldest()
            ]

    def keys(self) -> list[ChunkKey]:
        """The keys of every chunk now (committed or not), in no order: a
        snapshot taken at C speed, for walking a large store in pages."""
        with self._lock:
            return list(self._entries)

    def holdings_of(self, keys: Sequence[ChunkKey]) -> list[Holding]:
        """The committed chunks among ``keys``, with their sizes and tiers now."""
        with self._lock:
            entries = self._entries
            return [
                Holding(k, e.size, e.copy.level.name)
                for k in keys
                if (e := entries.get(k)) is not None and e.committed
            ]

    def inventory_digest(self) -> tuple[int, int]:
        """(committed chunks, their digest): what a heartbeat reports
        (:mod:`kvdepot.wire.digest`)."""
        with self._lock:
            inv = self._placement.inventory
            return inv.count, inv.total

    def inventory_cells(self) -> tuple[I64, U64]:
        """The digest cells (counts, sums) of every bucket, now."""
        with self._lock:
            return self._placement.inventory.cells()

    def bucket_holdings(self, buckets: Sequence[int]) -> list[list[Holding]]:
        """Per digest bucket, the committed chunks in it, with sizes and tiers."""
        with self._lock:
            inv, entries = self._placement.inventory, self._entries
            return [
                [Holding(k, (e := entries[k]).size, e.copy.level.name) for k in inv.bucket(b)]
                for b in buckets
            ]

    def stats(self) -> ChunkStoreStats:
        """A consistent snapshot of the DRAM tier's counters and the error counts."""
        with self._lock:
            cpu = self._cpu
            return ChunkStoreStats(
                capacity_bytes=self._cpu_tier.capacity,
                used_bytes=self._cpu_tier.used_bytes,
                chunks=len(cpu.policy),
                hits=cpu.hits,
                misses=cpu.misses,
                evictions=cpu.evictions,
                puts=self._puts,
                rejected=self._rejected,
                corrupt=self._placement.corrupt,
                write_errors=self._placement.write_errors,
                read_errors=self._placement.read_errors,
                recovered=self._recovered,
                degraded=self._placement.degraded(),
            )

    def tier_stats(self) -> list[TierStats]:
        """Usage and counters of every tier, fastest first."""
        with self._lock:
            return [lv.snapshot() for lv in self._levels]

    def close(self) -> None:
        """Stop moving chunks, finish writes to slow tiers, drop every chunk and
        release the tiers; later calls raise ``Unavailable``.

        Chunks of persistent tiers stay on disk for the next store.
        """
        with self._lock:
            if self._placement.closed or self._placement.closing:
                return
            self._placement.closing = True  # no new writes to slow tiers
        if self._mover is not None:
            self._mover.stop()
        for level in self._levels:
            executor = level.tier.executor
            if executor is not None:
                executor.shutdown(wait=True)
        with self._lock:
            self._placement.closed = True
            self._entries.clear()
            self._placement.inventory.clear()
            self._leases.clear()
        for level in self._levels:
            try:
                level.tier.close()
            except Exception:  # close the others whatever one hit
                logger.exception("closing the %s tier failed", level.name)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` began."""
        return self._placement.closed or self._placement.closing
