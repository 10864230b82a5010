"""The inventory digest: what a store and the index compare to agree on a node's chunks.

Every chunk key has a *bucket*, its first 12 bits (:func:`key_bucket`: 4096
buckets, in 64 *groups* of 64), and a 64-bit hash (:func:`key_hash`: the
splitmix64 finaliser over its two little-endian words, so that keys that are
not random, as in tests, spread as well). The digest of a set of keys is, per
bucket, a *cell*: how many keys it has and the sum of their hashes modulo
2^64. A sum does not depend on order, and both sides keep it up to date one
key at a time (add its hash when a key comes, subtract it when it goes) at a
constant cost; a group's cell and the whole set's are the sums of their
buckets' cells. Two sets with equal cells are equal but with a probability of
about 2^-64 per comparison.

On the wire a cell is 16 bytes: the count, then the sum (as two's
complement), each a big-endian int64: the layout Redis's ``BITFIELD`` keeps
``i64`` fields in, so that the Redis index compares cells as strings.

Both sides must compute exactly this: it is part of the control plane's wire
(``HeartbeatRequest.held``, ``ReconcileDigests``, ``ReconcileBuckets``).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

BUCKET_BITS = 12
BUCKETS = 1 << BUCKET_BITS
"""Buckets of a digest: a key's first 12 bits."""
GROUP_BUCKETS = 64
GROUPS = BUCKETS // GROUP_BUCKETS
"""Groups of a digest, each of 64 consecutive buckets."""
CELL_BYTES = 16
"""A cell on the wire: count and sum, each a big-endian int64."""
MASK = (1 << 64) - 1

_G = 0x9E3779B97F4A7C15
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]


def key_bucket(key: bytes) -> int:
    """The key's bucket: its first 12 bits."""
    return key[0] << 4 | key[1] >> 4


def bucket_k0(bucket: int) -> tuple[int, int]:
    """(value, mask) of the bits of a key's first little-endian word that make
    its bucket: ``k0 & mask == value`` for exactly the keys of ``bucket``."""
    return bucket >> 4 | (bucket & 0xF) << 12, 0xF0FF


def key_hash(key: bytes) -> int:
    """The key's 64-bit hash (unsigned)."""
    k0 = int.from_bytes(key[:8], "little")
    k1 = int.from_bytes(key[8:16], "little")
    x = k0 ^ ((k1 * _G) & MASK)
    x = ((x ^ (x >> 30)) * _C1) & MASK
    x = ((x ^ (x >> 27)) * _C2) & MASK
    return x ^ (x >> 31)


def words(keys: bytes) -> U64:
    """``n`` concatenated 16-byte keys as an ``(n, 2)`` array of little-endian words."""
    return np.frombuffer(keys, dtype="<u8").reshape(-1, 2).astype(np.uint64, copy=False)


def buckets_of(w: U64) -> I64:
    """:func:`key_bucket` of each key of ``w`` (from :func:`words`)."""
    k0 = w[:, 0]
    return (
        ((k0 & np.uint64(0xFF)) << np.uint64(4)) | ((k0 >> np.uint64(12)) & np.uint64(0xF))
    ).astype(np.int64)


def hashes_of(w: U64) -> U64:
    """:func:`key_hash` of each key of ``w`` (from :func:`words`)."""
    k0, k1 = w[:, 0], w[:, 1]
    with np.errstate(over="ignore"):
        x = k0 ^ (k1 * np.uint64(_G))
        x = (x ^ (x >> np.uint64(30))) * np.uint64(_C1)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(_C2)
        out: U64 = x ^ (x >> np.uint64(31))
    return out


def signed(v: int) -> int:
    """An unsigned 64-bit value as the int64 of the same bits."""
    v &= MASK
    return v - (1 << 64) if v >> 63 else v


def pack_cells(counts: I64 | list[int], sums: U64 | list[int]) -> bytes:
    """Cells on the wire (:data:`CELL_BYTES` each), in order."""
    c = np.asarray(counts, dtype=np.int64)
    s = np.asarray(sums, dtype=np.uint64)
    out = np.empty((len(c), 2), dtype=">i8")
    out[:, 0] = c
    out[:, 1] = s.view(np.int64)
    return out.tobytes()


def unpack_cells(raw: bytes) -> tuple[I64, U64]:
    """Counts and sums of cells on the wire.

    Raises:
        ValueError: ``raw`` is not a whole number of cells.
    """
    if len(raw) % CELL_BYTES:
        raise ValueError(f"{len(raw)} bytes of digest cells: not {CELL_BYTES} bytes each")
    arr = np.frombuffer(raw, dtype=">i8").reshape(-1, 2)
    return arr[:, 0].astype(np.int64), arr[:, 1].astype(np.int64).view(np.uint64)


