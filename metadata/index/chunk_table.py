"""A compact replica table for the embedded index: numpy records, no object per chunk.

One row per replica, that is per (chunk key, node slot). The rows live in an
open-addressing hash table with linear probing: one ``(capacity, 3)`` uint64
array, a 24-byte record per slot::

    k0, k1   the 16-byte key as two little-endian words
    meta     node << 48 | tier << 40 | size

Node 0 (a meta of 0) is an empty slot and node 0xFFFF a tombstone; live rows
have the caller's node slots, 1..0xFFFE. Sizes get 40 bits (up to 1 TiB; larger
is refused). Against about 500 bytes for a Python object per chunk this is 24
bytes a slot, about 40 a row at the usual load, and the garbage collector sees
one array instead of millions of objects.

Why records rather than a column per field: a lookup walks a few consecutive
slots and, on a hit, reads every field. With the fields side by side that is
one or two cache lines; with five columns it was five cache misses, a third
slower per hit at millions of rows. Packing node, tier and size in one word is
what makes the record 24 bytes, aligned, so that every field can be read
through a strided ``memoryview`` (numpy exports unaligned fields in a format
``memoryview`` cannot index).

Keys are xxh3_128 digests, uniformly random, so the low bits of ``k0`` are the
home slot. Several rows share a key (one per node holding it), so a lookup walks
the whole probe chain, up to an empty slot, collecting every row of the key;
tombstones keep chains intact. Node slots are the caller's: every registration
of a node gets its own, so the rows of a dead registration can be purged in the
background (``begin_purge`` / ``purge_step``) while a new registration of the same
node id writes under a new slot.

No call does work unbounded by its own arguments. Growth, and the cleaning of
tombstones, is an incremental migration: when a write would take the table past
``max_load``, a second table is made (larger when live rows need it), new writes
go there, reads look in both, and every write moves a few old slots across
(``MIGRATE_PER_ROW`` per row written) besides what ``maintain_step`` moves. The
new table is sized so that the migration finishes before it can fill up.

A migration starts on memory already faulted in. Rows land in random slots of
the new table, and the first touch of a page is a page fault (on a VM, about
2 us a 4 KiB page, and 4-5 ms a fresh 2 MiB huge page, which numpy asks for):
writing 4096 rows into a fresh 400 MB table took 0.25-0.8 s in one call. So a
growth is *prepared*: once the load is within ``1 / PREPARE_PER_ROW`` of the
new table's size of ``max_load``, the new table is allocated (an ``mmap``, with
small pages: finds are 5% slower, but a call faults in a few MiB in well under
a millisecond) and faulted in a slice at a time (``MADV_POPULATE_WRITE``, or zeros
written where that is missing), ``PREPARE_PER_ROW`` slots per row written. The
migration starts on it, as before, when a write would overfill the old table,
which is when the writes have touched all of it. A write that overfills the old
table sooner (a huge batch, a preparation that began late) starts the migration
at once all the same, on what is touched. A cleaning migration, started by
``maintain_step``, is prepared by its steps first. The old table, once migrated,
is given back a few MiB per call (unmapping 200 MB at once takes 15 ms).

Batch writes are vectorised: each round of probing looks at a window of
``_WINDOW`` slots for every key still unresolved, and new rows claim free slots
in rounds where ``np.unique`` picks one winner per slot. Single-key operations
walk the ``memoryview`` instead, which avoids numpy's per-item overhead.
"""

from __future__ import annotations

import mmap
import struct
import sys
from typing import Any

import numpy as np
import numpy.typing as npt

TOMBSTONE = 0xFFFF
MAX_NODE = 0xFFFE
MAX_SIZE = (1 << 40) - 1
MAX_TIER = 0xFF
MIGRATE_PER_ROW = 4
"""Old slots a write migrates per row it writes; the new table's size depends on it."""
DEFAULT_STEP = 16384
"""Slots ``maintain_step`` and ``purge_step`` look at by default (a millisecond or two)."""
PREPARE_PER_ROW = 16
"""Slots of the next table a write pre-touches per row it writes (384 bytes)."""

