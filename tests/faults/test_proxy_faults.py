"""The proxy in front of engines that freeze, hang, answer garbage or are gone.

Everything is a real process on 127.0.0.1: the proxy (``serve`` with short
bounds) and fake engines, small aiohttp servers that answer like vLLM, hang,
or answer HTML. A frozen engine is a fake engine stopped with SIGSTOP, as an
operator saw it: the kernel still accepts connections to it, nothing answers.
Each failure must come back as OpenAI-style JSON (502 or 504) within its
configured bound, never as a hang or a traceback.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvdepot.apps.cluster import wait_ready
from tests.procs import freeze

pytest.importorskip("aiohttp", reason="the proxy needs aiohttp")

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.timeout(120)]

BOUNDS = {
    "connect_timeout_s": 0.5,
    "first_byte_timeout_s": 1.0,
    "total_timeout_s": 4.0,
    "health_timeout_s": 0.5,
}
SILENT = BOUNDS["first_byte_timeout_s"] + BOUNDS["health_timeout_s"]
"""How long a request waits on a frozen engine: its silence, then its failed /health."""
SLACK = 1.5
"""Scheduling slack on a loaded 2-core machine."""

ENGINE = r"""
import asyncio, json, sys
from aiohttp import web

mode = sys.argv[1]

async def health(request):
    return web.json_response({})

async def models(request):
    if mode == "hang":
        await asyncio.sleep(3600)
    if mode == "html":
        return web.Response(text="<html>models?</html>", content_type="text/html")
    return web.json_response({"object": "list", "data": [{"id": "fake"}]})

async def completions(request):
    body = await request.json()
    if mode == "hang":
        await asyncio.sleep(3600)
    if mode == "html":
        status = 200 if request.path == "/v1/completions" else 500
        return web.Response(status=status, text="<html>oops</html>", content_type="text/html")
    if mode == "error":
        error = {"object": "error", "message": "max_tokens is too large",
                 "type": "BadRequestError", "param": None, "code": 400}
        return web.json_response(error, status=400)
    n = body.get("max_tokens", 1)
    if not body.get("stream"):
        return web.json_response({"choices": [{"text": "x" * n}],
                                  "kv_transfer_params": {"from": mode}})
    resp = web.StreamResponse()
    resp.content_type = "text/event-stream"
    await resp.prepare(request)
    for i in range(n):
        event = {"choices": [{"text": str(i)}]}
        await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        if mode == "stall" and i == 1:
            await asyncio.sleep(3600)
        await asyncio.sleep(0.1)
    await resp.write(b"data: [DONE]\n\n")
    return resp

app = web.Application()
app.router.add_get("/health", health)
app.router.add_get("/v1/models", models)
app.router.add_post("/v1/completions", completions)
app.router.add_post("/v1/chat/completions", completions)

