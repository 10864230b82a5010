"""KV-aware routing with real daemons: the Route RPC and the proxy's choice."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import numpy as np
import pytest

from kvdepot.apps.cluster import LocalCluster
from kvdepot.connector.client import ClientConfig, KVDepotClient
from kvdepot.keys import Namespace, chunk_keys
from kvdepot.proto.gen import metadata_pb2, metadata_pb2_grpc

pytestmark = pytest.mark.integration

NS = Namespace("test/model", chunk_tokens=16)
SIZE = 64 << 10


def publish(cluster: LocalCluster, node: str, tokens: list[int]) -> list[bytes]:
    keys: list[bytes] = list(chunk_keys(NS, tokens))
    with KVDepotClient(ClientConfig(metadata=cluster.metadata_address, node_id=node)) as c:
        r = c.put(keys, [np.full(SIZE, i, dtype=np.uint8) for i in range(len(keys))])
    assert r.stored == len(keys)
    return keys


def route(cluster: LocalCluster, keys: list[bytes], **extra: Any) -> metadata_pb2.RouteResponse:
    candidates = [
        metadata_pb2.RouteCandidate(id="e0", node_id="store-0"),
        metadata_pb2.RouteCandidate(id="e1", node_id="store-1"),
        metadata_pb2.RouteCandidate(id="e2", node_id=""),
    ]
    with grpc.insecure_channel(cluster.metadata_address) as ch:
        reply: metadata_pb2.RouteResponse = metadata_pb2_grpc.MetadataStub(ch).Route(
            metadata_pb2.RouteRequest(keys=keys, tokens_per_key=16, candidates=candidates, **extra),
            timeout=5,
        )
    return reply


def test_route_local_remote_none(cluster: LocalCluster) -> None:
    tokens = list(range(16 * 8))
    keys = publish(cluster, "store-0", tokens[: 16 * 6])
    reply = route(cluster, list(chunk_keys(NS, tokens)))
    assert reply.hits == 6
    split = [(s.candidate_id, s.local_tokens, s.remote_tokens, s.none_tokens) for s in reply.scores]
    assert split == [("e0", 96, 0, 32), ("e1", 0, 96, 32), ("e2", 0, 96, 32)]
    assert [s.remote_bytes for s in reply.scores] == [0, 6 * SIZE, 6 * SIZE]
    assert reply.best == 0
    assert reply.scores[0].score > reply.scores[1].score
    assert all(s.score == -s.estimated_s for s in reply.scores)

    other = publish(cluster, "store-1", [7] * (16 * 3))
    assert route(cluster, other).best == 1
    # A reader on store-1 that replicates what it pulls makes the prefix local there too.
    cfg = ClientConfig(metadata=cluster.metadata_address, node_id="store-1", replicate_on_read=True)
    with KVDepotClient(cfg) as c:
        assert c.get_into(keys[:2], [np.zeros(SIZE, dtype=np.uint8) for _ in range(2)]).leading == 2
    after = [(s.local_tokens, s.remote_tokens) for s in route(cluster, keys).scores]
    assert after[:2] == [(96, 0), (32, 64)]


def test_route_rejects_bad_requests(cluster: LocalCluster) -> None:
    with grpc.insecure_channel(cluster.metadata_address) as ch:
        stub = metadata_pb2_grpc.MetadataStub(ch)
        for req in (
            metadata_pb2.RouteRequest(keys=[b"x" * 16]),
            metadata_pb2.RouteRequest(
                keys=[b"short"], candidates=[metadata_pb2.RouteCandidate(id="a")]
            ),
            metadata_pb2.RouteRequest(
                candidates=[
                    metadata_pb2.RouteCandidate(id="a"),
                    metadata_pb2.RouteCandidate(id="a"),
                ]
            ),
        ):
            with pytest.raises(grpc.RpcError) as info:
                stub.Route(req, timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# -- the proxy ------------------------------------------------------------------
async def _fake_engine(name: str, seen: list[str]) -> Any:
    from aiohttp import web

    async def completions(request: Any) -> Any:
        await request.json()
        seen.append(name)
        return web.json_response({"choices": [{"text": name}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


async def _proxy_scenario(metadata: str, prompts: list[Any]) -> list[list[str]]:
    import aiohttp
    from aiohttp import web

    from kvdepot.proxy.server import Proxy, ProxyConfig

    seen: list[str] = []
    engines = {}
    runners = []
    for name in ("p0", "p1", "d0", "d1"):
        runner, url = await _fake_engine(name, seen)
        runners.append(runner)
        engines[name] = url
    config = ProxyConfig(
        prefill=(engines["p0"], engines["p1"]),
        decode=(engines["d0"], engines["d1"]),
        routing="kv-aware",
        prefill_nodes=((engines["p0"], "store-0"), (engines["p1"], "store-1")),
        decode_nodes=((engines["d0"], "store-0"), (engines["d1"], "store-1")),
        metadata=metadata,
        namespace=NS,
    )
    proxy = Proxy(config)
    runner = web.AppRunner(proxy.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    out = []
    try:
        async with aiohttp.ClientSession() as session:
            for prompt in prompts:
                seen.clear()
                body = {"model": "m", "prompt": prompt, "max_tokens": 4}
                async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                    assert r.status == 200
                    reply = await r.json()
                out.append([*seen])
                assert reply["choices"][0]["text"] == seen[-1]
    finally:
        await runner.cleanup()
        await proxy.close()
        for r in runners:
            await r.cleanup()
    return out


def test_proxy_kv_aware_picks_the_engine_holding_the_prefix(cluster: LocalCluster) -> None:
    pytest.importorskip("aiohttp")
    a = list(range(16 * 4))
    b = [9] * (16 * 4)
    publish(cluster, "store-1", a)
    publish(cluster, "store-0", b)
    routed = asyncio.run(
        _proxy_scenario(
            cluster.metadata_address,
            [[*a, 5, 6, 7], [*b, 1], a, "a text prompt", "another text prompt"],
        )
    )
    assert routed[0] == ["p1", "d1"]
    assert routed[1] == ["p0", "d0"]
    assert routed[2] == ["p1", "d1"]
    # Text prompts cannot be keyed: round-robin over both engines.
    assert {routed[3][0], routed[4][0]} == {"p0", "p1"}


def test_routing_benchmark_quick_json() -> None:
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "routing.py"
    out = subprocess.run(
        [sys.executable, str(script), "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result = json.loads(out.stdout)
    for policy in ("kv_aware", "round_robin"):
        assert {"recomputed_tokens", "bytes_moved", "ttft_est_s"} <= result[policy].keys()
    assert result["kv_aware"]["recomputed_tokens"] < result["round_robin"]["recomputed_tokens"]
    assert result["kv_aware"]["bytes_moved"] < result["round_robin"]["bytes_moved"]
