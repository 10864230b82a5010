"""Hot chunks, with real daemons: a prefix read from many nodes gets more
replicas (on the readers' nodes, up to the configured count) and readers
without a copy of their own are spread over the replicas."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from kvdepot.apps.cluster import LocalCluster
from kvdepot.connector.client import ClientConfig, KVDepotClient
from tests.faults.support import store_stats

pytestmark = [pytest.mark.integration]

CHUNK = 64 << 10
MAX_REPLICAS = 3


def replica_nodes(client: KVDepotClient, keys: list[bytes]) -> list[set[str]]:
    reply = client.lookup_locations(keys, count="none")
    return [{r.node_id for r in loc.replicas} for loc in reply.locations]


@pytest.mark.timeout(180)
def test_a_hot_prefix_gets_replicas_and_its_readers_spread(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "KVDEPOT_METADATA_HOT_READS": "4",
        "KVDEPOT_METADATA_HOT_MAX_REPLICAS": str(MAX_REPLICAS),
    }
    with LocalCluster(
        nodes=4, capacity="64MiB", lease_ttl_s=1.5, heartbeat_interval_s=0.3,
        log_dir=tmp_path / "logs", env=env,
    ) as cluster:  # fmt: skip
        address = cluster.metadata_address
        rng = np.random.default_rng(3)
        keys = [rng.bytes(16) for _ in range(4)]
        data = [np.frombuffer(rng.bytes(CHUNK), dtype=np.uint8) for _ in keys]

        def client(node: str = "") -> KVDepotClient:
            return KVDepotClient(ClientConfig(metadata=address, node_id=node, transport="tcp"))

        with client("store-0") as writer:
            assert writer.put(keys, data).stored == 4
        readers = [client(f"store-{i}") for i in (1, 2, 3)]
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                for r in readers:
                    bufs = [np.zeros(CHUNK, dtype=np.uint8) for _ in keys]
                    got = r.get_into(keys, bufs)
                    assert all(got.loaded)
                    assert all(np.array_equal(b, d) for b, d in zip(bufs, data, strict=True))
                if all(len(n) >= MAX_REPLICAS for n in replica_nodes(readers[0], keys)):
                    break
                time.sleep(0.1)
            # Copies went to readers' nodes, and stopped at the configured count.
            time.sleep(1.5)
            for r in readers:
                r.get_into(keys, [np.zeros(CHUNK, dtype=np.uint8) for _ in keys])
            holders = replica_nodes(readers[0], keys)
            assert all(len(n) == MAX_REPLICAS and "store-0" in n for n in holders), holders
        finally:
            for r in readers:
                r.close()

        # A reader without a store of its own: its reads go to every replica in turn.
        holding = set.intersection(*holders)
        grpc_of = {s.name: s.info["grpc_address"] for s in cluster.stores}
        before = {n: store_stats(grpc_of[n]).gets for n in holding}
        with client() as outsider:
            for _ in range(30):
                bufs = [np.zeros(CHUNK, dtype=np.uint8) for _ in keys]
                assert all(outsider.get_into(keys, bufs).loaded)
        served = {n: store_stats(grpc_of[n]).gets - before[n] for n in holding}
        assert len(served) >= 2 and all(v > 0 for v in served.values()), served
