"""A disk that fails under a running store, with real I/O errors.

The store daemon runs under an ``LD_PRELOAD`` shim (``eio_shim.c``, built
here with gcc) that makes every open, read, write and sync of a file in its
SSD directory fail with EIO once a trigger file exists: the errors reach the
store's code through the C library, where a dying disk's would.

What must hold: the failing tier is taken out, not believed. A lookup never
names a chunk the store can no longer serve (no phantom hits), the store
keeps serving from DRAM and taking puts, its stats and health say it is
degraded and why, and its log says so in a few lines, not one per chunk.

The chunk table's own tests below inject the errors where the SSD tier does
its I/O (one bad read; a device failing everything) and run in-process.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import re
import shutil
import subprocess
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvdepot.apps.cluster import LocalCluster
from kvdepot.connector.client import ClientConfig, KVDepotClient
from kvdepot.keys import ChunkKey, Namespace, chunk_keys
from kvdepot.records import TierStats
from kvdepot.store.chunks import ChunkStore, checksum
from kvdepot.store.tiers import segments as fmt
from kvdepot.store.tiers.faults import IoFaults, TierFailed
from kvdepot.store.tiers.policy import TieringOptions
from kvdepot.store.tiers.ssd import SsdTier
from tests.faults.support import ReadTally, payload, sentinel_buffers, store_stats, wait_for

pytestmark = [pytest.mark.faults, pytest.mark.integration]

NS = Namespace("test/faults/failing-disk", chunk_tokens=16)
CHUNK = 256 << 10
CHUNKS = 160
SHIM = Path(__file__).with_name("eio_shim.c")
MOST_WARNINGS = 10
"""Lines at WARNING or above a store may log about its failing disk: a few
per kind of failure, never one per chunk."""


def data(key: bytes) -> np.ndarray:
    return payload(key, CHUNK)


def build_shim(tmp_path: Path) -> Path:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is needed to build the EIO shim")
    out = tmp_path / "eio_shim.so"
    subprocess.run(
        [gcc, "-shared", "-fPIC", "-O2", "-o", str(out), str(SHIM), "-ldl"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return out


def phantoms(c: KVDepotClient, keys: list[ChunkKey], tally: ReadTally) -> tuple[int, int]:
    """(chunks a lookup names, of those, chunks a get_into loads)."""
    listed = [k for k in keys if c.lookup([k]) == 1]
    loaded = 0
    for k in listed:
        bufs = sentinel_buffers(1, CHUNK)
        loaded += tally.add([k], bufs, c.get_into([k], bufs), data)
    return len(listed), loaded


def serving(grpc_address: str) -> int:
    with grpc.insecure_channel(grpc_address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return int(reply.status)


def warnings_in(log: str) -> list[str]:
    return [line for line in log.splitlines() if re.search(r" (WARNING|ERROR|CRITICAL) ", line)]


def test_a_failing_disk_is_taken_out_not_believed(tmp_path: Path) -> None:
    """160 chunks of 256 KiB into a store with 8 MiB of DRAM and an SSD tier
    whose file system starts answering EIO after the 80th put.

    Lost: the chunks on the SSD and those on their way to it. Served wrong:
    nothing. Named by a lookup but not served: nothing, within seconds.
    """
    shim = build_shim(tmp_path)
    ssd_dir = (tmp_path / "ssd").resolve()
    trigger = tmp_path / "disk-fails"
    tally = ReadTally()
    logs = tmp_path / "logs"
    with LocalCluster(
        nodes=0, capacity="8MiB", lease_ttl_s=2, heartbeat_interval_s=0.3, log_dir=logs
    ) as cl:
        # Only the store runs on the failing disk.
        cl.env = {
            **os.environ,
            "LD_PRELOAD": str(shim),
            "EIO_SHIM_DIR": str(ssd_dir),
            "EIO_SHIM_TRIGGER": str(trigger),
        }
        store = cl.add_store(
            "sick", "--ssd-dir", str(ssd_dir), "--ssd-capacity", "64MiB", "--ssd-segment", "4MiB"
        )
        cl.env = None
        grpc_address = str(store.info["grpc_address"])
        with KVDepotClient(ClientConfig(metadata=cl.metadata_address)) as c:
            keys = [k for p in range(CHUNKS) for k in chunk_keys(NS, [p] * 16)]
            for i, k in enumerate(keys):
                if i == CHUNKS // 2:
                    trigger.touch()
                assert c.put([k], [data(k)]).failed == 0, f"put {i} failed"
            assert (
                store_stats(grpc_address).tier_write_errors
                + sum(t.chunks for t in store_stats(grpc_address).tiers if t.name == "ssd")
                > 0
            ), "nothing reached the SSD tier"

            # No phantom hits: within seconds, every chunk a lookup names loads.
            seen: list[tuple[int, int]] = []

            def consistent() -> bool:
                seen.append(phantoms(c, keys, tally))
                return seen[-1][0] == seen[-1][1]

            try:
                wait_for(consistent, 10, "lookup names chunks get_into cannot load")
            except AssertionError as exc:
                raise AssertionError(f"{exc}; (listed, loaded): {seen[-3:]}") from None
            time.sleep(1.0)
            listed, loaded = phantoms(c, keys, tally)
            assert listed == loaded, f"{listed} listed, {loaded} loaded a second later"
            assert listed > 0, "DRAM should still serve the newest chunks"
            assert c.lookup(keys[-1:]) == 1

            # The store lives, takes new puts and serves them.
            fresh = chunk_keys(NS, [99_999] * 16 * 2)
            assert c.put(fresh, [data(k) for k in fresh]).failed == 0
            bufs = sentinel_buffers(2, CHUNK)
            assert tally.add(fresh, bufs, c.get_into(fresh, bufs), data) == 2

            # Degraded, and says why; still SERVING: DRAM works.
            s = store_stats(grpc_address)
            assert "ssd" in s.degraded and "Input/output error" in s.degraded, s.degraded
            assert s.tier_write_errors + s.tier_read_errors > 0
            ssd = next(t for t in s.tiers if t.name == "ssd")
            assert ssd.chunks == 0, "a failed tier keeps no chunks"
            assert serving(grpc_address) == health_pb2.HealthCheckResponse.SERVING
        assert store.proc.poll() is None
    assert tally.wrong == 0, f"{tally.wrong} chunks served with wrong bytes"
    log = (logs / "sick.log").read_text()
    assert "Traceback" not in log, log[-4000:]
    warned = warnings_in(log)
    assert len(warned) <= MOST_WARNINGS, "\n".join(warned[:40])
    assert any("ssd tier failed" in line for line in warned), "\n".join(warned)


# -- the chunk table alone, with errors injected where the SSD tier does I/O ------
KiB = 1 << 10


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def blob(i: int) -> bytes:
    return random.Random(i).randbytes(64 * KiB)


class Table:
    """A chunk table of 1 MiB of DRAM over an SSD tier, and what it reported."""

    def __init__(self, directory: Path) -> None:
        self.removed: list[ChunkKey] = []
        self.cs = ChunkStore(
            1 << 20,
            on_removed=self.removed.extend,
            tiers=[SsdTier(directory, 8 << 20, segment_bytes=1 << 20)],
            options=TieringOptions(maintenance_interval_s=0.05),
        )

    def put(self, i: int) -> None:
        data = blob(i)
        res = self.cs.reserve(key(i), len(data), checksum(data))
        assert res is not None
        res.view[:] = data
        self.cs.commit(res)

    def get(self, i: int) -> bytes | None:
        lease = self.cs.acquire(key(i))
        if lease is None:
            return None
        try:
            return bytes(lease.view)
        finally:
            self.cs.release(lease)

    def tier(self, name: str) -> TierStats:
        return next(t for t in self.cs.tier_stats() if t.name == name)

    def on_ssd(self) -> list[int]:
        """The chunks on SSD whose bytes are written (none pending)."""
        wait_for(lambda: not self.cs.levels[1].pending_bytes, 10, "writes to SSD pending")
        return [int.from_bytes(h.key, "big") for h in self.cs.holdings() if h.tier == "ssd"]


def eio(*args: object, **kwargs: object) -> int:
    raise OSError(errno.EIO, os.strerror(errno.EIO))


def test_one_unreadable_chunk_costs_that_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = Table(tmp_path / "ssd")
    try:
        for i in range(30):
            t.put(i)
        bad, good = t.on_ssd()[:2]
        read = fmt.pread_into
        calls = iter([eio])
        monkeypatch.setattr(fmt, "pread_into", lambda *a: next(calls, read)(*a))
        assert t.get(bad) is None
        assert t.removed == [key(bad)]  # out of the index: no phantom hit
        assert not t.cs.contains(key(bad))
        s = t.cs.stats()
        assert (s.read_errors, s.degraded) == (1, "")
        assert t.get(good) == blob(good)  # one bad sector is not a bad disk
    finally:
        t.cs.close()


def test_a_failing_device_is_taken_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    t = Table(tmp_path / "ssd")
    try:
        for i in range(30):
            t.put(i)
        on_ssd = t.on_ssd()
        assert len(on_ssd) >= 10
        monkeypatch.setattr(fmt, "pread_into", eio)
        monkeypatch.setattr(fmt, "pwrite_all", eio)
        assert [t.get(i) for i in on_ssd[:3]] == [None] * 3
        wait_for(lambda: t.tier("ssd").chunks == 0, 10, "the failed tier keeps chunks")
        assert {key(i) for i in on_ssd} <= set(t.removed)
        assert all(not t.cs.contains(key(i)) for i in on_ssd)
        s = t.cs.stats()
        assert s.degraded.startswith("ssd tier failed: 3 I/O errors"), s.degraded
        assert "Input/output error" in s.degraded
        assert s.read_errors >= len(on_ssd)

        # DRAM serves on: puts land, and room is made by dropping, not demoting.
        demoted = t.tier("cpu").demotions
        for i in range(100, 140):
            t.put(i)
        assert t.get(139) == blob(139)
        assert t.tier("cpu").demotions == demoted
        assert t.tier("cpu").evictions > 0
        assert len(t.removed) == len(set(t.removed))  # each loss reported once
    finally:
        t.cs.close()
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) <= MOST_WARNINGS, [r.getMessage() for r in warned]
    assert not any(r.exc_info for r in warned)


def test_a_tier_fails_on_errors_close_together_not_on_a_full_disk() -> None:
    now = [0.0]
    faults = IoFaults("ssd", "/nvme", errors=3, window_s=10.0, clock=lambda: now[0])
    eio_error = OSError(errno.EIO, "Input/output error")
    for _ in range(5):
        assert not faults.error(OSError(errno.ENOSPC, "No space left on device"))
    assert not faults.error(eio_error)
    now[0] = 11.0  # the first one is out of the window
    assert not faults.error(eio_error)
    assert not faults.error(eio_error)
    assert faults.failure is None
    faults.check()
    now[0] = 12.0
    assert faults.error(eio_error, "sync a segment")
    assert faults.failure == (
        "ssd tier failed: 3 I/O errors in 1.0 s, the last: "
        "cannot sync a segment: [Errno 5] Input/output error"
    )
    with pytest.raises(TierFailed, match="ssd tier failed"):
        faults.check()
    assert not faults.error(eio_error)  # failed once, for good
    assert faults.total == 5
