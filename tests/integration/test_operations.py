"""Operating a cluster: Prometheus /metrics, ``kvdepot stats`` on ``kvdepot up``,
gRPC health that follows each daemon's dependencies, JSON logs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from kvdepot.apps.cluster import DaemonProcess, LocalCluster, wait_nodes, wait_ready
from kvdepot.errors import Unavailable
from kvdepot.metadata.config import MetadataConfig
from kvdepot.metadata.service import MetadataServer
from tests.conftest import free_port

pytestmark = pytest.mark.integration

KVDEPOT = [sys.executable, "-m", "kvdepot.apps.cli"]
DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana-kvdepot.json"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def kvdepot(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KVDEPOT, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def demo(metadata: str) -> dict[str, object]:
    out = kvdepot(
        "demo", "--json", "--metadata", metadata, "--prompts", "6", "--chunk-bytes", "128KiB"
    )
    assert out.returncode == 0, out.stderr
    summary: dict[str, object] = json.loads(out.stdout)
    assert summary["verified"] is True
    return summary


def scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    """GET /metrics, parsed with prometheus-client's parser: sample name -> samples."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        assert r.status == 200
        text = r.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        assert family.name.startswith("kvdepot_"), family.name
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def total(m: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    return sum(v for lab, v in m.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


def health(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=3
        )
    return int(reply.status)


def eventually(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout_s} s")
        time.sleep(0.1)


def test_metrics_scraped_from_a_cluster_and_json_logs(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    with LocalCluster(
        nodes=2, capacity="64MiB", metrics=True, log_format="json", log_dir=logs
    ) as cluster:
        assert cluster.metadata is not None
        ports = [
            cluster.metadata.info["metrics_port"],
            *(s.info["metrics_port"] for s in cluster.stores),
        ]
        assert all(isinstance(p, int) and p > 0 for p in ports)
        summary = demo(cluster.metadata_address)

        meta = scrape(ports[0])
        assert total(meta, "kvdepot_serving") == 1
        assert total(meta, "kvdepot_cluster_nodes") == 2
        assert total(meta, "kvdepot_cluster_lookups_total") > 0
        assert total(meta, "kvdepot_cluster_lookup_keys_total", result="hit") > 0
        assert total(meta, "kvdepot_cluster_lookup_tokens_total", result="hit") > 0
        assert total(meta, "kvdepot_cluster_lookup_tokens_total", result="miss") > 0
        assert total(meta, "kvdepot_cluster_saved_bytes_total") == summary["bytes_saved"]
        assert total(meta, "kvdepot_cluster_puts_committed_total") == summary["chunks_published"]
        assert total(meta, "kvdepot_cluster_node_tier_capacity_bytes", tier="cpu") == 2 * (64 << 20)

        stores = [scrape(p) for p in ports[1:]]
        for m, s in zip(stores, cluster.stores, strict=True):
            assert total(m, "kvdepot_serving") == 1
            assert {lab["node"] for lab, _ in m["kvdepot_store_puts_total"]} == {s.info["node_id"]}
        assert sum(total(m, "kvdepot_store_tier_hits_total") for m in stores) > 0
        assert (
            sum(total(m, "kvdepot_store_tier_chunks") for m in stores)
            == summary["chunks_published"]
        )
        assert (
            sum(total(m, "kvdepot_store_transfer_bytes_total", direction="out") for m in stores) > 0
        )

        # Every metric the sample Grafana dashboard queries exists.
        exposed = set(meta).union(*stores)
        queried = set(re.findall(r"\bkvdepot_[a-z_]+", DASHBOARD.read_text()))
        assert queried and queried <= exposed, sorted(queried - exposed)

    # JSON logs: one object per line, and no line per chunk.
    for name in ("metadata", "store-0", "store-1"):
        lines = (logs / f"{name}.log").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        assert records and all({"ts", "level", "logger", "msg"} <= set(r) for r in records)
        assert len(records) < 20, lines
        if name != "metadata":
            assert any(r.get("event") == "registered" for r in records)


def test_stats_of_a_running_kvdepot_up_after_demo(tmp_path: Path) -> None:
    port = free_port()
    metadata = f"127.0.0.1:{port}"
    out = open(tmp_path / "up.out", "wb")  # noqa: SIM115 - closed below
    up = subprocess.Popen(
        [*KVDEPOT, "up", "--nodes", "2", "--metadata-port", str(port), "--capacity", "64MiB"],
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    try:
        wait_nodes(metadata, 2, timeout_s=60)
        summary = demo(metadata)

        def transfer_seen() -> bool:
            r = kvdepot("stats", "--json", "--metadata", metadata)
            assert r.returncode == 0, r.stderr
            d = json.loads(r.stdout)
            return d["transfer_bytes_out_per_s"] > 0 and d["transfer_bytes_in_per_s"] > 0

        # Stores sample once a second and heartbeat once a second.
        eventually(transfer_seen, 10, "recent transfer rates in kvdepot stats")
        d = json.loads(kvdepot("stats", "--json", "--metadata", metadata).stdout)
        assert d["hit_keys"] > 0 and d["hit_tokens"] > 0 and d["lookups"] > 0
        assert d["bytes_saved"] == summary["bytes_saved"]
        assert len(d["nodes"]) == 2
        for n in d["nodes"]:
            assert set(n["transfer"]) == {"bytes_in_per_s", "bytes_out_per_s", "window_s"}
            assert n["tiers"][0]["name"] == "cpu"
        table = kvdepot("stats", "--metadata", metadata)
        assert table.returncode == 0, table.stderr
        assert "hit rate" in table.stdout and "out GB/s" in table.stdout
        assert f"({d['hit_keys']} hit" in table.stdout
    finally:
        up.send_signal(signal.SIGINT)
        try:
            assert up.wait(timeout=20) == 0
        finally:
            if up.poll() is None:
                up.kill()
                up.wait()
            out.close()


def test_store_health_follows_its_metadata_service(tmp_path: Path) -> None:
    port = free_port()
    with LocalCluster(
        nodes=1,
        metadata_port=port,
        capacity="16MiB",
        lease_ttl_s=1.0,
        heartbeat_interval_s=0.2,
        metrics=True,
        log_dir=tmp_path / "logs",
    ) as cluster:
        store = cluster.stores[0]
        target = store.info["grpc_address"]
        assert health(target) == SERVING
        assert cluster.metadata is not None
        cluster.metadata.proc.kill()
        cluster.metadata.proc.wait()

        # Heartbeats fail for longer than the lease (1 s): NOT_SERVING.
        eventually(lambda: health(target) == NOT_SERVING, 8, "NOT_SERVING")
        cli = kvdepot("health", "--target", target)
        assert cli.returncode == 1 and cli.stdout.strip() == "NOT_SERVING"
        assert total(scrape(store.info["metrics_port"]), "kvdepot_serving") == 0

        # A new metadata service on the same port: the store registers again.
        proc = subprocess.Popen(
            [
                *KVDEPOT,
                "metadata",
                "--port",
                str(port),
                "--lease-ttl",
                "1",
                "--heartbeat-interval",
                "0.2",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )
        cluster.metadata = DaemonProcess("metadata", proc)  # stopped with the cluster
        cluster.metadata.info = wait_ready(proc, "metadata", 30)
        eventually(lambda: health(target) == SERVING, 10, "SERVING again")
        wait_nodes(cluster.metadata_address, 1, timeout_s=5)
        assert kvdepot("health", "--target", target).stdout.strip() == "SERVING"

    log = (tmp_path / "logs" / "store-0.log").read_text()
    assert "NOT_SERVING" in log and "health: SERVING" in log


def test_metadata_health_follows_its_index_backend() -> None:
    async def main() -> None:
        server = MetadataServer(MetadataConfig(port=0, reap_interval_s=0.05, metrics_port=0))
        await server.start()
        target = f"127.0.0.1:{server.port}"
        channel = grpc.aio.insecure_channel(target)
        stub = health_pb2_grpc.HealthStub(channel)

        async def until(status: int) -> None:
            for _ in range(100):
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=3)
                if reply.status == status:
                    return
                await asyncio.sleep(0.05)
            raise AssertionError(f"health never became {status}")

        try:
            await until(SERVING)
            real = server.index.expire

            async def broken(now: float) -> tuple[int, int]:
                raise Unavailable("redis index error: connection refused")

            server.index.expire = broken  # type: ignore[method-assign]
            await until(NOT_SERVING)
            assert server.metrics is not None
            port = server.metrics.port
            m = await asyncio.to_thread(scrape, port)
            assert total(m, "kvdepot_serving") == 0
            server.index.expire = real  # type: ignore[method-assign]
            await until(SERVING)
        finally:
            await channel.close()
            with contextlib.suppress(Exception):
                await server.stop(0)

    asyncio.run(main())
