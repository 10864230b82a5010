"""The SSD tier: chunks in append-only segment files under one directory.

Room for a chunk is the next aligned span of the active segment
(:mod:`kvdepot.store.tiers.segments` has the format); a segment that is full
is sealed and a new one started. Freeing a chunk marks its record freed and
leaves a hole: a segment whose records are all freed is deleted, and a
background compactor rewrites the live records of segments that are mostly
holes into the active segment, then deletes them. Capacity counts the
segment files' bytes, holes included, so the directory never holds more than
it.

Handles are indirect: a record that compaction moves keeps its handle, and a
read that started before the move finishes on the old file, which is deleted
only after its last reader. Writes, reads, the freed marks and segment
deletions run without the tier's lock; the lock guards only the bookkeeping,
so ``allocate`` and ``free`` never wait for the disk. Writes and the other
slow work run on the tier's thread pool (:attr:`SsdTier.executor`).

Every read is checked against the chunk's checksum before anyone sees it: a
payload that fails is :class:`~kvdepot.errors.Corrupt`, never returned.

Opening a directory recovers it: each segment is scanned, records verified
(``verify_on_open``), truncated or corrupt ones dropped and counted, and the
live chunks handed to the chunk table by :meth:`SsdTier.recover`. A lock
file keeps two stores from sharing a directory.

A device that fails (I/O errors other than a full disk, several within
seconds) takes the tier out of service: see :mod:`kvdepot.store.tiers.faults`.

``fsync`` policy: ``always`` (each chunk is durable before it counts as
written), ``segment`` (a segment is synced when it is sealed and at close) or
``never`` (the page cache decides). A process crash loses nothing under any
policy; a power loss loses what was not synced.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kvdepot.errors import Corrupt, InvalidArgument, KVDepotError, Unavailable
from kvdepot.keys import ChunkKey
from kvdepot.store.config import FSYNC_POLICIES
from kvdepot.store.tiers import segments as fmt
from kvdepot.store.tiers.base import RecoveredChunk, Tier, TierLimits
from kvdepot.store.tiers.faults import IoFaults, TierFailed, TierIOError
from kvdepot.wire.xxh3 import xxh3_64

logger = logging.getLogger(__name__)

LOCK_NAME = "LOCK"
DEFAULT_SHARE = 0.9
"""Share of the free space of its file system the tier takes when no capacity is set."""


def default_capacity(directory: str | Path) -> int:
    """:data:`DEFAULT_SHARE` of the space free on ``directory``'s file system.

    Raises:
        InvalidArgument: If the file system cannot be examined.
    """
    path = Path(directory).absolute()
    probe = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
    try:
        st = os.statvfs(probe)
    except OSError as exc:
        raise InvalidArgument(f"cannot examine the file system of {directory}: {exc}") from exc
    return int(st.f_bavail * st.f_frsize * DEFAULT_SHARE)


class _Segment:
    """One segment file and its accounting (mutable; under the tier's lock)."""

    __slots__ = (
        "dirty",
        "doomed",
        "end",
        "fd",
        "handles",
        "inflight",
        "limit",
        "live",
        "readers",
        "sealed",
        "seg_id",
    )

    def __init__(self, seg_id: int, fd: int, limit: int, *, end: int = 0) -> None:
        self.seg_id = seg_id
        self.fd = fd
        self.limit = limit
        self.end = end  # bytes of the file spans cover (the next record's offset)
        self.live = 0  # bytes of spans of live records
        self.handles: set[int] = set()
        self.inflight = 0  # records allocated whose write has not finished
        self.readers = 0  # I/O in progress on the descriptor
        self.sealed = False
        self.doomed = False  # deleted from the tier: the file goes after the last reader
        self.dirty = False  # written since its last fsync


class _Record:
    __slots__ = ("checksum", "key", "offset", "seg", "seq", "size", "span", "written")

    def __init__(self, seg: _Segment, offset: int, size: int, span: int, seq: int) -> None:
        self.seg = seg
        self.offset = offset
        self.size = size
        self.span = span
        self.seq = seq
        self.key = ChunkKey(b"")
        self.checksum = 0
        self.written = False


@dataclass(frozen=True, slots=True)
class SsdTierConfig:
    """The SSD tier's settings: ``ssd_*`` of the store's (documented there)."""

    dir: str
    capacity_bytes: int
    watermarks: str
    segment_bytes: int
    fsync: str
    io_threads: int
    verify_on_open: bool
    compact_ratio: float


class SsdTier(Tier):
    """Chunks in segment files under ``directory``.

    Args:
        directory: Where the segments live (created if missing).
        capacity: Most bytes of segment files.
        limits: The tier's watermarks.
        segment_bytes: Size at which a segment is sealed; 0 picks
            ``min(64 MiB, capacity / 8)``. A chunk larger than that gets a
            segment of its own.
        fsync: ``always``, ``segment`` or ``never`` (see the module).
        io_threads: Threads of :attr:`executor`.
        verify_on_open: Check every payload against its checksum when the
            directory is opened (reads are checked regardless).
        compact_ratio: A sealed segment whose holes reach this fraction of
            it is compacted; 0 disables compaction (only fully freed
            segments are reclaimed).
        compact_interval_s: How often the compactor looks for work.

    Raises:
        InvalidArgument: If a setting is out of range.
        Unavailable: If the directory cannot be used or another store holds it.
    """

    name = "ssd"
    persistent = True
    config_type = SsdTierConfig

    def __init__(
        self,
        directory: str | Path,
        capacity: int,
        *,
        limits: TierLimits = TierLimits(0.95, 0.9),  # noqa: B008 - frozen, immutable default
        segment_bytes: int = 0,
        fsync: str = "segment",
        io_threads: int = 4,
        verify_on_open: bool = True,
        compact_ratio: float = 0.5,
        compact_interval_s: float = 0.5,
    ) -> None:
        super().__init__(limits)
        if capacity < fmt.ALIGN:
            raise InvalidArgument(f"ssd capacity must be at least {fmt.ALIGN} bytes")
        if fsync not in FSYNC_POLICIES:
            raise InvalidArgument(f"fsync must be one of {', '.join(FSYNC_POLICIES)}")
        if io_threads < 1 or not 0 <= compact_ratio < 1 or compact_interval_s <= 0:
            raise InvalidArgument("bad ssd tier io_threads, compact_ratio or compact_interval_s")
        self._dir = Path(directory)
        self._capacity = capacity
        seg = segment_bytes or min(64 << 20, capacity // 8)
        self._segment_bytes = max(fmt.ALIGN, seg - seg % fmt.ALIGN)
        self._fsync = fsync
        self._compact_ratio = compact_ratio
        # Reentrant: work that cannot go to the pool (while opening, or after
        # close) runs inline, and may take the lock again.
        self._lock = threading.RLock()
        self._segments: dict[int, _Segment] = {}
        self._records: dict[int, _Record] = {}
        self._active: _Segment | None = None
        self._next_handle = 1
        self._next_seg = 1
        self._next_seq = 1
        self._used = 0
        self._recovered: list[RecoveredChunk] = []
        self.dropped_on_open = 0
        self.compactions = 0
        self._faults = IoFaults(self.name, str(self._dir))
        self._lock_fd = self._lock_directory()
        try:
            self._open_existing(verify_on_open)
        except BaseException:
            self._close_files()
            raise
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvdepot-ssd-io")
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._compactor = threading.Thread(
            target=self._compact_forever,
            args=(compact_interval_s,),
            name="kvdepot-ssd-compact",
            daemon=True,
        )
        self._compactor.start()

    @classmethod
    def from_config(cls, config: SsdTierConfig) -> SsdTier:
        """The SSD tier on ``dir`` (``capacity_bytes``, or see :func:`default_capacity`)."""
        capacity = config.capacity_bytes
        if not capacity:
            capacity = default_capacity(config.dir)
            share = round(DEFAULT_SHARE * 100)
            if capacity < fmt.ALIGN:
                raise InvalidArgument(
                    f"ssd_dir {config.dir}: {share}% of the space free there is "
                    f"{capacity} bytes, too little for an SSD tier (set --ssd-capacity)"
                )
            # The operator did not choose this size: say what was taken.
            logger.info(
                "ssd tier on %s takes %.2f GiB, %d%% of the space free there "
                "(ssd_capacity_bytes / --ssd-capacity sets it)",
                config.dir,
                capacity / (1 << 30),
                share,
            )
        return cls(
            config.dir,
            capacity,
            limits=TierLimits.parse(config.watermarks),
            segment_bytes=config.segment_bytes,
            fsync=config.fsync,
            io_threads=config.io_threads,
            verify_on_open=config.verify_on_open,
            compact_ratio=config.compact_ratio,
        )

    # -- opening ------------------------------------------------------------------
    def _lock_directory(self) -> int:
        try:
            # Only the last component: a missing parent is a mistyped path,
            # not a tree to create on some other disk.
            self._dir.mkdir(exist_ok=True)
            fd = os.open(self._dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        except FileNotFoundError as exc:
            parent = self._dir.absolute().parent
            if not parent.is_dir():
                raise InvalidArgument(
                    f"ssd_dir {self._dir}: cannot be created: its parent {parent} "
                    "is not a directory"
                ) from None
            raise Unavailable(f"ssd_dir {self._dir}: cannot be created: {exc.strerror}") from None
        except OSError as exc:
            raise Unavailable(f"ssd_dir {self._dir}: cannot use it: {exc.strerror}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            raise Unavailable(f"ssd directory {self._dir} is in use by another store") from exc
        return fd

    def _open_existing(self, verify: bool) -> None:
        found: dict[ChunkKey, list[int]] = {}
        for seg_id in fmt.segment_ids(self._dir):
            self._next_seg = max(self._next_seg, seg_id + 1)
            fd = fmt.open_segment(self._dir, seg_id, create=False)
            size = os.fstat(fd).st_size
            seg = _Segment(seg_id, fd, size, end=size)
            seg.sealed = True
            self._segments[seg_id] = seg
            self._used += size
            for item in fmt.scan(fd, size, verify=verify):
                self._next_seq = max(self._next_seq, item.header.seq + 1)
                if item.status == "ok":
                    found.setdefault(item.header.key, []).append(self._adopt(seg, item))
                elif item.status != "freed":
                    self._drop_on_open(seg, item)
        kept: list[tuple[int, int]] = []
        for handles in found.values():
            # Several copies: a compaction that did not finish. Keep the newest.
            handles.sort(key=lambda h: (self._records[h].seq, h))
            for extra in handles[:-1]:
                self._free_locked(extra)
            kept.append((self._records[handles[-1]].seq, handles[-1]))
        for seg in list(self._segments.values()):
            if not seg.handles:
                self._retire(seg)
        self._recovered = [self._recovered_chunk(h) for _, h in sorted(kept)]
        if self._segments or self.dropped_on_open:
            logger.info(
                "ssd tier %s: %d chunks in %d segments (%d bytes), %d dropped",
                self._dir,
                len(self._recovered),
                len(self._segments),
                self._used,
                self.dropped_on_open,
            )

    def _adopt(self, seg: _Segment, item: fmt.ScanItem) -> int:
        h = item.header
        rec = _Record(seg, item.offset, h.size, fmt.record_span(h.size), h.seq)
        rec.key, rec.checksum, rec.written = h.key, h.checksum, True
        seg.live += rec.span
        return self._new_handle(rec)

    def _drop_on_open(self, seg: _Segment, item: fmt.ScanItem) -> None:
        self.dropped_on_open += 1
        logger.warning(
            "ssd tier %s: dropped %s chunk %s (segment %d, offset %d)",
            self._dir,
            item.status,
            item.header.key.hex(),
            seg.seg_id,
            item.offset,
        )
        if item.status == "corrupt":
            with contextlib.suppress(OSError):
                fmt.mark_freed(seg.fd, item.offset)

    def _recovered_chunk(self, handle: int) -> RecoveredChunk:
        rec = self._records[handle]
        return RecoveredChunk(key=rec.key, size=rec.size, checksum=rec.checksum, handle=handle)

    def recover(self) -> list[RecoveredChunk]:
        """The chunks found on open, oldest first (handed over once)."""
        with self._lock:
            out, self._recovered = self._recovered, []
        return out

    # -- accounting -----------------------------------------------------------------
    @property
    def directory(self) -> Path:
        """Where the segments live."""
        return self._dir

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def failure(self) -> str | None:
        return self._faults.failure

    @property
    def io_errors(self) -> int:
        """Operations of the device that failed (a full device's not counted)."""
        return self._faults.total

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def live_bytes(self) -> int:
        """Bytes of the spans of live records (``used_bytes`` less the holes)."""
        with self._lock:
            return sum(s.live for s in self._segments.values())

    @property
    def segments(self) -> int:
        """Segment files in the directory."""
        return len(self._segments)

    @property
    def executor(self) -> Executor:
        return self._pool

    def rounded(self, size: int) -> int:
        return fmt.record_span(size)

    def can_make_room(self, size: int, evictable_bytes: int) -> bool:
        # Freeing live records also frees the holes of the segments they
        # empty, which evictable_bytes does not count: never refuse early.
        return fmt.record_span(size) <= self._capacity

    def size_of(self, handle: int) -> int:
        with self._lock:
            return self._record(handle).span

    def _record(self, handle: int) -> _Record:
        rec = self._records.get(handle)
        if rec is None:
            raise InvalidArgument(f"no ssd record with handle {handle}")
        return rec

    def _new_handle(self, rec: _Record) -> int:
        handle = self._next_handle
        self._next_handle += 1
        self._records[handle] = rec
        rec.seg.handles.add(handle)
        return handle

    # -- allocation -------------------------------------------------------------
    def allocate(self, size: int) -> int | None:
        if size <= 0:
            raise InvalidArgument(f"allocation size must be positive, got {size}")
        self._faults.check()
        with self._lock:
            place = self._reserve_span(fmt.record_span(size))
            if place is None:
                return None
            seg, offset = place
            rec = _Record(seg, offset, size, fmt.record_span(size), self._next_seq)
            self._next_seq += 1
            seg.live += rec.span
            return self._new_handle(rec)

    def _reserve_span(self, span: int) -> tuple[_Segment, int] | None:
        # Under the lock. The span counts as used from now: capacity holds
        # even while writes are in flight.
        if self._used + span > self._capacity:
            return None
        seg = self._active
        if seg is None or seg.end + span > seg.limit:
            seg = self._roll(span)
        offset = seg.end
        seg.end += span
        seg.inflight += 1
        self._used += span
        return seg, offset

    def _roll(self, span: int) -> _Segment:
        old = self._active
        if old is not None:
            self._seal(old)
        seg_id = self._next_seg
        self._next_seg += 1
        try:
            fd = fmt.open_segment(self._dir, seg_id, create=True)
        except TierIOError as exc:
            self._faults.error(exc)  # raised: the caller says what it cost
            raise
        seg = _Segment(seg_id, fd, max(self._segment_bytes, span))
        self._segments[seg_id] = seg
        self._active = seg
        if self._fsync != "never":
            self._pool_submit(self._sync_dir)
        return seg

    def _seal(self, seg: _Segment) -> None:
        seg.sealed = True
        if self._active is seg:
            self._active = None
        self._maybe_sync(seg)

    def _maybe_sync(self, seg: _Segment) -> None:
        if (
            self._fsync == "segment"
            and seg.sealed
            and seg.dirty
            and not seg.inflight
            and not seg.doomed
        ):
            seg.dirty = False
            seg.readers += 1
            self._pool_submit(self._sync_segment, seg)

    def _sync_segment(self, seg: _Segment) -> None:
        try:
            if self._faults.failure is None:
                os.fdatasync(seg.fd)
        except OSError as exc:
            self._faults.error(exc, "sync a segment")
        finally:
            self._done_with(seg)

    def _sync_dir(self) -> None:
        if self._faults.failure is not None:
            return
        try:
            fmt.fsync_dir(self._dir)
        except OSError as exc:
            self._faults.error(exc, "sync the directory")

    def free(self, handle: int) -> None:
        with self._lock:
            self._free_locked(handle)

    def _free_locked(self, handle: int) -> None:
        rec = self._records.pop(handle, None)
        if rec is None:
            raise InvalidArgument(f"free of ssd handle {handle} that is not allocated")
        seg = rec.seg
        seg.handles.discard(handle)
        seg.live -= rec.span
        if not seg.handles and not seg.inflight:
            self._retire(seg)
        elif rec.written:
            # Never recovered again; its space comes back with the segment.
            seg.readers += 1
            self._pool_submit(self._mark_freed, seg, rec.offset)

    def _mark_freed(self, seg: _Segment, offset: int) -> None:
        try:
            if not seg.doomed and self._faults.failure is None:
                fmt.mark_freed(seg.fd, offset)
        except OSError as exc:
            self._faults.error(exc, "mark a chunk freed")
        finally:
            self._done_with(seg)

    def _retire(self, seg: _Segment) -> None:
        # Under the lock: the segment leaves the tier; its file goes once no
        # I/O uses its descriptor.
        if self._active is seg:
            self._active = None
        self._segments.pop(seg.seg_id, None)
        self._used -= seg.end
        seg.doomed = True
        if not seg.readers:
            seg.readers += 1
            self._pool_submit(self._done_with, seg)

    def _done_with(self, seg: _Segment) -> None:
        with self._lock:
            seg.readers -= 1
            gone = seg.doomed and seg.readers == 0
            if gone:
                seg.readers = -1  # removed once
        if gone:
            try:
                fmt.remove_segment(self._dir, seg.seg_id, seg.fd)
            except OSError as exc:
                self._faults.error(exc, "delete a segment")
            if self._fsync != "never":
                self._sync_dir()

    def _pool_submit(self, fn: Callable[..., object], *args: object) -> None:
        pool: ThreadPoolExecutor | None = getattr(self, "_pool", None)
        if pool is None or self._stopped():
            fn(*args)
            return
        try:
            pool.submit(fn, *args)
        except RuntimeError:  # shut down meanwhile
            fn(*args)

    def _stopped(self) -> bool:
        stop = getattr(self, "_stop", None)
        return stop is not None and stop.is_set()

    # -- I/O ------------------------------------------------------------------------
    def write(self, handle: int, data: memoryview, *, key: ChunkKey, checksum: int) -> None:
        with self._lock:
            rec = self._record(handle)
            if rec.written or len(data) != rec.size:
                raise InvalidArgument(f"bad write of {len(data)} bytes to ssd handle {handle}")
            rec.key, rec.checksum = key, checksum
            seg = rec.seg
            seg.readers += 1
        error: KVDepotError | None = None
        try:
            self._faults.check()
            header = fmt.pack_header(key, rec.size, checksum, rec.seq)
            fmt.pwrite_all(seg.fd, [header, data], rec.offset)
            if self._fsync == "always":
                os.fdatasync(seg.fd)
        except TierFailed as exc:
            error = exc
        except OSError as exc:
            error = fmt.io_error(exc, f"cannot write chunk {key.hex()} to {self._dir}")
            if isinstance(error, TierIOError):
                self._faults.error(error)
        with self._lock:
            seg.inflight -= 1
            seg.readers -= 1
            seg.dirty = self._fsync != "always"
            if error is None:
                rec.written = True
                if self._records.get(handle) is not rec:
                    # Freed while being written: it must not come back on open.
                    seg.readers += 1
                    self._pool_submit(self._mark_freed, seg, rec.offset)
            if not seg.handles and not seg.inflight and not seg.doomed:
                self._retire(seg)
            elif seg.doomed and seg.readers == 0:
                seg.readers += 1
                self._pool_submit(self._done_with, seg)
            self._maybe_sync(seg)
        if error is not None:
            raise error

    def read_into(self, handle: int, dest: memoryview) -> None:
        self._faults.check()  # a failed device is not believed, even where it answers
        with self._lock:
            rec = self._records.get(handle)
            if rec is None or not rec.written:
                raise Unavailable(f"ssd handle {handle} is not readable")
            if len(dest) != rec.size:
                raise InvalidArgument(f"read of {len(dest)} bytes from a {rec.size}-byte chunk")
            seg, offset, expected, key = rec.seg, rec.offset, rec.checksum, rec.key
            seg.readers += 1
        try:
            got = fmt.pread_into(seg.fd, dest, offset + fmt.HEADER.size)
        except OSError as exc:
            error = TierIOError(f"cannot read chunk {key.hex()} from {self._dir}: {exc}")
            self._faults.error(error)
            raise error from exc
        finally:
            self._done_with(seg)
        if got != len(dest):
            raise Corrupt(f"chunk {key.hex()} on ssd is truncated ({got} of {len(dest)} bytes)")
        if xxh3_64(dest) != expected:
            raise Corrupt(f"chunk {key.hex()} on ssd failed its checksum")

    # -- compaction -----------------------------------------------------------------
    def _compact_forever(self, interval_s: float) -> None:
        while not self._stop.is_set():
            self._wake.wait(interval_s)
            self._wake.clear()
            self._faults.log.flush()
            if self._stop.is_set() or not self._compact_ratio or self._faults.failure:
                continue
            try:
                self.compact_once()
            except KVDepotError as exc:  # the device's: counted where it happened
                self._faults.log.warn("ssd compaction", "ssd compaction pass failed: %s", exc)
            except Exception:  # keep compacting whatever one pass hit
                logger.exception("ssd compaction pass failed")

    def compact_once(self) -> bool:
        """Compact the sealed segment with the largest share of holes, if any
        reaches ``compact_ratio``; returns whether one was compacted."""
        with self._lock:
            candidates = [
                s
                for s in self._segments.values()
                if s.sealed and not s.inflight and s.end and s is not self._active
            ]
            best = max(candidates, key=lambda s: (s.end - s.live) / s.end, default=None)
            if best is None or (best.end - best.live) / best.end < max(self._compact_ratio, 1e-9):
                return False
            if self._used + best.live > self._capacity:
                return False  # no room to copy into: eviction will empty it instead
            handles = list(best.handles)
        for handle in handles:
            if self._stop.is_set() or not self._relocate(best, handle):
                return False
        with self._lock:
            if not best.handles and not best.doomed:
                self._retire(best)
            self.compactions += 1
        return True

    def _relocate(self, seg: _Segment, handle: int) -> bool:
        with self._lock:
            rec = self._records.get(handle)
            if rec is None or rec.seg is not seg:
                return True
            size, old_offset = rec.size, rec.offset
            seg.readers += 1
        try:
            buf = memoryview(bytearray(fmt.HEADER.size + size))
            got = fmt.pread_into(seg.fd, buf, old_offset)
        except OSError as exc:
            self._faults.error(exc, "read a segment to compact it")
            return False
        finally:
            self._done_with(seg)
        if got != len(buf) or xxh3_64(buf[fmt.HEADER.size :]) != rec.checksum:
            return True  # leave it: the next read drops it as corrupt
        with self._lock:
            place = self._reserve_span(rec.span)
            if place is None:
                return False
            new_seg, new_offset = place
            new_seg.readers += 1
        ok = True
        try:
            fmt.pwrite_all(new_seg.fd, [buf], new_offset)
            if self._fsync == "always":
                os.fdatasync(new_seg.fd)
        except OSError as exc:
            self._faults.error(exc, "write a segment to compact it")
            ok = False
        with self._lock:
            new_seg.inflight -= 1
            new_seg.readers -= 1
            new_seg.dirty = self._fsync != "always"
            if ok and self._records.get(handle) is rec and rec.seg is seg:
                seg.handles.discard(handle)
                seg.live -= rec.span
                rec.seg, rec.offset = new_seg, new_offset
                new_seg.handles.add(handle)
                new_seg.live += rec.span
            elif ok:
                new_seg.readers += 1
                self._pool_submit(self._mark_freed, new_seg, new_offset)
            if not new_seg.handles and not new_seg.inflight and not new_seg.doomed:
                self._retire(new_seg)
            self._maybe_sync(new_seg)
        return ok

    # -- closing --------------------------------------------------------------------
    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        self._compactor.join(10)
        self._pool.shutdown(wait=True)
        with self._lock:
            if self._fsync != "never":
                for seg in self._segments.values():
                    if seg.dirty:
                        with contextlib.suppress(OSError):
                            os.fdatasync(seg.fd)
        self._close_files()

    def _close_files(self) -> None:
        for seg in self._segments.values():
            with contextlib.suppress(OSError):
                os.close(seg.fd)
        self._segments.clear()
        self._records.clear()
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)  # releases the flock
