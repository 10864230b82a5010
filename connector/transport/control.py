"""Control connections of clients that move chunk bytes themselves.

The ``shm`` and ``nixl`` transports copy or RDMA the bytes directly into and
out of the store's arena; what goes over the store's data-plane socket is
only control: ATTACH (where is the arena, which generation), RESERVE and
COMMIT around a write, LEASE and RELEASE around a read, all batched. The
store ties reservations and leases to the connection that took them, so a
connection that saw any error is closed (the store then drops whatever it
held) and never returned to the pool.

COMMITs may be pipelined: :meth:`ControlConnection.send_commit` sends one
without waiting, so the store verifies a chunk's checksum on its own core
while the client copies the next one; :meth:`ControlConnection.finish_commits`
collects the answers in order. Every answer read later is one of the
connection's :class:`~kvdepot.connector.transport.stream.Owed` answers,
as a ``tcp`` stream's late puts are.

A deferring writer's put goes further (:meth:`ControlConnection.commit_late`):
it returns once its COMMIT (a COMMIT|GRANT in granted room) is sent, and the
answer is read by whatever next uses the connection, so the store commits one
put while the writer prepares the next. A :class:`Pipeline` per store keeps
count: a read waits for the answers of every commit sent before it
(read-your-writes), and what the store did not commit is counted lost until
the writer asks.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Sequence

from kvdepot.connector.transport.pipeline import Pipeline
from kvdepot.connector.transport.pool import IdlePool
from kvdepot.connector.transport.stall import Stalls
from kvdepot.connector.transport.stream import Connection, Owed
from kvdepot.errors import InvalidArgument
from kvdepot.keys import ChunkKey
from kvdepot.wire.protocol import (
    LEASE_REPLY_ENTRY,
    MAX_ATTACH_BODY,
    MAX_GRANTED_BYTES,
    RESERVE_REPLY_ENTRY,
    AttachInfo,
    AttachKind,
    CommitEntry,
    ErrorCode,
    GetEntry,
    Header,
    HeaderFlags,
    HeldCode,
    IndexCode,
    LeaseReplyEntry,
    Opcode,
    ProtocolError,
    PutCode,
    PutEntry,
    ReserveReplyEntry,
    index_flags,
    pack_commit_entries,
    pack_get_entries,
    pack_keys,
    pack_lease_ids,
    pack_put_entries,
    recv_exact,
    recv_index_codes,
    recv_reply_header,
    send_all,
    unpack_attach_info,
    unpack_lease_reply_entries,
    unpack_reserve_reply_entries,
    unpack_statuses,
)

logger = logging.getLogger(__name__)

_NO_KEY = ChunkKey(bytes(16))
"""The key of a RESERVE|GRANT entry: the store ignores it."""


class _Release(Owed):
    """The RELEASE_REPLY of ``n`` leases ended without waiting."""

    __slots__ = ("_n",)

    def __init__(self, n: int) -> None:
        self._n = n

    def read(self, sock: socket.socket) -> None:
        recv_reply_header(sock, Opcode.RELEASE_REPLY, self._n)
        recv_exact(sock, self._n)


class _Commit(Owed):
    """The COMMIT_REPLY of a pipelined COMMIT of ``n`` entries, kept for
    :meth:`ControlConnection.finish_commits`."""

    __slots__ = ("codes", "n", "statuses")

    def __init__(self, n: int) -> None:
        self.n = n
        self.statuses: list[PutCode] = []
        self.codes: list[IndexCode] = []

    def read(self, sock: socket.socket) -> None:
        header = recv_reply_header(sock, Opcode.COMMIT_REPLY, self.n)
        self.statuses = unpack_statuses(recv_exact(sock, self.n), PutCode)
        self.codes = recv_index_codes(sock, header)


class _LateCommit(Owed):
    """The answer of a deferring writer's COMMIT, read later: its chunks'
    sizes (those of the grants a COMMIT|GRANT's answer brings), its ticket."""

    __slots__ = ("_pipeline", "_read_granted", "_sizes", "_ticket")

    def __init__(
        self,
        sizes: list[int],
        pipeline: Pipeline,
        read_granted: Callable[[Sequence[int]], tuple[list[PutCode], list[IndexCode]]],
    ) -> None:
        self._sizes = sizes
        self._pipeline = pipeline
        self._ticket = pipeline.sent(len(sizes))
        self._read_granted = read_granted

    def read(self, sock: socket.socket) -> None:
        statuses, codes = self._read_granted(self._sizes)
        self._pipeline.answered(self._ticket, statuses, codes)

    def lost(self) -> None:
        self._pipeline.answered(self._ticket, None)


class ControlConnection(Connection):
    """One attached data-plane connection and the arena it attached to.

    Not thread-safe: a connection is used by one caller at a time (checked
    out of a :class:`ControlPool`). Closing it (after any error) makes the
    store drop what it held; a late commit's answer is never read then, and
    its chunks count as lost.

    Args:
        sock: The connected, attached socket.
        info: What the store answered to ATTACH.
        pipeline: Where commits sent without waiting take their tickets.
    """

    __slots__ = ("_pipeline", "grant_limit", "grants", "info")

    def __init__(
        self, sock: socket.socket, info: AttachInfo, pipeline: Pipeline | None = None
    ) -> None:
        super().__init__(sock)
        self.info = info
        self._pipeline = pipeline or Pipeline()
        # Arena offsets of the room the store granted this connection, by size.
        self.grants: dict[int, list[int]] = {}
        self.grant_limit = MAX_GRANTED_BYTES
        """Largest batch to copy into grants: lowered to what the store
        granted when it refused some (its DRAM is small, or other
        connections hold their share), so later puts reserve at once."""

    def reserve(self, entries: Sequence[PutEntry]) -> list[ReserveReplyEntry]:
        """Reserve room for chunks; OK entries carry their arena offset."""
        return self._reserve(entries, HeaderFlags.NONE)

    def grant(self, sizes: Sequence[int]) -> None:
        """Ask for room of each size ahead of its key (RESERVE|GRANT); what
        the store grants replaces :attr:`grants` (it drops the unused ones)."""
        replies = self._reserve([PutEntry(_NO_KEY, size, 0) for size in sizes], HeaderFlags.GRANT)
        self.grants = {}
        self._add_grants(sizes, replies)
        if any(r.status is not PutCode.OK for r in replies):
            granted = sum(s for s, r in zip(sizes, replies, strict=True) if r.status is PutCode.OK)
            self.grant_limit = min(self.grant_limit, granted)

    def take_grants(self, sizes: Sequence[int]) -> list[int] | None:
        """Arena offsets of a grant for each size (taken from :attr:`grants`),
        or ``None`` (nothing taken) when some size has none left."""
        need: dict[int, int] = {}
        for size in sizes:
            need[size] = need.get(size, 0) + 1
        if any(len(self.grants.get(size, ())) < k for size, k in need.items()):
            return None
        return [self.grants[size].pop() for size in sizes]

    def give_back(self, size: int, offset: int) -> None:
        """Return an unused grant (its copy was not committed)."""
        self.grants.setdefault(size, []).append(offset)

    def commit_granted(
        self,
        entries: Sequence[CommitEntry],
        sizes: Sequence[int],
        index: bool = False,
        writer: int = 0,
    ) -> tuple[list[PutCode], list[IndexCode]]:
        """Commit grants (``entries[i].offset``, of ``sizes[i]`` bytes) as their
        keys, one round trip: per entry its status and index code, as
        :meth:`finish_commits`; the new grants of the answer are kept."""
        self._send_granted(entries, index, writer)
        self.settle()
        return self._read_granted(sizes)

    def commit_late(
        self,
        entries: Sequence[CommitEntry],
        sizes: Sequence[int],
        writer: int,
        *,
        granted: bool = True,
    ) -> None:
        """Send a deferring writer's COMMIT (indexed after the answer; of
        ``granted`` room: a COMMIT|GRANT) and return: its answer, with the
        next grants, is read by the next exchange on this connection
        (:meth:`settle`), its outcome counted in the store's :class:`Pipeline`."""
        if granted:
            self._send_granted(entries, True, writer)
        else:
            self._send_commit(entries, True, writer)
        self.owe(_LateCommit(list(sizes), self._pipeline, self._read_granted))

    def _send_granted(self, entries: Sequence[CommitEntry], index: bool, writer: int) -> None:
        flags = index_flags(index, writer) | HeaderFlags.GRANT
        head = Header(Opcode.COMMIT, len(entries), writer, flags).pack()
        send_all(self.sock, [head + pack_commit_entries(entries, granted=True)])

    def _read_granted(self, sizes: Sequence[int]) -> tuple[list[PutCode], list[IndexCode]]:
        n = len(sizes)
        header = recv_reply_header(self.sock, Opcode.COMMIT_REPLY, n)
        statuses = unpack_statuses(recv_exact(self.sock, n), PutCode)
        codes = recv_index_codes(self.sock, header)
        if header.flags & HeaderFlags.GRANT:
            body = recv_exact(self.sock, n * RESERVE_REPLY_ENTRY.size)
            self._add_grants(sizes, unpack_reserve_reply_entries(body))
        return statuses, codes

    def _reserve(self, entries: Sequence[PutEntry], flags: HeaderFlags) -> list[ReserveReplyEntry]:
        n = len(entries)
        head = Header(Opcode.RESERVE, n, flags=int(flags)).pack()
        send_all(self.sock, [head + pack_put_entries(entries)])
        self.settle()
        recv_reply_header(self.sock, Opcode.RESERVE_REPLY, n)
        return unpack_reserve_reply_entries(recv_exact(self.sock, n * RESERVE_REPLY_ENTRY.size))

    def _add_grants(self, sizes: Sequence[int], replies: Sequence[ReserveReplyEntry]) -> None:
        for size, reply in zip(sizes, replies, strict=True):
            if reply.status is PutCode.OK:
                if reply.offset + size > self.info.arena_size:
                    raise ProtocolError(ErrorCode.MALFORMED, "grant outside the arena")
                self.grants.setdefault(size, []).append(reply.offset)

    def send_commit(
        self, entries: Sequence[CommitEntry], index: bool = False, writer: int = 0
    ) -> None:
        """Ask the store to verify and commit chunks (``index``: and to commit
        them into the cluster's index then, after answering where a
        ``writer`` token is given); the answer is read later."""
        self._send_commit(entries, index, writer)
        self.owe(_Commit(len(entries)))

    def _send_commit(self, entries: Sequence[CommitEntry], index: bool, writer: int) -> None:
        head = Header(Opcode.COMMIT, len(entries), writer, index_flags(index, writer)).pack()
        send_all(self.sock, [head + pack_commit_entries(entries)])

    def finish_commits(self, counts: Sequence[int]) -> tuple[list[PutCode], list[IndexCode]]:
        """Read the answers of the COMMITs sent, of ``counts[i]`` entries each:
        per entry its status and index code (NOT_INDEXED where the store sent none)."""
        commits = [o for o in self.owed() if isinstance(o, _Commit)]
        if [c.n for c in commits] != list(counts):
            raise InvalidArgument(
                f"COMMIT answers of {list(counts)} entries expected, "
                f"{[c.n for c in commits]} in flight"
            )
        self.settle()
        statuses: list[PutCode] = []
        codes: list[IndexCode] = []
        for c in commits:
            statuses.extend(c.statuses)
            codes.extend(c.codes)
        return statuses, codes

    def abort(self, keys: Sequence[ChunkKey]) -> list[HeldCode]:
        """Revoke reservations this connection holds."""
        n = len(keys)
        send_all(self.sock, [Header(Opcode.ABORT, n).pack() + pack_keys(keys)])
        self.settle()
        recv_reply_header(self.sock, Opcode.ABORT_REPLY, n)
        return unpack_statuses(recv_exact(self.sock, n), HeldCode)

    def lease(self, entries: Sequence[GetEntry]) -> list[LeaseReplyEntry]:
        """Lease chunks (or ranges); OK entries say where their bytes are."""
        n = len(entries)
        send_all(self.sock, [Header(Opcode.LEASE, n).pack() + pack_get_entries(entries)])
        self.settle()
        recv_reply_header(self.sock, Opcode.LEASE_REPLY, n)
        return unpack_lease_reply_entries(recv_exact(self.sock, n * LEASE_REPLY_ENTRY.size))

    def release(self, lease_ids: Sequence[int]) -> list[HeldCode]:
        """End leases this connection holds."""
        n = len(lease_ids)
        if not n:
            return []
        send_all(self.sock, [Header(Opcode.RELEASE, n).pack() + pack_lease_ids(lease_ids)])
        self.settle()
        recv_reply_header(self.sock, Opcode.RELEASE_REPLY, n)
        return unpack_statuses(recv_exact(self.sock, n), HeldCode)

    def release_later(self, lease_ids: Sequence[int]) -> None:
        """End leases without waiting for the answer (read by the next exchange).

        The store ends them as soon as the request arrives; the caller only
        skips a round trip. Answers are in request order, so whichever
        exchange comes next reads this one's first (:meth:`settle`).
        """
        n = len(lease_ids)
        if n:
            send_all(self.sock, [Header(Opcode.RELEASE, n).pack() + pack_lease_ids(lease_ids)])
            self.owe(_Release(n))


def attach(sock: socket.socket, kind: AttachKind) -> AttachInfo:
    """Send ATTACH on a fresh connection and parse what the store answers.

    Raises:
        ProtocolError: The store answered ERROR or something unparsable.
        Unavailable: The connection failed.
    """
    send_all(sock, [Header(Opcode.ATTACH, 0, int(kind)).pack()])
    header = recv_reply_header(sock, Opcode.ATTACH_REPLY, None)
    if header.count > MAX_ATTACH_BODY:
        raise ProtocolError(ErrorCode.MALFORMED, f"ATTACH_REPLY of {header.count} bytes")
    return unpack_attach_info(recv_exact(sock, header.count))


class ControlPool(IdlePool[ControlConnection]):
    """Idle attached connections per store; those in use belong to their caller.

    Args:
        kind: What the connections attach as (SHM, NIXL, or PROBE).
        connect_timeout_s: Time allowed to establish a connection.
        io_timeout_s: Time a control exchange may stall.
        max_idle: Idle connections kept per store.
        token: Proven to the store on each new connection (when it has one).
        stalls: Stores that stopped answering (see
            :class:`~kvdepot.connector.transport.pool.IdlePool`).
    """

    def __init__(
        self,
        kind: AttachKind,
        connect_timeout_s: float,
        io_timeout_s: float,
        max_idle: int = 4,
        token: str = "",
        stalls: Stalls | None = None,
    ) -> None:
        super().__init__(connect_timeout_s, io_timeout_s, max_idle, token, stalls)
        self._kind = kind

    def checkout(self, address: str) -> ControlConnection:
        """An attached connection to ``address`` (a pooled one if it is still alive).

        Raises:
            Stalled: The store stopped answering before.
            Unavailable: The store cannot be reached or did not attach.
            ProtocolError: The store answered something unparsable.
        """
        conn = self._reuse(address)
        if conn is not None:
            return conn
        sock = self._connect(address)
        try:
            return ControlConnection(sock, attach(sock, self._kind), self.pipeline(address))
        except BaseException as exc:
            sock.close()
            self.stalls.record(address, exc)
            raise

    def drop(self, address: str) -> None:
        """Close the idle connections to ``address`` (its store restarted)."""
        with self._lock:
            idle = self._idle.pop(address, [])
        for conn in idle:
            conn.close()
