"""Faults of the SSD tier, with real store daemons: chunks corrupted in the
segment files on disk (found at restart and while running) and a file system
that fills up under the tier.

Whatever the disk does, a reader gets the published bytes or a miss, and the
store stays up: a bad or unwritable chunk costs that chunk, counted, and is
dropped from the index.
"""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kvdepot.apps.cluster import LocalCluster
from kvdepot.connector.client import ClientConfig, KVDepotClient
from kvdepot.keys import ChunkKey, Namespace, chunk_keys
from kvdepot.proto.gen import common_pb2
from kvdepot.store.tiers import segments as fmt
from tests.faults.support import ReadTally, payload, sentinel_buffers, store_stats, wait_for

pytestmark = [pytest.mark.faults, pytest.mark.integration]

NS = Namespace("test/faults/disk", chunk_tokens=16)
MiB = 1 << 20
MOST_WARNINGS = 10
"""Lines at WARNING or above a store may log about a full disk."""


def data(key: bytes) -> np.ndarray:
    return payload(key, MiB)


def prompts(n: int, chunks: int = 2) -> list[list[ChunkKey]]:
    return [chunk_keys(NS, [p] * 16 * chunks) for p in range(n)]


def tiers(grpc_address: str) -> dict[str, common_pb2.TierStats]:
    return {t.name: t for t in store_stats(grpc_address).tiers}


def read_back(c: KVDepotClient, keys: list[ChunkKey], tally: ReadTally) -> int:
    """Chunks of ``keys`` read back, one get each into a sentinel buffer (all checked)."""
    ok = 0
    for k in keys:
        bufs = sentinel_buffers(1, MiB)
        ok += tally.add([k], bufs, c.get_into([k], bufs), data)
    return ok


def corrupt_record(ssd_dir: Path, key: bytes) -> bool:
    """Flip bytes in the payload of ``key``'s record; whether it was found."""
    for seg_id in fmt.segment_ids(ssd_dir):
        fd = os.open(ssd_dir / fmt.segment_name(seg_id), os.O_RDWR)
        try:
            for item in fmt.scan(fd, os.fstat(fd).st_size, verify=False):
                if item.header.key == key and item.status == "ok":
                    at = item.offset + fmt.HEADER.size + 4096
                    old = os.pread(fd, 2, at)
                    os.pwrite(fd, bytes(b ^ 0xFF for b in old), at)
                    return True
        finally:
            os.close(fd)
    return False


def on_disk(ssd_dir: Path, key: bytes) -> bool:
    """Whether ``key`` has an intact record in a segment file."""
    for seg_id in fmt.segment_ids(ssd_dir):
        fd = os.open(ssd_dir / fmt.segment_name(seg_id), os.O_RDONLY)
        try:
            if any(
                item.header.key == key and item.status == "ok"
                for item in fmt.scan(fd, os.fstat(fd).st_size, verify=True)
            ):
                return True
        finally:
            os.close(fd)
    return False


def test_corrupt_ssd_chunks_are_misses_at_restart_and_while_running(tmp_path: Path) -> None:
    """A store is SIGKILLed with most chunks demoted to SSD; one record is
    corrupted in its segment file, the store restarts on the directory; then
    another record is corrupted under the running store.

    Lost: the chunks that were only in DRAM at the kill, and the two corrupted
    chunks (each counted in ``chunks_corrupt``, neither listed after it was
    found). Served wrong: nothing: every read is exact or a miss, and the
    store keeps serving the other chunks.
    """
    ssd_dir = tmp_path / "ssd"
    args = (
        "--ssd-dir", str(ssd_dir), "--ssd-capacity", "64MiB", "--ssd-fsync", "never",
        # Demote nearly everything in the background: what SIGKILL loses is DRAM only.
        "--watermarks", "cpu=0.3:0.1",
    )  # fmt: skip
    tally = ReadTally()
    with (
        LocalCluster(
            nodes=0,
            capacity="16MiB",
            lease_ttl_s=2,
            heartbeat_interval_s=0.3,
            log_dir=tmp_path / "logs",
        ) as cl,
        KVDepotClient(ClientConfig(metadata=cl.metadata_address)) as c,
    ):
        first = cl.add_store("s0", *args)
        keys = [k for p in prompts(6) for k in p]
        assert c.put(keys, [data(k) for k in keys]).failed == 0
        try:
            wait_for(
                lambda: tiers(first.info["grpc_address"])["ssd"].chunks >= 10, 30, "no demotions"
            )
        except AssertionError as exc:  # say where the store stood
            log = (tmp_path / "logs" / "s0.log").read_text().splitlines()[-20:]
            raise AssertionError(
                f"{exc}; tiers: {tiers(first.info['grpc_address'])}; store log: {log}"
            ) from None
        os.kill(first.pid, signal.SIGKILL)
        first.proc.wait()
        on_ssd = [k for k in keys if on_disk(ssd_dir, k)]
        assert len(on_ssd) >= 10
        bad = on_ssd[0]
        assert corrupt_record(ssd_dir, bad)

        info = cl.add_store("s0", *args).info  # same node, same directory
        grpc_address = str(info["grpc_address"])
        s = store_stats(grpc_address)
        assert s.chunks_recovered == len(on_ssd) - 1
        # The corrupted one, and maybe a record SIGKILL cut short mid-write.
        assert s.chunks_corrupt >= 1
        good = on_ssd[1:]
        # The index agrees: the restarted store announced exactly its SSD chunks.
        wait_for(lambda: all(c.lookup([k]) == 1 for k in good), 15, "SSD chunks not announced")
        assert c.lookup([bad]) == 0
        assert read_back(c, [bad], tally) == 0
        for k in keys:
            if k not in on_ssd:
                assert c.lookup([k]) == 0  # lost with DRAM, and not listed
        loc = c.lookup_locations(good[:1])
        assert [r.tier for r in loc.locations[0].replicas] == ["ssd"]
        assert read_back(c, good[:5], tally) == 5

        # Corrupted while the store runs: a miss, counted, and the index forgets it.
        victim = good[-1]
        assert tiers(grpc_address)["ssd"].chunks >= len(good) - 5
        assert corrupt_record(ssd_dir, victim)
        assert read_back(c, [victim], tally) == 0
        wait_for(lambda: c.lookup([victim]) == 0, 10, "the corrupt chunk is still listed")
        assert store_stats(grpc_address).chunks_corrupt == s.chunks_corrupt + 1
        # The store keeps serving everything else.
        assert read_back(c, good[5:-1], tally) == len(good) - 6
    assert tally.wrong == 0, f"{tally.wrong} chunks served with wrong bytes"


