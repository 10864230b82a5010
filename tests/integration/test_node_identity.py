"""Node identity with real daemons: a node id is owned by the store instance
that holds its lease.

A second store started with a live store's ``--node-id`` is refused (exit 1,
one line) and leaves the first store's chunks indexed and reachable; an
operator may force the takeover, after which the old instance's heartbeats
are refused and it stops; a store restarted on its own SSD directory takes
its id back at once, while a new instance waits for the old lease. The same
with the memory index and with a Redis index.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvdepot.apps.cluster import LocalCluster, wait_ready, wait_registered
from kvdepot.connector.client import ClientConfig, KVDepotClient
from kvdepot.keys import Namespace, chunk_keys
from tests.integration.hostile import wait_for

pytestmark = pytest.mark.integration

NS = Namespace("test/identity", chunk_tokens=16)
SIZE = 64 << 10

INDEXES = ["memory", pytest.param("redis", marks=pytest.mark.redis)]


@pytest.fixture(params=INDEXES)
def index_url(request: pytest.FixtureRequest) -> str:
    if request.param == "memory":
        return "memory://"
    server = request.getfixturevalue("redis_server")
    return f"{server}?prefix=ident-{uuid.uuid4().hex[:12]}"


def _cluster(tmp_path: Path, index: str, lease_ttl_s: float = 3.0) -> LocalCluster:
    return LocalCluster(
        nodes=1,
        capacity="32MiB",
        lease_ttl_s=lease_ttl_s,
        heartbeat_interval_s=0.3,
        log_dir=tmp_path / "logs",
        index=index,
    )


@pytest.fixture()
def one_store(tmp_path: Path, index_url: str) -> Iterator[LocalCluster]:
    # A lease longer than a refusal may take: a refused store does not wait it out.
    c = _cluster(tmp_path, index_url, lease_ttl_s=20.0)
    c.start()
    try:
        yield c
    finally:
        c.stop()


def payload(key: bytes) -> np.ndarray:
    rng = np.random.default_rng(int.from_bytes(key, "little"))
    return np.frombuffer(rng.bytes(SIZE), dtype=np.uint8)


def publish(metadata: str, first: int, count: int) -> list[bytes]:
    keys = chunk_keys(NS, list(range(first, first + 16 * count)))
    with KVDepotClient(ClientConfig(metadata=metadata)) as c:
        r = c.put(keys, [payload(k) for k in keys])
        assert (r.stored, r.failed) == (count, 0), r
    return keys


def pulled(metadata: str, keys: list[bytes]) -> int:
    """How many leading chunks of ``keys`` read back with the published bytes."""
    bufs = [np.zeros(SIZE, dtype=np.uint8) for _ in keys]
    with KVDepotClient(ClientConfig(metadata=metadata)) as c:
        r = c.get_into(keys, bufs)
    assert all(np.array_equal(b, payload(k)) for k, b in zip(keys[: r.leading], bufs, strict=False))
    return int(r.leading)


def nodes(metadata: str) -> dict[str, tuple[str, int]]:
    """node id -> (gRPC address, chunks indexed), as the metadata service lists them."""
    with KVDepotClient(ClientConfig(metadata=metadata)) as c:
        return {n.node_id: (n.grpc_address, n.chunks_indexed) for n in c.stats().nodes}


def cli_stats(metadata: str, *extra: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "kvdepot.apps.cli", "stats", "--metadata", metadata, *extra],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout


def held_and_indexed(metadata: str) -> dict[str, tuple[int, int]]:
    """``kvdepot stats --json``: node id -> (chunks held, chunks indexed)."""
    data = json.loads(cli_stats(metadata, "--json"))
    return {n["node_id"]: (n["chunks_held"], n["chunks_indexed"]) for n in data["nodes"]}


def store_cmd(c: LocalCluster, node_id: str, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "kvdepot.apps.cli", "--log-level", "WARNING",
        "store",
        "--node-id", node_id,
        "--port", "0",
        "--grpc-port", "0",
        "--metadata", c.metadata_address,
        "--capacity", "16MiB",
        "--no-shm",
        "--nixl", "off",
        *extra,
    ]  # fmt: skip


def run_refused(cmd: list[str], node_id: str) -> str:
    """Run a store that must be refused: exit 1, one line naming the node id."""
    started = time.monotonic()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the store with a taken node id kept running: {exc.stderr!r}")
    # Refused once the holder renewed its lease, not after waiting it out.
    assert time.monotonic() - started < 15
    assert out.returncode == 1, (out.returncode, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert "Traceback" not in out.stderr
    assert len(lines) == 1, lines
    assert lines[0].startswith("kvdepot: error: ") and repr(node_id) in lines[0], lines
    assert "--force-node-id" in lines[0]
    return lines[0]


def test_a_duplicate_node_id_is_refused_and_the_cluster_stays_whole(
    one_store: LocalCluster,
) -> None:
    c = one_store
    md = c.metadata_address
    first = c.stores[0].info["grpc_address"]
    keys = publish(md, 0, 4)
    assert nodes(md) == {"store-0": (first, 4)}

    line = run_refused(store_cmd(c, "store-0"), "store-0")
    assert "held by another live store instance" in line

    # The first store still owns its id, its chunks stay indexed and readable,
    # and puts placed on it keep working, over several leases.
    assert nodes(md) == {"store-0": (first, 4)}
    assert pulled(md, keys) == 4
    time.sleep(3.0)  # several heartbeats
    assert c.stores[0].proc.poll() is None
    assert nodes(md) == {"store-0": (first, 4)}
    assert pulled(md, keys) == 4
    more = publish(md, 1000, 2)
    assert pulled(md, more) == 2
    assert nodes(md) == {"store-0": (first, 6)}
    # `kvdepot stats` shows both counts per node, so a mismatch would show.
    wait_for(lambda: held_and_indexed(md) == {"store-0": (6, 6)}, 10, "held == indexed")
    table = cli_stats(md).splitlines()
    assert "indexed" in table[0].split()


def test_a_forced_takeover_stops_the_old_instance(
    one_store: LocalCluster, tmp_path: Path
) -> None:
    c = one_store
    md = c.metadata_address
    old = c.stores[0]
    publish(md, 0, 3)
    new = subprocess.Popen(
        store_cmd(c, "store-0", "--force-node-id"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    try:
        info = wait_ready(new, "forcing store", 60)
        wait_registered(md, "store-0", str(info["grpc_address"]), 30)
        # The old instance's heartbeats are refused: it says so and exits 1,
        # and never keeps the new instance's entry alive nor takes it back.
        assert old.proc.wait(timeout=30) == 1
        log = (tmp_path / "logs" / "store-0.log").read_text()
        assert "refused this store's heartbeat" in log and "store-0" in log
        assert "Traceback" not in log
        assert nodes(md) == {"store-0": (str(info["grpc_address"]), 0)}
        time.sleep(3.0)  # several heartbeats
        assert new.poll() is None
        assert nodes(md) == {"store-0": (str(info["grpc_address"]), 0)}
        keys = publish(md, 5000, 2)
        assert pulled(md, keys) == 2
    finally:
        new.send_signal(signal.SIGTERM)
        try:
            new.wait(timeout=15)
        except subprocess.TimeoutExpired:
            new.kill()
            new.wait()
        for stream in (new.stdout, new.stderr):
            if stream is not None:
                stream.close()


def test_a_new_instance_waits_for_the_lease_of_a_crashed_one(
    tmp_path: Path, index_url: str
) -> None:
    lease = 8.0
    c = _cluster(tmp_path, index_url, lease_ttl_s=lease)
    c.start()
    new = None
    try:
        md = c.metadata_address
        os.kill(c.stores[0].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        c.stores[0].proc.wait()
        # Without an SSD directory a restart is a new instance: it registers
        # once the crashed one's lease has run out, not before.
        new = subprocess.Popen(
            store_cmd(c, "store-0"),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )
        grpc_address = str(wait_ready(new, "restarted store", 60)["grpc_address"])
        wait_for(
            lambda: nodes(md).get("store-0", ("", 0))[0] == grpc_address,
            lease + 30,
            "the restarted store registered",
        )
        waited = time.monotonic() - killed_at
        assert waited >= lease - 1.5, f"registered {waited:.1f} s after the kill"
        assert new.poll() is None
        keys = publish(md, 0, 2)
        assert pulled(md, keys) == 2
    finally:
        if new is not None:
            new.send_signal(signal.SIGTERM)
            try:
                new.wait(timeout=15)
            except subprocess.TimeoutExpired:
                new.kill()
                new.wait()
            if new.stdout is not None:
                new.stdout.close()
        c.stop()


def test_a_restart_on_its_ssd_directory_takes_the_id_back_at_once(
    tmp_path: Path, index_url: str
) -> None:
    # A long lease: a restart that had to wait for it would time out here.
    c = _cluster(tmp_path, index_url, lease_ttl_s=60.0)
    c.start()
    try:
        md = c.metadata_address
        ssd = tmp_path / "ssd"
        disk = c.add_store("disk", "--ssd-dir", str(ssd), "--ssd-capacity", "64MiB")
        assert (ssd / "instance-id").stat().st_mode & 0o077 == 0
        os.kill(disk.pid, signal.SIGKILL)
        disk.proc.wait()
        started = time.monotonic()
        again = c.add_store("disk", "--ssd-dir", str(ssd), "--ssd-capacity", "64MiB")
        assert time.monotonic() - started < 30
        assert nodes(md)["disk"][0] == again.info["grpc_address"]
        assert again.proc.poll() is None
    finally:
        c.stop()


def test_the_refusals_are_clear_grpc_errors(one_store: LocalCluster) -> None:
    import grpc

    from kvdepot.proto.gen import metadata_pb2, metadata_pb2_grpc

    def register(instance: str) -> metadata_pb2.RegisterNodeRequest:
        return metadata_pb2.RegisterNodeRequest(
            node_id="probe", address="127.0.0.1:1", instance_id=instance
        )

    with grpc.insecure_channel(one_store.metadata_address) as ch:
        stub = metadata_pb2_grpc.MetadataStub(ch)
        epoch = stub.RegisterNode(register("inst-a"), timeout=10).epoch
        assert epoch > 0
        with pytest.raises(grpc.RpcError) as info:
            stub.RegisterNode(register("inst-b"), timeout=10)
        assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "node id 'probe' is held by another live store instance" in info.value.details()
        trailing = dict(info.value.trailing_metadata() or ())
        assert 0 < int(trailing["kvdepot-lease-remaining-ms"]) <= 20_000
        with pytest.raises(grpc.RpcError) as info:
            stub.Heartbeat(metadata_pb2.HeartbeatRequest(node_id="probe", epoch=epoch + 1))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "'probe' was registered again" in info.value.details()
        assert stub.Heartbeat(
            metadata_pb2.HeartbeatRequest(node_id="probe", epoch=epoch), timeout=10
        ).lease_ttl_ms
        # The same instance takes its id back at once, under a new epoch.
        again = stub.RegisterNode(register("inst-a"), timeout=10).epoch
        assert again > epoch
