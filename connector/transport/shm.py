"""The ``shm`` transport: a same-host client copies straight into and out of the arena.

The store's DRAM arena is a file under ``/dev/shm``; a client on the same
host maps it and moves each chunk with one ``memcpy``. Only control messages
cross the store's data-plane socket, batched (see
:mod:`kvdepot.connector.transport.control`):

* put: RESERVE the batch, copy each chunk to its offset (hashing each block
  of the source right after it was copied, while it is in cache: the
  checksum costs no pass over memory of its own), COMMIT the batch. The
  store records that checksum; every reader checks it, so a source the
  caller changed during the copy is a miss, never torn data. A store started with
  ``--verify-shm-commits`` hashes the arena bytes again and commits only
  what matches; COMMITs to it are pipelined, so it verifies one group on its
  core while the client copies the next.
* get: LEASE the batch, copy each chunk out (hashing the destination while it
  is in cache) and compare with the checksum the store sent, RELEASE.

The chunks of a batch are copied by a few threads at once (:class:`Copier`):
one core does not saturate memory bandwidth.

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

import contextlib
import itertools
import logging
import mmap
import os
import threading
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np

from kvdepot.connector.transport.arena import (
    MISMATCH,
    ArenaTransport,
    ArenaUnusable,
    PutOutcome,
    check_lease,
)
from kvdepot.connector.transport.base import GetOutcome, GetStatus, PutStatus
from kvdepot.connector.transport.control import ControlConnection, ControlPool
from kvdepot.connector.transport.stall import Stalls
from kvdepot.connector.transport.stream import PUT_STATUS, GetWork, PutWork
from kvdepot.errors import InvalidArgument
from kvdepot.keys import ChunkKey
from kvdepot.rpc.security_config import SecurityConfig
from kvdepot.wire.host import host_identity
from kvdepot.wire.protocol import (
    AttachFlags,
    AttachInfo,
    AttachKind,
    CommitEntry,
    ErrorCode,
    GetCode,
    IndexCode,
    ProtocolError,
    ProtocolLimits,
    PutCode,
    PutEntry,
)
from kvdepot.wire.xxh3 import BlockHasher, xxh3_64

logger = logging.getLogger(__name__)

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)

COMMIT_GROUP_BYTES = 2 << 20
"""Bytes copied before their COMMIT is sent to a store that verifies commits."""


DEFAULT_COPY_THREADS = min(2, os.cpu_count() or 1)
"""Copy threads per client: two nearly doubled copy bandwidth over one."""


COPY_BLOCK = 1 << 20
"""Bytes copied between two hash updates in :func:`copy_hashed`.

Larger than the tcp paths' ``HASH_BLOCK``: on the CI machine kind (AMD EPYC,
a tmpfs arena in 4 KiB pages) a copy into the arena ran at 0.58-0.72 ms per
8 MiB in calls of 256-768 KiB and at 0.43-0.44 ms in calls of 1 MiB and up
(anonymous memory in huge pages: the same at every size); with the hash
after each block, a put of 8 x 1 MiB copied in 0.78 ms per 8 MiB with
512 KiB blocks and 0.59-0.62 ms with 1 MiB ones. A 1 MiB source block is
still in the core's L2 when it is hashed."""


class ShmUnavailable(ArenaUnusable):
    """The store's arena cannot be mapped here (another host, no file, no access)."""


def copy_hashed(
    dst: memoryview, src: memoryview, *, hash_dst: bool, block: int = COPY_BLOCK
) -> int:
    """Copy ``src`` into ``dst`` (same length) and return the xxh3-64 of the bytes.

    The copy goes block by block and each block is hashed right after it
    was copied, while it is in cache: the checksum adds a pass over cache,
    not over memory. Neither the copy nor the hash holds the GIL, so several
    threads copy chunks at once (see :class:`Copier`).

    Args:
        dst: Destination, as long as ``src``.
        src: Source bytes.
        hash_dst: Hash the copied destination (a reader checking what it got)
            rather than the source (a writer's checksum of its data).
        block: Bytes per copy-and-hash step.
    """
    total = src.nbytes
    d = np.frombuffer(dst, dtype=np.uint8)
    s = np.frombuffer(src, dtype=np.uint8)
    if total <= block:
        np.copyto(d, s)
        return xxh3_64(dst if hash_dst else src)
    hasher = BlockHasher(dst if hash_dst else src)
    for start in range(0, total, block):
        end = min(start + block, total)
        np.copyto(d[start:end], s[start:end])
        hasher.update(start, end)
    return hasher.digest()


