"""The proxy's calls to its engines, each bounded, and its errors as OpenAI-style JSON.

Every wait on an engine goes through :meth:`Upstream.guarded`: an engine that
stays silent for ``first_byte_timeout_s`` has its ``/health`` checked, and a
request never outlives its ``total_timeout_s``. What can go wrong becomes a
:class:`ProxyError`, which the server answers as ``{"error": {...}}``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

from kvdepot.proxy.config import UpstreamConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")

BAD_GATEWAY = 502
GATEWAY_TIMEOUT = 504
_TYPES = {BAD_GATEWAY: "upstream_error", GATEWAY_TIMEOUT: "upstream_timeout"}
_SNIPPET = 200


class ProxyError(Exception):
    """A request the proxy answers with an error: its status and JSON body.

    Attributes:
        status: The HTTP status.
        payload: ``{"error": {"message", "type", "param", "code"}}``.
    """

    def __init__(self, status: int, payload: dict[str, Any]) -> None:
        super().__init__(payload["error"]["message"])
        self.status = status
        self.payload = payload

    @classmethod
    def of(cls, status: int, code: str, message: str, kind: str = "") -> ProxyError:
        """An error of the proxy's own (``kind``: its type; by default the status's)."""
        return cls(status, error_payload(message, kind or _TYPES.get(status, "server_error"), code))


def error_payload(message: str, kind: str, code: str | int | None) -> dict[str, Any]:
    """The OpenAI error shape, which the OpenAI clients parse."""
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def _snippet(raw: bytes) -> str:
    text = raw[:_SNIPPET].decode("utf-8", "replace").strip()
    return " ".join(text.split()) or "an empty body"


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


@dataclass(frozen=True, slots=True)
class Answer:
    """An engine's whole answer to a call that is not streamed."""

    status: int
    body: bytes

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


def json_object(url: str, answer: Answer) -> dict[str, Any]:
    """The JSON object a successful answer must be.

    Raises:
        ProxyError: 502, the answer is no JSON object.
    """
    try:
        out = json.loads(answer.body)
    except (ValueError, UnicodeDecodeError):
        out = None
    if not isinstance(out, dict):
        message = f"engine {url} answered {answer.status} with no JSON object: "
        logger.warning("%s%s", message, _snippet(answer.body))
        raise ProxyError.of(BAD_GATEWAY, "bad_upstream_answer", message + _snippet(answer.body))
    return out


def engine_error(url: str, answer: Answer) -> ProxyError:
    """An engine's error answer, relayed with its status in the OpenAI shape; one
    that is no JSON (a proxy's HTML page, a traceback) is a bad answer: 502."""
    try:
        got = json.loads(answer.body)
    except (ValueError, UnicodeDecodeError):
        got = None
    if isinstance(got, dict):
        inner = got.get("error")
        if isinstance(inner, dict) and "message" in inner:
            return ProxyError(answer.status, got)
        message = got.get("message") or inner or got.get("detail")
        if message:
            kind = got.get("type") if isinstance(got.get("type"), str) else "upstream_error"
            code = got.get("code", answer.status)
            return ProxyError(answer.status, error_payload(str(message), str(kind), code))
    message = f"engine {url} answered {answer.status} with no JSON error: {_snippet(answer.body)}"
    logger.warning("%s", message)
    return ProxyError.of(BAD_GATEWAY, "bad_upstream_answer", message)


