"""The namespaces the index keeps: their fields and per-namespace counters.

A namespace is named by its digest in hex. A process registers it with the
fields that make it (:mod:`kvdepot.namespaces`); lookups, commits and
engines' reports of served tokens add to its counters. At most
``max_namespaces`` are kept; past that the one seen least recently goes.
"""

from __future__ import annotations

import abc
import re
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvdepot.errors import InvalidArgument

COUNTERS = (
    "chunks_stored",
    "lookups",
    "hit_chunks",
    "miss_chunks",
    "hit_tokens",
    "served_tokens",
)
"""The counters kept per namespace."""

MAX_FIELDS = 32
MAX_VALUE = 1024
_NAME = re.compile(r"^[0-9a-f]{32}$")
_FIELD = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
_CLIENTS = ("vllm", "lmcache", "client")


def check_name(name: str) -> str:
    """A namespace name (its digest in hex), or a clear error."""
    if not _NAME.match(name):
        raise InvalidArgument(
            f"a namespace is named by its digest in hex (32 digits), not {name!r}"
        )
    return name


def check_fields(fields: Sequence[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """Registered fields: at most :data:`MAX_FIELDS`, names like ``kv_dtype``."""
    if len(fields) > MAX_FIELDS:
        raise InvalidArgument(f"{len(fields)} namespace fields; the limit is {MAX_FIELDS}")
    for name, value in fields:
        if not _FIELD.match(name):
            raise InvalidArgument(f"namespace field name {name!r} must be lower_case_words")
        if len(value) > MAX_VALUE:
            raise InvalidArgument(f"namespace field {name} is over {MAX_VALUE} characters")
    return tuple(sorted(dict(fields).items()))


def check_client(client: str) -> str:
    if client and client not in _CLIENTS:
        raise InvalidArgument(f"namespace client {client!r}: one of {', '.join(_CLIENTS)}")
    return client


@dataclass(frozen=True, slots=True)
class NamespaceRecord:
    """A namespace as the index keeps it (times: wall clock, seconds)."""

    name: str
    fields: tuple[tuple[str, str], ...] = ()
    counters: Mapping[str, int] = field(default_factory=dict)
    first_seen: float = 0.0
    last_seen: float = 0.0
    clients: tuple[str, ...] = ()


class NamespaceStore(abc.ABC):
    """Where an index keeps its namespaces.

    Args:
        max_namespaces: Namespaces kept at most.
    """

    def __init__(self, max_namespaces: int = 1024) -> None:
        if max_namespaces < 1:
            raise InvalidArgument(f"max_namespaces must be positive, not {max_namespaces}")
        self.max_namespaces = max_namespaces

    @abc.abstractmethod
    async def register(
        self, name: str, fields: tuple[tuple[str, str], ...], client: str, at: float = 0.0
    ) -> bool:
        """Keep ``name`` with ``fields`` (replacing earlier ones); whether it was known."""

    @abc.abstractmethod
    async def add(self, deltas: Mapping[str, Mapping[str, int]], at: float = 0.0) -> None:
        """Add to the counters of each namespace (one unknown so far is kept, fieldless)."""

    @abc.abstractmethod
    async def list(self) -> list[NamespaceRecord]:
        """Every namespace kept, the most recently seen first."""


@dataclass(slots=True)
class _Entry:
    fields: tuple[tuple[str, str], ...]
    first_seen: float
    last_seen: float
    clients: set[str] = field(default_factory=set)
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))


class MemoryNamespaces(NamespaceStore):
    """The embedded index's namespaces, least recently seen first."""

    def __init__(self, max_namespaces: int = 1024) -> None:
        super().__init__(max_namespaces)
        self._ns: OrderedDict[str, _Entry] = OrderedDict()

    def _touch(self, name: str, at: float) -> tuple[_Entry, bool]:
        entry = self._ns.pop(name, None)
        known = entry is not None
        if entry is None:
            entry = _Entry((), at, at)
            while len(self._ns) >= self.max_namespaces:
                self._ns.popitem(last=False)
        entry.last_seen = max(entry.last_seen, at)
        self._ns[name] = entry
        return entry, known

    async def register(
        self, name: str, fields: tuple[tuple[str, str], ...], client: str, at: float = 0.0
    ) -> bool:
        entry, known = self._touch(name, at or time.time())
        entry.fields = fields or entry.fields
        if client:
            entry.clients.add(client)
        return known and bool(entry.fields)

    async def add(self, deltas: Mapping[str, Mapping[str, int]], at: float = 0.0) -> None:
        at = at or time.time()
        for name, counts in deltas.items():
            entry, _ = self._touch(name, at)
            for counter, n in counts.items():
                entry.counters[counter] = entry.counters.get(counter, 0) + n

    async def list(self) -> list[NamespaceRecord]:
        return [
            NamespaceRecord(
                name,
                e.fields,
                dict(e.counters),
                e.first_seen,
                e.last_seen,
                tuple(sorted(e.clients)),
            )
            for name, e in reversed(self._ns.items())
        ]


