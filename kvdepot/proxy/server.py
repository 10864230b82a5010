"""``kvdepot proxy``: disaggregated prefill → decode over OpenAI-compatible HTTP.

Each completion request goes first to a prefill engine with ``max_tokens=1``
(it computes the prompt's KV and its connector publishes it to kvdepot), then
unchanged to a decode engine, whose connector loads the prefix from kvdepot
instead of recomputing it. The decode engine's answer is relayed back,
streamed when the client asked for a stream. Engines are chosen round-robin,
or with ``routing="kv-aware"`` by the metadata service's ``Route`` query
(see :mod:`kvdepot.proxy.router`).
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvdepot.config import Port, positive, setting, validate
from kvdepot.errors import InvalidArgument, Unavailable
from kvdepot.keys import ChunkKey, Namespace
from kvdepot.proxy.router import ROUTING_MODES, Choice, EnginePool, KVRouter, prompt_keys
from kvdepot.rpc.security_config import SecurityConfig

logger = logging.getLogger(__name__)

_FORWARDED = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """Configuration of the proxy.

    Attributes:
        prefill: Base URLs of the prefill engines (``http://host:port``).
        decode: Base URLs of the decode engines.
        host: Address the proxy binds.
        port: Port the proxy listens on.
        timeout_s: Deadline of each upstream request.
        routing: ``"round-robin"`` or ``"kv-aware"``.
        prefill_nodes: ``(url, store node id)`` of prefill engines (kv-aware).
        decode_nodes: ``(url, store node id)`` of decode engines (kv-aware).
        metadata: Metadata service ``host:port`` (kv-aware).
        namespace: The engines' key namespace, to key prompts (kv-aware).
    """

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = setting(8000, Port())
    timeout_s: float = setting(600.0, positive())
    routing: str = "round-robin"
    prefill_nodes: tuple[tuple[str, str], ...] = ()
    decode_nodes: tuple[tuple[str, str], ...] = ()
    metadata: str = ""
    namespace: Namespace | None = None

    def __post_init__(self) -> None:
        validate(self)
        if not self.prefill or not self.decode:
            raise InvalidArgument("the proxy needs at least one prefill and one decode engine")
        for url in (*self.prefill, *self.decode):
            if not url.startswith(("http://", "https://")):
                raise InvalidArgument(f"engine URL {url!r} must start with http:// or https://")
        if self.routing not in ROUTING_MODES:
            raise InvalidArgument(f"routing must be one of {', '.join(ROUTING_MODES)}")
        if self.routing == "kv-aware":
            if not self.metadata or self.namespace is None:
                raise InvalidArgument("kv-aware routing needs --metadata and a model namespace")
            if not self.prefill_nodes:
                raise InvalidArgument("kv-aware routing needs --prefill-node URL=NODE_ID")
        for url, _ in (*self.prefill_nodes, *self.decode_nodes):
            if url not in (*self.prefill, *self.decode):
                raise InvalidArgument(f"{url!r} is mapped to a node but is not an engine")


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
    """The aiohttp application and its upstream session."""

    def __init__(self, config: ProxyConfig, security: SecurityConfig | None = None) -> None:
        self.config = config
        self.security = security
        self._decode = itertools.cycle(config.decode)
        self.requests = 0
        self.prefill_pool = EnginePool(config.prefill, dict(config.prefill_nodes))
        self.decode_pool = EnginePool(config.decode, dict(config.decode_nodes))
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
        if self._router is not None:
            await self._router.close()

    def app(self) -> Any:
        from aiohttp import web

        app = web.Application(client_max_size=64 << 20)
        for path in _FORWARDED:
            app.router.add_post(path, self._handle)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        return app

    async def _health(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"status": "ok", "requests": self.requests, "routed": self.routed})

    async def _models(self, request: Any) -> Any:
        import aiohttp
        from aiohttp import web

        async with (
            aiohttp.ClientSession() as session,
            session.get(next(self._decode) + "/v1/models") as r,
        ):
            return web.json_response(await r.json(), status=r.status)

    async def _handle(self, request: Any) -> Any:
        import aiohttp
        from aiohttp import web

        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return web.json_response({"error": "request body must be JSON"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": "request body must be an object"}, status=400)
        self.requests += 1
        path = request.path
        keys = None
        if self.config.routing == "kv-aware" and self.config.namespace is not None:
            keys = prompt_keys(body, self.config.namespace)
        prefill = (await self._choose(self.prefill_pool, keys, True)).url
        timeout = aiohttp.ClientTimeout(total=self.config.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            try:
                self.prefill_pool.inflight[prefill] += 1
                try:
                    async with session.post(prefill + path, json=prefill_body(body)) as r:
                        if r.status != 200:
                            text = await r.text()
                            logger.warning(
                                "prefill %s answered %d: %s", prefill, r.status, text[:200]
                            )
                            return web.Response(
                                status=r.status, text=text, content_type="application/json"
                            )
                        answer = await r.read()
                finally:
                    self.prefill_pool.inflight[prefill] -= 1
                body = decode_body(body, answer)
                mapped = bool(self.config.decode_nodes)
                decode = (await self._choose(self.decode_pool, keys, mapped)).url
                self.decode_pool.inflight[decode] += 1
                try:
                    return await self._relay(session, request, decode + path, body)
                finally:
                    self.decode_pool.inflight[decode] -= 1
            except (TimeoutError, aiohttp.ClientError) as exc:
                logger.warning("upstream engine failed: %s", exc)
                return web.json_response(
                    {"error": f"upstream engine unavailable: {exc}"}, status=502
                )

    async def _relay(self, session: Any, request: Any, url: str, body: dict[str, Any]) -> Any:
        """Send ``body`` to the decode engine and relay its answer."""
        from aiohttp import web

        async with session.post(url, json=body) as r:
            if not body.get("stream"):
                return web.Response(
                    status=r.status,
                    body=await r.read(),
                    content_type=r.content_type or "application/json",
                )
            resp = web.StreamResponse(status=r.status)
            resp.content_type = r.content_type or "text/event-stream"
            await resp.prepare(request)
            async for chunk in r.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp


async def serve(
    config: ProxyConfig, announce: Any = None, security: SecurityConfig | None = None
) -> None:
    """Serve until cancelled (``security``: of the proxy's calls to the metadata service).

    Raises:
        Unavailable: The port is in use (one line naming it).
    """
    from aiohttp import web

    proxy = Proxy(config, security)
    runner = web.AppRunner(proxy.app())
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
    logger.info(
        "proxy on %s:%d (%s): prefill %s, decode %s",
        config.host,
        port,
        config.routing,
        ", ".join(config.prefill),
        ", ".join(config.decode),
    )
    if announce is not None:
        announce("KVDEPOT READY " + json.dumps({"role": "proxy", "port": port}))
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        await proxy.close()
