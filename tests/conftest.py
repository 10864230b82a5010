"""Shared fixtures: real daemons as subprocesses on 127.0.0.1."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvdepot.connector.client import ClientConfig, KVDepotClient

from kvdepot.cluster import LocalCluster


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture()
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    """Metadata + two stores with a short lease, logs under the test's tmp dir."""
    c = LocalCluster(
        nodes=2,
        capacity="64MiB",
        lease_ttl_s=1.5,
        heartbeat_interval_s=0.3,
        log_dir=tmp_path / "logs",
    )
    c.start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture()
def client(cluster: LocalCluster) -> Iterator[KVDepotClient]:
    with KVDepotClient(
        ClientConfig(metadata=cluster.metadata_address, node_id=cluster.stores[0].info["node_id"])
    ) as c:
        yield c
