"""Talking to the Redis index's server(s): index URLs, the client, and commands in few round trips.

A single server and a Redis Cluster take the same calls: :class:`Connection`
runs a list of commands as pipelines (split by node on a cluster), loads the
scripts of :mod:`kvdepot.metadata.index.redis_scripts` again when a server lost
them, and calls a vectorised script once per item on a cluster (each item is
one slot) or once per batch on a single server. redis-py's errors become
kvdepot's at the boundary of each index method (:func:`guarded`).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, ParamSpec, TypeVar
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from redis import exceptions as rx
from redis.asyncio import Redis, RedisCluster
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from kvdepot.endpoints import split_endpoint
from kvdepot.errors import InvalidArgument, KVDepotError, Unavailable
from kvdepot.metadata.index import redis_scripts as scripts
from kvdepot.metadata.index.redis_scripts import Cmd

# Deadline of one round trip: a stuck server must not hang an RPC for ever.
_ROUND_TRIP_TIMEOUT_S = 10.0
# Commands per pipeline, and items per vectorised script call: bound the size
# of one request and reply (big inventories) and how long one script blocks
# the server, while keeping round trips few.
_PIPELINE_MAX = 4096
_ITEMS_PER_CALL = 1024

_P = ParamSpec("_P")
_T = TypeVar("_T")

# Errors after which a retry elsewhere or later may succeed.
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    rx.ConnectionError,
    rx.TimeoutError,
    rx.ClusterDownError,
    rx.TryAgainError,
    rx.ReadOnlyError,
    rx.SlotNotCoveredError,
    TimeoutError,
    OSError,
)


def guarded(fn: Callable[_P, Awaitable[_T]]) -> Callable[_P, Coroutine[Any, Any, _T]]:
    """Translate redis-py errors into kvdepot's at the boundary of a method."""

    @functools.wraps(fn)
    async def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        try:
            return await fn(*args, **kwargs)
        except _UNAVAILABLE as exc:
            raise Unavailable(f"redis index unavailable: {exc}") from exc
        except (rx.RedisError, rx.RedisClusterException) as exc:
            # e.g. "Redis Cluster cannot be connected", raised from a ConnectionError
            if isinstance(exc.__cause__ or exc.__context__, _UNAVAILABLE):
                raise Unavailable(f"redis index unavailable: {exc}") from exc
            raise KVDepotError(f"redis index error: {exc}") from exc

    return wrapper