_NODE = 48  # shift of the node in meta
_TIER = 40  # shift of the tier
_DEAD = TOMBSTONE << _NODE  # the meta of a tombstone; no live meta reaches it
_TIER_MASK = MAX_TIER << _TIER
_WINDOW = 8
_AR = np.arange(_WINDOW, dtype=np.int64)
_MIN_CAPACITY = 8
_DEBT_CHUNK = 256  # scalar writes migrate in vectorised chunks of up to this many slots
_unpack = struct.Struct("<QQ").unpack
_REC = 24  # bytes a slot
_PREPARE_MIN_BYTES = 1 << 20  # smaller tables are made when needed, untouched
_PIECE = 256 << 10  # pre-touching is paid in pieces of at least this many bytes
_FREE_PIECE = 8 << 20  # an old table is given back by pieces of this many bytes
_MADV_POPULATE_WRITE = 23  # Linux 5.14; Python 3.11's mmap module lacks the name
_populate = [sys.platform.startswith("linux")]  # until the kernel refuses it

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]
Views = tuple[memoryview, memoryview, memoryview, int]  # k0, k1, meta, mask


def keys_array(keys: bytes) -> U64:
    """The ``(n, 2)`` uint64 form of ``n`` concatenated 16-byte keys."""
    return np.frombuffer(keys, dtype="<u8").reshape(-1, 2)


class _Table:
    """One open-addressing table: the records, views of them, and its counts."""

    __slots__ = ("buf", "cap", "k0", "k1", "live", "mask", "meta", "rec", "tomb", "views")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.mask = cap - 1
        self.buf: mmap.mmap | None = None
        if cap * _REC < _PREPARE_MIN_BYTES or not hasattr(mmap, "MAP_PRIVATE"):
            self.rec: U64 = np.zeros((cap, 3), np.uint64)
        else:
            # Zeroed pages, faulted in on first touch, unmapped with the last
            # view. Huge pages are off: faulting in a fresh one took 2 ms a MiB
            # here, four times more than small pages, and a 2 MiB piece at once.
            self.buf = mmap.mmap(-1, cap * _REC, flags=mmap.MAP_PRIVATE)
            if hasattr(mmap, "MADV_NOHUGEPAGE"):
                self.buf.madvise(mmap.MADV_NOHUGEPAGE)
            self.rec = np.frombuffer(self.buf, np.uint64).reshape(cap, 3)
        self.k0: U64 = self.rec[:, 0]
        self.k1: U64 = self.rec[:, 1]
        self.meta: U64 = self.rec[:, 2]
        self.live = 0  # rows
        self.tomb = 0  # tombstoned slots
        # The array is never reallocated (growth makes a new table), so these
        # views stay valid for the table's life.
        self.views: Views = (
            self.k0.data,
            self.k1.data,
            self.meta.data,
            self.mask,
        )

    @property
    def used(self) -> int:
        return self.live + self.tomb

    def touch(self, a: int, b: int) -> None:
        """Fault in bytes ``a`` to ``b`` of the records, which must hold no row yet."""
        if self.buf is not None and _populate[0]:
            lo = a - a % mmap.PAGESIZE
            try:
                self.buf.madvise(_MADV_POPULATE_WRITE, lo, b - lo)
                return
            except OSError:  # before Linux 5.14, or not Linux
                _populate[0] = False
        self.rec.reshape(-1).view(np.uint8)[a:b] = 0

    def home(self, k0: U64) -> I64:
        return (k0 & np.uint64(self.mask)).astype(np.int64)

    def locate(self, k0: U64, k1: U64, node: int) -> tuple[I64, I64]:
        """Per key: the slot of its row of ``node`` (-1 if none), and the chain's first free slot.

        The free slot (a tombstone or the empty slot that ends the chain) is
        only meaningful where no row was found.
        """
        m = len(k0)
        found = np.full(m, -1, np.int64)
        free = np.full(m, -1, np.int64)
        rows = np.arange(m)
        p = self.home(k0)
        while rows.size:
            idx = (p[:, None] + _AR) & self.mask
            meta = self.meta[idx]
            empty = meta == 0
            stop = empty.any(axis=1)
            first_empty = np.where(stop, empty.argmax(axis=1), _WINDOW)
            r, c = np.nonzero((first_empty[:, None] > _AR) & ((meta >> _NODE) == node))
            if r.size:
                s = idx[r, c]
                ok = (self.k0[s] == k0[rows[r]]) & (self.k1[s] == k1[rows[r]])
                found[rows[r[ok]]] = s[ok]
                stop[r[ok]] = True
            isfree = empty | (meta >= _DEAD)
            need = np.flatnonzero(isfree.any(axis=1) & (free[rows] < 0))
            free[rows[need]] = idx[need, isfree[need].argmax(axis=1)]
            go = ~stop
            rows = rows[go]
            p = (p[go] + _WINDOW) & self.mask
        return found, free

    def claim(self, start: I64, metas: U64) -> tuple[I64, int]:
        """Take one free slot per row, the first at or after ``start`` on its chain.

        The slots get their ``metas`` at once (so that later rounds see them
        taken); the caller writes the keys. Returns the slots and how many of
        them were tombstones.
        """
        out = np.empty(len(start), np.int64)
        rows = np.arange(len(start))
        p = start.astype(np.int64, copy=True)
        reused = 0
        for _ in range(self.cap + len(start)):  # every round moves each row on by a slot
            if not rows.size:
                return out, reused
            idx = (p[:, None] + _AR) & self.mask
            isfree = self.meta[idx]
            isfree = (isfree == 0) | (isfree >= _DEAD)
            anyfree = isfree.any(axis=1)
            cand = idx[np.arange(len(rows)), isfree.argmax(axis=1)]
            contenders = np.flatnonzero(anyfree)
            _, first = np.unique(cand[contenders], return_index=True)
            win = contenders[first]
            slots = cand[win]
            reused += int(np.count_nonzero(self.meta[slots] >= _DEAD))
            self.meta[slots] = metas[rows[win]]
            out[rows[win]] = slots
            # Losers try the slot after the one they lost; rows whose window
            # was full skip the window.
            nxt = np.where(anyfree, cand + 1, p + _WINDOW) & self.mask
            keep = np.ones(len(rows), bool)
            keep[win] = False
            rows = rows[keep]
            p = nxt[keep]
        raise RuntimeError("no free slot: the load bound was broken")


