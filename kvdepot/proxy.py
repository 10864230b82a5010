"""``kvdepot proxy``: disaggregated prefill → decode over OpenAI-compatible HTTP.

Each completion request goes first to a prefill engine with ``max_tokens=1``
(it computes the prompt's KV and its connector publishes it to kvdepot), then
unchanged to a decode engine, whose connector loads the prefix from kvdepot
instead of recomputing it. The decode engine's answer is relayed back,
streamed when the client asked for a stream. Engines are chosen round-robin.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvdepot.errors import InvalidArgument

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
    """

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise InvalidArgument("the proxy needs at least one prefill and one decode engine")
        for url in (*self.prefill, *self.decode):
            if not url.startswith(("http://", "https://")):
                raise InvalidArgument(f"engine URL {url!r} must start with http:// or https://")
        if not 0 <= self.port < 65536:
            raise InvalidArgument(f"bad port {self.port}")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request sent to the prefill engine: same prompt, one token, no stream."""
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    return out


class Proxy:
    """The aiohttp application and its upstream session."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self._prefill = itertools.cycle(config.prefill)
        self._decode = itertools.cycle(config.decode)
        self.requests = 0

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

        return web.json_response({"status": "ok", "requests": self.requests})

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
        prefill, decode = next(self._prefill), next(self._decode)
        timeout = aiohttp.ClientTimeout(total=self.config.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            try:
                async with session.post(prefill + path, json=prefill_body(body)) as r:
                    if r.status != 200:
                        text = await r.text()
                        logger.warning("prefill %s answered %d: %s", prefill, r.status, text[:200])
                        return web.Response(
                            status=r.status, text=text, content_type="application/json"
                        )
                    await r.read()
                async with session.post(decode + path, json=body) as r:
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
            except (TimeoutError, aiohttp.ClientError) as exc:
                logger.warning("upstream engine failed: %s", exc)
                return web.json_response(
                    {"error": f"upstream engine unavailable: {exc}"}, status=502
                )


async def serve(config: ProxyConfig, announce: Any = None) -> None:
    """Serve until cancelled."""
    from aiohttp import web

    runner = web.AppRunner(Proxy(config).app())
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    sockets: Sequence[Any] = getattr(site._server, "sockets", ()) or ()
    port = sockets[0].getsockname()[1] if sockets else config.port
    logger.info(
        "proxy on %s:%d: prefill %s, decode %s",
        config.host,
        port,
        ", ".join(config.prefill),
        ", ".join(config.decode),
    )
    if announce is not None:
        announce("KVDEPOT READY " + json.dumps({"role": "proxy", "port": port}))
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
