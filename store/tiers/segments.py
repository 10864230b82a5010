"""The on-disk format of the SSD tier: append-only segment files of records.

A segment is a file ``seg-<id>.kvs`` of records, each starting on a 4 KiB
boundary (so payloads stay page-aligned and a damaged header costs at most a
page of scanning to find the next record)::

    offset  size  field
    0       4     magic: b"KVC1" (live) or b"KVCX" (freed)
    4       4     format version (1)
    8       16    chunk key
    24      8     payload size in bytes
    32      8     payload checksum (xxh3-64, the chunk's own checksum)
    40      8     write sequence number (orders records across segments)
    48      8     reserved (0)
    56      8     xxh3-64 of bytes 4..56: the header's own check
    64      size  payload

The header check does not cover the magic, so freeing a record is one
4-byte write of the freed magic that leaves its size readable: a scan steps
over it exactly. Anything else that does not parse (a torn header, zeroes of
a hole, garbage) is skipped page by page until a header parses again.
A record whose payload runs past the end of its file is truncated (a crash
mid-write) and dropped; one whose payload fails its checksum is dropped.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvdepot.errors import CapacityExceeded
from kvdepot.keys import ChunkKey
from kvdepot.store.tiers.faults import FULL_ERRNOS, TierIOError
from kvdepot.wire.xxh3 import xxh3_64

HEADER = struct.Struct("<4sI16sQQQQQ")
MAGIC = b"KVC1"
FREED = b"KVCX"
VERSION = 1
ALIGN = 4096
_CHECKED = slice(4, 56)
_NAME = re.compile(r"^seg-(\d{12})\.kvs$")


def record_span(size: int) -> int:
    """Bytes a record of a ``size``-byte payload takes in its segment."""
    return -(-(HEADER.size + size) // ALIGN) * ALIGN


def segment_name(seg_id: int) -> str:
    """The file name of segment ``seg_id``."""
    return f"seg-{seg_id:012d}.kvs"


def segment_ids(directory: Path) -> list[int]:
    """Ids of the segment files in ``directory``, ascending."""
    ids = []
    for entry in os.listdir(directory):
        m = _NAME.match(entry)
        if m:
            ids.append(int(m.group(1)))
    return sorted(ids)


@dataclass(frozen=True, slots=True)
class RecordHeader:
    """The parsed header of one record."""

    key: ChunkKey
    size: int
    checksum: int
    seq: int
    live: bool


def pack_header(key: ChunkKey, size: int, checksum: int, seq: int) -> bytes:
    """The 64-byte header of a live record."""
    body = bytearray(HEADER.pack(MAGIC, VERSION, bytes(key), size, checksum, seq, 0, 0))
    body[56:64] = xxh3_64(memoryview(body)[_CHECKED]).to_bytes(8, "little")
    return bytes(body)


def parse_header(raw: bytes | memoryview) -> RecordHeader | None:
    """The header in ``raw`` (64 bytes), or ``None`` if it is not one."""
    if len(raw) < HEADER.size:
        return None
    magic, version, key, size, checksum, seq, _, check = HEADER.unpack(raw[: HEADER.size])
    if magic not in (MAGIC, FREED) or version != VERSION:
        return None
    if xxh3_64(memoryview(raw)[_CHECKED]) != check:
        return None
    return RecordHeader(ChunkKey(key), size, checksum, seq, magic == MAGIC)


def io_error(exc: OSError, what: str) -> CapacityExceeded | TierIOError:
    """The kvdepot error for a failed file operation: a full device is ``CapacityExceeded``."""
    if exc.errno in FULL_ERRNOS:
        return CapacityExceeded(f"{what}: device full ({exc.strerror})")
    return TierIOError(f"{what}: {exc}")


def pwrite_all(fd: int, buffers: Sequence[bytes | memoryview], offset: int) -> None:
    """Write ``buffers`` at ``offset`` completely (``pwritev`` may write less).

    Raises:
        OSError: From the system call.
    """
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        n = os.pwritev(fd, views, offset)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]


def pread_into(fd: int, dest: memoryview, offset: int) -> int:
    """Fill ``dest`` from ``offset``; returns the bytes read (less at end of file).

    Raises:
        OSError: From the system call.
    """
    done = 0
    total = len(dest)
    while done < total:
        n = os.preadv(fd, [dest[done:]], offset + done)
        if n <= 0:
            break
        done += n
    return done


def mark_freed(fd: int, offset: int) -> None:
    """Turn the record at ``offset`` into a freed one (never recovered again)."""
    os.pwrite(fd, FREED, offset)


@dataclass(frozen=True, slots=True)
class ScanItem:
    """One record found by :func:`scan`.

    Attributes:
        offset: Where the record starts.
        header: Its header.
        status: ``ok``; ``freed``; ``corrupt`` (payload fails its checksum);
            or ``truncated`` (payload runs past the end of the file).
    """

    offset: int
    header: RecordHeader
    status: str


def scan(
    fd: int, file_size: int, *, verify: bool, buffer_bytes: int = 8 << 20
) -> Iterator[ScanItem]:
    """The records of one segment file, in file order.

    Args:
        fd: The open segment.
        file_size: Its size.
        verify: Read every live payload and check it against its checksum.
        buffer_bytes: Size of the reusable read buffer (larger payloads get
            their own).
    """
    buf = bytearray(buffer_bytes)
    offset = 0
    while offset + HEADER.size <= file_size:
        header = parse_header(os.pread(fd, HEADER.size, offset))
        if header is None:
            offset += ALIGN
            continue
        if offset + HEADER.size + header.size > file_size:
            if header.live:
                yield ScanItem(offset, header, "truncated")
            return
        if not header.live:
            yield ScanItem(offset, header, "freed")
        elif verify and not _payload_ok(fd, offset, header, buf):
            yield ScanItem(offset, header, "corrupt")
        else:
            yield ScanItem(offset, header, "ok")
        offset += record_span(header.size)


def _payload_ok(fd: int, offset: int, header: RecordHeader, buf: bytearray) -> bool:
    view = (
        memoryview(buf)[: header.size]
        if header.size <= len(buf)
        else memoryview(bytearray(header.size))
    )
    if pread_into(fd, view, offset + HEADER.size) != header.size:
        return False
    return xxh3_64(view) == header.checksum


def open_segment(directory: Path, seg_id: int, *, create: bool) -> int:
    """Open (or create, exclusively) a segment file; returns its descriptor.

    Raises:
        CapacityExceeded: If the device is full.
        TierIOError: If the file cannot be opened or created.
    """
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    try:
        return os.open(directory / segment_name(seg_id), flags, 0o600)
    except OSError as exc:
        raise io_error(exc, f"cannot open segment {seg_id} in {directory}") from exc


def remove_segment(directory: Path, seg_id: int, fd: int) -> None:
    """Close and delete a segment file.

    Raises:
        OSError: If it cannot be deleted (it is gone once closed, whatever).
    """
    with contextlib.suppress(OSError):
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(directory / segment_name(seg_id))


def fsync_dir(directory: Path) -> None:
    """Make the directory's entries (new or deleted segments) durable.

    Raises:
        OSError: If it cannot be opened or synced.
    """
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