class RedisNamespaces(NamespaceStore):
    """The Redis index's namespaces, shared by every metadata replica.

    ``P:ns:<name>`` (hash): ``f:<field>`` the fields, ``c:<counter>`` the
    counters (HINCRBY), ``first`` and ``last`` seen, ``cl:<client>``;
    ``P:nsz`` (zset): name -> last seen, to forget the least recent ones.
    """

    def __init__(self, db: Any, prefix: str, max_namespaces: int = 1024) -> None:
        super().__init__(max_namespaces)
        self._db = db
        self._p = prefix
        self._k_all = f"{prefix}:nsz"

    def _key(self, name: str) -> str:
        return f"{self._p}:ns:{name}"

    def _touch(self, name: str, at: float) -> list[tuple[Any, ...]]:
        return [
            ("HSETNX", self._key(name), "first", repr(at)),
            ("HSET", self._key(name), "last", repr(at)),
            ("ZADD", self._k_all, at, name),
        ]

    async def _bound(self) -> None:
        count = int(await self._db.one(("ZCARD", self._k_all)))
        if count > self.max_namespaces:
            old = await self._db.one(("ZRANGE", self._k_all, 0, count - self.max_namespaces - 1))
            await self._db.exec(
                [("ZREM", self._k_all, *old), *(("DEL", self._key(n.decode())) for n in old)]
            )

    async def register(
        self, name: str, fields: tuple[tuple[str, str], ...], client: str, at: float = 0.0
    ) -> bool:
        at = at or time.time()
        key = self._key(name)
        cmds: list[tuple[Any, ...]] = [("HEXISTS", key, "fields")]
        if fields:
            old = await self._db.one(("HKEYS", key))
            stale = [f for f in old if f.startswith(b"f:")]
            if stale:
                cmds.append(("HDEL", key, *stale))
            cmds.append(
                ("HSET", key, "fields", len(fields), *[x for n, v in fields for x in (f"f:{n}", v)])
            )
        if client:
            cmds.append(("HSET", key, f"cl:{client}", 1))
        out = await self._db.exec(cmds + self._touch(name, at))
        await self._bound()
        return bool(out[0])

    async def add(self, deltas: Mapping[str, Mapping[str, int]], at: float = 0.0) -> None:
        at = at or time.time()
        cmds: list[tuple[Any, ...]] = []
        for name, counts in deltas.items():
            cmds.extend(("HINCRBY", self._key(name), f"c:{c}", n) for c, n in counts.items() if n)
            cmds.extend(self._touch(name, at))
        if cmds:
            await self._db.exec(cmds)
            await self._bound()

    async def list(self) -> list[NamespaceRecord]:
        names = [n.decode() for n in await self._db.one(("ZREVRANGE", self._k_all, 0, -1))]
        hashes = await self._db.exec([("HGETALL", self._key(n)) for n in names])
        out = []
        for name, h in zip(names, hashes, strict=True):
            if not h:
                continue  # forgotten meanwhile
            d = {k.decode(): v.decode() for k, v in h.items()}
            out.append(
                NamespaceRecord(
                    name,
                    tuple(sorted((k[2:], v) for k, v in d.items() if k.startswith("f:"))),
                    {c: int(d.get(f"c:{c}", 0)) for c in COUNTERS},
                    float(d.get("first", 0.0)),
                    float(d.get("last", 0.0)),
                    tuple(sorted(k[3:] for k in d if k.startswith("cl:"))),
                )
            )
        return out
