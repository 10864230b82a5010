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
import contextlib
import functools
import logging
from collections import Counter
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
from kvdepot.repeat_log import RepeatLog
from kvdepot.wire.digest import U64, Cells, flat_deltas

# Deadline of one round trip: a stuck server must not hang an RPC for ever.
_ROUND_TRIP_TIMEOUT_S = 10.0
# Commands per pipeline, and items per vectorised script call: bound the size
# of one request and reply (big inventories) and how long one script blocks
# the server, while keeping round trips few.
_PIPELINE_MAX = 4096
_ITEMS_PER_CALL = 1024
# Counters reach Redis at most this late (other replicas' stats lag as much).
_FLUSH_DELAY_S = 0.05

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


OWN_OPTIONS = ("prefix", "bucket_bits")
"""Query parameters of an index URL that are kvdepot's, not redis-py's."""


def split_options(url: str) -> tuple[str, dict[str, str]]:
    """Split kvdepot's own query parameters (:data:`OWN_OPTIONS`) off an index URL.

    Returns:
        The URL without them (for redis-py) and those given, by name.
    """
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    own = {k: v for k, v in query if k in OWN_OPTIONS}
    rest = urlencode([(k, v) for k, v in query if k not in OWN_OPTIONS])
    return urlunsplit(parts._replace(query=rest)), own


def split_url(url: str) -> tuple[str, str | None]:
    """Split kvdepot's own parameters off an index URL.

    Args:
        url: ``redis://…``, ``rediss://…`` or ``redis+cluster://…``, with
            optional query parameters, e.g. ``?prefix=kvd-test&bucket_bits=18``.

    Returns:
        The URL without kvdepot's parameters (for redis-py) and the prefix, if given.
    """
    rest, own = split_options(url)
    return rest, own.get("prefix")


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

    async def exec(self, cmds: Sequence[Cmd], raise_errors: bool = True) -> list[Any]:
        """Run ``cmds`` as pipelines (one round trip each); raise the first
        error (or, ``raise_errors`` false, return errors in their places)."""
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
            if raise_errors and isinstance(r, BaseException):
                raise r
        return results

    async def one(self, cmd: Cmd) -> Any:
        return (await self.exec([cmd]))[0]

    async def read(self, cmds: Sequence[Cmd]) -> list[Any]:
        """Run single-key reads (GET, HGET, HMGET, HGETALL, HKEYS) in one round trip.

        On a single server as one script call (one reply); on a cluster, whose
        keys span slots, as a pipeline.
        """
        if self.cluster or len(cmds) < 4:
            return await self.exec(cmds)
        keys = [c[1] for c in cmds]
        argv = self._read_argv(cmds)
        (out,) = await self.exec([scripts.READ_BATCH.cmd(keys, argv)])
        return [
            dict(zip(it := iter(r), it, strict=True)) if c[0] == "HGETALL" else r
            for c, r in zip(cmds, out, strict=True)
        ]

    @staticmethod
    def _read_argv(cmds: Sequence[Cmd]) -> list[Any]:
        """READ_BATCH's arguments: runs of commands of one shape, with their arguments."""
        argv: list[Any] = []
        start = 0
        for i in range(1, len(cmds) + 1):
            if i == len(cmds) or (cmds[i][0], len(cmds[i])) != (cmds[start][0], len(cmds[start])):
                argv += [cmds[start][0], i - start, len(cmds[start]) - 2]
                for c in cmds[start:i]:
                    argv.extend(c[2:])
                start = i
        return argv

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

    def cols(
        self,
        script: scripts.Script,
        keys: Sequence[Sequence[str]],
        shared: Sequence[Any],
        columns: Sequence[tuple[bytes, int]],
    ) -> list[Cmd]:
        """Like :meth:`vec`, with the items' own arguments in ``columns``:
        (the items' values concatenated, the width of one). A call gets one
        argument per column: its items' part of it."""
        size = 1 if self.cluster else _ITEMS_PER_CALL
        return [
            script.cmd(
                [k for ks in keys[i : i + size] for k in ks],
                [*shared, *(blob[i * w : (i + size) * w] for blob, w in columns)],
            )
            for i in range(0, len(keys), size)
        ]


