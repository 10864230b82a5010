"""The foundation loop with real daemons: publish, look up, pull, across processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvdepot.apps.cluster import LocalCluster, wait_nodes, wait_ready
from kvdepot.connector.client import ClientConfig, KVDepotClient
from kvdepot.keys import Namespace, chunk_keys
from kvdepot.proto.gen import store_pb2, store_pb2_grpc
from tests.integration.hostile import wait_for

pytestmark = pytest.mark.integration

NS = Namespace("test/model", chunk_tokens=16)


def payload(key: bytes, size: int) -> np.ndarray:
    rng = np.random.default_rng(int.from_bytes(key, "little"))
    return np.frombuffer(rng.bytes(size), dtype=np.uint8)


def store_stats(address: str) -> store_pb2.StoreStats:
    with grpc.insecure_channel(address) as ch:
        return store_pb2_grpc.StoreStub(ch).GetStats(store_pb2.StoreStatsRequest(), timeout=5)


PULL_SCRIPT = r"""
import hashlib, json, sys
import numpy as np
from kvdepot.connector.client import ClientConfig, KVDepotClient
from kvdepot.keys import Namespace, chunk_keys
metadata, size = sys.argv[1], int(sys.argv[2])
tokens = json.loads(sys.stdin.read())
keys = chunk_keys(Namespace("test/model", chunk_tokens=16), tokens)
bufs = [np.zeros(size, dtype=np.uint8) for _ in keys]
with KVDepotClient(ClientConfig(metadata=metadata)) as c:
    hits = c.lookup(keys)
    r = c.get_into(keys, bufs)
