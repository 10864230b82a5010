"""The ``shm`` transport: a same-host client copies straight into and out of the arena.

The store's DRAM arena is a file under ``/dev/shm``; a client on the same
host maps it and moves each chunk with one ``memcpy``. Only control messages
cross the store's data-plane socket, batched (see
:mod:`kvdepot.connector.transport.control`):

* put: RESERVE the batch, copy each chunk to its offset (hashing each block
  of the source while it is in cache: the writer's checksum costs no pass of
  its own), COMMIT it; the store hashes the arena bytes and commits only if
  they match. COMMITs are pipelined, so the store verifies one chunk on its
  core while the client copies the next.
* get: LEASE the batch, copy each chunk out (hashing the destination while it
  is in cache) and compare with the checksum the store sent, RELEASE.

Safety: the client maps the arena only after checking that the store runs on
this kernel (boot id) and that the file it opened is the store's
(``st_dev``/``st_ino``). Each connection attaches to one arena generation and
offsets are used only against the mapping of that generation: a store that
restarted has a new arena file and generation, which the next connection sees
and maps anew, so stale memory is never read. A copy that raced with a store
restart or a lease that ended under it fails its checksum: a miss, never
wrong data.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from kvdepot.connector.transport.arena import ArenaTransport
from kvdepot.connector.transport.base import GetOutcome, PutItem, PutStatus
from kvdepot.connector.transport.control import ControlConnection, ControlPool
from kvdepot.connector.transport.tcp import (
    PUT_STATUS,
    PutWork,
    TcpTransport,
)
from kvdepot.errors import InvalidArgument, KVDepotError, Unauthenticated, Unavailable
from kvdepot.security import SecurityConfig
from kvdepot.store.host import host_identity
from kvdepot.store.protocol import (
    HASH_BLOCK,
    AttachFlags,
    AttachInfo,
    AttachKind,
    CommitEntry,
    ErrorCode,
    GetCode,
    GetEntry,
    LeaseReplyEntry,
    ProtocolError,
    ProtocolLimits,
    PutCode,
    PutEntry,
)
from kvdepot.store.xxh3 import Xxh3Stream, xxh3_64

logger = logging.getLogger(__name__)

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)

COMMIT_GROUP_BYTES = 2 << 20
"""Bytes copied before their COMMIT is sent (pipelined; at least one chunk)."""


class ShmUnavailable(Unavailable):
    """The store's arena cannot be mapped here (another host, no file, no access)."""


def copy_hashed(
    dst: memoryview, src: memoryview, *, hash_dst: bool, block: int = HASH_BLOCK
) -> int:
    """Copy ``src`` into ``dst`` (same length) and return the xxh3-64 of the bytes.

    The copy goes block by block and each block is hashed right after it
    was copied, while it is in cache: the checksum adds a pass over cache,
    not over memory.

    Args:
        dst: Destination, as long as ``src``.
        src: Source bytes.
        hash_dst: Hash the copied destination (a reader checking what it got)
            rather than the source (a writer's checksum of its data).
        block: Bytes per copy-and-hash step.
    """
    total = src.nbytes
    if total <= block:
        dst[:] = src
        return xxh3_64(dst if hash_dst else src)
    hasher = Xxh3Stream()
    hashed = dst if hash_dst else src
    for start in range(0, total, block):
        end = min(start + block, total)
        dst[start:end] = src[start:end]
        hasher.update(hashed[start:end])
    return hasher.digest()


@dataclass(frozen=True, slots=True)
class _Mapping:
    """This process's mapping of one generation of a store's arena."""

    generation: int
    view: memoryview


def _map_arena(info: AttachInfo) -> _Mapping:
    """Map the arena ``info`` describes, after checking it is really the store's.

    Raises:
        ShmUnavailable: Another host, no shareable arena, or the file here is
            not the store's (another container's ``/dev/shm``) or not accessible.
    """
    if not info.flags & AttachFlags.SHM or not info.arena_path:
        raise ShmUnavailable("the store's arena is not shared (anonymous memory)")
    if info.host_id != host_identity():
        raise ShmUnavailable("the store runs on another host")
    try:
        fd = os.open(info.arena_path, os.O_RDWR)
    except OSError as exc:
        raise ShmUnavailable(f"cannot open arena file {info.arena_path}: {exc}") from exc
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (info.file_dev, info.file_ino):
            raise ShmUnavailable(f"{info.arena_path} here is not the store's arena file")
        if st.st_size < info.arena_size:
            raise ShmUnavailable(f"arena file {info.arena_path} is smaller than the arena")
        # Populated up front: faulting pages in on the hot path would cost
        # more than the copy itself.
        mm = mmap.mmap(fd, info.arena_size, flags=mmap.MAP_SHARED | _POPULATE)
    except OSError as exc:
        raise ShmUnavailable(f"cannot map arena file {info.arena_path}: {exc}") from exc
    finally:
        os.close(fd)
    return _Mapping(info.generation, memoryview(mm))


