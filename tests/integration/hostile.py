"""What the hostile-input tests share: a store with short timeouts, and its vital signs."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvdepot.apps.cluster import LocalCluster
from kvdepot.proto.gen import store_pb2, store_pb2_grpc

MiB = 1 << 20

# Short data-plane timeouts, so that a stalled or too slow peer is cut off in
# a second or two rather than the production defaults (30 s, 60 s).
SHORT_TIMEOUTS = {
    "KVDEPOT_STORE_IO_TIMEOUT_S": "1.0",
    "KVDEPOT_STORE_IDLE_TIMEOUT_S": "3.0",
    "KVDEPOT_STORE_HOLD_TIMEOUT_S": "3.0",
    "KVDEPOT_STORE_MIN_RATE_BYTES": "1MiB",
}


def short_timeout_cluster(log_dir: Path, capacity: str = "32MiB") -> LocalCluster:
    """A started cluster of one store whose data plane has :data:`SHORT_TIMEOUTS`."""
    return LocalCluster(
        nodes=1,
        capacity=capacity,
        lease_ttl_s=1.5,
        heartbeat_interval_s=0.3,
        log_dir=log_dir,
        env={**os.environ, **SHORT_TIMEOUTS},
    ).start()


def store_stats(cluster: LocalCluster) -> store_pb2.StoreStats:
    with grpc.insecure_channel(cluster.stores[0].info["grpc_address"]) as ch:
        stats: store_pb2.StoreStats = store_pb2_grpc.StoreStub(ch).GetStats(
            store_pb2.StoreStatsRequest(), timeout=10
        )
        return stats


def used_bytes(cluster: LocalCluster) -> int:
    """Bytes the store's tiers hold: committed chunks and reservations."""
    return sum(t.used_bytes for t in store_stats(cluster).tiers)


def serving(address: str) -> bool:
    """Whether the daemon at the gRPC ``address`` answers its health check with SERVING."""
    with grpc.insecure_channel(address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def memory_kib(pid: int) -> dict[str, int]:
    """``VmRSS``, ``RssAnon`` and ``RssShmem`` of a process, in KiB."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssShmem"):
            out[name] = int(value.split()[0])
    return out


def wait_for(cond: Callable[[], bool], timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        time.sleep(0.05)


def connect(cluster: LocalCluster) -> socket.socket:
    host, port = cluster.stores[0].info["address"].rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def closed_by_peer(s: socket.socket, timeout: float) -> bytes | None:
    """What the peer sent until it closed ``s``; None if it is still open after ``timeout``."""
    s.settimeout(timeout)
    data = b""
    try:
        while part := s.recv(65536):
            data += part
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return data
