"""The ``kvdepot`` command as users run it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvdepot.apps.cluster import LocalCluster, wait_nodes
from tests.conftest import free_port

pytestmark = pytest.mark.integration

KVDEPOT = [sys.executable, "-m", "kvdepot.apps.cli"]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KVDEPOT, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def test_demo_against_a_running_cluster(cluster: LocalCluster) -> None:
    out = run("demo", "--json", "--metadata", cluster.metadata_address, "--chunk-bytes", "256KiB")
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    assert s["verified"] is True
    assert s["chunks_deduplicated"] > 0 and s["bytes_saved"] > 0
    # 16 prompts = 4 system prompts x 4 chunks + 16 x 2 unique chunks.
    assert s["chunks_published"] == 4 * 4 + 16 * 2
    assert s["chunks_deduplicated"] == 12 * 4
    assert 0.5 < s["prefix_hit_rate"] < 1.0
    assert s["bytes_transferred"] >= s["chunks_published"] * 256 * 1024

    # Tier figures reach the metadata service with each store's next heartbeat.
    deadline = time.monotonic() + 15
    while True:
        stats = run("stats", "--json", "--metadata", cluster.metadata_address)
        assert stats.returncode == 0, stats.stderr
        d = json.loads(stats.stdout)
        tier_chunks = sum(t["chunks"] for n in d["nodes"] for t in n["tiers"])
        if tier_chunks == s["chunks_published"] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(d["nodes"]) == 2
    for n in d["nodes"]:
        assert n["address"].startswith("127.0.0.1:")
        (tier,) = n["tiers"]
        assert tier["name"] == "cpu" and tier["capacity_bytes"] == 64 << 20
    assert tier_chunks == s["chunks_published"]
    assert d["bytes_saved"] == s["bytes_saved"]
    assert d["hit_tokens"] == s["chunks_pulled"] * 256
    assert d["lookups"] > 0 and d["miss_tokens"] > 0
    table = run("stats", "--metadata", cluster.metadata_address)
    assert "store-0" in table.stdout and "hit rate" in table.stdout


def test_demo_starts_its_own_cluster() -> None:
    out = run("demo", "--json", "--prompts", "6", "--chunk-bytes", "128KiB")
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    assert s["verified"] and s["chunks_deduplicated"] > 0 and s["bytes_saved"] > 0
    human = run("demo", "--prompts", "4", "--chunk-bytes", "64KiB")
    assert human.returncode == 0 and "verified: yes" in human.stdout


def test_errors_are_one_line_and_an_exit_code() -> None:
    out = run("stats", "--metadata", f"127.0.0.1:{free_port()}", "--timeout", "1")
    assert out.returncode == 1
    assert out.stderr.startswith("kvdepot: error:") and out.stderr.count("\n") == 1
    out = run("store", "--capacity", "12parsecs", "--check")
    assert out.returncode == 1 and "bad size" in out.stderr
    out = run("store", "--capacity", "1GiB", "--metadata", "h:1", "--check")
    assert out.returncode == 0 and json.loads(out.stdout)["store"]["capacity_bytes"] == 1 << 30
    out = run("metadata", "--lease-ttl", "0.1", "--check")
    assert out.returncode == 1 and out.stderr.count("\n") == 1
    assert run("frobnicate").returncode == 2


def test_env_configures_the_daemons() -> None:
    env = dict(os.environ, KVDEPOT_STORE_CAPACITY_BYTES="3MiB", KVDEPOT_STORE_NODE_ID="from-env")
    out = subprocess.run(
        [*KVDEPOT, "store", "--check"], env=env, capture_output=True, text=True, check=False
    )
    cfg = json.loads(out.stdout)["store"]
    assert cfg["capacity_bytes"] == 3 << 20 and cfg["node_id"] == "from-env"


def test_up_starts_and_ctrl_c_stops_everything(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [*KVDEPOT, "up", "--nodes", "3", "--metadata-port", str(port), "--capacity", "16MiB"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_nodes(f"127.0.0.1:{port}", 3, timeout_s=60)
        out = run("stats", "--json", "--metadata", f"127.0.0.1:{port}")
        assert len(json.loads(out.stdout)["nodes"]) == 3
        proc.send_signal(signal.SIGINT)
        stdout, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0
        assert stdout.count("store store-") == 3
    finally:
        if proc.poll() is None:
            proc.kill()
    # Every daemon is gone: the port is free again.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if run("stats", "--metadata", f"127.0.0.1:{port}", "--timeout", "0.5").returncode == 1:
            break
        time.sleep(0.2)
    else:
        pytest.fail("metadata still answering after Ctrl-C")


def test_example_config_is_accepted() -> None:
    cfg = str(Path(__file__).resolve().parents[2] / "deploy" / "kvdepot.example.toml")
    out = run("metadata", "--config", cfg, "--check")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["metadata"]["port"] == 7700
    out = run("store", "--config", cfg, "--check")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["store"]["capacity_bytes"] == 4 << 30


@pytest.mark.redis
def test_up_with_the_redis_index(redis_server: str, tmp_path: Path) -> None:
    import redis

    port = free_port()
    prefix = f"up-{port}"
    url = f"{redis_server}?prefix={prefix}"
    proc = subprocess.Popen(
        [
            *KVDEPOT,
            "up",
            "--nodes",
            "2",
            "--metadata-port",
            str(port),
            "--capacity",
            "32MiB",
            "--index",
            url,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_nodes(f"127.0.0.1:{port}", 2, timeout_s=60)
        out = run(
            "demo",
            "--json",
            "--metadata",
            f"127.0.0.1:{port}",
            "--prompts",
            "4",
            "--chunk-bytes",
            "64KiB",
        )
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["verified"] is True
        with redis.Redis.from_url(redis_server) as r:
            assert any(True for _ in r.scan_iter(match=f"{prefix}:*", count=100))
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