def _probe(v: Views, k0: int, k1: int, node: int) -> tuple[int, int]:
    """Scalar ``_Table.locate``: (slot of the row of ``node`` or -1, first free slot)."""
    k0v, k1v, mv, mask = v
    lo = node << _NODE  # the metas of the node's rows are lo..hi-1
    hi = lo + (1 << _NODE)
    i = k0 & mask
    free = -1
    while True:
        m = mv[i]
        if lo <= m < hi:
            if k0v[i] == k0 and k1v[i] == k1:
                return i, free
        elif m == 0:
            return -1, (i if free < 0 else free)
        elif m >= _DEAD and free < 0:
            free = i
        i = (i + 1) & mask


def _collect(v: Views, k0: int, k1: int, out: list[tuple[int, int]]) -> int:
    """Append (node, tier) of every row of the key to ``out``; the size of one, or -1."""
    k0v, k1v, mv, mask = v
    size = -1
    i = k0 & mask
    m = mv[i]
    while m:
        if k0v[i] == k0 and m < _DEAD and k1v[i] == k1:
            out.append((m >> 48, (m >> 40) & 0xFF))
            size = m & MAX_SIZE
        i = (i + 1) & mask
        m = mv[i]
    return size


def _meta(node: int, tiers: U64, sizes: U64) -> U64:
    return (tiers << np.uint64(_TIER)) | sizes | np.uint64(node << _NODE)