digests = [hashlib.sha256(b.tobytes()).hexdigest() for b in bufs[: r.leading]]
print(json.dumps({"hits": hits, "leading": r.leading, "digests": digests}))
"""


def test_publish_in_one_process_pull_in_another(
    cluster: LocalCluster, client: KVDepotClient
) -> None:
    import hashlib

    size = 256 << 10
    tokens = list(range(16 * 6 + 5))
    keys = chunk_keys(NS, tokens)
    bufs = [payload(k, size) for k in keys]
    r = client.put(keys, bufs)
    assert (r.stored, r.skipped, r.failed) == (6, 0, 0)
    assert r.bytes_sent == 6 * size
    out = subprocess.run(
        [sys.executable, "-c", PULL_SCRIPT, cluster.metadata_address, str(size)],
        input=json.dumps(tokens),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    got = json.loads(out.stdout)
    assert got["hits"] == 6 and got["leading"] == 6
    assert got["digests"] == [hashlib.sha256(b.tobytes()).hexdigest() for b in bufs]


def test_second_publish_of_a_prefix_sends_no_chunk_bytes(
    cluster: LocalCluster, client: KVDepotClient
) -> None:
    size = 64 << 10
    system = list(range(16 * 4))
    first = chunk_keys(NS, system + [1000 + i for i in range(32)])
    client.put(first, [payload(k, size) for k in first])
    before = sum(store_stats(s.info["grpc_address"]).bytes_in for s in cluster.stores)
    # Same system prompt, another user turn: only the new chunks travel.
    second = chunk_keys(NS, system + [2000 + i for i in range(32)])
    r = client.put(second, [payload(k, size) for k in second])
    assert (r.stored, r.skipped) == (2, 4)
    assert r.bytes_sent == 2 * size and r.bytes_skipped == 4 * size
    # The very same prompt again: nothing at all is sent.
    r = client.put(second, [payload(k, size) for k in second])
    assert (r.stored, r.skipped, r.bytes_sent) == (0, 6, 0)
    after = sum(store_stats(s.info["grpc_address"]).bytes_in for s in cluster.stores)
    assert after - before == 2 * size
    stats = client.stats()
    assert stats.chunks_deduplicated == 10 and stats.bytes_saved == 10 * size


def test_eviction_keeps_the_index_truthful(tmp_path) -> None:  # type: ignore[no-untyped-def]
    size = 1 << 20
    with LocalCluster(
        nodes=1, capacity="8MiB", lease_ttl_s=2, heartbeat_interval_s=0.3, log_dir=tmp_path
    ) as cl, KVDepotClient(ClientConfig(metadata=cl.metadata_address)) as c:
        prompts = [chunk_keys(NS, [p] * 16 * 2) for p in range(12)]  # 24 MiB into 8 MiB
        for keys in prompts:
            assert c.put(keys, [payload(k, size) for k in keys]).failed == 0
        # The store reports evictions in batches, after the puts that caused
        # them: wait until the index lists exactly as many chunks as the store
        # holds (every committed chunk is listed before its put returns).
        grpc_address = cl.stores[0].info["grpc_address"]

        def index_lists_what_the_store_holds() -> bool:
            (tier,) = store_stats(grpc_address).tiers
            return sum(c.lookup([k]) for keys in prompts for k in keys) == tier.chunks

        wait_for(index_lists_what_the_store_holds, 10, "an index without evicted chunks")
        assert c.lookup(prompts[-1]) == 2, "the most recent prompt must still be cached"
        for keys in prompts:
            n = c.lookup(keys)
            bufs = [np.zeros(size, dtype=np.uint8) for _ in keys]
            r = c.get_into(keys, bufs)
            assert r.leading == n, "lookup reported chunks that a get cannot return"
            for k, b in zip(keys[:n], bufs[:n], strict=True):
                assert np.array_equal(b, payload(k, size))
        (tier,) = store_stats(grpc_address).tiers
        assert tier.chunks <= 8
        assert tier.evictions >= 24 - 8
        assert tier.used_bytes <= 8 << 20


def test_unknown_keys_are_misses(client: KVDepotClient) -> None:
    keys = chunk_keys(NS, list(range(99, 99 + 64)))
    bufs = [np.zeros(1024, dtype=np.uint8) for _ in keys]
    assert client.lookup(keys) == 0
    r = client.get_into(keys, bufs)
    assert r.loaded == (False,) * 4 and r.bytes_received == 0


def test_too_small_buffer_is_a_miss_not_an_overflow(client: KVDepotClient) -> None:
    keys = chunk_keys(NS, list(range(500, 516)))
    client.put(keys, [payload(keys[0], 4096)])
    small = np.zeros(1000, dtype=np.uint8)
    assert client.get_into(keys, [small]).leading == 0
    assert not small.any()


def _metadata_proc(tmp_path: Path, name: str) -> tuple[subprocess.Popen[bytes], str]:
    log = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvdepot.apps.cli", "metadata", "--port", "0", "--lease-ttl", "1.5",
         "--heartbeat-interval", "0.3"],
        stdout=subprocess.PIPE,
        stderr=log,
    )
    info = wait_ready(proc, name, 30)
    return proc, f"127.0.0.1:{info['port']}"


def test_store_and_client_fail_over_between_metadata_replicas(tmp_path: Path) -> None:
    a, addr_a = _metadata_proc(tmp_path, "meta-a")
    b, addr_b = _metadata_proc(tmp_path, "meta-b")
    both = f"{addr_a},{addr_b}"
    store = subprocess.Popen(
        [sys.executable, "-m", "kvdepot.apps.cli", "store", "--port", "0", "--metadata", both,
         "--capacity", "16MiB", "--node-id", "s0"],
        stdout=subprocess.PIPE,
        stderr=open(tmp_path / "store.log", "wb"),  # noqa: SIM115
    )
    try:
        wait_ready(store, "store", 30)
        wait_nodes(addr_a, 1)
        keys = chunk_keys(NS, list(range(16 * 4)))
        size = 64 << 10
        with KVDepotClient(ClientConfig(metadata=both)) as c:
            assert c.put(keys, [payload(k, size) for k in keys]).stored == 4
            a.kill()
            a.wait()
            # The store re-registers on B with its inventory: the index is rebuilt there.
            deadline = time.monotonic() + 10
            while c.lookup(keys) != 4:
                assert time.monotonic() < deadline, "no failover to the second replica"
                time.sleep(0.1)
            bufs = [np.zeros(size, dtype=np.uint8) for _ in keys]
            assert c.get_into(keys, bufs).leading == 4
            assert all(np.array_equal(x, payload(k, size)) for k, x in zip(keys, bufs, strict=True))
    finally:
        for p in (store, a, b):
            if p.poll() is None:
                p.kill()
            p.wait()


def test_reader_adds_a_replica_on_its_own_node(cluster: LocalCluster) -> None:
    size = 64 << 10
    keys = chunk_keys(NS, list(range(700, 700 + 16 * 3)))
    writer, reader = (s.info["node_id"] for s in cluster.stores)
    with KVDepotClient(ClientConfig(metadata=cluster.metadata_address, node_id=writer)) as c:
        assert c.put(keys, [payload(k, size) for k in keys]).stored == 3
    cfg = ClientConfig(metadata=cluster.metadata_address, node_id=reader, replicate_on_read=True)
    with KVDepotClient(cfg) as c:
        bufs = [np.zeros(size, dtype=np.uint8) for _ in keys]
        assert c.get_into(keys, bufs).leading == 3
        loc = c.lookup_locations(keys)
        # Both nodes hold the chunks now; the reader's own copy is listed first.
        assert all([r.node_id for r in x.replicas] == [reader, writer] for x in loc.locations)
    # With the writer gone, the chunks are still served, from the reader's node.
    os.kill(cluster.stores[0].pid, signal.SIGKILL)
    with KVDepotClient(ClientConfig(metadata=cluster.metadata_address)) as c:
        bufs = [np.zeros(size, dtype=np.uint8) for _ in keys]
        assert c.get_into(keys, bufs).leading == 3
        assert all(np.array_equal(b, payload(k, size)) for k, b in zip(keys, bufs, strict=True))
