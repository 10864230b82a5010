"""The store's committed keys by digest bucket, with their digest (see :mod:`kvdepot.wire.digest`).

The chunk table keeps one :class:`Inventory` under its lock and tells it
every key that becomes committed and every committed key that leaves, so
that the digest a heartbeat carries is always the table's, at a constant
cost a key (about a microsecond), and the keys of one bucket can be listed
without walking the whole table: a bucket holds 1/4096 of the chunks.
"""

from __future__ import annotations

import numpy as np

from kvdepot.keys import ChunkKey
from kvdepot.wire.digest import BUCKETS, I64, MASK, U64, key_bucket, key_hash


class Inventory:
    """Committed keys per bucket, each bucket's hash sum, and the totals.

    Not thread-safe: the caller holds the table's lock.
    """

    __slots__ = ("_keys", "_sums", "count", "total")

    def __init__(self) -> None:
        self._keys: list[set[ChunkKey]] = [set() for _ in range(BUCKETS)]
        self._sums = [0] * BUCKETS
        self.count = 0
        self.total = 0

    def add(self, key: ChunkKey) -> None:
        """A key became committed (a key counted already changes nothing)."""
        b = key[0] << 4 | key[1] >> 4
        keys = self._keys[b]
        if key in keys:
            return
        keys.add(key)
        h = key_hash(key)
        self._sums[b] = (self._sums[b] + h) & MASK
        self.total = (self.total + h) & MASK
        self.count += 1

    def remove(self, key: ChunkKey) -> None:
        """A committed key left (a key not counted changes nothing)."""
        b = key_bucket(key)
        keys = self._keys[b]
        if key not in keys:
            return
        keys.remove(key)
        h = key_hash(key)
        self._sums[b] = (self._sums[b] - h) & MASK
        self.total = (self.total - h) & MASK
        self.count -= 1

    def clear(self) -> None:
        for keys in self._keys:
            keys.clear()
        self._sums = [0] * BUCKETS
        self.count = self.total = 0

    def cells(self) -> tuple[I64, U64]:
        """Counts and sums of every bucket (copies)."""
        counts = np.fromiter(map(len, self._keys), dtype=np.int64, count=BUCKETS)
        return counts, np.array(self._sums, dtype=np.uint64)

    def bucket(self, b: int) -> list[ChunkKey]:
        """The keys of bucket ``b`` (a copy)."""
        return list(self._keys[b])

    def bucket_size(self, b: int) -> int:
        return len(self._keys[b])
