"""Tests of the SSD tier: segments, checksums, recovery, compaction, full disks."""

from __future__ import annotations

import errno
import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvdepot.errors import CapacityExceeded, Corrupt, InvalidArgument, Unavailable
from kvdepot.keys import ChunkKey
from kvdepot.store.chunks import checksum
from kvdepot.store.tiers import segments as fmt
from kvdepot.store.tiers.ssd import SsdTier

KiB = 1 << 10
MiB = 1 << 20


def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def put(tier: SsdTier, k: ChunkKey, data: bytes) -> int:
    handle = tier.allocate(len(data))
    assert handle is not None
    tier.write(handle, memoryview(data), key=k, checksum=checksum(data))
    return handle


def read(tier: SsdTier, handle: int, size: int) -> bytes:
    buf = bytearray(size)
    tier.read_into(handle, memoryview(buf))
    return bytes(buf)


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[SsdTier]:
    t = SsdTier(tmp_path / "ssd", 8 * MiB, segment_bytes=MiB, compact_ratio=0)
    yield t
    t.close()


def record_offset(directory: Path, k: ChunkKey) -> tuple[Path, int]:
    """Where the live record of ``k`` is on disk."""
    for seg_id in fmt.segment_ids(directory):
        path = directory / fmt.segment_name(seg_id)
        fd = os.open(path, os.O_RDONLY)
        try:
            for item in fmt.scan(fd, os.fstat(fd).st_size, verify=False):
                if item.header.key == k and item.status == "ok":
                    return path, item.offset
        finally:
            os.close(fd)
    raise AssertionError(f"no record of {k.hex()}")


def test_round_trip_and_reopen_in_write_order(tmp_path: Path) -> None:
    rng = random.Random(1)
    data = {key(i): rng.randbytes(rng.choice([1, 5000, 64 * KiB, 300 * KiB])) for i in range(20)}
    t = SsdTier(tmp_path, 16 * MiB, segment_bytes=MiB)
    handles = {k: put(t, k, d) for k, d in data.items()}
    for k, d in data.items():
        assert read(t, handles[k], len(d)) == d
    assert t.segments > 1  # rolled over at 1 MiB
    t.close()
    t = SsdTier(tmp_path, 16 * MiB, segment_bytes=MiB)
    try:
        found = t.recover()
        assert [c.key for c in found] == list(data)
        assert t.recover() == []  # handed over once
        for c in found:
            assert (c.size, c.checksum) == (len(data[c.key]), checksum(data[c.key]))
            assert read(t, c.handle, c.size) == data[c.key]
        assert t.dropped_on_open == 0
    finally:
        t.close()


def test_a_flipped_byte_is_corrupt_never_returned(tier: SsdTier) -> None:
    data = os.urandom(100 * KiB)
    handle = put(tier, key(1), data)
    path, offset = record_offset(tier.directory, key(1))
    with open(path, "r+b") as f:
        f.seek(offset + fmt.HEADER.size + 5000)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    buf = bytearray(len(data))
    with pytest.raises(Corrupt, match="checksum"):
        tier.read_into(handle, memoryview(buf))


def test_corrupt_and_truncated_records_are_dropped_on_open(tmp_path: Path) -> None:
    d = tmp_path / "ssd"
    t = SsdTier(d, 8 * MiB, segment_bytes=4 * MiB)
    data = {key(i): os.urandom(64 * KiB) for i in range(6)}
    for k, v in data.items():
        put(t, k, v)
    t.close()
    path, offset = record_offset(d, key(2))
    with open(path, "r+b") as f:  # corrupt the payload of chunk 2
        f.seek(offset + fmt.HEADER.size + 10)
        f.write(b"\x00\x01\x02")
    _, last = record_offset(d, key(5))
    os.truncate(path, last + fmt.HEADER.size + 1000)  # a crash mid-write of chunk 5
    t = SsdTier(d, 8 * MiB, segment_bytes=4 * MiB)
    try:
        found = {c.key for c in t.recover()}
        assert found == set(data) - {key(2), key(5)}
        assert t.dropped_on_open == 2
    finally:
        t.close()
    # The corrupt record was marked freed: not examined (nor counted) again.
    t = SsdTier(d, 8 * MiB, segment_bytes=4 * MiB)
    try:
        assert {c.key for c in t.recover()} == found
        assert t.dropped_on_open == 1  # the truncated tail is still there
    finally:
        t.close()


def test_garbage_between_records_is_skipped(tmp_path: Path) -> None:
    d = tmp_path / "ssd"
    t = SsdTier(d, 8 * MiB, segment_bytes=4 * MiB)
    for i in range(3):
        put(t, key(i), os.urandom(10 * KiB))
    t.close()
    path, offset = record_offset(d, key(1))
    with open(path, "r+b") as f:  # a torn header
        f.seek(offset + 8)
        f.write(os.urandom(40))
    t = SsdTier(d, 8 * MiB, segment_bytes=4 * MiB, verify_on_open=False)
    try:
        assert [c.key for c in t.recover()] == [key(0), key(2)]
    finally:
        t.close()