async def main():
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    print("KVDEPOT READY " + json.dumps({"role": "engine", "port": port}), flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""

PROXY = r"""
import asyncio, json, logging, sys
from kvdepot.proxy.config import ProxyConfig, UpstreamConfig
from kvdepot.proxy.server import serve

logging.basicConfig(level=logging.INFO, stream=sys.stderr)
spec = json.loads(sys.argv[1])
config = ProxyConfig(
    prefill=tuple(spec["prefill"]),
    decode=tuple(spec["decode"]),
    port=0,
    upstream=UpstreamConfig(**spec["bounds"]),
)
asyncio.run(serve(config, announce=lambda line: print(line, flush=True)))
"""


class Cluster:
    """Fake engines and proxies this test started; all killed at its end."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []

    def _start(self, code: str, arg: str, name: str) -> tuple[subprocess.Popen[bytes], int]:
        log = self.tmp / f"{name}-{len(self.procs)}.log"
        proc = subprocess.Popen(
            [sys.executable, "-c", code, arg],
            stdout=subprocess.PIPE,
            stderr=log.open("wb"),
        )
        self.procs.append(proc)
        self.logs.append(log)
        port: int = wait_ready(proc, name, 30)["port"]
        return proc, port

    def engine(self, mode: str = "ok") -> tuple[subprocess.Popen[bytes], str]:
        proc, port = self._start(ENGINE, mode, f"engine-{mode}")
        return proc, f"http://127.0.0.1:{port}"

    def proxy(self, prefill: list[str], decode: list[str], **bounds: float) -> Client:
        spec = {"prefill": prefill, "decode": decode, "bounds": {**BOUNDS, **bounds}}
        _, port = self._start(PROXY, json.dumps(spec), "proxy")
        return Client(port)

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()  # SIGKILL also ends a stopped process
        for proc in self.procs:
            proc.wait(timeout=10)
            if proc.stdout is not None:
                proc.stdout.close()

    def proxy_tracebacks(self) -> list[str]:
        return [
            log.name
            for log in self.logs
            if log.name.startswith("proxy") and "Traceback" in log.read_text(errors="replace")
        ]


class Client:
    """Plain HTTP to the proxy, with the time each answer took."""

    def __init__(self, port: int) -> None:
        self.port = port

    def call(
        self, method: str, path: str, body: Any = None, raw: bytes | None = None
    ) -> tuple[int, dict[str, Any], float]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        start = time.monotonic()
        try:
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            payload = r.read()
        finally:
            conn.close()
        took = time.monotonic() - start
        assert r.getheader("Content-Type", "").startswith("application/json"), payload[:200]
        return r.status, json.loads(payload), took

    def complete(self, **extra: Any) -> tuple[int, dict[str, Any], float]:
        return self.call("POST", "/v1/completions", {"model": "m", "prompt": "hi", **extra})

    def stream(self, max_tokens: int) -> tuple[http.client.HTTPConnection, Iterator[str]]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        body = {"model": "m", "prompt": "hi", "max_tokens": max_tokens, "stream": True}
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode())
        r = conn.getresponse()
        assert r.status == 200
        assert r.getheader("Content-Type", "").startswith("text/event-stream")

        def events() -> Iterator[str]:
            for line in r:
                text = line.decode().strip()
                if text.startswith("data: "):
                    yield text[len("data: ") :]

        return conn, events()


def assert_error(
    answer: tuple[int, dict[str, Any], float], status: int, code: str, within: float
) -> dict[str, Any]:
    got, body, took = answer
    assert got == status, body
    error = body["error"]
    assert error["code"] == code, error
    assert error["type"] == {502: "upstream_error", 504: "upstream_timeout"}[status]
    assert isinstance(error["message"], str) and error["message"]
    assert took < within, f"{code} after {took:.2f} s, bound {within:.2f} s"
    return error


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.stop()
    assert not c.proxy_tracebacks(), f"a proxy logged a traceback: see {tmp_path}"


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def frozen(proc: subprocess.Popen[bytes]) -> Callable[[], None]:
    freeze(proc.pid)
    return lambda: os.kill(proc.pid, signal.SIGCONT)


def test_a_frozen_engine_is_a_504_within_the_bound(cluster: Cluster) -> None:
    prefill, p_url = cluster.engine()
    decode, d_url = cluster.engine()
    proxy = cluster.proxy([p_url], [d_url])
    status, body, _ = proxy.complete(max_tokens=3)
    assert (status, body["choices"][0]["text"]) == (200, "xxx")
    status, health, _ = proxy.call("GET", "/health")
    assert (status, health["status"]) == (200, "ok"), health

    thaw = frozen(decode)
    error = assert_error(proxy.complete(), 504, "engine_unresponsive", SILENT + SLACK)
    assert d_url in error["message"]
    assert_error(proxy.call("GET", "/v1/models"), 504, "engine_unresponsive", SILENT + SLACK)
    status, health, took = proxy.call("GET", "/health")
    assert status == 503 and health["down"] == [d_url], health
    assert health["engines"]["prefill"] == {p_url: "ok"}
    assert health["error"]["code"] == "engines_down"
    assert took < BOUNDS["health_timeout_s"] + SLACK
    thaw()
    status, health, _ = proxy.call("GET", "/health")
    assert (status, health["status"], health["down"]) == (200, "ok", [])
    assert proxy.complete()[0] == 200

    thaw = frozen(prefill)
    error = assert_error(proxy.complete(), 504, "engine_unresponsive", SILENT + SLACK)
    assert p_url in error["message"]
    thaw()
    assert proxy.complete()[0] == 200


def test_a_live_engine_that_never_answers_is_cut_at_the_total_timeout(cluster: Cluster) -> None:
    _, p_url = cluster.engine()
    _, d_url = cluster.engine("hang")
    proxy = cluster.proxy([p_url], [d_url])
    # Its /health answers, so the proxy keeps waiting: up to the request's deadline.
    total = BOUNDS["total_timeout_s"]
    error = assert_error(proxy.complete(), 504, "total_timeout", total + SLACK)
    assert d_url in error["message"]
    assert proxy.call("GET", "/health")[0] == 200


def test_a_connect_that_hangs_is_a_504(cluster: Cluster) -> None:
    # A listener whose accept queue is full: the kernel drops further SYNs, so
    # connecting hangs as it does to a host that vanished.
    with socket.socket() as listener, socket.socket() as filler:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        filler.connect(listener.getsockname())
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        _, d_url = cluster.engine()
        proxy = cluster.proxy([url], [d_url])
        bound = BOUNDS["connect_timeout_s"] + SLACK
        error = assert_error(proxy.complete(), 504, "connect_timeout", bound)
        assert url in error["message"]
        status, health, _ = proxy.call("GET", "/health")
        assert status == 503 and health["down"] == [url]


def test_with_the_engines_down_every_route_answers_json(cluster: Cluster) -> None:
    p_url, d_url = closed_port_url(), closed_port_url()
    proxy = cluster.proxy([p_url], [d_url])
    error = assert_error(proxy.call("GET", "/v1/models"), 502, "engines_down", SLACK)
    assert d_url in error["message"]
    assert_error(proxy.complete(), 502, "engine_unreachable", SLACK)
    chat = proxy.call("POST", "/v1/chat/completions", {"model": "m", "messages": []})
    assert_error(chat, 502, "engine_unreachable", SLACK)
    status, health, _ = proxy.call("GET", "/health")
    assert status == 503 and health["status"] == "unavailable"
    assert sorted(health["down"]) == sorted([p_url, d_url])
    assert "prefill" in health["error"]["message"] and "decode" in health["error"]["message"]
    # The proxy's own refusals are JSON too.
    for method, path, raw, code in (
        ("GET", "/nowhere", None, 404),
        ("GET", "/v1/completions", None, 405),
        ("POST", "/v1/completions", b"{not json", 400),
        ("POST", "/v1/completions", b"[1, 2]", 400),
    ):
        status, body, _ = proxy.call(method, path, raw=raw)
        assert status == code and body["error"]["type"] == "invalid_request_error", body


def test_answers_that_are_no_json_are_502_and_engine_errors_are_relayed(
    cluster: Cluster,
) -> None:
    _, ok_url = cluster.engine()
    _, html_url = cluster.engine("html")
    _, error_url = cluster.engine("error")
    proxy = cluster.proxy([ok_url], [html_url])
    error = assert_error(proxy.complete(), 502, "bad_upstream_answer", SLACK)
    assert html_url in error["message"] and "oops" in error["message"]
    chat = proxy.call("POST", "/v1/chat/completions", {"model": "m", "messages": []})
    assert "500" in assert_error(chat, 502, "bad_upstream_answer", SLACK)["message"]
    assert_error(proxy.call("GET", "/v1/models"), 502, "engines_down", SLACK)
    # A prefill answering HTML fails the request before any decode.
    assert_error(cluster.proxy([html_url], [ok_url]).complete(), 502, "bad_upstream_answer", SLACK)

    # An engine's own JSON error keeps its status, in the OpenAI shape.
    status, body, _ = cluster.proxy([ok_url], [error_url]).complete(max_tokens=10**6)
    assert status == 400
    assert body["error"]["message"] == "max_tokens is too large"
    assert body["error"]["code"] == 400


def test_a_stream_ends_within_the_bound_when_its_engine_stalls(cluster: Cluster) -> None:
    _, p_url = cluster.engine()
    decode, d_url = cluster.engine()
    proxy = cluster.proxy([p_url], [d_url])
    conn, events = proxy.stream(3)
    assert list(events) == [
        *(json.dumps({"choices": [{"text": str(i)}]}) for i in range(3)),
        "[DONE]",
    ]
    conn.close()

    conn, events = proxy.stream(500)  # 50 s of events unless it stalls
    try:
        assert json.loads(next(events))["choices"][0]["text"] == "0"
        thaw = frozen(decode)
        start = time.monotonic()
        rest = list(events)
        took = time.monotonic() - start
        thaw()
    finally:
        conn.close()
    assert took < SILENT + SLACK, f"the stream ended {took:.2f} s after the stall"
    last = json.loads(rest[-1])
    assert last["error"]["code"] == "engine_unresponsive", rest[-3:]
    assert "[DONE]" not in rest


def test_a_stream_whose_live_engine_goes_silent_ends_at_the_total_timeout(
    cluster: Cluster,
) -> None:
    _, p_url = cluster.engine()
    _, d_url = cluster.engine("stall")
    proxy = cluster.proxy([p_url], [d_url])
    start = time.monotonic()
    conn, events = proxy.stream(10)
    try:
        got = list(events)
    finally:
        conn.close()
    took = time.monotonic() - start
    assert [json.loads(e)["choices"][0]["text"] for e in got[:2]] == ["0", "1"]
    assert json.loads(got[-1])["error"]["code"] == "total_timeout"
    assert took < BOUNDS["total_timeout_s"] + SLACK
