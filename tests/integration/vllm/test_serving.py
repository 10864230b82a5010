"""A real ``vllm serve`` with the connector while kvdepot's daemons freeze.

A store or the metadata service stopped with SIGSTOP (a frozen process: its
sockets accept, nothing answers) must never stall the engine: a request that
needs nothing from kvdepot finishes within twice its normal latency, one
whose KV is on the frozen store recomputes after the load deadline and is
correct, and after SIGCONT loads hit again without a restart.
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np
import pytest

from kvdepot.apps.cluster import LocalCluster
from kvdepot.proto.gen import store_pb2, store_pb2_grpc

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvdepot[vllm]')")

from tests.procs import freeze

from .engine import build_tiny_llama
from .test_connector import kv
from .test_proxy import free_port, post, serve, wait_http

pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.timeout(1200)]

LOAD_TIMEOUT_S = 8.0
rng = np.random.default_rng(99)


def prompt(n: int) -> list[int]:
    return rng.integers(1, 1000, n).tolist()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("serve")
    # Big enough that a request takes a fraction of a second, so the
    # latency bound is not lost in the scheduling noise of two shared cores.
    model = str(build_tiny_llama(tmp / "model", layers=4, hidden=256, heads=4, kv_heads=2))
    cluster = LocalCluster(
        nodes=1, capacity="256MiB", log_dir=tmp / "logs", lease_ttl_s=120, heartbeat_interval_s=1
    )
    cluster.start()
    port = free_port()
    cfg = kv(
        "kv_both",
        cluster.metadata_address,
        "store-0",
        chunk_tokens=256,
        lookup_timeout_s=0.05,  # the default
        load_timeout_s=LOAD_TIMEOUT_S,
        io_timeout_s=LOAD_TIMEOUT_S,
        rpc_timeout_s=LOAD_TIMEOUT_S,
    )
    proc = serve(model, port, cfg, tmp, "engine")
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, 600)
        yield {"url": f"http://127.0.0.1:{port}", "model": model, "cluster": cluster, "tmp": tmp}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except Exception:
            proc.kill()
            proc.wait()
        cluster.stop()


def complete(
    server: dict[str, Any], ids: list[int], max_tokens: int = 16
) -> tuple[list[int], float]:
    body = {
        "model": server["model"],
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "return_token_ids": True,
    }
    t0 = time.perf_counter()
    out = post(server["url"] + "/v1/completions", body)
    return list(out["choices"][0]["token_ids"]), time.perf_counter() - t0


# Two shared cores: a request's latency varies by a few hundred ms with
# whatever else runs. The stalls these tests guard against cost seconds (the
# load deadline or an RPC timeout), so the bound allows that much noise.
NOISE_S = 1.0


def normal_latency(server: dict[str, Any], n: int = 5) -> float:
    """Median latency of requests that miss kvdepot, with everything healthy."""
    return statistics.median(complete(server, prompt(700))[1] for _ in range(n))


def store_reads(cluster: LocalCluster) -> int:
    with grpc.insecure_channel(cluster.stores[0].info["grpc_address"]) as ch:
        stats = store_pb2_grpc.StoreStub(ch).GetStats(store_pb2.StoreStatsRequest(), timeout=5)
        # shm readers copy out of the arena themselves: count leases (gets) too.
        return int(stats.gets + stats.bytes_out + sum(t.hits for t in stats.tiers))


def wait_published(cluster: LocalCluster, at_least: int, timeout_s: float = 15.0) -> None:
    from kvdepot.connector.client import ClientConfig, KVDepotClient

    deadline = time.monotonic() + timeout_s
    with KVDepotClient(ClientConfig(metadata=cluster.metadata_address)) as client:
        while client.stats().puts_committed < at_least:
            assert time.monotonic() < deadline, "the engine's saves were not published"
            time.sleep(0.2)


def frozen(pid: int) -> Any:
    class _Frozen:
        def __enter__(self) -> None:
            freeze(pid)

        def __exit__(self, *exc: object) -> None:
            os.kill(pid, signal.SIGCONT)

    return _Frozen()


def test_a_frozen_store_costs_only_the_requests_whose_kv_it_holds(server: dict[str, Any]) -> None:
    cluster: LocalCluster = server["cluster"]
    cached = prompt(700)  # 2 chunks of 256 and a tail block of 128
    want, _ = complete(server, cached)
    wait_published(cluster, 3)
    again, _ = complete(server, cached)
    assert again == want
    normal = normal_latency(server)
    with frozen(cluster.stores[0].pid), ThreadPoolExecutor(2) as pool:
        stuck = pool.submit(complete, server, cached)
        time.sleep(0.3)  # its load is under way, against the frozen store
        # Requests that need nothing of the frozen store, while that load waits.
        free = [complete(server, prompt(700))[1] for _ in range(3)]
        tokens, took = stuck.result(timeout=120)
    print(f"frozen store: normal {normal:.3f} s, free {free}, stuck {took:.2f} s")
    assert statistics.median(free) <= 2 * normal + NOISE_S, (free, normal)
    # Recomputed after the load deadline, with the same answer.
    assert tokens == want
    assert took >= LOAD_TIMEOUT_S * 0.9, took
    # The store thaws: the next request loads from it again.
    before = store_reads(cluster)
    tokens, _ = complete(server, cached)
    assert tokens == want
    assert store_reads(cluster) > before


def test_a_frozen_metadata_service_costs_a_miss_not_seconds(server: dict[str, Any]) -> None:
    cluster: LocalCluster = server["cluster"]
    cached = prompt(700)
    want, _ = complete(server, cached)
    wait_published(cluster, 1)
    normal = normal_latency(server)
    assert cluster.metadata is not None
    with frozen(cluster.metadata.pid):
        free = [complete(server, prompt(700))[1] for _ in range(4)]
        tokens, _ = complete(server, cached)
    # Each new request costs at most the lookup deadline, not the RPC timeout.
    print(f"frozen metadata: normal {normal:.3f} s, free {free}")
    assert statistics.median(free) <= 2 * normal + NOISE_S, (free, normal)
    assert tokens == want
    # Thawed: once the breaker closes, the cached prompt loads again.
    time.sleep(2.5)
    deadline = time.monotonic() + 30
    before = store_reads(cluster)
    while True:
        tokens, _ = complete(server, cached)
        assert tokens == want
        if store_reads(cluster) > before:
            break
        assert time.monotonic() < deadline, "loads did not resume after SIGCONT"
        time.sleep(1.0)
