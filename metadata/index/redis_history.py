"""The Redis index's namespaces and departure history (a part of ``RedisIndex``).

Both live in Redis beside the index, so that every metadata replica answers
``Explain`` and ``ListNamespaces`` alike. A chunk of a node whose lease ran
out is not listed one by one (the reaper records the registration as ended
in O(1)); until the sweep deletes its replicas, :meth:`lost_with_node` finds
the ended registration in the chunk's own record; the sweep records those it
is about to delete as departures first (up to ``_LOST_PER_STEP`` a step), so
that a reader who asks the chunk's record, then the history, finds one or
the other.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvdepot.keys import ChunkKey
from kvdepot.metadata.index.base import IndexConfig
from kvdepot.metadata.index.departures import DepartureLog, RedisDepartures
from kvdepot.metadata.index.namespaces import NamespaceStore, RedisNamespaces
from kvdepot.metadata.index.redis_client import Connection, guarded
from kvdepot.metadata.index.redis_layout import Buckets, LostListener, replicas, tag

_LOST_PER_STEP = 4096
"""Keys of a dead node's replicas one sweep step records as departures at most."""


class RedisHistory:
    """Namespaces, departures and the chunks of ended registrations."""

    _p: str
    _db: Connection
    _k_dead: str

    async def _layout(self) -> Buckets:
        raise NotImplementedError

    _namespaces: NamespaceStore | None
    _departures: DepartureLog | None

    def _init_history(self, config: IndexConfig) -> None:
        self._namespaces = RedisNamespaces(self._db, self._p, config.max_namespaces)
        self._history = RedisDepartures(self._db, self._p, tag, config.departures)
        self._departures = self._history

    def _lost_listener(self) -> tuple[LostListener | None, int, int]:
        """What the sweep tells of the replicas of ended registrations it
        deletes: a step's at most, and a registration's in a pass (the
        history keeps no more)."""
        keep = self._history.config.per_node
        want = min(keep, _LOST_PER_STEP)
        return (self._record_lost if want else None), want, keep

    async def _record_lost(self, node_id: str, at: float, keys: list[ChunkKey]) -> None:
        await self._history.record(node_id, keys, "node_lost", "", at)

    @guarded
    async def lost_with_node(self, keys: Sequence[ChunkKey]) -> dict[ChunkKey, tuple[str, float]]:
        if not keys:
            return {}
        b = await self._layout()
        values = await self._db.read([("HGET", b.bucket(k), b.field(k)) for k in keys])
        raw = await self._db.one(("HGETALL", self._k_dead))
        # epoch -> "<ended ms> <replicas then> <node>"
        ended = {int(e): v.decode().split(" ", 2) for e, v in raw.items()}
        out: dict[ChunkKey, tuple[str, float]] = {}
        for key, value in zip(keys, values, strict=True):
            for epoch, _tier in replicas(value) if value is not None else ():
                gone = ended.get(epoch)
                if gone is not None and len(gone) == 3:
                    out[key] = (gone[2], int(gone[0]) / 1000)
        return out