class Counters:
    """Counters shared by every metadata replica, added to without a round trip
    on the caller's path.

    A flush starts at most every ``_FLUSH_DELAY_S`` and takes everything
    accumulated meanwhile, so many requests share one pipeline; :meth:`sync`
    flushes at once (a replica's stats then include its own counts).

    Args:
        db: The connection.
        key: The hash of cluster-wide counters (HINCRBY).
        node_cmd: The command adding to a registration's replica count and
            to its digest cells (node id, epoch, delta, cell/delta pairs).
        log: The logger of a failed flush.
    """

    def __init__(
        self,
        db: Connection,
        key: str,
        node_cmd: Callable[[str, int, int, list[int]], Cmd],
        log: logging.Logger,
    ) -> None:
        self._db = db
        self._key = key
        self._node_cmd = node_cmd
        self._deltas: Counter[str] = Counter()
        self._nodes: Counter[tuple[str, int]] = Counter()  # replicas, by registration
        # Digest deltas, by registration (kvdepot.wire.digest).
        self._cells: dict[tuple[str, int], Cells] = {}
        self._flusher: asyncio.Task[None] | None = None
        self._flush_now = asyncio.Event()
        # A flush follows every counted call: one line per failed one would
        # flood the log while Redis is down.
        self._failures = RepeatLog(log)

    def add(self, **deltas: int) -> None:
        for name, n in deltas.items():
            if n:
                self._deltas[name] += n
        self._flush_soon()

    def add_node(self, node_id: str, epoch: int, n: int) -> None:
        """Add to the replica count of the node's registration ``epoch``."""
        if n:
            self._nodes[node_id, epoch] += n
            self._flush_soon()

    def add_keys(self, node_id: str, epoch: int, keys: U64, sign: int = 1) -> None:
        """Count keys (:func:`~kvdepot.wire.digest.words`) into (1) or out of
        (-1) the digest of the node's registration ``epoch``."""
        if len(keys):
            self._cells.setdefault((node_id, epoch), Cells()).add_words(keys, sign)
            self._flush_soon()

    def take_node(self, node_id: str, epoch: int) -> int:
        """What :meth:`add_node` holds for a registration, not flushed: the
        caller adds it itself."""
        return self._nodes.pop((node_id, epoch), 0)

    def _flush_soon(self) -> None:
        pending = self._deltas or self._nodes or self._cells
        if pending and (self._flusher is None or self._flusher.done()):
            self._flusher = asyncio.get_running_loop().create_task(self._flush_later())

    async def _flush_later(self) -> None:
        self._flush_now.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._flush_now.wait(), _FLUSH_DELAY_S)
        await self._flush()

    async def _flush(self) -> None:
        while self._deltas or self._nodes or self._cells:
            deltas, self._deltas = self._deltas, Counter()
            nodes, self._nodes = self._nodes, Counter()
            cells, self._cells = self._cells, {}
            regs = list(dict.fromkeys([*nodes, *cells]))
            cmds = [("HINCRBY", self._key, k, v) for k, v in deltas.items()]
            cmds += [
                self._node_cmd(r[0], r[1], nodes.get(r, 0), flat_deltas(cells.get(r))) for r in regs
            ]
            try:
                out = await self._db.exec(cmds, raise_errors=False)
            except Exception as exc:  # kept for the next flush, never lost silently
                out = [exc] * len(cmds)
            failed = [r for r in out if isinstance(r, BaseException)]
            if failed:
                for (k, v), r in zip(deltas.items(), out, strict=False):
                    if isinstance(r, BaseException):
                        self._deltas[k] += v
                for nk, r in zip(regs, out[len(deltas) :], strict=True):
                    if isinstance(r, BaseException):
                        self._nodes[nk] += nodes.get(nk, 0)
                        if nk in cells:
                            self._cells.setdefault(nk, Cells()).merge(cells[nk])
                self._failures.warn(
                    "flush",
                    "redis index: counters not flushed: %s; kept for the next flush",
                    failed[0],
                    extra={"event": "repeated_failure"},
                )
                return
        self._failures.flush()

    async def sync(self) -> None:
        """Flush now, and wait for it."""
        if self._flusher is not None and not self._flusher.done():
            self._flush_now.set()  # rather than after the delay
            await self._flusher
        await self._flush()
