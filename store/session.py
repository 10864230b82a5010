"""Reservations and read leases held by one data-plane connection.

Clients of the ``shm`` and ``nixl`` transports move chunk bytes themselves:
they reserve room in the arena, write it through their own mapping (or an
RDMA WRITE), then ask the store to commit; they lease a chunk, read it, then
release it. A :class:`Session` is what one connection holds between those
steps. It belongs to the connection: when the connection closes, cleanly or
because the client died, :meth:`Session.close` revokes every reservation and
releases every lease, so a dead client never leaks arena memory nor pins
chunks against eviction.

Commit is where the store checks the client's work: it hashes the reserved
bytes and commits only if they match the checksum the writer announced, so
the checksum is verified end to end whichever way the bytes came in.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

from kvdepot.errors import CapacityExceeded, InvalidArgument
from kvdepot.keys import ChunkKey
from kvdepot.rpc.auth import tenant_key
from kvdepot.store.chunks import ChunkStore, ReadLease, Reservation, checksum
from kvdepot.wire.protocol import (
    MAX_GRANTED_BYTES,
    AttachKind,
    CommitEntry,
    ErrorCode,
    GetCode,
    GetEntry,
    HeldCode,
    LeaseReplyEntry,
    ProtocolError,
    PutCode,
    PutEntry,
    ReserveReplyEntry,
)

logger = logging.getLogger(__name__)

HeldListener = Callable[[int], None]
"""Told the change in items a session of kind NIXL holds (+n, -n)."""


CONNECTION_GRANT_DIVISOR = 32
"""A connection's grants are at most 1/32 of DRAM (but ``MIN_CONNECTION_GRANT`` at least)."""

MIN_CONNECTION_GRANT = 8 << 20
"""What a connection may hold in grants on the smallest stores."""

STORE_GRANT_DIVISOR = 4
"""Grants of all connections together are at most 1/4 of DRAM."""


class GrantBudget:
    """What a store's ``shm`` connections may hold in grants: each at most
    ``MAX_GRANTED_BYTES`` and 1/32 of DRAM (8 MiB at least), all together a
    quarter of DRAM. Room granted ahead of any key is taken from the cache:
    an idle connection keeps the room of its last batch, so on a small
    store a few idle writers must not hold most of it.

    Thread-safe: the data-plane threads of all connections share one.

    Args:
        capacity: The store's DRAM bytes.
    """

    def __init__(self, capacity: int) -> None:
        share = capacity // CONNECTION_GRANT_DIVISOR
        self.per_connection = min(MAX_GRANTED_BYTES, max(MIN_CONNECTION_GRANT, share))
        self._total = capacity // STORE_GRANT_DIVISOR
        self._held = 0
        self._lock = threading.Lock()

    def take(self, size: int) -> bool:
        """Count ``size`` more bytes granted, if the store-wide share allows."""
        with self._lock:
            if self._held + size > self._total:
                return False
            self._held += size
            return True

    def give(self, size: int) -> None:
        """Count ``size`` granted bytes given back (used, freed or dropped)."""
        with self._lock:
            self._held -= size