def _batched(items: Sequence[_T], size: int) -> list[Sequence[_T]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def flat(replies: Sequence[Sequence[int]]) -> list[int]:
    """One result per item from the replies of :meth:`Connection.vec`'s calls."""
    return [int(r) for reply in replies for r in reply]


def split_url(url: str) -> tuple[str, str | None]:
    """Split kvdepot's own ``prefix`` query parameter off an index URL.

    Args:
        url: ``redis://…``, ``rediss://…`` or ``redis+cluster://…``, with
            optional query parameters, e.g. ``?prefix=kvd-test``.

    Returns:
        The URL without ``prefix`` (for redis-py) and the prefix, if given.
    """
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    prefix = next((v for k, v in query if k == "prefix"), None)
    rest = urlencode([(k, v) for k, v in query if k != "prefix"])
    return urlunsplit(parts._replace(query=rest)), prefix


def reconnect_policy() -> Retry:
    """How a single server's client retries a command whose connection broke.

    A restarted server leaves every pooled connection dead; each is found so
    by its next command ("Connection closed by server"). That command runs
    again on a new connection, after a short backoff, instead of failing the
    RPC. Only connection errors: a command that timed out may have run.
    (``Redis.from_url`` builds its pool without the client's default retry,
    so without this a broken connection fails at once.)
    """
    return Retry(ExponentialBackoff(cap=0.2, base=0.02), 2, supported_errors=(rx.ConnectionError,))


def connect(url: str, retry: Retry | None = None) -> Redis | RedisCluster:
    """A redis-py asyncio client for an index URL (without ``prefix``).

    ``redis://host:port/db`` and ``rediss://…`` give a single-server client;
    ``redis+cluster://[user:password@]host:port[,host:port…]`` a cluster client
    with those startup nodes. ``retry`` (default :func:`reconnect_policy`)
    applies to a single server; a cluster client keeps its own redirections
    and retries.
    """
    # No per-read socket timeout: redis-py arms one per reply, which costs more
    # than the reply itself on a 128-command pipeline. Each index operation
    # runs under one deadline instead (see Connection.exec).
    timeouts: dict[str, Any] = {"socket_timeout": None, "socket_connect_timeout": 5.0}
    parts = urlsplit(url)
    if parts.scheme != "redis+cluster":
        try:
            client: Redis = Redis.from_url(url, retry=retry or reconnect_policy(), **timeouts)
        except ValueError as exc:
            raise InvalidArgument(f"bad index url {url!r}: {exc}") from None
        return client
    netloc = parts.netloc
    auth: dict[str, Any] = {}
    if "@" in netloc:
        userinfo, netloc = netloc.rsplit("@", 1)
        user, _, password = userinfo.partition(":")
        auth = {"username": unquote(user) or None, "password": unquote(password) or None}
    nodes: list[ClusterNode] = []
    for hostport in filter(None, netloc.split(",")):
        host, port = split_endpoint(hostport)
        if port is None:
            host, port = hostport.strip("[]"), 6379
        nodes.append(ClusterNode(host or "127.0.0.1", port))
    if not nodes:
        raise InvalidArgument(f"index url {url!r} names no cluster nodes")
    options = {k: float(v) for k, v in parse_qsl(parts.query) if k in timeouts and v}
    return RedisCluster(startup_nodes=nodes, **{**timeouts, **options, **auth})


class Connection:
    """Runs the index's commands on one redis-py client (a server or a cluster).

    Args:
        client: The client (its owner closes it).
    """

    def __init__(self, client: Redis | RedisCluster) -> None:
        self.client = client
        self.cluster = isinstance(client, RedisCluster)
        self._scripts_loaded = False

    async def pipeline(self, cmds: Sequence[Cmd]) -> list[Any]:
        """Run ``cmds`` as one pipeline; errors are returned in their places."""
        pipe = self.client.pipeline(transaction=False)
        for c in cmds:
            pipe.execute_command(*c)
        async with asyncio.timeout(_ROUND_TRIP_TIMEOUT_S):
            return list(await pipe.execute(raise_on_error=False))

    async def _load_scripts(self) -> None:
        async with asyncio.timeout(_ROUND_TRIP_TIMEOUT_S):
            for s in scripts.ALL:
                await self.client.script_load(s.source)  # on every primary of a cluster
        self._scripts_loaded = True

    async def exec(self, cmds: Sequence[Cmd]) -> list[Any]:
        """Run ``cmds`` as pipelines (one round trip each); raise the first error."""
        if not self._scripts_loaded:
            await self._load_scripts()
        results: list[Any] = []
        for part in _batched(cmds, _PIPELINE_MAX):
            out = await self.pipeline(part)
            missing = [i for i, r in enumerate(out) if isinstance(r, rx.NoScriptError)]
            if missing:
                # A server restarted or a replica took over since the scripts
                # were loaded: load them again and re-run only what did not run.
                await self._load_scripts()
                again = await self.pipeline([part[i] for i in missing])
                for i, r in zip(missing, again, strict=True):
                    out[i] = r
            results.extend(out)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results

    async def one(self, cmd: Cmd) -> Any:
        return (await self.exec([cmd]))[0]

    async def read(self, cmds: Sequence[Cmd]) -> list[Any]:
        """Run single-key reads (HGETALL, GET, HMGET, HKEYS) in one round trip.

        On a single server as one script call (one reply); on a cluster, whose
        keys span slots, as a pipeline.
        """
        if self.cluster or len(cmds) < 4:
            return await self.exec(cmds)
        argv: list[Any] = []
        shape: tuple[Any, ...] = ()
        keys: list[str] = []
        for c in cmds:
            this = (c[0], *c[2:])
            if this != shape:
                if keys:
                    argv += [*shape[:1], len(shape) - 1, *shape[1:], "\n".join(keys) + "\n"]
                shape, keys = this, []
            keys.append(c[1])
        argv += [*shape[:1], len(shape) - 1, *shape[1:], "\n".join(keys) + "\n"]
        (out,) = await self.exec([scripts.READ_BATCH.cmd([], argv)])
        return [
            dict(zip(it := iter(r), it, strict=True)) if c[0] == "HGETALL" else r
            for c, r in zip(cmds, out, strict=True)
        ]

    def vec(
        self,
        script: scripts.Script,
        keys: Sequence[Sequence[str]],
        shared: Sequence[Any],
        per_item: Sequence[Sequence[Any]] = (),
    ) -> list[Cmd]:
        """Calls of a vectorised script over items (``keys[i]``, ``per_item[i]``).

        One call per item on a cluster (each item is one slot), one per batch
        of items on a single server. :func:`flat` turns the replies of either
        into one result per item.
        """
        size = 1 if self.cluster else _ITEMS_PER_CALL
        return [
            script.cmd(
                [k for ks in keys[i : i + size] for k in ks],
                [*shared, *(a for args in per_item[i : i + size] for a in args)],
            )
            for i in range(0, len(keys), size)
        ]
