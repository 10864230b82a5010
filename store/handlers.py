"""What the ``tcp`` data plane answers: one request at a time, on its connection.

:class:`~kvdepot.store.dataplane.DataPlaneServer` accepts connections, reads
each request's header under its deadlines and hands it here: PUT (received
straight into the arena, committed only once every payload arrived and
matched its checksum), GET (leased chunks sent in one vector), DELETE, PING,
and the control messages of clients that move the bytes themselves (``shm``,
``nixl``: ATTACH, RESERVE, COMMIT, ABORT, LEASE, RELEASE), whose reservations
and leases belong to the connection's :class:`~kvdepot.store.session.Session`.
"""

from __future__ import annotations

import socket
from collections.abc import Callable

from kvdepot.errors import CapacityExceeded, InvalidArgument, Unavailable
from kvdepot.keys import KEY_BYTES, ChunkKey
from kvdepot.store.chunks import ChunkStore, ReadLease, Reservation, checksum
from kvdepot.store.indexer import Indexer
from kvdepot.store.session import Session
from kvdepot.store.watchdog import RequestWatchdog
from kvdepot.wire.protocol import (
    CHECKSUM,
    COMMIT_ENTRY,
    GET_ENTRY,
    GET_REPLY_ENTRY,
    GRANTED_COMMIT_ENTRY,
    LEASE_ID,
    PUT_ENTRY,
    AttachInfo,
    AttachKind,
    DeleteCode,
    ErrorCode,
    GetCode,
    Header,
    HeaderFlags,
    IndexCode,
    IndexSettled,
    Opcode,
    ProtocolError,
    ProtocolLimits,
    PutCode,
    PutEntry,
    drain,
    pack_lease_reply_entries,
    pack_reserve_reply_entries,
    recv_exact,
    recv_exact_into,
    recv_hashed_into,
    send_all,
    unpack_commit_entries,
    unpack_get_entries,
    unpack_get_rows,
    unpack_keys,
    unpack_lease_ids,
    unpack_put_entries,
)

_NOT_FOUND = GET_REPLY_ENTRY.pack(GetCode.NOT_FOUND, 0, 0)
_INVALID = GET_REPLY_ENTRY.pack(GetCode.INVALID, 0, 0)

_SESSION_OPS = frozenset(
    {
        Opcode.ATTACH,
        Opcode.RESERVE,
        Opcode.COMMIT,
        Opcode.ABORT,
        Opcode.LEASE,
        Opcode.RELEASE,
    }
)


class ReplyFailed(Unavailable):
    """Sending a reply failed: the peer left; not a protocol violation."""