PARALLEL_COPY_BYTES = 4 << 20
"""Batches smaller than this are copied on the caller's thread alone: waking
another thread costs more than it saves there. At 4 MiB two threads already
win: a put of 8 x 1 MiB went from 0.71 to 0.88-1.01 x raw-shm (the same
runs with 16 MiB and 4 MiB alternating); 2 MiB batches gained nothing."""


def _drain(
    jobs: Sequence[tuple[memoryview, memoryview, bool]],
    sums: list[int | None],
    take: Callable[[], int],
    stop: threading.Event,
) -> None:
    """Copy the jobs ``take`` hands out until none is left (or ``stop``)."""
    while not stop.is_set():
        i = take()
        if i >= len(jobs):
            return
        dst, src, hash_dst = jobs[i]
        sums[i] = copy_hashed(dst, src, hash_dst=hash_dst)


class Copier:
    """Runs the chunk copies of a batch on a few threads at once.

    One core does not saturate memory bandwidth with copies: two threads
    moved nearly twice the bytes of one on the CI machine kind. Copies and
    hashes release the GIL (numpy ``copyto``, xxh3 through ctypes), so the
    threads really run in parallel. The caller and the pool threads take
    the batch's chunks one at a time, in order, each the next one left, so
    a batch wakes each helper once, and a thread the store's or the index's
    work takes the core from leaves its share to the others: with a fixed
    share each, the batch waited for the thread that lost its core (a put
    of 8 x 16 MiB with the store and the metadata service on the same two
    cores). Waking a thread cost
    0.1 ms to several ms on the 2-vCPU CI machine kind (more while the host
    was busy), so small batches stay on the caller's thread.

    Args:
        threads: Threads copying a large batch, the caller's included; 1
            copies everything on the caller's thread.
        parallel_bytes: Smallest batch copied on several threads.
    """

    def __init__(self, threads: int, parallel_bytes: int = PARALLEL_COPY_BYTES) -> None:
        if threads < 1:
            raise InvalidArgument("copy threads must be at least 1")
        self._threads = threads
        self._parallel_bytes = parallel_bytes
        self._pool = (
            ThreadPoolExecutor(threads - 1, thread_name_prefix="kvdepot-copy")
            if threads > 1
            else None
        )

    def map(
        self, jobs: Sequence[tuple[memoryview, memoryview, bool]]
    ) -> Generator[int, None, None]:
        """Copy each ``(dst, src, hash_dst)`` job; yield the checksums in job order.

        Close the generator (``contextlib.closing``) when not iterating it to
        the end: closing waits for the copies still running.
        """
        pool = self._pool
        if (
            pool is None
            or len(jobs) < 2
            or (sum(src.nbytes for _, src, _ in jobs) < self._parallel_bytes)
        ):
            for dst, src, hash_dst in jobs:
                yield copy_hashed(dst, src, hash_dst=hash_dst)
            return
        sums: list[int | None] = [None] * len(jobs)
        counter = itertools.count()
        lock = threading.Lock()
        stop = threading.Event()

        def take() -> int:
            with lock:
                return next(counter)

        helpers = min(self._threads - 1, len(jobs) - 1)
        futures = [pool.submit(_drain, jobs, sums, take, stop) for _ in range(helpers)]
        head = 0
        try:
            while (i := take()) < len(jobs):
                dst, src, hash_dst = jobs[i]
                sums[i] = copy_hashed(dst, src, hash_dst=hash_dst)
                while head < len(jobs) and (ck := sums[head]) is not None:
                    yield ck
                    head += 1
            for f in futures:
                f.result()  # raises what a helper raised
            for ck in sums[head:]:
                assert ck is not None
                yield ck
        finally:
            # A caller that stops early (an error) must not leave copies
            # running into memory it is about to give back.
            stop.set()
            wait(futures)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


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
    (FAILED puts and reads); :meth:`usable` says beforehand. Deletes and
    index syncs go over the same control connections.

    Args:
        connect_timeout_s: Time allowed to connect to a store.
        io_timeout_s: Time a control exchange may stall.
        max_idle_per_peer: Idle control connections kept per store.
        limits: The stores' protocol limits; batches are split to fit.
        security: The token each new control connection proves it holds.
        copy_threads: Threads copying the chunks of a batch at once.
        stalls: The record of stores that stopped answering, shared with the
            other transports of a client (``auto``); by default its own.

    Raises:
        InvalidArgument: If a timeout is not positive or ``copy_threads`` < 1.
    """

    name = "shm"

    def __init__(
        self,
        connect_timeout_s: float = 5.0,
        io_timeout_s: float = 30.0,
        max_idle_per_peer: int = 4,
        *,
        limits: ProtocolLimits | None = None,
        security: SecurityConfig | None = None,
        copy_threads: int = DEFAULT_COPY_THREADS,
        stalls: Stalls | None = None,
    ) -> None:
        if connect_timeout_s <= 0 or io_timeout_s <= 0:
            raise InvalidArgument("transport timeouts must be positive")
        self._copier = Copier(copy_threads)
        self._limits = limits or ProtocolLimits()
        self._io_timeout_s = io_timeout_s
        token = security.tokens().token if security is not None else ""
        self._pool = ControlPool(
            AttachKind.SHM, connect_timeout_s, io_timeout_s, max_idle_per_peer, token, stalls
        )
        self._lock = threading.Lock()
        self._maps: dict[str, _Mapping] = {}
        self._closed = False

    def generation(self, address: str) -> int:
        """Generation of the arena mapped for ``address`` (0 when none is)."""
        with self._lock:
            m = self._maps.get(address)
        return m.generation if m is not None else 0

    def _forget_peer(self, address: str) -> None:
        # The store is gone: do not keep its old arena's memory mapped.
        with self._lock:
            self._maps.pop(address, None)

    def _arena(self, address: str, conn: ControlConnection) -> _Mapping:
        # The mapping of the very arena generation the connection attached to.
        info = conn.info
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
        index: bool,
        writer: int = 0,
    ) -> list[PutOutcome]:
        sizes = [e.size for _, e, _, _ in batch]
        if conn.info.flags & AttachFlags.GRANTS and sum(sizes) <= conn.grant_limit:
            conn.settle()  # a late commit's answer brings the grants of this put
            offsets = conn.take_grants(sizes)
            if offsets is None:
                conn.grant(sizes)
                offsets = conn.take_grants(sizes)
            if offsets is not None:
                return self._put_granted(conn, m, batch, offsets, index, writer)
        replies = conn.reserve([PutEntry(e.key, e.size, 0) for _, e, _, _ in batch])
        out: list[PutOutcome] = []
        arena = m.view
        placed: list[tuple[int, PutEntry, int | None]] = []
        jobs: list[tuple[memoryview, memoryview, bool]] = []
        for (i, entry, view, trailed), reply in zip(batch, replies, strict=True):
            if reply.status is not PutCode.OK:
                out.append((i, PUT_STATUS[reply.status], IndexCode.NOT_INDEXED))
                continue
            if reply.offset + entry.size > arena.nbytes:
                raise ProtocolError(ErrorCode.MALFORMED, "reservation outside the arena")
            placed.append((i, entry, None if trailed else entry.checksum))
            # The checksum is of the source, each block hashed right after it
            # was copied: bytes changed under the copy then fail it at read
            # time (hashing the copy would record them as the truth).
            jobs.append((arena[reply.offset : reply.offset + entry.size], view, False))
        committed: list[int] = []
        counts: list[int] = []
        group: list[CommitEntry] = []
        group_bytes = 0
        wrong: list[ChunkKey] = []
        # A store that hashes commits again gets them as copies finish, in
        # order, and checks one group on its core while the next ones are
        # copied; one that does not gets one COMMIT for the batch.
        limit = COMMIT_GROUP_BYTES if conn.info.flags & AttachFlags.VERIFIES_SHM else 1 << 62
        # Closed before anything leaves: every copy has ended, even when a
        # COMMIT fails, before the connection (and its reservations) goes.
        with contextlib.closing(self._copier.map(jobs)) as sums:
            for (i, entry, given), ck in zip(placed, sums, strict=True):
                if given is not None and given != ck:
                    # The caller's checksum does not describe its bytes: store neither.
                    wrong.append(entry.key)
                    out.append((i, PutStatus.CORRUPT, IndexCode.NOT_INDEXED))
                    continue
                group.append(CommitEntry(entry.key, ck))
                committed.append(i)
                group_bytes += entry.size
                if group_bytes >= limit:
                    conn.send_commit(group, index, writer)
                    counts.append(len(group))
                    group, group_bytes = [], 0
        if group and not counts and not wrong and writer and index:
            # A deferring writer's batch in one COMMIT: its answer is read
            # by the connection's next exchange, as in granted room.
            conn.commit_late(group, [e.size for _, e, _ in placed], writer, granted=False)
            return out + _pending(committed)
        if group:
            conn.send_commit(group, index, writer)
            counts.append(len(group))
        statuses, codes = conn.finish_commits(counts)
        if wrong:
            conn.abort(wrong)
        return out + _outcomes(committed, statuses, codes)

    def _put_granted(
        self,
        conn: ControlConnection,
        m: _Mapping,
        batch: list[PutWork],
        offsets: list[int],
        index: bool,
        writer: int,
    ) -> list[PutOutcome]:
        """Copy a batch into room the store granted ahead, then COMMIT it: one
        round trip. A chunk the store holds already is copied for nothing
        (the store frees its grant and answers EXISTS): a local copy of at
        most the connection's ``grant_limit``, against a RESERVE round trip
        saved on every put.

        A deferring ``writer``'s COMMIT is not waited for: its chunks are
        reported OK and PENDING (their index commit follows the store's
        commit anyway), and the answer is read by the connection's next
        exchange (see :meth:`ControlConnection.commit_late`)."""
        arena = m.view
        jobs = [
            (arena[off : off + e.size], view, False)
            for (_, e, view, _), off in zip(batch, offsets, strict=True)
        ]
        out: list[PutOutcome] = []
        entries: list[CommitEntry] = []
        committed: list[int] = []
        sizes: list[int] = []
        # Closed before anything leaves: every copy has ended.
        with contextlib.closing(self._copier.map(jobs)) as sums:
            for (i, e, _, trailed), off, ck in zip(batch, offsets, sums, strict=True):
                if not trailed and e.checksum != ck:
                    # The caller's checksum does not describe its bytes: store neither.
                    out.append((i, PutStatus.CORRUPT, IndexCode.NOT_INDEXED))
                    conn.give_back(e.size, off)
                    continue
                entries.append(CommitEntry(e.key, ck, off))
                committed.append(i)
                sizes.append(e.size)
        if not entries:
            return out
        if writer and index:
            conn.commit_late(entries, sizes, writer)
            return out + _pending(committed)
        statuses, codes = conn.commit_granted(entries, sizes, index, writer)
        return out + _outcomes(committed, statuses, codes)

    def _get_batch(
        self, conn: ControlConnection, m: _Mapping, batch: list[GetWork]
    ) -> list[tuple[int, GetOutcome]]:
        replies = conn.lease([e for _, e, _ in batch])
        out: list[tuple[int, GetOutcome]] = []
        lease_ids = [r.lease_id for r in replies if r.status is GetCode.OK]
        arena = m.view
        try:
            copies: list[tuple[int, int]] = []  # (index in out, expected checksum)
            jobs: list[tuple[memoryview, memoryview, bool]] = []
            for (i, entry, buf), reply in zip(batch, replies, strict=True):
                refused = check_lease(arena.nbytes, entry, buf, reply)
                if refused is not None:
                    out.append((i, refused))
                    continue
                length = reply.length
                dest = buf[:length] if length < buf.nbytes else buf
                copies.append((len(out), reply.checksum))
                out.append((i, GetOutcome(GetStatus.OK, length)))
                jobs.append((dest, arena[reply.offset : reply.offset + length], True))
            # Every copy has ended when the iterator is closed, before the leases go.
            with contextlib.closing(self._copier.map(jobs)) as sums:
                for (slot, expected), got in zip(copies, sums, strict=True):
                    if got != expected:
                        out[slot] = (out[slot][0], MISMATCH)
        finally:
            conn.release_later(lease_ids)
        return out

    def _release(self) -> None:
        self._copier.close()
        with self._lock:
            self._maps.clear()


def _pending(committed: list[int]) -> list[PutOutcome]:
    """Chunks a deferring writer's COMMIT carries without waiting for its
    answer: OK now, PENDING in the index."""
    return [(i, PutStatus.OK, IndexCode.PENDING) for i in committed]


def _outcomes(
    committed: list[int], statuses: list[PutCode], codes: list[IndexCode]
) -> list[PutOutcome]:
    """The outcomes of the items ``committed`` from a COMMIT's answer."""
    return [(i, PUT_STATUS[s], c) for i, s, c in zip(committed, statuses, codes, strict=True)]
