"""The index's history of chunk departures: why a chunk left a node.

Each node has a ring of its last ``per_node`` departures (a key, the wall
time, a reason and the tier it left from: 26 bytes an entry in the embedded
index); nodes past ``max_nodes`` are forgotten, the least recently active
first. Departures are recorded where removals are reported (off the lookup
path) and read only by ``Explain``, which scans every ring: an explanation is
rare, a departure is not.
"""

from __future__ import annotations

import abc
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvdepot.errors import InvalidArgument
from kvdepot.keys import KEY_BYTES, ChunkKey
from kvdepot.types import TIER_BY_CODE, TIER_RANK

REASONS = ("removed", "evicted", "node_lost", "corrupt", "tier_failed", "revoked", "expired")
"""Departure reasons; a reason's position is its code (``Departure.Reason`` on the wire)."""
REASON_CODE = {name: code for code, name in enumerate(REASONS)}
_NO_TIER = 255
ENTRY_BYTES = KEY_BYTES + 8 + 1 + 1
"""One departure: the key, the time (ms), the reason and the tier codes."""


@dataclass(frozen=True, slots=True)
class DepartureConfig:
    """How much departure history the index keeps.

    Attributes:
        per_node: Departures kept per node (the newest); 0 keeps none.
        max_nodes: Nodes whose history is kept (the most recently active).
    """

    per_node: int = 65536
    max_nodes: int = 256

    def __post_init__(self) -> None:
        if not 0 <= self.per_node <= 1 << 24:
            raise InvalidArgument(f"departures per node must be in [0, 2**24], not {self.per_node}")
        if self.max_nodes < 1:
            raise InvalidArgument(
                f"departure history max_nodes must be positive, not {self.max_nodes}"
            )


@dataclass(frozen=True, slots=True)
class Departure:
    """A chunk left ``node_id`` at ``at`` (wall clock, seconds) for ``reason``."""

    key: ChunkKey
    node_id: str
    reason: str
    tier: str
    at: float


def check_reason(reason: str) -> str:
    """``reason`` if known, else a clear error ("" reads as ``removed``)."""
    reason = reason or "removed"
    if reason not in REASON_CODE:
        raise InvalidArgument(f"unknown departure reason {reason!r}; one of {', '.join(REASONS)}")
    return reason


def _tier_code(tier: str) -> int:
    return TIER_RANK.get(tier, _NO_TIER)


def _tier_name(code: int) -> str:
    return TIER_BY_CODE[code] if code < len(TIER_BY_CODE) else ""


