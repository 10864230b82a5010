"""Two metadata replicas over one Redis, with a real store: shared index, rebuild after loss."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvdepot.cluster import wait_ready
from kvdepot.connector.client import ClientConfig, KVDepotClient
from kvdepot.metadata.keys import Namespace, chunk_keys

pytestmark = [pytest.mark.integration, pytest.mark.redis]

NS = Namespace("test/redis-index", chunk_tokens=16)
CHUNK = 64 << 10


def payload(key: bytes) -> np.ndarray:
    rng = np.random.default_rng(int.from_bytes(key, "little"))
    return np.frombuffer(rng.bytes(CHUNK), dtype=np.uint8)


@contextlib.contextmanager
def daemon(args: list[str], log: Path) -> Iterator[dict[str, Any]]:
    """A kvdepot daemon subprocess; yields what its READY line announced."""
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvdepot.cli", "--log-level", "WARNING", *args],
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
        )
    try:
        yield wait_ready(proc, args[0], 60)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def metadata(url: str, log: Path) -> contextlib.AbstractContextManager[dict[str, Any]]:
    return daemon(
        [
            "metadata",
            "--host", "127.0.0.1",
            "--port", "0",
            "--index", url,
            "--lease-ttl", "1.5",
            "--heartbeat-interval", "0.3",
        ],
        log,
    )  # fmt: skip


def wait_for(check: Any, timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def test_replicas_share_the_index_and_rebuild_it_after_a_flush(
    redis_server: str, tmp_path: Path
) -> None:
    import redis

    url = f"{redis_server}?prefix=e2e-{uuid.uuid4().hex[:8]}"
    with (
        metadata(url, tmp_path / "metadata-a.log") as a,
        metadata(url, tmp_path / "metadata-b.log") as b,
        daemon(
            [
                "store",
                "--metadata",
                f"127.0.0.1:{a['port']}",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--grpc-port",
                "0",
                "--capacity",
                "32MiB",
                "--node-id",
                "s0",
            ],
            tmp_path / "store.log",
        ),  # fmt: skip
        KVDepotClient(ClientConfig(metadata=f"127.0.0.1:{a['port']}", node_id="s0")) as via_a,
        KVDepotClient(ClientConfig(metadata=f"127.0.0.1:{b['port']}")) as via_b,
    ):
        assert wait_for(lambda: len(via_b.stats().nodes) == 1), "store not visible through B"
        keys = chunk_keys(NS, list(range(16 * 8)))
        data = [payload(k) for k in keys]
        result = via_a.put(keys, data)
        assert result.stored == len(keys)
        # A second publish of the same prefix through the other replica is skipped.
        assert via_b.put(keys, data).skipped == len(keys)

        before_a, before_b = via_a.lookup_locations(keys), via_b.lookup_locations(keys)
        assert before_a.hits == before_b.hits == len(keys)
        assert before_a.locations == before_b.locations
        assert {r.node_id for loc in before_b.locations for r in loc.replicas} == {"s0"}

        def pulled_intact() -> bool:
            bufs = [np.zeros(CHUNK, dtype=np.uint8) for _ in keys]
            got = via_b.get_into(keys, bufs)
            return got.leading == len(keys) and all(
                np.array_equal(x, y) for x, y in zip(bufs, data, strict=True)
            )

        assert pulled_intact()

        # Index loss: the store's next heartbeat is refused and it registers again.
        with redis.Redis.from_url(redis_server) as r:
            r.flushall()
        assert wait_for(lambda: via_b.lookup(keys) == len(keys)), "index not rebuilt"
        assert "registering again" in (tmp_path / "store.log").read_text()
        assert via_b.lookup_locations(keys).locations == before_b.locations
        assert via_a.lookup_locations(keys).locations == before_a.locations
        assert pulled_intact()  # no bytes lost


def test_redis_cluster_replica_killed_mid_run_and_a_dead_store(
    redis_cluster: str, tmp_path: Path
) -> None:
    """Two metadata replicas over a 3-master Redis Cluster: one is SIGKILLed
    mid-run and clients and the store carry on through the other; a SIGKILLed
    store's chunks then vanish from lookups within its lease."""
    url = f"{redis_cluster}?prefix=kill-{uuid.uuid4().hex[:8]}"
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(args: list[str], name: str) -> dict[str, Any]:
        p = subprocess.Popen(
            [sys.executable, "-m", "kvdepot.cli", "--log-level", "WARNING", *args],
            stdout=subprocess.PIPE,
            stderr=open(tmp_path / f"{name}.log", "wb"),  # noqa: SIM115 - lives with p
            stdin=subprocess.DEVNULL,
        )
        procs.append(p)
        return wait_ready(p, name, 60)

    try:
        meta = [
            spawn(
                [
                    "metadata",
                    "--port",
                    "0",
                    "--index",
                    url,
                    "--lease-ttl",
                    "1.5",
                    "--heartbeat-interval",
                    "0.3",
                ],
                f"meta{i}",
            )
            for i in range(2)
        ]
        both = ",".join(f"127.0.0.1:{m['port']}" for m in meta)
        spawn(
            ["store", "--port", "0", "--metadata", both, "--capacity", "32MiB", "--node-id", "s0"],
            "store",
        )
        keys = chunk_keys(NS, list(range(16 * 6)))
        with KVDepotClient(ClientConfig(metadata=both, rpc_timeout_s=3)) as client:
            assert wait_for(lambda: client.stats().nodes)
            assert client.put(keys[:3], [payload(k) for k in keys[:3]]).stored == 3
            procs[0].kill()  # metadata replica A, mid-run
            procs[0].wait()
            assert client.put(keys, [payload(k) for k in keys]).stored == 3  # 3 skipped
            assert client.lookup(keys) == 6
            bufs = [np.zeros(CHUNK, dtype=np.uint8) for _ in keys]
            assert client.get_into(keys, bufs).leading == 6
            assert all(np.array_equal(b, payload(k)) for k, b in zip(keys, bufs, strict=True))
            # The store keeps its lease through replica B: still listed later.
            time.sleep(2.0)
            assert wait_for(lambda: client.lookup(keys) == 6, timeout_s=5.0)
            procs[2].kill()  # the store
            procs[2].wait()
            killed = time.monotonic()
            assert wait_for(lambda: client.lookup(keys) == 0, timeout_s=5.0)
            assert time.monotonic() - killed < 1.5 + 3.0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