class Upstream:
    """The proxy's one HTTP client session to its engines, and the bounds on it."""

    def __init__(self, config: UpstreamConfig) -> None:
        self.config = config
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        # Made on first use: a session belongs to the running event loop.
        if self._session is None:
            timeout = aiohttp.ClientTimeout(
                total=None,
                connect=self.config.connect_timeout_s,
                sock_connect=self.config.connect_timeout_s,
            )
            # No cap on connections: aiohttp's default of 100 would queue the
            # 101st concurrent request behind the others, for no engine's sake.
            connector = aiohttp.TCPConnector(limit=0)
            self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def alive(self, url: str, bound_s: float | None = None) -> str | None:
        """``None`` when ``url``'s ``/health`` answers 200 in time, else why not."""
        bound = self.config.health_timeout_s if bound_s is None else bound_s
        try:
            timeout = aiohttp.ClientTimeout(total=bound)
            async with self.session.get(url + "/health", timeout=timeout) as r:
                if r.status == 200:
                    return None
                return f"/health answered {r.status}"
        except TimeoutError:
            return f"/health did not answer within {bound:g} s"
        except aiohttp.ClientError as exc:
            return f"unreachable: {_one_line(exc)}"

    async def guarded(self, url: str, step: Awaitable[T], deadline: float) -> T:
        """Await ``step``, a wait on the engine at ``url``, within the bounds.

        Raises:
            ProxyError: 504 when the request's deadline passed or the engine,
                silent for ``first_byte_timeout_s``, failed its health check;
                502 (or 504 on a connect timeout) when the call itself failed.
        """
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(step)
        silence = self.config.first_byte_timeout_s
        try:
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    raise self._past_deadline(url)
                await asyncio.wait({task}, timeout=min(silence, left))
                if task.done():
                    return self._result(url, task)
                left = deadline - loop.time()
                if left <= 0:
                    raise self._past_deadline(url)
                why = await self.alive(url, min(self.config.health_timeout_s, left))
                if task.done():
                    return self._result(url, task)
                if why is not None:
                    logger.warning("engine %s silent for %g s and %s", url, silence, why)
                    raise ProxyError.of(
                        GATEWAY_TIMEOUT,
                        "engine_unresponsive",
                        f"engine {url} sent nothing for {silence:g} s and its {why}",
                    )
        finally:
            if not task.done():
                task.cancel()
                # Not `await task`: that would swallow a cancellation of our own.
                await asyncio.wait({task})
                if not task.cancelled():
                    task.exception()  # retrieved: no "never retrieved" noise in the log

    def _past_deadline(self, url: str) -> ProxyError:
        total = self.config.total_timeout_s
        logger.warning("request to engine %s passed its %g s deadline", url, total)
        return ProxyError.of(
            GATEWAY_TIMEOUT,
            "total_timeout",
            f"engine {url}: the request did not complete within {total:g} s",
        )

    def _result(self, url: str, task: asyncio.Future[T]) -> T:
        try:
            return task.result()
        except aiohttp.ServerTimeoutError as exc:  # no read timeout is set: a connect timeout
            logger.warning("engine %s: connect timed out: %s", url, _one_line(exc))
            raise ProxyError.of(
                GATEWAY_TIMEOUT,
                "connect_timeout",
                f"engine {url}: no connection within {self.config.connect_timeout_s:g} s",
            ) from None
        except aiohttp.ClientConnectorError as exc:
            logger.warning("engine %s unreachable: %s", url, _one_line(exc))
            raise ProxyError.of(
                BAD_GATEWAY, "engine_unreachable", f"engine {url} unreachable: {_one_line(exc)}"
            ) from None
        except aiohttp.ClientError as exc:
            logger.warning("engine %s failed: %s", url, _one_line(exc))
            raise ProxyError.of(
                BAD_GATEWAY, "engine_failed", f"engine {url} failed: {_one_line(exc)}"
            ) from None

    async def exchange(self, url: str, path: str, body: dict[str, Any], deadline: float) -> Answer:
        """POST ``body`` to ``url + path`` and read the whole answer, within the bounds."""

        async def call() -> Answer:
            async with self.session.post(url + path, json=body) as r:
                return Answer(r.status, await r.read())

        return await self.guarded(url, call(), deadline)

    async def get(self, url: str, path: str, deadline: float) -> Answer:
        async def call() -> Answer:
            async with self.session.get(url + path) as r:
                return Answer(r.status, await r.read())

        return await self.guarded(url, call(), deadline)

    async def open(
        self, url: str, path: str, body: dict[str, Any], deadline: float
    ) -> aiohttp.ClientResponse:
        """POST ``body`` and return once the answer's headers are in (the caller closes it)."""

        async def call() -> aiohttp.ClientResponse:
            return await self.session.post(url + path, json=body)

        return await self.guarded(url, call(), deadline)