def group_cells(counts: I64, sums: U64) -> tuple[I64, U64]:
    """The 64 groups' cells from the 4096 buckets'."""
    c = counts.reshape(GROUPS, GROUP_BUCKETS).sum(axis=1, dtype=np.int64)
    with np.errstate(over="ignore"):
        s = sums.reshape(GROUPS, GROUP_BUCKETS).sum(axis=1, dtype=np.uint64)
    return c, s


def differing_groups(mine: bytes, theirs: bytes) -> list[int]:
    """The groups whose cells differ between two packed group digests."""
    a = np.frombuffer(mine, dtype=np.uint8).reshape(GROUPS, CELL_BYTES)
    b = np.frombuffer(theirs, dtype=np.uint8).reshape(GROUPS, CELL_BYTES)
    out: list[int] = np.flatnonzero((a != b).any(axis=1)).tolist()
    return out


def key_set(w: U64) -> set[bytes]:
    """The keys of ``w`` (from :func:`words`) as a set of 16-byte strings."""
    raw = np.ascontiguousarray(w, dtype="<u8").tobytes()
    return {raw[i : i + 16] for i in range(0, len(raw), 16)}


def digest_of(keys: bytes) -> tuple[int, int]:
    """(count, sum) of a set of distinct keys, 16 bytes each, concatenated."""
    w = words(keys)
    with np.errstate(over="ignore"):
        return len(w), int(hashes_of(w).sum(dtype=np.uint64))


GROUP_CELL = 2
"""Where a digest is one array of int64 (as the Redis index keeps it): the
whole set's count and sum, then each group's, then each bucket's. The first
group's count is at this index, ..."""
BUCKET_CELL = GROUP_CELL + 2 * GROUPS
"""... and the first bucket's count at this one."""
FLAT_CELLS = BUCKET_CELL + 2 * BUCKETS


class Cells:
    """A set's digest, bucket by bucket, kept up to date in place (numpy).

    Attributes:
        counts: Keys per bucket.
        sums: Sum of the keys' hashes per bucket, modulo 2^64.
        count: Keys in all.
        total: Sum of all the keys' hashes, modulo 2^64.
    """

    __slots__ = ("count", "counts", "sums", "total")

    def __init__(self) -> None:
        self.counts: I64 = np.zeros(BUCKETS, dtype=np.int64)
        self.sums: U64 = np.zeros(BUCKETS, dtype=np.uint64)
        self.count = 0
        self.total = 0

    def add(self, key: bytes, sign: int = 1) -> None:
        """Count one key in (``sign`` 1) or out (-1)."""
        b, h = key_bucket(key), key_hash(key)
        self.counts[b] += sign
        self.sums[b] = (int(self.sums[b]) + sign * h) & MASK
        self.count += sign
        self.total = (self.total + sign * h) & MASK

    def add_words(self, w: U64, sign: int = 1) -> None:
        """Count distinct keys in (``sign`` 1) or out (-1), as :func:`words`."""
        if not len(w):
            return
        b, h = buckets_of(w), hashes_of(w)
        np.add.at(self.counts, b, sign)
        with np.errstate(over="ignore"):
            if sign > 0:
                np.add.at(self.sums, b, h)
            else:
                np.subtract.at(self.sums, b, h)
            part = int(h.sum(dtype=np.uint64))
        self.count += sign * len(w)
        self.total = (self.total + sign * part) & MASK

    def groups(self) -> bytes:
        """The 64 groups' cells, packed."""
        return pack_cells(*group_cells(self.counts, self.sums))

    def buckets(self, groups: list[int]) -> bytes:
        """The cells of every bucket of ``groups``, group after group, packed."""
        idx = (
            np.asarray(groups, dtype=np.int64)[:, None] * GROUP_BUCKETS + np.arange(GROUP_BUCKETS)
        ).ravel()
        return pack_cells(self.counts[idx], self.sums[idx])

    def cell(self, bucket: int) -> tuple[int, int]:
        return int(self.counts[bucket]), int(self.sums[bucket])

    def merge(self, other: Cells) -> None:
        """Add another digest's cells (of keys not counted here) to these."""
        self.counts += other.counts
        with np.errstate(over="ignore"):
            self.sums += other.sums
        self.count += other.count
        self.total = (self.total + other.total) & MASK


def flat_deltas(cells: Cells | None) -> list[int]:
    """The changes ``cells`` make to a flat digest (:data:`GROUP_CELL`), as
    (index, signed delta) pairs, flattened; cells that do not change are left out."""
    if cells is None:
        return []
    out: list[int] = []
    gc, gs = group_cells(cells.counts, cells.sums)
    for first, counts, sums in ((BUCKET_CELL, cells.counts, cells.sums), (GROUP_CELL, gc, gs)):
        for i in np.flatnonzero((counts != 0) | (sums != 0)).tolist():
            out += [first + 2 * i, int(counts[i]), first + 2 * i + 1, signed(int(sums[i]))]
    if cells.count or cells.total:
        out += [0, cells.count, 1, signed(cells.total)]
    return out