def _words(keys: Sequence[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(keys), dtype="<u8").reshape(-1, 2)


class DepartureLog(abc.ABC):
    """Where an index keeps its departure history."""

    def __init__(self, config: DepartureConfig) -> None:
        self.config = config

    @abc.abstractmethod
    async def record(
        self, node_id: str, keys: Sequence[ChunkKey], reason: str, tier: str = "", at: float = 0.0
    ) -> None:
        """``keys`` left ``node_id`` (``at`` 0: now)."""

    @abc.abstractmethod
    async def find(self, keys: Sequence[ChunkKey]) -> list[Departure | None]:
        """Per key, its newest departure from any node, or None."""


def _newest(keys: Sequence[ChunkKey], found: list[Departure]) -> list[Departure | None]:
    best: dict[bytes, Departure] = {}
    for d in found:
        have = best.get(d.key)
        if have is None or d.at >= have.at:
            best[d.key] = d
    return [best.get(k) for k in keys]


class _Ring:
    """One node's last ``cap`` departures, in columns."""

    def __init__(self, cap: int) -> None:
        self.words = np.zeros((cap, 2), dtype="<u8")
        self.at = np.zeros(cap, dtype=np.float64)
        self.codes = np.zeros((cap, 2), dtype=np.uint8)  # reason, tier
        self.pos = 0
        self.count = 0

    @property
    def nbytes(self) -> int:
        return int(self.words.nbytes + self.at.nbytes + self.codes.nbytes)

    def add(self, words: np.ndarray, at: float, reason: int, tier: int) -> None:
        cap = len(self.at)
        words = words[-cap:]
        n = len(words)
        idx = (self.pos + np.arange(n)) % cap
        self.words[idx] = words
        self.at[idx] = at
        self.codes[idx] = (reason, tier)
        self.pos = (self.pos + n) % cap
        self.count = min(cap, self.count + n)

    def match(self, node_id: str, words: np.ndarray) -> list[Departure]:
        live = slice(0, self.count)
        have = self.words[live]
        hit = np.flatnonzero(np.isin(have[:, 0], words[:, 0]))
        wanted = {(int(a), int(b)) for a, b in words.tolist()}
        out = []
        for i in hit.tolist():
            k0, k1 = (int(v) for v in have[i])
            if (k0, k1) in wanted:
                key = ChunkKey(np.array([k0, k1], dtype="<u8").tobytes())
                reason, tier = (int(c) for c in self.codes[i])
                out.append(
                    Departure(key, node_id, REASONS[reason], _tier_name(tier), float(self.at[i]))
                )
        return out


class MemoryDepartures(DepartureLog):
    """The embedded index's history: a ring of numpy columns per node."""

    def __init__(self, config: DepartureConfig | None = None) -> None:
        super().__init__(config or DepartureConfig())
        self._rings: OrderedDict[str, _Ring] = OrderedDict()

    @property
    def nbytes(self) -> int:
        """Memory the rings hold (allocated in full when a node's first departure comes)."""
        return sum(r.nbytes for r in self._rings.values())

    async def record(
        self, node_id: str, keys: Sequence[ChunkKey], reason: str, tier: str = "", at: float = 0.0
    ) -> None:
        self.add_words(node_id, _words(keys), reason, tier, at)

    def add_words(
        self, node_id: str, words: np.ndarray, reason: str, tier: str = "", at: float = 0.0
    ) -> None:
        """:meth:`record` of keys as ``(n, 2)`` little-endian words (no object per key)."""
        if not len(words) or not self.config.per_node:
            return
        ring = self._rings.pop(node_id, None)
        if ring is None:
            ring = _Ring(self.config.per_node)
            while len(self._rings) >= self.config.max_nodes:
                self._rings.popitem(last=False)
        self._rings[node_id] = ring  # the most recently active last
        ring.add(words, at or time.time(), REASON_CODE[check_reason(reason)], _tier_code(tier))

    async def find(self, keys: Sequence[ChunkKey]) -> list[Departure | None]:
        if not keys:
            return []
        words = _words(keys)
        found = [d for nid, ring in self._rings.items() for d in ring.match(nid, words)]
        return _newest(keys, found)


class RedisDepartures(DepartureLog):
    """The Redis index's history: a capped list of packed entries per node.

    ``P:d:{<node>}`` (list): entries of :data:`ENTRY_BYTES`; ``P:dn`` (zset):
    node -> the time of its last departure, to forget the least active
    nodes' lists past ``max_nodes``. Lists expire a day after their last write.
    """

    _TTL_S = 86400

    def __init__(
        self, db: Any, prefix: str, tag: Any, config: DepartureConfig | None = None
    ) -> None:
        super().__init__(config or DepartureConfig())
        self._db = db
        self._p = prefix
        self._tag = tag
        self._k_nodes = f"{prefix}:dn"

    def _list(self, node_id: str) -> str:
        return f"{self._p}:d:{{{self._tag(node_id)}}}"

    async def record(
        self, node_id: str, keys: Sequence[ChunkKey], reason: str, tier: str = "", at: float = 0.0
    ) -> None:
        cap = self.config.per_node
        if not keys or not cap:
            return
        at = at or time.time()
        tail = int(at * 1000).to_bytes(8, "big") + bytes(
            (REASON_CODE[check_reason(reason)], _tier_code(tier))
        )
        entries = [bytes(k) + tail for k in keys[-cap:]]
        lst = self._list(node_id)
        await self._db.exec(
            [
                ("RPUSH", lst, *entries),
                ("LTRIM", lst, -cap, -1),
                ("EXPIRE", lst, self._TTL_S),
                ("ZADD", self._k_nodes, at, node_id),
            ]
        )
        count = int(await self._db.one(("ZCARD", self._k_nodes)))
        if count > self.config.max_nodes:
            old = await self._db.one(
                ("ZRANGE", self._k_nodes, 0, count - self.config.max_nodes - 1)
            )
            await self._db.exec(
                [("ZREM", self._k_nodes, *old), *(("DEL", self._list(n.decode())) for n in old)]
            )

    async def find(self, keys: Sequence[ChunkKey]) -> list[Departure | None]:
        if not keys:
            return []
        nodes = [n.decode() for n in await self._db.one(("ZRANGE", self._k_nodes, 0, -1))]
        lists = await self._db.exec([("LRANGE", self._list(n), 0, -1) for n in nodes])
        wanted = set(keys)
        found = []
        for node_id, entries in zip(nodes, lists, strict=True):
            for e in entries:
                key = e[:KEY_BYTES]
                if key in wanted:
                    at = int.from_bytes(e[KEY_BYTES : KEY_BYTES + 8], "big") / 1000
                    reason, tier = e[KEY_BYTES + 8], e[KEY_BYTES + 9]
                    found.append(
                        Departure(ChunkKey(key), node_id, REASONS[reason], _tier_name(tier), at)
                    )
        return _newest(keys, found)