class Session:
    """What one connection holds on behalf of a client that moves bytes itself.

    Not thread-safe: one connection's requests are handled one at a time by
    its own thread.

    Args:
        chunks: The chunk table.
        max_held: Most reservations plus leases held at once; a request that
            would exceed it is a protocol error (the connection is closed).
        on_held: Told the change in the number of held items of sessions
            that attached as NIXL (the store's NIXL agent progresses UCX
            while remote transfers may be in flight).
        verify_shm_commits: Hash again what a same-host (``shm``) client
            copied before committing it. Off, the checksum that client took
            of its source as it copied it is recorded as it is: every reader
            verifies it, so a wrong one (or a source changed during the copy)
            is a miss, never wrong data, and the put saves a pass over memory.
            NIXL writes are always verified (the writer never sees the arena).
        grants: The store's grant budget, shared by its connections (by
            default one of this connection's own).
    """

    def __init__(
        self,
        chunks: ChunkStore,
        max_held: int,
        on_held: HeldListener | None = None,
        *,
        verify_shm_commits: bool = False,
        grants: GrantBudget | None = None,
    ) -> None:
        self._chunks = chunks
        self._budget = grants if grants is not None else GrantBudget(chunks.capacity)
        self._verify_shm = verify_shm_commits
        self._max_held = max_held
        self._on_held = on_held
        self._reservations: dict[ChunkKey, Reservation] = {}
        # Room granted ahead of its key (see grant), by arena offset, each
        # under a placeholder key: a random prefix of this connection's and a
        # count (one urandom call per put cost 10 us each).
        self._grants: dict[int, Reservation] = {}
        self._granted_bytes = 0
        self._placeholder = os.urandom(8)
        self._placeholders = itertools.count()
        self._leases: dict[int, ReadLease] = {}
        self._next_lease = 1
        self.kind = AttachKind.PROBE
        self.held_since: float | None = None
        """When the connection last went from holding nothing to holding something."""
        self.tenant = ""
        """The tenant the connection authenticated as ("" for the cluster token or none)."""

    def key(self, key: ChunkKey) -> ChunkKey:
        """Where ``key`` lives for this connection: a tenant's keys are its own."""
        return ChunkKey(tenant_key(self.tenant, key)) if self.tenant else key

    @property
    def granted(self) -> bool:
        """Whether the connection holds grants (its client may be copying into them)."""
        return bool(self._grants)

    @property
    def held(self) -> int:
        """Reservations plus leases held now."""
        return len(self._reservations) + len(self._leases)

    def attach(self, kind: AttachKind) -> None:
        """Record how the client means to move bytes (counts only for NIXL)."""
        if kind is not self.kind:
            held = self.held
            self._notify(-held)
            self.kind = kind
            self._notify(held)

    def _notify(self, delta: int) -> None:
        # Every change of what is held passes here: track since when anything is.
        if not self.held:
            self.held_since = None
        elif self.held_since is None:
            self.held_since = time.monotonic()
        if delta and self._on_held is not None and self.kind is AttachKind.NIXL:
            self._on_held(delta)

    def _check_room(self, n: int) -> None:
        if self.held + n > self._max_held:
            raise ProtocolError(
                ErrorCode.LIMIT_EXCEEDED,
                f"connection would hold {self.held + n} reservations and leases, "
                f"above the limit of {self._max_held}",
            )

    # -- writes -------------------------------------------------------------------
    def reserve(self, entries: Sequence[PutEntry]) -> list[ReserveReplyEntry]:
        """Reserve room for each chunk; the client writes it at the offset returned.

        Raises:
            ProtocolError: The connection would hold too many items.
        """
        self._check_room(len(entries))
        out: list[ReserveReplyEntry] = []
        added = 0
        for e in entries:
            if e.size == 0:
                out.append(ReserveReplyEntry(PutCode.INVALID))
                continue
            res = self._reserve(self.key(e.key), e.size, e.checksum)
            if isinstance(res, PutCode):
                out.append(ReserveReplyEntry(res))
                continue
            self._reservations[e.key] = res
            added += 1
            out.append(ReserveReplyEntry(PutCode.OK, res.offset))
        self._notify(added)
        return out

    def _reserve(self, key: ChunkKey, size: int, checksum: int) -> Reservation | PutCode:
        """A reservation, or why none: NO_SPACE, INVALID, or EXISTS (the key
        is stored or being written)."""
        try:
            res = self._chunks.reserve(key, size, checksum)
        except CapacityExceeded:
            return PutCode.NO_SPACE
        except InvalidArgument:
            return PutCode.INVALID
        return PutCode.EXISTS if res is None else res

    def commit(self, entries: Sequence[CommitEntry]) -> list[tuple[PutCode, int]]:
        """Verify and commit reserved chunks.

        Returns:
            Per chunk its size (0 if unknown) and OK (committed), CORRUPT (its
            bytes do not match the checksum: revoked, never visible) or
            INVALID (not reserved on this connection).
        """
        out: list[tuple[PutCode, int]] = []
        dropped = 0
        verify = self._verify_shm or self.kind is not AttachKind.SHM
        for e in entries:
            res = self._reservations.pop(e.key, None)
            if res is None:
                out.append((PutCode.INVALID, 0))
                continue
            dropped += 1
            if verify and checksum(res.view) != e.checksum:
                self._chunks.revoke(res)
                out.append((PutCode.CORRUPT, res.size))
                continue
            try:
                self._chunks.commit(res, e.checksum)
            except InvalidArgument:
                out.append((PutCode.INVALID, res.size))
                continue
            out.append((PutCode.OK, res.size))
        self._notify(-dropped)
        return out

    # -- grants: room ahead of its key, for one-round-trip shm puts ---------------
    def grant(self, sizes: Sequence[int], *, replace: bool = False) -> list[ReserveReplyEntry]:
        """Grant room for each size, under a placeholder key no reader knows.

        Only ``shm`` connections are granted room (NIXL writers are remote:
        a grant's safety rests on the client's death closing the socket), at
        most what the store's :class:`GrantBudget` allows; beyond that an
        entry is NO_SPACE and the client reserves by key as before.

        Args:
            sizes: One size per grant asked for.
            replace: Drop the connection's unused grants first.
        """
        if replace:
            self._drop_grants()
        out: list[ReserveReplyEntry] = []
        for size in sizes:
            if self.kind is not AttachKind.SHM or size <= 0:
                out.append(ReserveReplyEntry(PutCode.INVALID))
                continue
            over = self._granted_bytes + size > self._budget.per_connection
            if over or not self._budget.take(size):
                out.append(ReserveReplyEntry(PutCode.NO_SPACE))
                continue
            name = self._placeholder + next(self._placeholders).to_bytes(8, "little")
            res = self._reserve(ChunkKey(name), size, 0)
            if isinstance(res, PutCode):
                self._budget.give(size)
                # EXISTS: a chunk stored under a placeholder key (2**-64).
                out.append(ReserveReplyEntry(PutCode.NO_SPACE if res is PutCode.EXISTS else res))
                continue
            self._grants[res.offset] = res
            self._granted_bytes += size
            out.append(ReserveReplyEntry(PutCode.OK, res.offset))
        return out

    def commit_granted(self, entries: Sequence[CommitEntry]) -> list[tuple[PutCode, int]]:
        """Commit each grant (``entry.offset``) as chunk ``entry.key``.

        Returns:
            Per chunk its size (0 if unknown) and OK, EXISTS (the key was
            stored already: the grant is freed), CORRUPT (the bytes do not
            match the checksum: freed, never visible) or INVALID (no grant
            of this connection at that offset).
        """
        out: list[tuple[PutCode, int]] = []
        for e in entries:
            res = self._grants.pop(e.offset, None)
            if res is None:
                out.append((PutCode.INVALID, 0))
                continue
            self._granted_bytes -= res.size
            self._budget.give(res.size)
            if self._verify_shm and checksum(res.view) != e.checksum:
                self._chunks.revoke(res)
                out.append((PutCode.CORRUPT, res.size))
                continue
            try:
                stored = self._chunks.commit(res, e.checksum, key=self.key(e.key))
            except InvalidArgument:
                self._chunks.revoke(res)
                out.append((PutCode.INVALID, res.size))
                continue
            out.append((PutCode.OK if stored else PutCode.EXISTS, res.size))
        return out

    def _drop_grants(self) -> None:
        for res in self._grants.values():
            self._chunks.revoke(res)
        self._grants.clear()
        self._budget.give(self._granted_bytes)
        self._granted_bytes = 0

    def abort(self, keys: Sequence[ChunkKey]) -> list[HeldCode]:
        """Revoke reservations of this connection (a client that gave up on them)."""
        out: list[HeldCode] = []
        for key in keys:
            res = self._reservations.pop(key, None)
            if res is None:
                out.append(HeldCode.NOT_HELD)
                continue
            self._chunks.revoke(res)
            self._notify(-1)
            out.append(HeldCode.OK)
        return out

    # -- reads --------------------------------------------------------------------
    def lease(self, entries: Sequence[GetEntry]) -> list[LeaseReplyEntry]:
        """Lease each chunk (or range of it): it stays put until released.

        Raises:
            ProtocolError: The connection would hold too many items.
        """
        self._check_room(len(entries))
        out: list[LeaseReplyEntry] = []
        added = 0
        # These clients read the arena themselves: a chunk in another tier
        # is promoted into DRAM first (or is a miss).
        acquired = self._chunks.acquire_many(
            [self.key(e.key) for e in entries],
            in_arena=True,
            # A range past a chunk's start continues a read counted at its first.
            continued=[e.offset > 0 for e in entries],
        )
        for e, lease in zip(entries, acquired, strict=True):
            if lease is None:
                out.append(LeaseReplyEntry(GetCode.NOT_FOUND))
                continue
            size = lease.size
            length = e.length or size - e.offset
            if e.offset >= size or length <= 0 or e.offset + length > size:
                self._chunks.release(lease)
                out.append(LeaseReplyEntry(GetCode.INVALID))
                continue
            if length == size:
                ck = lease.checksum
            else:
                ck = checksum(lease.view[e.offset : e.offset + length])
            lease_id = self._next_lease
            self._next_lease += 1
            self._leases[lease_id] = lease
            added += 1
            out.append(LeaseReplyEntry(GetCode.OK, lease_id, lease.offset + e.offset, length, ck))
        self._notify(added)
        return out

    def release(self, lease_ids: Sequence[int]) -> list[HeldCode]:
        """End leases of this connection."""
        out: list[HeldCode] = []
        for lease_id in lease_ids:
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                out.append(HeldCode.NOT_HELD)
                continue
            self._chunks.release(lease)
            self._notify(-1)
            out.append(HeldCode.OK)
        return out

    def close(self) -> None:
        """Revoke every reservation and release every lease still held."""
        held = self.held
        if held:
            logger.debug(
                "closing a session holding %d reservations and %d leases",
                len(self._reservations),
                len(self._leases),
            )
        for res in self._reservations.values():
            self._chunks.revoke(res)
        self._drop_grants()
        for lease in self._leases.values():
            self._chunks.release(lease)
        self._reservations.clear()
        self._leases.clear()
        self._notify(-held)
