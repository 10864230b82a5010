"""``kvdepot proxy``: disaggregated prefill → decode over OpenAI-compatible HTTP.

Each completion request goes first to a prefill engine with ``max_tokens=1``
(it computes the prompt's KV and its connector publishes it to kvdepot), then
unchanged to a decode engine, whose connector loads the prefix from kvdepot
instead of recomputing it. The decode engine's answer is relayed back,
streamed when the client asked for a stream. Engines are chosen round-robin,
or with ``routing="kv-aware"`` by the metadata service's ``Route`` query
(see :mod:`kvdepot.proxy.router`).

Every call to an engine is bounded (:class:`~kvdepot.proxy.config.UpstreamConfig`)
and every error, on every route, is an OpenAI-style ``{"error": {...}}``: 502
when an engine is unreachable or answers garbage, 504 when it does not answer
in time. ``/health`` asks the engines: 503 while no engine of a role answers.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiohttp import web

from kvdepot.errors import Unavailable
from kvdepot.keys import ChunkKey
from kvdepot.proxy.config import ProxyConfig, UpstreamConfig
from kvdepot.proxy.router import Choice, EnginePool, KVRouter, prompt_keys
from kvdepot.proxy.upstream import (
    BAD_GATEWAY,
    GATEWAY_TIMEOUT,
    Answer,
    ProxyError,
    Upstream,
    engine_error,
    error_payload,
    json_object,
)
from kvdepot.rpc.security_config import SecurityConfig

__all__ = ["Proxy", "ProxyConfig", "UpstreamConfig", "decode_body", "prefill_body", "serve"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

logger = logging.getLogger(__name__)

_FORWARDED = ("/v1/completions", "/v1/chat/completions")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request sent to the prefill engine: same prompt, one token, no stream."""
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    return out


def decode_body(body: dict[str, Any], prefill_answer: bytes) -> dict[str, Any]:
    """The request sent to the decode engine: the client's, plus the prefill's
    ``kv_transfer_params`` (the tokens it published), so the decode engine's
    connector waits for them to be committed instead of missing them."""
    try:
        params = json.loads(prefill_answer).get("kv_transfer_params")
    except (ValueError, AttributeError):
        return body
    if not isinstance(params, dict):
        return body
    return {**body, "kv_transfer_params": params}


class Proxy:
    """The aiohttp application and the calls it makes to the engines."""

    def __init__(self, config: ProxyConfig, security: SecurityConfig | None = None) -> None:
        self.config = config
        self.security = security
        self.requests = 0
        self.prefill_pool = EnginePool(config.prefill, dict(config.prefill_nodes))
        self.decode_pool = EnginePool(config.decode, dict(config.decode_nodes))
        self.upstream = Upstream(config.upstream)
        self._router: KVRouter | None = None
        self.routed = 0

    async def _choose(self, pool: EnginePool, keys: list[ChunkKey] | None, mapped: bool) -> Choice:
        if keys is None or not mapped:
            return Choice(pool.next_round_robin(), routed=False)
        if self._router is None:
            assert self.config.namespace is not None
            self._router = KVRouter(
                self.config.metadata, self.config.namespace.chunk_tokens, security=self.security
            )
        choice = await self._router.choose(pool, keys)
        self.routed += choice.routed
        return choice

    async def close(self) -> None:
        await self.upstream.close()
        if self._router is not None:
            await self._router.close()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20, middlewares=[errors_as_json])
        for path in _FORWARDED:
            app.router.add_post(path, self._handle)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        return app

    def _deadline(self) -> float:
        return asyncio.get_running_loop().time() + self.config.upstream.total_timeout_s

    async def _health(self, request: web.Request) -> web.Response:
        """200 while at least one engine of each role answers its ``/health``, else 503."""
        urls = sorted({*self.config.prefill, *self.config.decode})
        found = dict(zip(urls, await asyncio.gather(*map(self.upstream.alive, urls)), strict=True))
        engines = {
            role: {u: found[u] or "ok" for u in pool}
            for role, pool in (("prefill", self.config.prefill), ("decode", self.config.decode))
        }
        down = [u for u in urls if found[u] is not None]
        missing = [r for r, states in engines.items() if "ok" not in states.values()]
        body: dict[str, Any] = {
            "status": "unavailable" if missing else ("degraded" if down else "ok"),
            "engines": engines,
            "down": down,
            "requests": self.requests,
            "routed": self.routed,
        }
        if missing:
            why = "; ".join(f"{u} {found[u]}" for u in down)
            message = f"no {' and no '.join(missing)} engine answers /health: {why}"
            body.update(error_payload(message, "upstream_error", "engines_down"))
        return web.json_response(body, status=503 if missing else 200)

    async def _models(self, request: web.Request) -> web.Response:
        """The model list of the first decode engine (in turn) that answers one."""
        deadline = self._deadline()
        failures: list[ProxyError] = []
        for url in self.decode_pool.rotation():
            try:
                answer = await self.upstream.get(url, "/v1/models", deadline)
                if not answer.ok:
                    # The client asked the proxy nothing wrong: an engine's error is its fault.
                    raise ProxyError.of(
                        BAD_GATEWAY, "bad_upstream_answer", str(engine_error(url, answer))
                    )
                json_object(url, answer)
                return _json_bytes(answer.status, answer.body)
            except ProxyError as exc:
                failures.append(exc)
        if all(f.status == GATEWAY_TIMEOUT for f in failures):
            raise failures[-1]
        message = "no decode engine answered /v1/models: " + "; ".join(map(str, failures))
        raise ProxyError.of(BAD_GATEWAY, "engines_down", message)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await _request_object(request)
        self.requests += 1
        deadline = self._deadline()
        path = request.path
        keys = None
        if self.config.routing == "kv-aware" and self.config.namespace is not None:
            keys = prompt_keys(body, self.config.namespace)
        prefill = (await self._choose(self.prefill_pool, keys, True)).url
        self.prefill_pool.inflight[prefill] += 1
        try:
            answer = await self.upstream.exchange(prefill, path, prefill_body(body), deadline)
        finally:
            self.prefill_pool.inflight[prefill] -= 1
        _check(prefill, answer)
        body = decode_body(body, answer.body)
        mapped = bool(self.config.decode_nodes)
        decode = (await self._choose(self.decode_pool, keys, mapped)).url
        self.decode_pool.inflight[decode] += 1
        try:
            if body.get("stream"):
                return await self._stream(request, decode, body, deadline)
            answer = await self.upstream.exchange(decode, path, body, deadline)
            _check(decode, answer)
            return _json_bytes(answer.status, answer.body)
        finally:
            self.decode_pool.inflight[decode] -= 1

    async def _stream(
        self, request: web.Request, url: str, body: dict[str, Any], deadline: float
    ) -> web.StreamResponse:
        """Relay the decode engine's event stream. Its status goes out before its
        first event, so a stall or failure after that ends it with an error event."""
        r = await self.upstream.open(url, request.path, body, deadline)
        try:
            if not (200 <= r.status < 300 and r.content_type == "text/event-stream"):
                # An error, or an engine that ignored "stream": a whole answer.
                answer = Answer(r.status, await self.upstream.guarded(url, r.read(), deadline))
                _check(url, answer)
                return _json_bytes(answer.status, answer.body)
            resp = web.StreamResponse(status=r.status)
            resp.content_type = "text/event-stream"
            resp.headers["Cache-Control"] = "no-cache"
            await resp.prepare(request)
            try:
                try:
                    while chunk := await self.upstream.guarded(url, r.content.readany(), deadline):
                        await resp.write(chunk)
                except ProxyError as exc:
                    await resp.write(b"data: " + json.dumps(exc.payload).encode() + b"\n\n")
                await resp.write_eof()
            except ConnectionResetError:
                # The client left: no one to answer; closing the engine's call stops its work.
                logger.info("client of %s left mid-stream", request.path)
            return resp
        finally:
            r.close()


