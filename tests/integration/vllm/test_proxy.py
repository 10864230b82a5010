"""Disaggregated serving over HTTP: kvdepot proxy → prefill vllm serve → decode vllm serve."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvdepot.apps.cluster import LocalCluster, wait_ready
from kvdepot.connector.client import ClientConfig, KVDepotClient
from kvdepot.proto.gen import store_pb2, store_pb2_grpc

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvdepot[vllm]')")
pytest.importorskip("aiohttp", reason="the proxy needs aiohttp")

from .engine import build_tiny_llama, engine_env
from .test_connector import PROMPT_A, kv, run_engine, spec

pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.timeout(1200)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def serve(
    model: str, port: int, kvcfg: dict[str, Any], tmp: Path, name: str, *extra: str
) -> subprocess.Popen[bytes]:
    env = engine_env(tmp / name)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--skip-tokenizer-init",
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "4096",
            "--no-enable-prefix-caching",
            "--distributed-executor-backend",
            "uni",
            "--kv-transfer-config",
            json.dumps(kvcfg),
            *extra,
        ],
        env=env,
        stdout=open(tmp / f"{name}.out", "wb"),
        stderr=subprocess.STDOUT,
    )


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"server for {url} exited"
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"{url} not up within {timeout_s} s")


def engine_trouble(tmp: Path) -> dict[str, list[str]]:
    """The engines' kvdepot, error and traceback lines, for a failure message.

    (CI once saw a prefill that published nothing, with no log left to read.)
    """
    found: dict[str, list[str]] = {}
    for name in ("prefill", "decode"):
        text = (tmp / f"{name}.out").read_text(errors="replace")
        lines = [ln for ln in text.splitlines() if re.search("kvdepot|Error|Traceback", ln)]
        found[name] = lines[-20:]
    return found


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def chunk_reads(cluster: LocalCluster) -> int:
    """Chunk reads the cluster's stores served (tcp gets and shm leases alike)."""
    total = 0
    for store in cluster.stores:
        with grpc.insecure_channel(store.info["grpc_address"]) as ch:
            stub = store_pb2_grpc.StoreStub(ch)
            total += int(stub.GetStats(store_pb2.StoreStatsRequest(), timeout=5).gets)
    return total


def test_proxy_prefill_then_decode_over_http(tmp_path: Path) -> None:
    model = str(build_tiny_llama(tmp_path / "tiny-llama"))
    plain = run_engine(tmp_path, spec(model, [PROMPT_A], None), "plain")["outputs"][0]
    with LocalCluster(nodes=2, capacity="64MiB", log_dir=tmp_path / "logs") as cluster:
        meta = cluster.metadata_address
        pport, dport = free_port(), free_port()
        procs = [
            serve(model, pport, kv("kv_producer", meta, "store-0"), tmp_path, "prefill"),
            serve(model, dport, kv("kv_consumer", meta, "store-1"), tmp_path, "decode"),
        ]
        proxy = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvdepot.apps.cli",
                "proxy",
                "--port",
                "0",
                "--prefill",
                f"http://127.0.0.1:{pport}",
                "--decode",
                f"http://127.0.0.1:{dport}",
            ],
            stdout=subprocess.PIPE,
            stderr=open(tmp_path / "proxy.log", "wb"),  # noqa: SIM115
        )
        procs.append(proxy)
        try:
            port = wait_ready(proxy, "proxy", 30)["port"]
            for p, name in ((pport, "prefill"), (dport, "decode")):
                wait_http(f"http://127.0.0.1:{p}/health", procs[0 if name == "prefill" else 1], 600)
            body = {
                "model": model,
                "prompt": PROMPT_A,
                "max_tokens": 8,
                "temperature": 0.0,
                "return_token_ids": True,
            }
            out = post(f"http://127.0.0.1:{port}/v1/completions", body)
            assert out["choices"][0]["token_ids"] == plain["tokens"]
            with KVDepotClient(ClientConfig(metadata=meta)) as client:
                stats = client.stats()
            # The prefill published the prompt's 2 chunks and its 32-token
            # tail unit, one object per KV head (2); the decode loaded them
            # from the stores. (Its scheduler's lookup may run before the
            # prefill's publish is committed, which the decode then waits for:
            # the cluster's hit counters do not always see that load.)
            assert stats.puts_committed == 2 * (2 + 1), (stats, engine_trouble(tmp_path))
            assert chunk_reads(cluster) >= 2, engine_trouble(tmp_path)
            # Streaming goes through too.
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions",
                data=json.dumps({**body, "stream": True}).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=300) as r:
                events = [ln for ln in r.read().decode().splitlines() if ln.startswith("data:")]
            tokens = [
                t
                for e in events
                if e != "data: [DONE]"
                for t in json.loads(e[5:])["choices"][0].get("token_ids") or []
            ]
            assert tokens == plain["tokens"]
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