class RequestHandlers:
    """Answers the requests of a data plane server's connections.

    Args:
        chunks: The chunk table served.
        limits: Bounds checked on every request before anything is reserved.
        watchdog: The server's request deadlines (re-armed per reply size).
        count: Adds to the server's counters (:class:`DataPlaneStats` names).
        attach_info: What ATTACH answers now.
        index: Commits chunks into the cluster's index for writers that ask
            (``HeaderFlags.INDEX``, with ``DEFER`` after the reply), after the
            store committed them; ``None`` (a data plane without a daemon)
            indexes nothing.
    """

    def __init__(
        self,
        chunks: ChunkStore,
        limits: ProtocolLimits,
        watchdog: RequestWatchdog,
        count: Callable[..., None],
        attach_info: Callable[[], AttachInfo],
        index: Indexer | None = None,
    ) -> None:
        self._index = index
        self._chunks = chunks
        self._limits = limits
        self._watchdog = watchdog
        self._count = count
        self._attach_info = attach_info

    def dispatch(self, conn: socket.socket, header: Header, session: Session) -> None:
        """Answer one request whose header was read (its body is still to read)."""
        op = header.opcode
        if op is Opcode.PUT:
            self._handle_put(conn, self._checked_count(header), session, header, trailed=False)
        elif op is Opcode.PUT_TRAILED:
            self._handle_put(conn, self._checked_count(header), session, header, trailed=True)
        elif op in _SESSION_OPS:
            self._handle_session(conn, header, session)
        elif op is Opcode.GET:
            self._handle_get(conn, self._checked_count(header), session)
        elif op is Opcode.DELETE:
            self._handle_delete(conn, self._checked_count(header), session)
        elif op is Opcode.PING:
            if header.count:
                raise ProtocolError(ErrorCode.MALFORMED, f"PING with count {header.count}")
            self._reply(conn, [Header(Opcode.PONG, 0, header.aux).pack()])
        elif op is Opcode.SYNC:
            self._handle_sync(conn, header, session)
        else:
            raise ProtocolError(ErrorCode.BAD_OPCODE, f"{op.name} is not a request")

    def _checked_count(self, header: Header) -> int:
        if header.count > self._limits.max_batch:
            raise ProtocolError(
                ErrorCode.LIMIT_EXCEEDED,
                f"{header.opcode.name} of {header.count} entries is above the limit of "
                f"{self._limits.max_batch}",
            )
        return header.count

    def _reply(self, conn: socket.socket, buffers: list[bytes | bytearray | memoryview]) -> None:
        try:
            send_all(conn, buffers)
        except Unavailable as exc:
            raise ReplyFailed(str(exc)) from exc

    def _indexed(
        self,
        header: Header,
        session: Session,
        statuses: bytes | bytearray,
        keys: list[ChunkKey],
        sizes: list[int],
    ) -> list[bytes | bytearray]:
        """The reply's tail for a request that asked for indexing (``HeaderFlags.INDEX``):
        the chunks it stored (OK) committed into the index, their codes; else nothing."""
        if not header.flags & HeaderFlags.INDEX:
            return []
        codes = bytearray(len(statuses))  # NOT_INDEXED
        stored = [i for i, st in enumerate(statuses) if st == PutCode.OK]
        index = self._index
        if not stored or index is None:
            return [codes]
        # Only after the store's own commit: a lookup never names a chunk
        # that cannot be read here.
        skeys, ssizes = [keys[i] for i in stored], [sizes[i] for i in stored]
        if (
            header.flags & HeaderFlags.DEFER
            and header.aux
            and index.defer((session.tenant, header.aux), skeys, ssizes)
        ):
            for i in stored:
                codes[i] = IndexCode.PENDING
            return [codes]
        # Bounded: a stalled index costs the wait, then the writer commits
        # them itself.
        for i, code in zip(stored, index.commit(skeys, ssizes), strict=True):
            codes[i] = code
        return [codes]

    def _handle_sync(self, conn: socket.socket, header: Header, session: Session) -> None:
        # A deferring writer asks what the index did with its chunks.
        self._watchdog.disarm(conn)  # waiting for the index is the store's work
        settled = (
            self._index.sync((session.tenant, header.aux), header.count / 1000)
            if self._index is not None and header.aux
            else IndexSettled()
        )
        body = settled.pack()
        self._reply(conn, [Header(Opcode.SYNC_REPLY, len(body)).pack(), body])

    @staticmethod
    def _put_reply(
        header: Header, n: int, tail: list[bytes | bytearray], granted: bool = False
    ) -> bytes:
        """The header of the answer to a PUT, PUT_TRAILED or COMMIT (``granted``:
        a COMMIT|GRANT, whose last part of ``tail`` is the new grants)."""
        op = Opcode.COMMIT_REPLY if header.opcode is Opcode.COMMIT else Opcode.PUT_REPLY
        flags = HeaderFlags.INDEX if len(tail) > granted else HeaderFlags.NONE
        if granted:
            flags |= HeaderFlags.GRANT
        return Header(op, n, flags=int(flags)).pack()

    def _handle_put(
        self, conn: socket.socket, n: int, session: Session, header: Header, *, trailed: bool
    ) -> None:
        # PUT announces each checksum before the payload, PUT_TRAILED right
        # after it; either way the payload is received straight into its
        # reservation and hashed block by block while it arrives.
        entries = unpack_put_entries(recv_exact(conn, n * PUT_ENTRY.size))
        total = self._check_put_sizes(entries)
        self._watchdog.arm(conn, total + (n * CHECKSUM.size if trailed else 0))
        statuses = bytearray(n)
        pending: list[tuple[Reservation, int]] = []
        trailer = memoryview(bytearray(CHECKSUM.size))
        try:
            for i, e in enumerate(entries):
                res: Reservation | None = None
                code = PutCode.OK
                if e.size == 0:
                    code = PutCode.INVALID
                else:
                    try:
                        res = self._chunks.reserve(session.key(e.key), e.size, e.checksum)
                    except CapacityExceeded:
                        code = PutCode.NO_SPACE
                    except InvalidArgument:
                        code = PutCode.INVALID
                    else:
                        if res is None:
                            code = PutCode.EXISTS
                if res is None:
                    # Into a per-thread scratch buffer: one per connection.
                    drain(conn, e.size + (CHECKSUM.size if trailed else 0))
                    statuses[i] = code
                    continue
                # Registered before receiving, so a failure revokes it.
                pending.append((res, e.checksum))
                got = recv_hashed_into(conn, res.view)
                expected = e.checksum
                if trailed:
                    recv_exact_into(conn, trailer)
                    (expected,) = CHECKSUM.unpack(trailer)
                    pending[-1] = (res, expected)
                if got != expected:
                    pending.pop()
                    self._chunks.revoke(res)
                    code = PutCode.CORRUPT
                statuses[i] = code
            for res, ck in pending:
                self._chunks.commit(res, ck)
        except BaseException:
            # Nothing of a failed request becomes visible; revoking an already
            # committed reservation is a no-op.
            for res, _ in pending:
                self._chunks.revoke(res)
            raise
        self._count_puts(statuses, total)
        tail = self._indexed(
            header,
            session,
            statuses,
            [session.key(e.key) for e in entries],
            [e.size for e in entries],
        )
        self._reply(conn, [self._put_reply(header, n, tail), statuses, *tail])

    def _check_put_sizes(self, entries: list[PutEntry]) -> int:
        limits = self._limits
        total = 0
        for e in entries:
            if e.size > limits.max_chunk_bytes:
                raise ProtocolError(
                    ErrorCode.LIMIT_EXCEEDED,
                    f"chunk of {e.size} bytes is above the limit of {limits.max_chunk_bytes}",
                )
            total += e.size
        if total > limits.max_request_bytes:
            raise ProtocolError(
                ErrorCode.LIMIT_EXCEEDED,
                f"PUT of {total} bytes is above the limit of {limits.max_request_bytes}",
            )
        return total

    def _count_puts(self, statuses: bytes | bytearray, total: int) -> None:
        self._count(
            puts=statuses.count(PutCode.OK),
            bytes_in=total,
            corrupt_puts=statuses.count(PutCode.CORRUPT),
            put_rejected=statuses.count(PutCode.NO_SPACE) + statuses.count(PutCode.INVALID),
        )

    def _handle_session(self, conn: socket.socket, header: Header, session: Session) -> None:
        # Control messages of clients that move the bytes themselves.
        op = header.opcode
        if op is Opcode.ATTACH:
            if header.count:
                raise ProtocolError(ErrorCode.MALFORMED, f"ATTACH with count {header.count}")
            try:
                kind = AttachKind(header.aux)
            except ValueError:
                raise ProtocolError(
                    ErrorCode.MALFORMED, f"ATTACH of unknown kind {header.aux}"
                ) from None
            session.attach(kind)
            info = self._attach_info()
            if session.tenant:
                # The arena holds every tenant's chunks: a tenant never maps it.
                info = AttachInfo(info.generation, info.arena_size, host_id=info.host_id)
            body = info.pack()
            self._reply(conn, [Header(Opcode.ATTACH_REPLY, len(body)).pack(), body])
            return
        n = self._checked_count(header)
        if op is Opcode.RESERVE:
            entries = unpack_put_entries(recv_exact(conn, n * PUT_ENTRY.size))
            self._check_put_sizes(entries)
            reserved = (
                session.grant([e.size for e in entries], replace=True)
                if header.flags & HeaderFlags.GRANT
                else session.reserve(entries)
            )
            body = pack_reserve_reply_entries(reserved)
            self._count(
                put_rejected=sum(
                    1 for r in reserved if r.status in (PutCode.NO_SPACE, PutCode.INVALID)
                )
            )
            self._reply(conn, [Header(Opcode.RESERVE_REPLY, n).pack(), body])
        elif op is Opcode.COMMIT:
            self._handle_commit(conn, header, n, session)
        elif op is Opcode.ABORT:
            keys = unpack_keys(recv_exact(conn, n * KEY_BYTES))
            self._reply(conn, [Header(Opcode.ABORT_REPLY, n).pack(), bytes(session.abort(keys))])
        elif op is Opcode.LEASE:
            reads = unpack_get_entries(recv_exact(conn, n * GET_ENTRY.size))
            self._watchdog.disarm(conn)  # a lease may promote a chunk off SSD first
            leased = session.lease(reads)
            ok = [r for r in leased if r.status is GetCode.OK]
            self._count(
                gets=len(ok),
                get_misses=sum(1 for r in leased if r.status is GetCode.NOT_FOUND),
                bytes_out=sum(r.length for r in ok),
            )
            body = pack_lease_reply_entries(leased)
            self._reply(conn, [Header(Opcode.LEASE_REPLY, n).pack(), body])
        elif op is Opcode.RELEASE:
            ids = unpack_lease_ids(recv_exact(conn, n * LEASE_ID.size))
            released = bytes(session.release(ids))
            self._reply(conn, [Header(Opcode.RELEASE_REPLY, n).pack(), released])
        else:  # pragma: no cover - _SESSION_OPS and this chain agree
            raise ProtocolError(ErrorCode.BAD_OPCODE, f"{op.name} is not a session request")

    def _handle_commit(self, conn: socket.socket, header: Header, n: int, session: Session) -> None:
        granted = bool(header.flags & HeaderFlags.GRANT)
        entry_bytes = GRANTED_COMMIT_ENTRY.size if granted else COMMIT_ENTRY.size
        commits = unpack_commit_entries(recv_exact(conn, n * entry_bytes), granted=granted)
        self._watchdog.disarm(conn)  # hashing the reserved bytes is the store's work
        results = session.commit_granted(commits) if granted else session.commit(commits)
        statuses = bytes(code for code, _ in results)
        # What the client copied for a key stored already (EXISTS) was never
        # the store's: as for a RESERVE answered EXISTS, it is not counted in.
        self._count(
            puts=statuses.count(PutCode.OK),
            corrupt_puts=statuses.count(PutCode.CORRUPT),
            bytes_in=sum(size for code, size in results if code is not PutCode.EXISTS),
        )
        tail = self._indexed(
            header,
            session,
            statuses,
            [session.key(e.key) for e in commits],
            [size for _, size in results],
        )
        if granted:
            # The next put's room, of the sizes this one used: steady
            # puts of a writer take one round trip each.
            refill = session.grant([size for _, size in results])
            tail.append(pack_reserve_reply_entries(refill))
        self._reply(conn, [self._put_reply(header, n, tail, granted), statuses, *tail])

    def _handle_get(self, conn: socket.socket, n: int, session: Session) -> None:
        entries = unpack_get_rows(recv_exact(conn, n * GET_ENTRY.size))
        self._watchdog.disarm(conn)  # reads off SSD are the store's work
        leases: list[ReadLease] = []
        try:
            replies: list[bytes] = []
            payloads: list[memoryview] = []
            misses = 0
            # Chunks on SSD are read in parallel, off this thread. A range
            # past a chunk's start continues a read counted at its first range.
            acquired = self._chunks.acquire_many(
                [session.key(key) for key, _, _ in entries],
                continued=[offset > 0 for _, offset, _ in entries],
            )
            leases = [lease for lease in acquired if lease is not None]
            for (_, offset, asked), lease in zip(entries, acquired, strict=True):
                if lease is None:
                    replies.append(_NOT_FOUND)
                    misses += 1
                    continue
                size = lease.size
                length = asked or size - offset
                if offset >= size or length <= 0 or offset + length > size:
                    replies.append(_INVALID)
                    continue
                if length == size:
                    # Whole chunk: the writer's checksum, checked end to end.
                    view, ck = lease.view, lease.checksum
                else:
                    view = lease.view[offset : offset + length]
                    ck = checksum(view)
                replies.append(GET_REPLY_ENTRY.pack(GetCode.OK, length, ck))
                payloads.append(view)
            # Counted before the reply goes out, so a client that has its
            # answer also sees it in the stats.
            out = sum(p.nbytes for p in payloads)
            self._count(gets=len(payloads), get_misses=misses, bytes_out=out)
            head = b"".join([Header(Opcode.GET_REPLY, n).pack(), *replies])
            self._watchdog.arm(conn, len(head) + out)
            self._reply(conn, [head, *payloads])
        finally:
            self._chunks.release_many(leases)

    def _handle_delete(self, conn: socket.socket, n: int, session: Session) -> None:
        keys = unpack_keys(recv_exact(conn, n * KEY_BYTES))
        statuses = bytes(
            DeleteCode.OK if self._chunks.delete(session.key(key)) else DeleteCode.NOT_FOUND
            for key in keys
        )
        self._reply(conn, [Header(Opcode.DELETE_REPLY, n).pack(), statuses])
