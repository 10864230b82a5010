"""The chunk table of the DRAM tier: one arena, one allocator, LRU, leases.

A chunk goes through two phases, so a half-written chunk is never visible:

1. :meth:`ChunkStore.reserve` allocates its bytes (evicting least-recently-used
   chunks if needed) and hands the writer a :class:`Reservation` whose view is
   the chunk's slice of the arena: the data plane ``recv_into``\\s it directly.
2. :meth:`ChunkStore.commit` makes it readable; :meth:`ChunkStore.revoke`
   drops it (a failed or corrupt write), and it was never seen.

Readers take a :class:`ReadLease`: while any lease on a chunk is held the chunk
is neither evicted nor its memory reused, so a reader can send straight from
the arena without copying. Deleting a leased chunk hides it at once and frees
its memory when the last lease is released.

Every state change happens under one lock; the ``on_removed`` callback runs
outside it, so it may call back into the store or block on the network.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvdepot.errors import CapacityExceeded, InvalidArgument, Unavailable
from kvdepot.metadata.keys import KEY_BYTES, ChunkKey
from kvdepot.store.allocator import Allocator
from kvdepot.store.arena import Arena
from kvdepot.store.xxh3 import xxh3_64

logger = logging.getLogger(__name__)


def checksum(data: memoryview | bytes | bytearray) -> int:
    """The checksum every chunk carries: xxh3-64 of its bytes.

    Computed by the writer over the whole chunk and checked whenever the bytes
    cross the network or come off disk. Non-byte formats (a memoryview of
    float16 values, say) are hashed as their raw bytes. Large inputs are
    hashed without holding the GIL (see :mod:`kvdepot.store.xxh3`).
    """
    view = data if isinstance(data, memoryview) else memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return xxh3_64(view)


class ChunkTooLarge(CapacityExceeded, InvalidArgument):
    """A chunk larger than the whole store.

    It is both: this store can never hold it (capacity), and retrying the same
    put here will fail again (invalid for this store); another store with a
    larger arena may take it.
    """


@dataclass(frozen=True, slots=True)
class Reservation:
    """Room for one chunk being written; not visible to readers until committed.

    Attributes:
        key: The chunk's key.
        offset: Where the chunk starts in the arena.
        size: The chunk's size in bytes.
        checksum: The checksum the writer announced for the chunk.
        view: Writable arena slice of exactly ``size`` bytes to receive into.
    """

    key: ChunkKey
    offset: int
    size: int
    checksum: int
    view: memoryview


@dataclass(frozen=True, slots=True)
class ReadLease:
    """A read of one committed chunk; its bytes stay put until released.

    Attributes:
        key: The chunk's key.
        size: The chunk's size in bytes.
        checksum: The checksum stored with the chunk (the writer's).
        view: Read-only arena slice of the chunk's bytes.
        offset: Where the chunk starts in the arena (for clients that map it).
    """

    key: ChunkKey
    size: int
    checksum: int
    view: memoryview
    offset: int = 0


@dataclass(frozen=True, slots=True)
class ChunkStoreStats:
    """A snapshot of the chunk table's counters.

    Attributes:
        capacity_bytes: Bytes the arena can hold.
        used_bytes: Bytes allocated (committed, being written, or deleted but
            still leased), counting alignment.
        chunks: Committed chunks.
        hits: :meth:`ChunkStore.acquire` calls that found a committed chunk.
        misses: :meth:`ChunkStore.acquire` calls that did not.
        evictions: Chunks evicted to make room.
        puts: Chunks committed.
        rejected: Reservations refused for lack of space.
    """

    capacity_bytes: int
    used_bytes: int
    chunks: int
    hits: int
    misses: int
    evictions: int
    puts: int
    rejected: int


class _State(enum.Enum):
    WRITING = "writing"
    COMMITTED = "committed"


class _Entry:
    """The table's record of one chunk (mutable; only touched under the lock)."""

    __slots__ = ("alloc_size", "checksum", "deleted", "key", "leases", "offset", "size", "state")

    def __init__(
        self, key: ChunkKey, offset: int, size: int, alloc_size: int, checksum: int
    ) -> None:
        self.key = key
        self.offset = offset
        self.size = size
        self.alloc_size = alloc_size
        self.checksum = checksum
        self.state = _State.WRITING
        self.leases = 0
        # Deleted while leased: out of the table, memory freed at the last release.
        self.deleted = False


class ChunkStore:
    """Thread-safe table of the chunks held in one DRAM arena.

    Args:
        capacity: Bytes of the arena.
        arena_path: Back the arena with a shared file here (see :class:`Arena`).
        on_removed: Called with the keys of committed chunks that left the
            store (evicted or deleted), outside the lock, so the daemon can
            tell the metadata service. Exceptions from it are logged.
        max_chunk_bytes: Largest chunk accepted; defaults to ``capacity``.

    Raises:
        InvalidArgument: If ``capacity`` or ``max_chunk_bytes`` is not positive.
    """

    def __init__(
        self,
        capacity: int,
        *,
        arena_path: str | None = None,
        on_removed: Callable[[list[ChunkKey]], None] | None = None,
        max_chunk_bytes: int | None = None,
    ) -> None:
        if max_chunk_bytes is not None and max_chunk_bytes <= 0:
            raise InvalidArgument(f"max_chunk_bytes must be positive, got {max_chunk_bytes}")
        self._allocator = Allocator(capacity)
        self._arena = Arena(capacity, path=arena_path)
        self._on_removed = on_removed
        self._max_chunk_bytes = max_chunk_bytes or capacity
        self._lock = threading.Lock()
        self._entries: dict[ChunkKey, _Entry] = {}
        # Committed chunks, least recently used first.
        self._lru: OrderedDict[ChunkKey, _Entry] = OrderedDict()
        # Outstanding leases by identity; the lease object is kept so its id
        # cannot be reused while it is registered.
        self._leases: dict[int, tuple[ReadLease, _Entry]] = {}
        # Allocated bytes of committed chunks, and of those the leased ones:
        # their difference is what eviction can free, known without a scan.
        self._committed_bytes = 0
        self._pinned_bytes = 0
        self._closed = False
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._puts = 0
        self._rejected = 0

    @property
    def capacity(self) -> int:
        """Bytes chunks can occupy (the arena's capacity rounded down to pages)."""
        return self._allocator.capacity

    @property
    def arena(self) -> Arena:
        """The arena holding the chunks (for transports that map it)."""
        return self._arena

    def reserve(self, key: ChunkKey, size: int, checksum: int) -> Reservation | None:
        """Allocate room for a chunk about to be written.

        Least-recently-used committed chunks that are not leased are evicted,
        one at a time, until the chunk fits.

        Args:
            key: The chunk's key (16 bytes).
            size: The chunk's size in bytes.
            checksum: The writer's checksum of the chunk, stored with it.

        Returns:
            The reservation to write into, or ``None`` if the key is already
            committed or being written (the caller skips the bytes).

        Raises:
            InvalidArgument: If the key is malformed, ``size`` is not positive
                or above ``max_chunk_bytes``.
            ChunkTooLarge: If ``size`` is above the store's capacity (both a
                :class:`CapacityExceeded` and an :class:`InvalidArgument`).
            CapacityExceeded: If the chunk does not fit even after evicting
                every chunk that may be evicted.
            Unavailable: If the store is closed.
        """
        if len(key) != KEY_BYTES:
            raise InvalidArgument(f"chunk keys are {KEY_BYTES} bytes, got {len(key)}")
        if size <= 0:
            raise InvalidArgument(f"chunk size must be positive, got {size}")
        if size > self._allocator.capacity:
            raise ChunkTooLarge(
                f"chunk of {size} bytes is larger than the store ({self._allocator.capacity} bytes)"
            )
        if size > self._max_chunk_bytes:
            raise InvalidArgument(
                f"chunk of {size} bytes is above the limit of {self._max_chunk_bytes} bytes"
            )
        evicted: list[ChunkKey] = []
        try:
            with self._lock:
                self._check_open()
                if key in self._entries:
                    return None
                offset = self._allocate(size, evicted)
                entry = _Entry(key, offset, size, self._allocator.size_of(offset), checksum)
                self._entries[key] = entry
                view = self._arena.view(offset, size)
        finally:
            self._notify_removed(evicted)
        return Reservation(key=key, offset=offset, size=size, checksum=checksum, view=view)

    def _allocate(self, size: int, evicted: list[ChunkKey]) -> int:
        # Called under the lock. Fails fast, before evicting anything, when even
        # evicting every unleased chunk could not free enough bytes.
        alloc = self._allocator
        offset = alloc.alloc(size)
        if offset is not None:
            return offset
        evictable = self._committed_bytes - self._pinned_bytes
        if alloc.free_bytes + evictable < alloc.rounded(size):
            self._rejected += 1
            raise CapacityExceeded(
                f"no room for a chunk of {size} bytes: store capacity {alloc.capacity} bytes, "
                f"{alloc.free_bytes} free, {evictable} evictable, the rest leased or being written"
            )
        while offset is None:
            # Leased chunks were just read, so they sit near the MRU end: the
            # scan for the first unleased one is short.
            victim = next((e for e in self._lru.values() if e.leases == 0), None)
            if victim is None:
                self._rejected += 1
                raise CapacityExceeded(
                    f"no room for a chunk of {size} bytes: store capacity {alloc.capacity} bytes, "
                    f"largest free extent {alloc.largest_free} bytes after evicting "
                    f"{len(evicted)} chunks"
                )
            self._remove(victim)
            alloc.free(victim.offset)
            self._evictions += 1
            evicted.append(victim.key)
            offset = alloc.alloc(size)
        return offset

    def commit(self, res: Reservation, checksum: int | None = None) -> None:
        """Make a reserved chunk readable and most recently used.

        Args:
            res: The reservation.
            checksum: The chunk's checksum, when the writer announced it only
                after the bytes (it replaces ``res.checksum``). The caller has
                verified the bytes against it.

        Raises:
            InvalidArgument: If ``res`` is not an outstanding reservation.
        """
        with self._lock:
            self._check_open()
            entry = self._reserved_entry(res)
            if entry is None:
                raise InvalidArgument(
                    f"commit of a reservation that is not outstanding: {res.key.hex()}"
                )
            entry.state = _State.COMMITTED
            if checksum is not None:
                entry.checksum = checksum
            self._lru[res.key] = entry
            self._committed_bytes += entry.alloc_size
            self._puts += 1

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
            self._allocator.free(entry.offset)

    def _reserved_entry(self, res: Reservation) -> _Entry | None:
        entry = self._entries.get(res.key)
        if entry is None or entry.state is not _State.WRITING or entry.offset != res.offset:
            return None
        return entry

    def acquire(self, key: ChunkKey) -> ReadLease | None:
        """Lease a committed chunk for reading and mark it most recently used.

        Returns:
            The lease, or ``None`` on a miss (absent or still being written).
            Release it with :meth:`release`, always.

        Raises:
            Unavailable: If the store is closed.
        """
        with self._lock:
            self._check_open()
            entry = self._entries.get(key)
            if entry is None or entry.state is not _State.COMMITTED:
                self._misses += 1
                return None
            self._hits += 1
            if entry.leases == 0:
                self._pinned_bytes += entry.alloc_size
            entry.leases += 1
            self._lru.move_to_end(key)
            view = self._arena.view(entry.offset, entry.size).toreadonly()
            lease = ReadLease(
                key=key, size=entry.size, checksum=entry.checksum, view=view, offset=entry.offset
            )
            self._leases[id(lease)] = (lease, entry)
            return lease

    def release(self, lease: ReadLease) -> None:
        """End a read lease; frees the chunk if it was deleted meanwhile.

        Raises:
            InvalidArgument: If ``lease`` is not outstanding (released twice).
        """
        with self._lock:
            held = self._leases.pop(id(lease), None)
            if held is None:
                if self._closed:
                    return
                raise InvalidArgument(
                    f"release of a lease that is not outstanding: {lease.key.hex()}"
                )
            entry = held[1]
            entry.leases -= 1
            if entry.leases == 0:
                if entry.deleted:
                    self._allocator.free(entry.offset)
                else:
                    self._pinned_bytes -= entry.alloc_size

    def delete(self, key: ChunkKey) -> bool:
        """Remove a committed chunk.

        A leased chunk disappears from the table at once; its memory is freed
        when the last lease is released. A chunk still being written is not
        touched (its writer owns it until commit or revoke).

        Returns:
            Whether a committed chunk was removed.
        """
        with self._lock:
            if self._closed:
                return False
            entry = self._entries.get(key)
            if entry is None or entry.state is not _State.COMMITTED:
                return False
            self._remove(entry)
            if entry.leases:
                entry.deleted = True
            else:
                self._allocator.free(entry.offset)
        self._notify_removed([key])
        return True

    def _remove(self, entry: _Entry) -> None:
        # Takes a committed chunk out of the table; the caller frees or defers.
        del self._entries[entry.key]
        del self._lru[entry.key]
        self._committed_bytes -= entry.alloc_size
        if entry.leases:
            self._pinned_bytes -= entry.alloc_size

    def contains(self, key: ChunkKey) -> bool:
        """Whether a committed chunk with this key is held (no LRU or hit effect)."""
        with self._lock:
            entry = self._entries.get(key)
            return entry is not None and entry.state is _State.COMMITTED

    def inventory(self) -> list[tuple[ChunkKey, int]]:
        """Keys and sizes of every committed chunk, least recently used first."""
        with self._lock:
            return [(key, entry.size) for key, entry in self._lru.items()]

    def stats(self) -> ChunkStoreStats:
        """A consistent snapshot of the counters."""
        with self._lock:
            return ChunkStoreStats(
                capacity_bytes=self._allocator.capacity,
                used_bytes=self._allocator.used_bytes,
                chunks=len(self._lru),
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
                puts=self._puts,
                rejected=self._rejected,
            )

    def close(self) -> None:
        """Drop every chunk and unmap the arena; later calls raise ``Unavailable``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._entries.clear()
            self._lru.clear()
            self._leases.clear()
        self._arena.close()

    def _check_open(self) -> None:
        if self._closed:
            raise Unavailable("chunk store is closed")

    def _notify_removed(self, keys: list[ChunkKey]) -> None:
        if not keys or self._on_removed is None:
            return
        try:
            self._on_removed(keys)
        except Exception:
            # The removal already happened; a failing listener must not undo
            # it nor break the put that triggered it.
            logger.exception("on_removed callback failed for %d keys", len(keys))