@web.middleware
async def errors_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error the proxy answers, its own or aiohttp's (404, 405, 413), as
    OpenAI-style JSON; an unforeseen exception is logged, never sent."""
    try:
        return await handler(request)
    except ProxyError as exc:
        return web.json_response(exc.payload, status=exc.status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        message = f"{request.method} {request.path}: {exc.reason}"
        return web.json_response(error_payload(message, kind, exc.status), status=exc.status)
    except ConnectionResetError:
        raise  # the client left: there is no one to answer
    except Exception:
        logger.exception("proxy failed on %s %s", request.method, request.path)
        message = "the proxy failed on this request (see its log)"
        return web.json_response(error_payload(message, "server_error", "proxy_error"), status=500)


def _check(url: str, answer: Answer) -> None:
    """Raise what the client gets for an engine's answer that is an error or no JSON object."""
    if not answer.ok:
        raise engine_error(url, answer)
    json_object(url, answer)


def _json_bytes(status: int, raw: bytes) -> web.Response:
    # Relayed as the engine wrote it: nothing is lost or reordered by a round trip.
    return web.Response(status=status, body=raw, content_type="application/json")


async def _request_object(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ProxyError.of(
            400, "invalid_json", "request body must be JSON", "invalid_request_error"
        ) from None
    if not isinstance(body, dict):
        raise ProxyError.of(
            400, "invalid_json", "request body must be a JSON object", "invalid_request_error"
        )
    return body


async def serve(
    config: ProxyConfig, announce: Any = None, security: SecurityConfig | None = None
) -> None:
    """Serve until cancelled (``security``: of the proxy's calls to the metadata service).

    Raises:
        Unavailable: The port is in use (one line naming it).
    """
    proxy = Proxy(config, security)
    # A client that hangs up cancels its handler, which closes the engine's call:
    # vLLM then aborts that request instead of generating for no one.
    runner = web.AppRunner(proxy.app(), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        why = f"port {config.port} is already in use" if exc.errno == errno.EADDRINUSE else exc
        raise Unavailable(f"cannot listen on {config.host}:{config.port} (proxy): {why}") from None
    sockets: Sequence[Any] = getattr(site._server, "sockets", ()) or ()
    port = sockets[0].getsockname()[1] if sockets else config.port
    bounds = config.upstream
    logger.info(
        "proxy on %s:%d (%s): prefill %s, decode %s; engine timeouts: connect %g s, "
        "silence %g s, total %g s, health %g s",
        config.host,
        port,
        config.routing,
        ", ".join(config.prefill),
        ", ".join(config.decode),
        bounds.connect_timeout_s,
        bounds.first_byte_timeout_s,
        bounds.total_timeout_s,
        bounds.health_timeout_s,
    )
    if announce is not None:
        announce("KVDEPOT READY " + json.dumps({"role": "proxy", "port": port}))
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        await proxy.close()
