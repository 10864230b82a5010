"""Store daemons with a DRAM and an SSD tier, as real processes: demotion and
promotion under pressure, SIGKILL and restart on the same SSD directory,
corrupt chunks on disk, and a disk that fills up."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvdepot.cluster import LocalCluster, wait_nodes, wait_ready
from kvdepot.connector.client import ClientConfig, KVDepotClient
from kvdepot.connector.transport import GetItem, ShmTransport
from kvdepot.metadata.keys import ChunkKey, Namespace, chunk_keys
from kvdepot.proto.gen import common_pb2, store_pb2, store_pb2_grpc
from kvdepot.store.tiers import segments as fmt

pytestmark = pytest.mark.integration

NS = Namespace("test/tiers", chunk_tokens=16)
MiB = 1 << 20


def payload(key: bytes, size: int = MiB) -> np.ndarray:
    rng = np.random.default_rng(int.from_bytes(key, "little"))
    return np.frombuffer(rng.bytes(size), dtype=np.uint8)


def prompts(n: int, chunks: int = 2) -> list[list[ChunkKey]]:
    return [chunk_keys(NS, [p] * 16 * chunks) for p in range(n)]


def store_stats(grpc_address: str) -> store_pb2.StoreStats:
    with grpc.insecure_channel(grpc_address) as ch:
        return store_pb2_grpc.StoreStub(ch).GetStats(store_pb2.StoreStatsRequest(), timeout=5)


def tiers(grpc_address: str) -> dict[str, common_pb2.TierStats]:
    return {t.name: t for t in store_stats(grpc_address).tiers}


def wait_for(cond: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def read_back(c: KVDepotClient, keys: list[ChunkKey]) -> int:
    """Chunks of ``keys`` read back (each byte-exact), one at a time."""
    ok = 0
    for k in keys:
        buf = np.zeros(MiB, dtype=np.uint8)
        if c.get_into([k], [buf]).leading == 1:
            assert np.array_equal(buf, payload(k)), f"chunk {k.hex()} differs"
            ok += 1
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


def test_demotion_and_promotion_under_pressure_keep_every_byte(tmp_path: Path) -> None:
    ssd_dir = tmp_path / "ssd"
    with (
        LocalCluster(
            nodes=1,
            capacity="8MiB",
            lease_ttl_s=2,
            heartbeat_interval_s=0.3,
            log_dir=tmp_path / "logs",
            extra_store_args=("--ssd-dir", str(ssd_dir), "--ssd-capacity", "64MiB"),
        ) as cl,
        KVDepotClient(ClientConfig(metadata=cl.metadata_address)) as c,
    ):
        store = cl.stores[0].info
        assert store["tiers"] == ["cpu", "ssd"]
        keys = [k for p in prompts(12) for k in p]  # 24 MiB into 8 MiB of DRAM
        for i in range(0, len(keys), 2):
            r = c.put(keys[i : i + 2], [payload(k) for k in keys[i : i + 2]])
            assert r.failed == 0
        assert c.lookup(keys) == len(keys)  # nothing was dropped
        t = tiers(store["grpc_address"])
        assert t["cpu"].demotions > 0 and t["ssd"].chunks > 0
        assert read_back(c, keys) == len(keys)  # over tcp: SSD chunks promoted
        # A same-host client maps DRAM: SSD chunks are promoted for it first.
        cold = [h for h in keys if h not in keys[-4:]][:6]
        with ShmTransport(io_timeout_s=5) as shm:
            bufs = [bytearray(MiB) for _ in cold]
            outs = shm.get_into(
                store["address"],
                [GetItem(k, memoryview(b)) for k, b in zip(cold, bufs, strict=True)],
            )
            assert all(o.ok for o in outs)
            for k, b in zip(cold, bufs, strict=True):
                assert np.array_equal(np.frombuffer(b, dtype=np.uint8), payload(k))
        t = tiers(store["grpc_address"])
        assert t["ssd"].promotions > 0 and t["ssd"].hits > 0
        assert t["cpu"].used_bytes <= t["cpu"].capacity_bytes
        out = subprocess.run(
            [sys.executable, "-m", "kvdepot.cli", "stats", "--json", "--metadata",
             cl.metadata_address],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
        (node,) = json.loads(out.stdout)["nodes"]
        listed = {t["name"]: t for t in node["tiers"]}
        assert set(listed) == {"cpu", "ssd"}
        assert listed["ssd"]["capacity_bytes"] == 64 * MiB
        for field in ("used_bytes", "chunks", "hits", "misses", "evictions", "promotions"):
            assert field in listed["ssd"]
        assert listed["cpu"]["demotions"] > 0


def test_sigkill_then_restart_serves_ssd_chunks_and_drops_corrupt_ones(tmp_path: Path) -> None:
    ssd_dir = tmp_path / "ssd"
    args = (
        "--ssd-dir", str(ssd_dir), "--ssd-capacity", "64MiB", "--ssd-fsync", "never",
        # Demote nearly everything in the background: what SIGKILL loses is DRAM only.
        "--watermarks", "cpu=0.3:0.1",
    )  # fmt: skip
    with LocalCluster(
        nodes=0, capacity="16MiB", lease_ttl_s=2, heartbeat_interval_s=0.3,
        log_dir=tmp_path / "logs",
    ) as cl, KVDepotClient(ClientConfig(metadata=cl.metadata_address)) as c:  # fmt: skip
        first = cl.add_store("s0", *args)
        keys = [k for p in prompts(6) for k in p]
        assert c.put(keys, [payload(k) for k in keys]).failed == 0
        wait_for(lambda: tiers(first.info["grpc_address"])["ssd"].chunks >= 10)
        os.kill(first.pid, signal.SIGKILL)
        first.proc.wait()
        on_ssd = [k for k in keys if _on_disk(ssd_dir, k)]
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
        wait_for(lambda: all(c.lookup([k]) == 1 for k in good))
        assert c.lookup([bad]) == 0
        for k in keys:
            if k not in on_ssd:
                assert c.lookup([k]) == 0  # lost with DRAM, and not listed
        loc = c.lookup_locations(good[:1])
        assert [r.tier for r in loc.locations[0].replicas] == ["ssd"]
        assert read_back(c, good[:5]) == 5

        # Corrupted while the store runs: a miss, and the index forgets it.
        victim = good[-1]
        assert tiers(grpc_address)["ssd"].chunks >= len(good) - 5
        assert corrupt_record(ssd_dir, victim)
        assert read_back(c, [victim]) == 0
        wait_for(lambda: c.lookup([victim]) == 0)
        assert store_stats(grpc_address).chunks_corrupt == s.chunks_corrupt + 1


def _on_disk(ssd_dir: Path, key: bytes) -> bool:
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


def test_a_full_disk_costs_chunks_not_the_store(tmp_path: Path) -> None:
    limit = 3 * MiB

    def small_files() -> None:  # writes past 3 MiB in a file fail with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    with LocalCluster(nodes=0, lease_ttl_s=2, heartbeat_interval_s=0.3) as cl:
        log = open(tmp_path / "store.log", "wb")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvdepot.cli", "store", "--node-id", "full", "--port", "0",
             "--metadata", cl.metadata_address, "--capacity", "8MiB",
             "--ssd-dir", str(tmp_path / "ssd"), "--ssd-capacity", "64MiB",
             "--ssd-segment", "16MiB", "--no-shm"],  # the limit would hit the arena file too
            stdout=subprocess.PIPE, stderr=log, preexec_fn=small_files,
        )  # fmt: skip
        try:
            info = wait_ready(proc, "store", 30)
            wait_nodes(cl.metadata_address, 1)
            with KVDepotClient(ClientConfig(metadata=cl.metadata_address)) as c:
                keys = [k for p in prompts(12) for k in p]
                for i in range(0, len(keys), 2):
                    assert c.put(keys[i : i + 2], [payload(k) for k in keys[i : i + 2]]).failed == 0
                wait_for(lambda: store_stats(info["grpc_address"]).tier_write_errors > 0)
                assert proc.poll() is None  # the store lives on
                # Lost chunks leave the index; the others read back intact.
                # (Reading promotes chunks, which pushes others out of DRAM
                # onto the full disk: some listed now may be lost meanwhile.)
                wait_for(lambda: c.lookup(keys[-2:]) == 2)
                listed = [k for k in keys if c.lookup([k]) == 1]
                assert len(listed) < len(keys)
                lost = [k for k in listed if read_back(c, [k]) == 0]
                assert len(lost) < len(listed)
                wait_for(lambda: all(c.lookup([k]) == 0 for k in lost))
                # New puts still land.
                fresh = chunk_keys(NS, [999] * 16 * 2)
                assert c.put(fresh, [payload(k) for k in fresh]).failed == 0
                assert read_back(c, fresh) == 2
        finally:
            proc.kill()
            proc.wait()
            log.close()
            if proc.stdout is not None:
                proc.stdout.close()