@dataclass
class SmallDisk:
    """A directory that runs out of space after ``limit`` bytes.

    ``how`` is ``tmpfs`` (a file system of that size mounted there: writes
    fail with ENOSPC once its segment files fill it) or ``fsize`` (where
    mounting is not allowed: the store process gets RLIMIT_FSIZE, and writes
    past ``limit`` in one segment file fail with EFBIG).
    """

    path: Path
    limit: int
    how: str

    def ssd_args(self) -> tuple[str, ...]:
        """SSD tier flags of a store on this disk: far more capacity than it has."""
        # RLIMIT_FSIZE bounds each file: segments must be larger than the limit.
        segment = "4MiB" if self.how == "tmpfs" else "16MiB"
        return ("--ssd-dir", str(self.path), "--ssd-capacity", "64MiB", "--ssd-segment", segment)

    def confine(self, pid: int) -> None:
        """Apply the limit to the store process ``pid`` (started already)."""
        if self.how == "fsize":
            # After start-up: the arena file is larger than the limit.
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (self.limit, self.limit))


@pytest.fixture()
def small_disk(tmp_path: Path) -> Iterator[SmallDisk]:
    path = tmp_path / f"small-{uuid.uuid4().hex[:6]}"
    path.mkdir()
    limit = 6 * MiB
    mounted = (
        os.geteuid() == 0
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={limit},mode=0700", "tmpfs", str(path)],
            capture_output=True,
            timeout=20,
            check=False,
        ).returncode
        == 0
    )
    try:
        yield SmallDisk(path, limit, "tmpfs") if mounted else SmallDisk(path, 3 * MiB, "fsize")
    finally:
        if mounted:
            # The store is stopped by now; lazily, should a descriptor linger.
            subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=20)


def test_a_full_disk_costs_chunks_not_the_store(tmp_path: Path, small_disk: SmallDisk) -> None:
    """24 MiB of chunks go into a store with 8 MiB of DRAM whose SSD tier
    (64 MiB configured) sits on a 6 MiB tmpfs: demotions hit ENOSPC (or, where
    mounting is not allowed, EFBIG past 3 MiB of a file under RLIMIT_FSIZE).

    Lost: the chunks whose demotion failed, counted in ``tier_write_errors``
    and dropped from the index; nothing the store still lists. Served wrong:
    nothing: every listed chunk reads back exact or is a miss that then leaves
    the index. The store stays up and takes new puts, and its log says so in
    a few lines with counts, not a line per lost chunk.
    """
    tally = ReadTally()
    with LocalCluster(
        nodes=0, capacity="8MiB", lease_ttl_s=2, heartbeat_interval_s=0.3, log_dir=tmp_path / "logs"
    ) as cl:
        store = cl.add_store("full", *small_disk.ssd_args())
        small_disk.confine(store.pid)
        grpc_address = store.info["grpc_address"]
        with KVDepotClient(ClientConfig(metadata=cl.metadata_address)) as c:
            keys = [k for p in prompts(12) for k in p]
            for i in range(0, len(keys), 2):
                assert c.put(keys[i : i + 2], [data(k) for k in keys[i : i + 2]]).failed == 0
            wait_for(
                lambda: store_stats(grpc_address).tier_write_errors > 0,
                15,
                f"no write error on the full disk ({small_disk.how})",
            )
            assert store.proc.poll() is None  # the store lives on
            # Lost chunks leave the index; the others read back intact.
            # (Reading promotes chunks, which pushes others out of DRAM
            # onto the full disk: some listed now may be lost meanwhile.)
            wait_for(lambda: c.lookup(keys[-2:]) == 2, 10, "the newest chunks are not listed")
            listed = [k for k in keys if c.lookup([k]) == 1]
            assert len(listed) < len(keys)
            lost = [k for k in listed if read_back(c, [k], tally) == 0]
            assert len(lost) < len(listed)
            wait_for(
                lambda: all(c.lookup([k]) == 0 for k in lost), 10, "unreadable chunks still listed"
            )
            # New puts still land.
            fresh = chunk_keys(NS, [999] * 16 * 2)
            assert c.put(fresh, [data(k) for k in fresh]).failed == 0
            assert read_back(c, fresh, tally) == 2
        assert store.proc.poll() is None
    assert tally.wrong == 0, f"{tally.wrong} chunks served with wrong bytes"
    # A full disk costs a few lines, each with a count, never one per chunk.
    log = (tmp_path / "logs" / "full.log").read_text()
    assert "Traceback" not in log, log[-4000:]
    warned = [ln for ln in log.splitlines() if re.search(r" (WARNING|ERROR|CRITICAL) ", ln)]
    assert len(warned) <= MOST_WARNINGS, "\n".join(warned[:40])
