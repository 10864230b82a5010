"""deploy/docker-compose.yml, up for real on a Docker engine of the test's own.

Builds the images on a local Debian base (no registry here), brings the
cluster up with a cluster token, waits for every service to be healthy, then
works it from the host the way a user would: the demo, stats, a chunk on a
store's SSD volume across a restart, a store killed mid-run, a metadata
replica killed, and a client without the token. ``down -v`` always.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvdepot.connector.client import ClientConfig, KVDepotClient
from kvdepot.errors import KVDepotError, Unauthenticated
from kvdepot.keys import KEY_BYTES
from kvdepot.rpc.security_config import SecurityConfig
from tests.conftest import free_port
from tests.deploy.dockerhost import Engine, Project, free_subnet

pytestmark = [pytest.mark.docker, pytest.mark.integration, pytest.mark.timeout(900)]

KVDEPOT = [sys.executable, "-m", "kvdepot.apps.cli"]
SERVICES = ["redis", "metadata-0", "metadata-1", "store-0", "store-1", "store-2"]
ARENA = 64 << 20
SHM = "80m"
SSD = 1 << 30
CHUNK = 1 << 20
UP_TIMEOUT_S = 180


class Cluster:
    def __init__(self, project: Project, token: str, ports: tuple[int, int], subnet: str) -> None:
        self.project = project
        self.token = token
        self.metadata = f"127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}"
        self.subnet = subnet

    def client(self, *, token: bool = True, node_id: str = "") -> KVDepotClient:
        security = SecurityConfig(auth_token=self.token) if token else SecurityConfig()
        return KVDepotClient(
            ClientConfig(
                metadata=self.metadata,
                node_id=node_id,
                security=security,
                rpc_timeout_s=5.0,
                connect_timeout_s=3.0,
                io_timeout_s=10.0,
            )
        )

    def cli(
        self, *args: str, token: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVDEPOT_")}
        if token:
            env["KVDEPOT_AUTH_TOKEN"] = self.token
        return subprocess.run(
            [*KVDEPOT, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
        )

    def stats(self) -> dict[str, object]:
        r = self.cli("stats", "--metadata", self.metadata, "--json")
        assert r.returncode == 0, r.stderr
        out: dict[str, object] = json.loads(r.stdout)
        return out


@pytest.fixture(scope="module")
def cluster(
    docker_engine: Engine, kvdepot_images: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("compose")
    token = uuid.uuid4().hex + uuid.uuid4().hex
    token_file = tmp / "kvdepot-token"
    token_file.write_text(token + "\n")
    # What docs/deployment.md tells users: readable by the image's uid only.
    os.chown(token_file, 10001, 10001)
    token_file.chmod(0o600)
    ports = (free_port(), free_port())
    subnet = free_subnet()
    env = {
        **docker_engine.env,
        **kvdepot_images,
        "METADATA_PORT": str(ports[0]),
        "METADATA_1_PORT": str(ports[1]),
        "PROXY_PORT": str(free_port()),
        "SUBNET": subnet,
        "STORE_CAPACITY": str(ARENA),
        "STORE_SHM_SIZE": SHM,
        "STORE_SSD_CAPACITY": str(SSD),
        "HEALTH_INTERVAL": "3s",
        # A busy 2-core host takes seconds to start a Python process.
        "HEALTH_TIMEOUT": "30s",
        "LOG_FORMAT": "text",
        "KVDEPOT_TOKEN_FILE": str(token_file),
    }
    project = Project(docker_engine, f"kvdt{os.getpid()}", env, Path(tmp))
    try:
        started = time.monotonic()
        project.up(timeout_s=UP_TIMEOUT_S)
        project.wait_healthy(SERVICES, UP_TIMEOUT_S)
        print(f"compose cluster healthy in {time.monotonic() - started:.0f} s")
        yield Cluster(project, token, ports, subnet)
    finally:
        project.down()


def chunks(n: int, seed: int, size: int = CHUNK) -> tuple[list[bytes], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    keys = [rng.bytes(KEY_BYTES) for _ in range(n)]
    bufs = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]
    return keys, bufs


def read_back(client: KVDepotClient, keys: list[bytes], want: list[np.ndarray]) -> tuple[int, int]:
    """Pull ``keys``; (exact chunks, wrong chunks): a loaded chunk must be the bytes put."""
    out = [np.zeros_like(w) for w in want]
    result = client.get_into(keys, out)
    exact = wrong = 0
    for ok, got, expected in zip(result.loaded, out, want, strict=True):
        if ok:
            if np.array_equal(got, expected):
                exact += 1
            else:
                wrong += 1
    return exact, wrong


def eventually(check: object, timeout_s: float, what: str) -> None:
    assert callable(check)
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f} s: {what}"
        time.sleep(0.5)


def test_containers_run_as_configured(cluster: Cluster) -> None:
    p = cluster.project
    for service in ("metadata-0", "store-1"):
        info = json.loads(p.eng.docker("inspect", p.container(service)))[0]
        assert info["HostConfig"]["Init"] is True, service
        assert info["Config"]["User"] == "kvdepot", service
        ports = [b for bs in (info["HostConfig"]["PortBindings"] or {}).values() for b in bs]
        assert all(b["HostIp"] == "127.0.0.1" for b in ports), (service, ports)
    store = json.loads(p.eng.docker("inspect", p.container("store-1")))[0]
    assert store["HostConfig"]["ShmSize"] == 80 << 20
    ssd_owner = p.compose("exec", "-T", "store-1", "stat", "-c", "%u", "/var/lib/kvdepot/ssd")
    assert ssd_owner.stdout.strip() == "10001"
    # The token arrives as a file (the secret), never as a variable of the container.
    env = store["Config"]["Env"]
    assert not [e for e in env if e.startswith("KVDEPOT_AUTH_TOKEN=")]
    assert cluster.token not in json.dumps(store)


def test_demo_against_the_compose_cluster(cluster: Cluster) -> None:
    r = cluster.cli("demo", "--metadata", cluster.metadata, "--json", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout)
    assert summary["verified"] is True
    assert summary["mismatched_chunks"] == 0
    assert summary["prefix_hit_rate"] > 0
    assert summary["chunks_pulled"] > 0
    assert summary["nodes"] == 3


def test_stats_lists_three_stores_with_dram_and_ssd(cluster: Cluster) -> None:
    nodes = cluster.stats()["nodes"]
    assert isinstance(nodes, list)
    by_id = {n["node_id"]: n for n in nodes}
    assert set(by_id) == {"store-0", "store-1", "store-2"}
    for i, node_id in enumerate(("store-0", "store-1", "store-2")):
        node = by_id[node_id]
        assert node["address"] == f"{cluster.subnet}.{11 + i}:7800"
        tiers = {t["name"]: t for t in node["tiers"]}
        assert set(tiers) == {"cpu", "ssd"}, node
        assert tiers["cpu"]["capacity_bytes"] == ARENA
        assert tiers["ssd"]["capacity_bytes"] == SSD


def test_chunk_on_the_ssd_volume_survives_a_restart(cluster: Cluster) -> None:
    # More than store-1's DRAM arena, written to store-1: the oldest go to its SSD.
    keys, bufs = chunks(96, seed=1)
    with cluster.client(node_id="store-1") as client:
        for i in range(0, len(keys), 8):
            # A full arena refuses (NO_SPACE) until demotion makes room: retry.
            batch = (keys[i : i + 8], bufs[i : i + 8])
            eventually(lambda b=batch: client.put(*b).failed == 0, 30, f"put of batch {i}")  # type: ignore[misc]

        def on_ssd() -> list[int]:
            locs = client.lookup_locations(keys).locations
            return [
                i
                for i, loc in enumerate(locs)
                if any(r.node_id == "store-1" and r.tier == "ssd" for r in loc.replicas)
            ]

        eventually(lambda: len(on_ssd()) >= 8, 60, "chunks demoted to store-1's SSD")
        demoted = on_ssd()
    files = cluster.project.compose(
        "exec", "-T", "store-1", "du", "-sb", "/var/lib/kvdepot/ssd"
    ).stdout
    assert int(files.split()[0]) >= 8 * CHUNK, files

    cluster.project.compose("restart", "--timeout", "10", "store-1")
    cluster.project.wait_healthy(["store-1"], 90)
    ssd_keys = [keys[i] for i in demoted]
    ssd_bufs = [bufs[i] for i in demoted]
    with cluster.client() as client:
        eventually(
            lambda: client.lookup(ssd_keys[:1]) == 1, 30, "store-1 re-announced its SSD chunks"
        )
        exact, wrong = read_back(client, ssd_keys, ssd_bufs)
    assert wrong == 0
    assert exact == len(ssd_keys)


def test_killing_one_metadata_replica_changes_nothing_for_clients(cluster: Cluster) -> None:
    keys, bufs = chunks(8, seed=2)
    with cluster.client() as client:
        assert client.put(keys, bufs).failed == 0
    cluster.project.compose("kill", "metadata-0")
    try:
        with cluster.client() as client:
            assert client.lookup(keys) == 8
            assert read_back(client, keys, bufs) == (8, 0)
            more, more_bufs = chunks(8, seed=3)
            assert client.put(more, more_bufs).failed == 0
            assert read_back(client, more, more_bufs) == (8, 0)
        assert {n["node_id"] for n in cluster.stats()["nodes"]} == {  # type: ignore[attr-defined]
            "store-0",
            "store-1",
            "store-2",
        }
    finally:
        cluster.project.compose("start", "metadata-0")
        cluster.project.wait_healthy(["metadata-0"], 60)


def test_a_client_without_the_token_is_refused(cluster: Cluster) -> None:
    with cluster.client(token=False) as client, pytest.raises(Unauthenticated):
        client.lookup([bytes(KEY_BYTES)])
    r = cluster.cli("stats", "--metadata", cluster.metadata, token=False)
    assert r.returncode == 1
    assert "no auth token" in r.stderr, r.stderr
    store = cluster.cli("health", "--target", f"{cluster.subnet}.11:7801", token=False)
    assert store.returncode == 1 and "UNAUTHENTICATED" in store.stderr, store.stderr
    assert cluster.cli("health", "--target", f"{cluster.subnet}.11:7801").returncode == 0


def test_a_store_killed_mid_run_gives_misses_not_wrong_bytes(cluster: Cluster) -> None:
    stop = threading.Event()
    tally = {"exact": 0, "wrong": 0, "misses": 0, "errors": 0, "rounds": 0}
    written: list[tuple[list[bytes], list[np.ndarray]]] = []

    def work() -> None:
        seed = 100
        # Written from "store-0's host": its chunks go to store-0 first; read
        # by a client of no node (one of store-0 would try its dead store first).
        with cluster.client(node_id="store-0") as writer, cluster.client() as reader:
            while not stop.is_set():
                seed += 1
                keys, bufs = chunks(6, seed, size=256 << 10)
                try:
                    if writer.put(keys, bufs).failed == 0:
                        written.append((keys, bufs))
                    for ks, bs in written[-5:]:
                        exact, wrong = read_back(reader, ks, bs)
                        tally["exact"] += exact
                        tally["wrong"] += wrong
                        tally["misses"] += len(ks) - exact - wrong
                except KVDepotError:
                    tally["errors"] += 1
                tally["rounds"] += 1

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    try:
        eventually(lambda: tally["rounds"] >= 3, 60, "the workload running")
        nodes = cluster.stats()["nodes"]
        held = {n["node_id"]: n["chunks_indexed"] for n in nodes}  # type: ignore[attr-defined]
        assert held["store-0"] > 0, held
        cluster.project.compose("kill", "store-0")
        killed_at = tally["rounds"]
        # Past the lease (5 s): the cluster drops store-0 and its chunks.
        eventually(lambda: tally["rounds"] >= killed_at + 5, 90, "the workload going on")
        time.sleep(8)
    finally:
        stop.set()
        worker.join(timeout=60)
    assert not worker.is_alive()
    assert tally["wrong"] == 0, tally
    assert tally["exact"] > 0, tally
    assert tally["misses"] + tally["errors"] > 0, tally  # the kill was felt
    # The cluster keeps serving: new chunks go in and come back exact.
    keys, bufs = chunks(12, seed=7, size=256 << 10)
    with cluster.client() as client:
        eventually(lambda: client.put(keys, bufs).failed == 0, 30, "puts succeeding again")
        assert read_back(client, keys, bufs) == (12, 0)
        # What store-0 held (its DRAM died with it) is a miss now, never other bytes.
        for ks, bs in written[:5]:
            assert read_back(client, ks, bs)[1] == 0


def test_an_arena_that_does_not_fit_the_container_is_a_clear_error(
    docker_engine: Engine, kvdepot_images: dict[str, str]
) -> None:
    r = subprocess.run(
        [
            "docker" if not os.access("/usr/bin/docker", os.X_OK) else "/usr/bin/docker",
            "run",
            "--rm",
            "--network",
            "none",
            f"--shm-size={SHM}",
            kvdepot_images["KVDEPOT_IMAGE"],
            "store",
            f"--capacity={2 * ARENA}",
        ],
        env=docker_engine.env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 1
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("kvdepot: error:")]
    assert len(errors) == 1, r.stderr[-2000:]
    assert "cannot reserve" in errors[0] and "shm_size" in errors[0], errors
