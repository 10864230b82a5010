"""The records the chunk table hands out: reservations, leases, stats."""

from __future__ import annotations

from dataclasses import dataclass

from kvdepot.errors import CapacityExceeded, InvalidArgument
from kvdepot.keys import ChunkKey


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


@dataclass(slots=True, eq=False)
class ReadLease:
    """A read of one committed chunk; its bytes stay put until released.

    Read-only by contract, not frozen: one is built per chunk on every read,
    and a frozen dataclass's ``__init__`` (``object.__setattr__`` per field)
    cost three times as much. A lease is its identity (``eq=False``): the
    store finds it by ``id``.

    Attributes:
        key: The chunk's key.
        size: The chunk's size in bytes.
        checksum: The checksum stored with the chunk (the writer's).
        view: Read-only view of the chunk's bytes.
        offset: Where the chunk starts in the arena (for clients that map
            it); meaningful only when ``in_arena``.
        tier: The tier the read was served from.
        in_arena: Whether ``view`` is the DRAM arena (else a private copy).
    """

    key: ChunkKey
    size: int
    checksum: int
    view: memoryview
    offset: int = 0
    tier: str = "cpu"
    in_arena: bool = True


@dataclass(frozen=True, slots=True)
class ChunkStoreStats:
    """A snapshot of the DRAM tier's counters and the store's error counts.

    Attributes:
        capacity_bytes: Bytes the arena can hold.
        used_bytes: Bytes allocated (committed, being written, or deleted but
            still leased), counting alignment.
        chunks: Committed chunks in DRAM.
        hits: :meth:`ChunkStore.acquire` calls served from DRAM.
        misses: :meth:`ChunkStore.acquire` calls that did not find the chunk in
            DRAM (nor in a faster tier).
        evictions: Chunks dropped from the store to make room in DRAM.
        puts: Chunks committed.
        rejected: Reservations refused for lack of space.
        corrupt: Chunks dropped because their bytes failed their checksum
            when read back from a tier (and on opening the SSD tier).
        write_errors: Chunks lost because a tier could not write them.
        recovered: Chunks found in persistent tiers when the store opened.
        read_errors: Chunks lost because a tier could not read them back
            (an I/O error, or their tier failed and was taken out).
        degraded: Why the store runs on fewer tiers than it was opened with
            (``"ssd tier failed: ..."``); empty while every tier works.
    """

    capacity_bytes: int
    used_bytes: int
    chunks: int
    hits: int
    misses: int
    evictions: int
    puts: int
    rejected: int
    corrupt: int = 0
    write_errors: int = 0
    recovered: int = 0
    read_errors: int = 0
    degraded: str = ""


@dataclass(frozen=True, slots=True)
class Holding:
    """A committed chunk as the store announces it: key, size and tier."""

    key: ChunkKey
    size: int
    tier: str