class ShmTransport(ArenaTransport[_Mapping]):
    """The ``shm`` data plane client: same-host stores only.

    Items for a store on another host (or whose arena is not shared) fail
    (FAILED puts, ``ok=False`` reads); :meth:`usable` says beforehand.
    Deletes go over the store's socket, as with ``tcp``.

    Args:
        connect_timeout_s: Time allowed to connect to a store.
        io_timeout_s: Time a control exchange may stall.
        max_idle_per_peer: Idle control connections kept per store.
        limits: The stores' protocol limits; batches are split to fit.
        security: The token each new control connection proves it holds.

    Raises:
        InvalidArgument: If a timeout is not positive.
    """

    def __init__(
        self,
        connect_timeout_s: float = 5.0,
        io_timeout_s: float = 30.0,
        max_idle_per_peer: int = 4,
        *,
        limits: ProtocolLimits | None = None,
        security: SecurityConfig | None = None,
    ) -> None:
        if connect_timeout_s <= 0 or io_timeout_s <= 0:
            raise InvalidArgument("transport timeouts must be positive")
        self._limits = limits or ProtocolLimits()
        token = security.tokens().token if security is not None else ""
        self._pool = ControlPool(
            AttachKind.SHM, connect_timeout_s, io_timeout_s, max_idle_per_peer, token
        )
        self._tcp = TcpTransport(
            connect_timeout_s, io_timeout_s, 1, limits=self._limits, security=security
        )
        self._lock = threading.Lock()
        self._maps: dict[str, _Mapping] = {}
        self._closed = False

    def usable(self, address: str) -> bool:
        """Whether the store at ``address`` is on this host with an arena this process can map."""
        try:
            conn, _ = self._open(address)
        except Unauthenticated:
            raise  # not a matter of shm: tcp would be refused the same
        except (KVDepotError, OSError) as exc:
            logger.debug("shm to %s not usable: %s", address, str(exc))
            return False
        self._pool.checkin(address, conn)
        return True

    def generation(self, address: str) -> int:
        """Generation of the arena mapped for ``address`` (0 when none is)."""
        with self._lock:
            m = self._maps.get(address)
        return m.generation if m is not None else 0

    def _open(self, address: str) -> tuple[ControlConnection, _Mapping]:
        # A connection and the mapping of the very arena generation it attached to.
        if self._closed:
            raise InvalidArgument("transport is closed")
        try:
            conn = self._pool.checkout(address)
        except Unavailable:
            # The store is gone: do not keep its old arena's memory mapped.
            with self._lock:
                self._maps.pop(address, None)
            raise
        try:
            return conn, self._mapping(address, conn.info)
        except BaseException:
            conn.close()
            raise

    def _mapping(self, address: str, info: AttachInfo) -> _Mapping:
        with self._lock:
            m = self._maps.get(address)
        if m is not None and m.generation == info.generation:
            return m
        if m is not None:
            logger.info(
                "store %s has a new arena (generation %x, was %x): mapping it",
                address,
                info.generation,
                m.generation,
            )
            # Other idle connections attached to the old arena: never use them.
            self._pool.drop(address)
        new = _map_arena(info)
        with self._lock:
            self._maps[address] = new
        # The old mapping is unmapped when the last transfer using it ends.
        return new

    def _put_batch(
        self,
        conn: ControlConnection,
        m: _Mapping,
        batch: list[PutWork],
        items: Sequence[PutItem],
    ) -> list[tuple[int, PutStatus]]:
        replies = conn.reserve([PutEntry(e.key, e.size, 0) for _, e, _, _ in batch])
        out: list[tuple[int, PutStatus]] = []
        committed: list[int] = []
        counts: list[int] = []
        group: list[CommitEntry] = []
        group_bytes = 0
        arena = m.view
        for (i, entry, view, _), reply in zip(batch, replies, strict=True):
            if reply.status is not PutCode.OK:
                out.append((i, PUT_STATUS[reply.status]))
                continue
            if reply.offset + entry.size > arena.nbytes:
                raise ProtocolError(ErrorCode.MALFORMED, "reservation outside the arena")
            dest = arena[reply.offset : reply.offset + entry.size]
            given = items[i].checksum
            if given is None:
                ck = copy_hashed(dest, view, hash_dst=False)
            else:
                dest[:] = view
                ck = given
            group.append(CommitEntry(entry.key, ck))
            committed.append(i)
            group_bytes += entry.size
            if group_bytes >= COMMIT_GROUP_BYTES:
                conn.send_commit(group)
                counts.append(len(group))
                group, group_bytes = [], 0
        if group:
            conn.send_commit(group)
            counts.append(len(group))
        codes = conn.finish_commits(counts)
        out.extend((i, PUT_STATUS[c]) for i, c in zip(committed, codes, strict=True))
        return out

    def _get_batch(
        self, conn: ControlConnection, m: _Mapping, batch: list[tuple[int, GetEntry, memoryview]]
    ) -> list[tuple[int, GetOutcome]]:
        replies = conn.lease([e for _, e, _ in batch])
        out: list[tuple[int, GetOutcome]] = []
        lease_ids = [r.lease_id for r in replies if r.status is GetCode.OK]
        arena = m.view
        try:
            for (i, entry, buf), reply in zip(batch, replies, strict=True):
                out.append((i, _read_one(arena, entry, buf, reply)))
        finally:
            conn.release(lease_ids)
        return out

    def _release(self) -> None:
        with self._lock:
            self._maps.clear()


def _read_one(
    arena: memoryview, entry: GetEntry, buf: memoryview, reply: LeaseReplyEntry
) -> GetOutcome:
    if reply.status is GetCode.NOT_FOUND:
        return GetOutcome(False, 0, "not found")
    if reply.status is GetCode.INVALID:
        return GetOutcome(False, 0, "invalid range")
    length = reply.length
    if reply.offset + length > arena.nbytes:
        raise ProtocolError(ErrorCode.MALFORMED, "lease outside the arena")
    if length > buf.nbytes:
        return GetOutcome(False, 0, f"buffer of {buf.nbytes} bytes too small for {length}")
    if entry.length and length != entry.length:
        return GetOutcome(False, 0, f"store leased {length} bytes for a range of {entry.length}")
    dest = buf[:length] if length < buf.nbytes else buf
    got = copy_hashed(dest, arena[reply.offset : reply.offset + length], hash_dst=True)
    if got != reply.checksum:
        return GetOutcome(False, 0, "checksum mismatch")
    return GetOutcome(True, length)
