"""Store daemons with a DRAM and an SSD tier, as real processes: demotion and
promotion under pressure. (SIGKILL and restart on the same SSD directory,
corrupt chunks on disk and a disk that fills up are in tests/faults.)"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvdepot.apps.cluster import LocalCluster
from kvdepot.connector.client import ClientConfig, KVDepotClient
from kvdepot.connector.transport import GetItem, ShmTransport
from kvdepot.keys import ChunkKey, Namespace, chunk_keys
from kvdepot.proto.gen import common_pb2, store_pb2, store_pb2_grpc

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
        listed: dict[str, dict[str, int]] = {}

        def demotions_listed() -> bool:
            # Tier figures reach the metadata service with the store's next heartbeat.
            nonlocal listed
            out = subprocess.run(
                [sys.executable, "-m", "kvdepot.apps.cli", "stats", "--json", "--metadata",
                 cl.metadata_address],
                capture_output=True, text=True, timeout=30, check=True,
            )  # fmt: skip
            (node,) = json.loads(out.stdout)["nodes"]
            listed = {t["name"]: t for t in node["tiers"]}
            return listed["cpu"]["demotions"] > 0

        wait_for(demotions_listed)
        assert set(listed) == {"cpu", "ssd"}
        assert listed["ssd"]["capacity_bytes"] == 64 * MiB
        for field in ("used_bytes", "chunks", "hits", "misses", "evictions", "promotions"):
            assert field in listed["ssd"]
        assert listed["cpu"]["demotions"] > 0