class ChunkTable:
    """Replicas of chunks, one row per (key, node slot), in a numpy hash table.

    Not thread-safe: like the rest of the embedded index, it is driven from
    one event loop. Keys passed as ``bytes`` must be 16 bytes long.
    """

    def __init__(self, initial_capacity: int = 1 << 16, max_load: float = 0.7) -> None:
        if not 0.1 <= max_load <= 0.9:
            raise ValueError(f"max_load {max_load} is outside [0.1, 0.9]")
        cap = _MIN_CAPACITY
        while cap < initial_capacity:
            cap *= 2
        self._min_cap = cap
        self._max_load = max_load
        self._t = _Table(cap)  # where writes go
        self._v = self._t.views
        self._old: _Table | None = None  # being migrated into _t
        self._ov: Views | None = None
        self._cursor = 0  # next old slot to migrate
        self._debt = 0  # old slots owed by scalar writes
        self._debt_chunk = _DEBT_CHUNK
        # Purges: slots of the current table still to sweep, per node; nodes
        # that also wait for the migration under way to end; the sweep's place.
        self._purge_left: dict[int, int] = {}
        self._purge_wait: set[int] = set()
        self._purge_arr: U64 = np.zeros(0, np.uint64)
        self._sweep = 0
        self._purged: dict[int, int] = {}  # rows dropped by migration, not yet reported
        # The next table while it is prepared: bytes of it faulted in, and
        # bytes owed by writes, paid in pieces; the load that starts it.
        self._next: _Table | None = None
        self._touched = 0
        self._owed = 0
        self._dead: _Table | None = None  # a migrated old table, given back piecewise
        self._freed = 0  # bytes of it given back
        self._prep_at = self._prepare_threshold()

    # -- sizes --------------------------------------------------------------

    def __len__(self) -> int:
        return self._t.live + (self._old.live if self._old is not None else 0)

    @property
    def capacity(self) -> int:
        """Slots of the table that takes writes."""
        return self._t.cap

    @property
    def nbytes(self) -> int:
        """Bytes of all the arrays held now (both tables during a migration).

        Of a table being prepared, the bytes faulted in so far.
        """
        old = self._old.rec.nbytes if self._old is not None else 0
        if self._dead is not None:
            old += self._dead.rec.nbytes - self._freed
        return self._t.rec.nbytes + old + self._touched

    @property
    def tombstones(self) -> int:
        """Tombstoned slots (of a migration's old table: only those not migrated yet)."""
        return self._t.tomb + (self._old.tomb if self._old is not None else 0)

    @property
    def migrating(self) -> bool:
        return self._old is not None

    @property
    def preparing(self) -> bool:
        """Whether the table of the next migration is made and being faulted in."""
        return self._next is not None

    @property
    def purging(self) -> bool:
        """Whether some ``begin_purge`` has not completed yet."""
        return bool(self._purge_left)

    # -- reads --------------------------------------------------------------

    def find(self, key: bytes) -> tuple[int, list[tuple[int, int]]] | None:
        """(size, [(node, tier), ...]) of every row of ``key``, or None.

        Rows of a node being purged may still show until its purge completes.
        Sizes of one key are expected to agree; the size of one row is returned.
        """
        k0, k1 = _unpack(key)
        k0v, k1v, mv, mask = self._v
        out = None
        i = k0 & mask
        m = mv[i]
        # Literals rather than the module's constants: global lookups cost here.
        while m:
            if k0v[i] == k0 and m < 0xFFFF000000000000 and k1v[i] == k1:
                if out is None:
                    size = m & 0xFFFFFFFFFF
                    out = [(m >> 48, (m >> 40) & 0xFF)]
                else:
                    out.append((m >> 48, (m >> 40) & 0xFF))
            i = (i + 1) & mask
            m = mv[i]
        if self._ov is not None:
            rest: list[tuple[int, int]] = []
            old_size = _collect(self._ov, k0, k1, rest)
            if rest:
                if out is None:
                    return old_size, rest
                out.extend(rest)
        return None if out is None else (size, out)

    # -- writes -------------------------------------------------------------

    def upsert_many(
        self, keys: U64, sizes: U64, tiers: npt.NDArray[np.uint8] | int, node: int
    ) -> int:
        """Insert or update the rows of ``node`` for ``keys`` (shape ``(n, 2)``).

        ``sizes`` and ``tiers`` are per key (``tiers`` may be one scalar). Of
        keys repeated in the batch, the last wins. Returns the number of new rows.
        """
        return len(self.upsert_new(keys, sizes, tiers, node))

    def upsert_new(
        self, keys: U64, sizes: U64, tiers: npt.NDArray[np.uint8] | int, node: int
    ) -> U64:
        """:meth:`upsert_many`, returning the keys whose rows are new (``(m, 2)``)."""
        node = int(node)
        self._check_writer(node)
        k0, k1, metas = _batch(keys, sizes, tiers, node)
        n = len(k0)
        if n == 0:
            return np.zeros((0, 2), np.uint64)
        self._make_room(n)
        moved: npt.NDArray[np.bool_] = np.zeros(n, bool)
        old = self._old
        if old is not None:
            # A row still in the old table moves to the new one with its update.
            pos, _ = old.locate(k0, k1, node)
            moved = pos >= 0
            pos = pos[moved]
            old.meta[pos] = _DEAD
            old.live -= len(pos)
            old.tomb += len(pos)
        t = self._t
        pos, free = t.locate(k0, k1, node)
        hit = pos >= 0
        t.meta[pos[hit]] = metas[hit]
        miss = ~hit
        slots, reused = t.claim(free[miss], metas[miss])
        t.k0[slots] = k0[miss]
        t.k1[slots] = k1[miss]
        t.live += len(slots)
        t.tomb -= reused
        new = miss & ~moved
        return np.stack((k0[new], k1[new]), axis=1)

    def node_keys(self, node: int, match: int, mask: int) -> U64:
        """The keys of ``node``'s rows whose ``k0 & mask == match`` (``(m, 2)``).

        ``mask`` keeps bits of ``k0``; with its low byte set, the rows are
        found on the chains from the homes whose bits agree with ``match``
        (1/256 of the table or less), not by a scan of the whole table.
        """
        tables = [t for t in (self._t, self._old) if t is not None]
        out = [_rows_of(t, int(node), int(match), mask) for t in tables]
        return np.concatenate(out) if out else np.zeros((0, 2), np.uint64)

    def slot_keys(self, node: int, limit: int) -> U64:
        """Up to ``limit`` keys of ``node``'s rows (``(m, 2)``), by a scan of
        the records a piece at a time (for a dead node's departures: rare)."""
        out: list[U64] = []
        left = limit
        for t in (self._t, self._old):
            for a in range(0, t.cap if t is not None else 0, 1 << 20):
                assert t is not None
                rows = np.flatnonzero((t.meta[a : a + (1 << 20)] >> np.uint64(_NODE)) == node)
                rows = rows[:left] + a
                out.append(np.stack((t.k0[rows], t.k1[rows]), axis=1))
                left -= len(rows)
                if left <= 0:
                    return np.concatenate(out)
        return np.concatenate(out) if out else np.zeros((0, 2), np.uint64)

    def upsert(self, key: bytes, size: int, node: int, tier: int) -> bool:
        """Insert or update one row; True if it is new."""
        # Plain ints: a numpy integer would overflow in the shifts below.
        node, size, tier = int(node), int(size), int(tier)
        self._check_writer(node)
        if not (0 <= size <= MAX_SIZE and 0 <= tier <= MAX_TIER):
            raise ValueError(f"size {size} or tier {tier} out of range")
        k0, k1 = _unpack(key)
        if self._dead is not None:
            self._free_some()
        if self._old is not None:
            self._debt += MIGRATE_PER_ROW
            if self._debt >= self._debt_chunk:
                self._migrate(self._debt)
                self._debt = 0
        if self._old is None and (self._t.used + 1 > self._prep_at or self._next is not None):
            self._make_room(1)
        meta = node << _NODE | tier << _TIER | size
        t = self._t
        k0v, k1v, mv, _ = self._v
        i, free = _probe(self._v, k0, k1, node)
        if i >= 0:
            mv[i] = meta
            return False
        new = True
        if self._old is not None:
            new = not self._kill(self._old, k0, k1, node)
        if mv[free]:
            t.tomb -= 1  # a free slot that is not empty is a tombstone
        k0v[free] = k0
        k1v[free] = k1
        mv[free] = meta
        t.live += 1
        return new

    def set_tier(self, key: bytes, node: int, tier: int) -> bool:
        """Change the tier of the row of (key, node); False if there is none."""
        node, tier = int(node), int(tier)
        if not 0 <= tier <= MAX_TIER:
            raise ValueError(f"tier {tier} out of range")
        k0, k1 = _unpack(key)
        for v in (self._v, self._ov):
            if v is not None:
                i, _ = _probe(v, k0, k1, node)
                if i >= 0:
                    mv = v[2]
                    mv[i] = mv[i] & ~_TIER_MASK | tier << _TIER
                    return True
        return False

    def remove(self, key: bytes, node: int) -> bool:
        """Tombstone the row of (key, node); False if there is none."""
        node = int(node)
        k0, k1 = _unpack(key)
        return self._kill(self._t, k0, k1, node) or (
            self._old is not None and self._kill(self._old, k0, k1, node)
        )

    @staticmethod
    def _kill(t: _Table, k0: int, k1: int, node: int) -> bool:
        i, _ = _probe(t.views, k0, k1, node)
        if i < 0:
            return False
        t.views[2][i] = _DEAD
        t.live -= 1
        t.tomb += 1
        return True

    def _check_writer(self, node: int) -> None:
        if not 0 < node <= MAX_NODE:
            raise ValueError(f"node slot {node} is outside 1..{MAX_NODE}")
        if node in self._purge_left:
            raise ValueError(f"node slot {node} is being purged")

    # -- growth and cleaning -------------------------------------------------

    def _limit(self, cap: int) -> int:
        return int(self._max_load * cap)

    def _make_room(self, n: int) -> None:
        """Pay what ``n`` written rows owe; start a migration if they would overfill the table."""
        if self._dead is not None:
            self._free_some()
        if self._old is not None:
            self._migrate(MIGRATE_PER_ROW * n)
        if self._old is not None:
            return
        t = self._t
        limit = self._limit(t.cap)
        if self._next is not None or self._prep_at < min(limit, t.used + n):
            self._prepare(PREPARE_PER_ROW * n, 0)
        if t.used + n > limit:
            self._start_migration(n)
            self._migrate(MIGRATE_PER_ROW * n)

    def _new_cap(self, live: int, n: int) -> int:
        """The size of a table to migrate the current one into, with ``live`` rows in it.

        While the migration lasts the new table receives at most the live rows
        of the old one, plus one row per ``MIGRATE_PER_ROW`` old slots migrated
        by writes (plus what scalar writes owe, and the first write's ``n``).
        It must also end at most half full, so that the next migration is far off.
        """
        owed = (self._t.cap + _debt_chunk(self._t.cap)) // MIGRATE_PER_ROW + n
        cap = self._min_cap
        while live > self._limit(cap) // 2 or live + owed > self._limit(cap):
            cap *= 2
        return cap

    def _prepare_threshold(self) -> int:
        """The load of the current table from which writes prepare the next one.

        Writes from there to ``max_load`` pre-touch all of it, at
        ``PREPARE_PER_ROW`` slots a row, whatever rows they write.
        """
        limit = self._limit(self._t.cap)
        cap = self._new_cap(limit, 0)
        if cap * _REC < _PREPARE_MIN_BYTES:
            return limit  # never: a table that small is faulted in fast enough
        rows = -(-(cap * _REC + _PIECE) // (_REC * PREPARE_PER_ROW))
        return limit - rows - 1

    def _prepare(self, slots: int, cap: int) -> bool:
        """Fault in ``slots`` more slots of the next table; True once all of it is.

        ``cap`` is the size wanted (0: the size a growth from the current load
        would want); a next table of another size is made again.
        """
        nxt = self._next
        if nxt is None or (cap and not _fits(nxt.cap, cap)):
            nxt = self._next = _Table(cap or self._new_cap(self._limit(self._t.cap), 0))
            self._touched = self._owed = 0
        end = nxt.rec.nbytes
        if end < _PREPARE_MIN_BYTES:
            self._touched = end  # from the heap, faulted in fast enough
        self._owed += slots * _REC
        if self._touched < end and (self._owed >= _PIECE or self._touched + self._owed >= end):
            b = min(end, self._touched + self._owed)
            nxt.touch(self._touched, b)
            self._touched = b
            self._owed = 0
        return self._touched == end

    def _start_migration(self, n: int) -> None:
        """Make the table that takes writes from now on (the one prepared if it fits)."""
        old = self._t
        # Small tables pay scalar debts sooner, so that they need little slack.
        self._debt_chunk = _debt_chunk(old.cap)
        cap = self._new_cap(old.live, n)
        nxt, self._next = self._next, None
        self._touched = self._owed = 0
        self._old, self._ov = old, old.views
        self._t = nxt if nxt is not None and _fits(nxt.cap, cap) else _Table(cap)
        self._v = self._t.views
        self._prep_at = self._prepare_threshold()
        self._cursor = 0
        self._debt = 0
        # The new table never receives rows of nodes purged now (writes are
        # refused, the migration drops them): they are done once it ends.
        self._purge_wait.update(self._purge_left)
        self._purge_left = dict.fromkeys(self._purge_left, 0)
        self._sweep = 0

    def _migrate(self, budget: int) -> None:
        """Move the rows of up to ``budget`` old slots into the new table."""
        old = self._old
        if old is None or budget <= 0:
            return
        a = self._cursor
        b = min(old.cap, a + budget)
        seg = old.meta[a:b]
        live = (seg != 0) & (seg < _DEAD)
        old.tomb -= int(np.count_nonzero(seg >= _DEAD))
        if self._purge_arr.size:
            drop = live & np.isin(seg >> _NODE, self._purge_arr)
            if drop.any():
                _count_into(self._purged, seg[drop] >> _NODE)
                old.live -= int(np.count_nonzero(drop))
                live &= ~drop
        idx = a + np.flatnonzero(live)
        t = self._t
        k0 = old.k0[idx]
        slots, reused = t.claim(t.home(k0), old.meta[idx])
        t.k0[slots] = k0
        t.k1[slots] = old.k1[idx]
        t.live += len(idx)
        t.tomb -= reused
        old.live -= len(idx)
        # Migrated slots become tombstones: finds in the old table skip them,
        # and its chains through them stay intact.
        seg[seg != 0] = _DEAD
        self._cursor = b
        if b == old.cap:
            self._old = self._ov = None
            self._purge_wait.clear()
            if old.buf is not None:
                self._dead, self._freed = old, 0

    def _free_some(self) -> None:
        """Give back a piece of the last migration's old table.

        Unmapping 200 MB of small pages at once takes 15 ms; a piece, well
        under one.
        """
        dead = self._dead
        if dead is None or dead.buf is None:
            self._dead = None
            return
        end = min(dead.rec.nbytes, self._freed + _FREE_PIECE)
        if hasattr(mmap, "MADV_DONTNEED"):
            dead.buf.madvise(mmap.MADV_DONTNEED, self._freed, end - self._freed)
        self._freed = end
        if end == dead.rec.nbytes:
            self._dead = None  # nothing mapped is left to unmap

    def maintain_step(self, max_slots: int = DEFAULT_STEP) -> bool:
        """Migrate up to ``max_slots`` old slots; True while a migration remains.

        With no migration under way, one is started to clean the table when
        tombstones outnumber live rows and hold a quarter of the load budget
        (this may also shrink it), once the steps have pre-touched its table,
        ``max_slots`` slots each. Steps leave the preparation of a growth to
        the writes, which end it as it is needed: ended sooner, it would only
        hold the memory longer.
        """
        if self._dead is not None:
            self._free_some()
        t = self._t
        if self._old is None and t.tomb > max(t.live, self._limit(t.cap) // 4):
            if self._prepare(max_slots, self._new_cap(t.live, 0)):
                self._start_migration(0)
            return True
        self._migrate(max_slots)
        return self._old is not None

    # -- purging --------------------------------------------------------------

    def begin_purge(self, node: int) -> None:
        """Start removing every row of ``node``; writes under it are refused until done."""
        if not 0 < node <= MAX_NODE:
            raise ValueError(f"node slot {node} is outside 1..{MAX_NODE}")
        if node in self._purge_left:
            return  # no row of it can have appeared since the first call
        # A full cycle of the sweep from here covers the current table; the
        # old one, if any, is covered by the migration, which drops its rows.
        self._purge_left[node] = self._t.cap
        if self._old is not None:
            self._purge_wait.add(node)
        self._purge_arr = np.fromiter(self._purge_left, np.uint64)

    def purge_step(self, max_slots: int = DEFAULT_STEP) -> tuple[dict[int, int], list[int]]:
        """Sweep up to ``max_slots`` slots for rows of purged nodes.

        Returns the rows removed per node (including rows a migration dropped
        since the last call) and the nodes whose purge is complete: they have
        no rows left and their slot numbers may be used again. When no sweep is
        needed but nodes wait for the migration, the step migrates instead.
        """
        if any(left > 0 for left in self._purge_left.values()):
            self._sweep_step(max_slots)
        elif self._purge_wait:
            self._migrate(max_slots)
        removed, self._purged = self._purged, {}
        done = [
            n for n, left in self._purge_left.items() if left <= 0 and n not in self._purge_wait
        ]
        for n in done:
            del self._purge_left[n]
        if done:
            self._purge_arr = np.fromiter(self._purge_left, np.uint64)
        return removed, done

    def _sweep_step(self, max_slots: int) -> None:
        t = self._t
        a = self._sweep
        b = min(t.cap, a + max(1, max_slots))
        seg = t.meta[a:b]
        hit = np.isin(seg >> _NODE, self._purge_arr)
        if hit.any():
            _count_into(self._purged, seg[hit] >> _NODE)
            seg[hit] = _DEAD
            gone = int(np.count_nonzero(hit))
            t.live -= gone
            t.tomb += gone
        self._sweep = b & t.mask
        for n, left in self._purge_left.items():
            self._purge_left[n] = left - (b - a)


def _rows_of(t: _Table, node: int, match: int, mask: int) -> U64:
    """:meth:`ChunkTable.node_keys` in one table: walk the chains from every
    home whose bits (under ``mask``) agree with ``match``."""
    low = mask & t.mask & 0xFF
    homes = np.arange(match & low, t.cap, low + 1, dtype=np.int64)
    keep = t.mask & mask & ~low
    homes = homes[(homes & keep) == (match & keep)]
    slots: list[I64] = []
    p = homes
    while p.size:
        idx = (p[:, None] + _AR) & t.mask
        meta = t.meta[idx]
        empty = meta == 0
        end = np.where(empty.any(axis=1), empty.argmax(axis=1), _WINDOW)
        slots.append(idx[(end[:, None] > _AR) & ((meta >> _NODE) == node)])
        p = (p[end == _WINDOW] + _WINDOW) & t.mask
    found = np.unique(np.concatenate(slots)) if slots else np.zeros(0, np.int64)
    found = found[(t.k0[found] & np.uint64(mask)) == np.uint64(match)]
    return np.stack((t.k0[found], t.k1[found]), axis=1)


def _debt_chunk(cap: int) -> int:
    return max(MIGRATE_PER_ROW, min(_DEBT_CHUNK, cap // 8))


def _fits(have: int, want: int) -> bool:
    """Whether a table of ``have`` slots will do where ``want`` are needed."""
    return want <= have <= 2 * want


def _count_into(acc: dict[int, int], nodes: npt.NDArray[np.integer[Any]]) -> None:
    vals, counts = np.unique(nodes, return_counts=True)
    for v, c in zip(vals.tolist(), counts.tolist(), strict=True):
        acc[v] = acc.get(v, 0) + c


def _batch(
    keys: U64, sizes: U64, tiers: npt.NDArray[np.uint8] | int, node: int
) -> tuple[U64, U64, U64]:
    """``k0``, ``k1`` and metas of a batch, validated, one entry per key (the last given)."""
    keys = np.asarray(keys)
    if keys.ndim != 2 or keys.shape[1] != 2 or keys.dtype != np.uint64:
        raise ValueError(f"keys must be an (n, 2) uint64 array, not {keys.shape} {keys.dtype}")
    n = len(keys)
    sz = np.asarray(sizes)
    tr = np.broadcast_to(np.asarray(tiers), (n,))
    if sz.shape != (n,):
        raise ValueError(f"{sz.shape} sizes for {n} keys")
    if n and (sz.min() < 0 or sz.max() > MAX_SIZE or tr.min() < 0 or tr.max() > MAX_TIER):
        raise ValueError("a size or a tier is out of range")
    metas = _meta(node, tr.astype(np.uint64), sz.astype(np.uint64))
    k0 = keys[:, 0]
    k1 = keys[:, 1]
    s = np.sort(k0)
    if not np.any(s[1:] == s[:-1]):
        return k0, k1, metas
    order = np.lexsort((k1, k0))  # stable: the last of equal keys stays last
    sk0, sk1 = k0[order], k1[order]
    last = np.ones(n, bool)
    last[:-1] = (sk0[1:] != sk0[:-1]) | (sk1[1:] != sk1[:-1])
    order = order[last]
    return k0[order], k1[order], metas[order]