def test_freed_records_never_come_back(tmp_path: Path) -> None:
    d = tmp_path / "ssd"
    t = SsdTier(d, 8 * MiB, segment_bytes=4 * MiB)
    handles = [put(t, key(i), os.urandom(8 * KiB)) for i in range(4)]
    t.free(handles[1])
    with pytest.raises(InvalidArgument):
        t.free(handles[1])
    t.close()
    t = SsdTier(d, 8 * MiB, segment_bytes=4 * MiB)
    try:
        assert [c.key for c in t.recover()] == [key(0), key(2), key(3)]
    finally:
        t.close()


def test_capacity_counts_files_and_emptied_segments_are_deleted(tier: SsdTier) -> None:
    chunk = 200 * KiB  # a 204 KiB span: 5 per 1 MiB segment
    handles = []
    while (h := tier.allocate(chunk)) is not None:
        tier.write(h, memoryview(bytes(chunk)), key=key(len(handles)), checksum=0)
        handles.append(h)
    assert tier.used_bytes <= tier.capacity
    assert len(handles) == tier.capacity // fmt.record_span(chunk)
    segments = tier.segments
    for h in handles[:5]:  # the whole first segment
        tier.free(h)
    assert tier.segments == segments - 1
    assert tier.allocate(chunk) is not None  # its space came back
    # The file goes on the tier's threads; + 1 for the LOCK file.
    wait_for(lambda: len(os.listdir(tier.directory)) == tier.segments + 1)


def test_compaction_reclaims_holes_and_keeps_every_byte(tmp_path: Path) -> None:
    d = tmp_path / "ssd"
    t = SsdTier(d, 16 * MiB, segment_bytes=MiB, compact_ratio=0.4, compact_interval_s=60)
    data = {key(i): os.urandom(100 * KiB) for i in range(40)}
    handles = {k: put(t, k, v) for k, v in data.items()}
    for i, k in enumerate(list(data)):
        if i % 2:
            t.free(handles.pop(k))
            del data[k]
    used = t.used_bytes
    while t.compact_once():
        pass
    assert t.compactions >= 3
    assert t.used_bytes < used * 0.75
    for k, v in data.items():
        assert read(t, handles[k], len(v)) == v  # handles survive moves
    t.close()
    t = SsdTier(d, 16 * MiB, segment_bytes=MiB)
    try:
        found = t.recover()
        assert {c.key for c in found} == set(data)  # no duplicates, no resurrections
        for c in found:
            assert read(t, c.handle, c.size) == data[c.key]
    finally:
        t.close()


def test_a_second_store_cannot_open_the_same_directory(tier: SsdTier) -> None:
    with pytest.raises(Unavailable, match="in use"):
        SsdTier(tier.directory, MiB)


def test_a_full_disk_is_capacity_exceeded(tier: SsdTier, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(*args: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    handle = tier.allocate(10 * KiB)
    assert handle is not None
    monkeypatch.setattr(os, "pwritev", full)
    with pytest.raises(CapacityExceeded, match="device full"):
        tier.write(handle, memoryview(bytes(10 * KiB)), key=key(1), checksum=0)
    monkeypatch.undo()
    tier.free(handle)
    assert tier.used_bytes == 0  # the failed record's segment went with it
    put(tier, key(2), b"still works")


@pytest.mark.parametrize(
    ("policy", "during", "after"), [("always", 3, 3), ("segment", 2, 3), ("never", 0, 0)]
)
def test_fsync_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy: str, during: int, after: int
) -> None:
    calls: list[int] = []
    real = os.fdatasync

    def counted(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", counted)
    t = SsdTier(tmp_path / "ssd", 8 * MiB, segment_bytes=8 * KiB, fsync=policy, io_threads=1)
    try:
        for i in range(3):  # 4 KiB + 64 B: a segment each
            put(t, key(i), bytes(4 * KiB))
        t.executor.submit(lambda: None).result()  # one thread: what was queued ran
        # "always": every chunk; "segment": the two sealed segments.
        assert len(calls) == during
    finally:
        t.close()
    # Closing syncs what is not yet durable (for "segment", the active segment).
    assert len(calls) == after


def test_bad_settings_and_handles(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument):
        SsdTier(tmp_path, 100)
    with pytest.raises(InvalidArgument):
        SsdTier(tmp_path, MiB, fsync="sometimes")
    t = SsdTier(tmp_path, MiB)
    try:
        with pytest.raises(Unavailable):
            t.read_into(12345, memoryview(bytearray(1)))
        h = t.allocate(10)
        assert h is not None
        with pytest.raises(Unavailable, match="not readable"):
            t.read_into(h, memoryview(bytearray(10)))  # not written yet
        with pytest.raises(InvalidArgument):
            t.write(h, memoryview(bytes(11)), key=key(1), checksum=0)
    finally:
        t.close()
