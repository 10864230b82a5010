"""The embedded in-memory index: one process, nothing else to start.

All methods run on the metadata service's event loop and never await while
changing state, so each call is atomic without a lock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from kvdepot.keys import ChunkKey
from kvdepot.metadata.admission import ABSENT, KeyState, admit
from kvdepot.metadata.index.base import (
    IndexBackend,
    IndexConfig,
    next_epoch,
    node_id_taken,
    stale_registration,
)
from kvdepot.metadata.replica_tiers import ReplicaTierIndex
from kvdepot.records import TierStats, TransferRate
from kvdepot.types import (
    TIER_RANK,
    Action,
    Allocation,
    IndexStats,
    InventoryItem,
    KeyLocation,
    LookupCounting,
    LookupResult,
    NodeId,
    NodeInfo,
    NodeStatus,
    Replica,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Node:
    info: NodeInfo
    expires_at: float
    keys: set[ChunkKey] = field(default_factory=set)
    instance: str = ""  # the store instance that owns the id
    epoch: int = 0  # of its registration


@dataclass(slots=True)
class _Chunk:
    size: int
    replicas: dict[NodeId, str] = field(default_factory=dict)  # node -> tier
    # The lookup answer for this chunk, replicas by tier speed; None when a
    # replica changed, stale when its generation is not the index's.
    location: KeyLocation | None = None
    generation: int = 0


@dataclass(slots=True)
class _Pending:
    node_id: NodeId
    size: int
    expires_at: float
    request_id: bytes = b""  # of the put that made it ("" for none)


@dataclass(slots=True)
class _Counters:
    lookups: int = 0
    hit_keys: int = 0
    miss_keys: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    puts_committed: int = 0
    chunks_deduplicated: int = 0
    bytes_saved: int = 0
    bytes_committed: int = 0
    nodes_expired: int = 0
    allocations_expired: int = 0


class MemoryIndex(IndexBackend, ReplicaTierIndex):
    """Dictionaries keyed by chunk key and node id."""

    def __init__(self, config: IndexConfig) -> None:
        self._config = config
        self._nodes: dict[NodeId, _Node] = {}
        self._chunks: dict[ChunkKey, _Chunk] = {}
        self._pending: dict[ChunkKey, _Pending] = {}
        self._c = _Counters()
        # One Replica per (node, tier), shared by every lookup answer: building
        # them per key was most of a lookup's cost. Emptied when a node
        # (re)registers or goes, since its address is in them.
        self._replica_cache: dict[tuple[NodeId, str], Replica] = {}
        # Bumped with every emptying of the replica cache: chunks' cached
        # answers of an older generation may name an old address.
        self._generation = 0
        self._epoch = 0  # the last registration's

    def _forget_replicas(self) -> None:
        self._replica_cache.clear()
        self._generation += 1

    async def register_node(
        self,
        node: NodeInfo,
        inventory: Sequence[InventoryItem],
        now: float,
        instance: str = "",
        force: bool = False,
    ) -> int:
        held = self._nodes.get(node.node_id)
        if held is not None and held.expires_at > now and held.instance != instance:
            if not force:
                raise node_id_taken(node.node_id, held.info.address, held.expires_at - now)
            logger.warning(
                "node %s taken over (forced) from the instance at %s",
                node.node_id,
                held.info.address,
            )
        old = self._nodes.pop(node.node_id, None)
        self._forget_replicas()
        if old is not None:
            self._drop_replicas(node.node_id, old.keys)
        self._epoch = next_epoch(self._epoch, int(time.time() * 1000))
        entry = _Node(
            info=node,
            expires_at=now + self._config.lease_ttl_s,
            instance=instance,
            epoch=self._epoch,
        )
        self._nodes[node.node_id] = entry
        for item in inventory:
            self._add_replica(entry, item.key, item.size, item.tier)
        logger.info(
            "node %s registered at %s with %d chunks (epoch %d)",
            node.node_id,
            node.address,
            len(inventory),
            entry.epoch,
        )
        return entry.epoch

    async def heartbeat(
        self,
        node_id: NodeId,
        tiers: Sequence[TierStats],
        now: float,
        transfer: TransferRate | None = None,
        epoch: int = 0,
    ) -> bool:
        entry = self._nodes.get(node_id)
        if entry is None:
            return False
        if epoch and epoch != entry.epoch:
            raise stale_registration(node_id, epoch, entry.epoch)
        entry.expires_at = now + self._config.lease_ttl_s
        if tiers:
            entry.info = replace(entry.info, tiers=tuple(tiers))
        if transfer is not None:
            entry.info = replace(entry.info, transfer=transfer)
        return True

    async def set_replica_tier(self, node_id: NodeId, keys: Sequence[ChunkKey], tier: str) -> int:
        changed = 0
        for key in keys:
            chunk = self._chunks.get(key)
            if chunk is not None and chunk.replicas.get(node_id, tier) != tier:
                chunk.replicas[node_id] = tier
                chunk.location = None
                changed += 1
        return changed

    async def remove_replicas(self, node_id: NodeId, keys: Sequence[ChunkKey]) -> int:
        entry = self._nodes.get(node_id)
        if entry is None:
            return 0
        held = [k for k in keys if k in entry.keys]
        entry.keys.difference_update(held)
        self._drop_replicas(node_id, held)
        return len(held)

    async def put_start(
        self,
        keys: Sequence[ChunkKey],
        sizes: Sequence[int],
        writer_node_id: NodeId,
        now: float,
        request_id: bytes = b"",
    ) -> list[Allocation]:
        nodes = {nid: n.info for nid, n in self._nodes.items()}
        states = [self._key_state(key, now, request_id) for key in keys]
        decided = admit(keys, sizes, states, nodes, writer_node_id)
        # A retried put's allocation on a node that is gone is simply replaced
        # below: there is nothing of it to revoke elsewhere.
        expires_at = now + self._config.allocation_ttl_s
        for i, node in decided.placements:
            self._pending[keys[i]] = _Pending(node.node_id, sizes[i], expires_at, request_id)
            decided.allocations[i] = Allocation(
                Action.WRITE, Replica(node.node_id, node.address, "cpu")
            )
        self._c.chunks_deduplicated += decided.deduplicated
        self._c.bytes_saved += decided.bytes_saved
        return [a for a in decided.allocations if a is not None]

    def _key_state(self, key: ChunkKey, now: float, request_id: bytes) -> KeyState:
        chunk = self._chunks.get(key)
        if chunk is not None and chunk.replicas:
            return KeyState(exists=True)
        pending = self._pending.get(key)
        if pending is None or pending.expires_at <= now:
            return ABSENT
        mine = bool(request_id) and pending.request_id == request_id
        return KeyState(pending=True, retried=pending.node_id if mine else None)

    async def put_end(self, node_id: NodeId, keys: Sequence[ChunkKey], sizes: Sequence[int]) -> int:
        entry = self._nodes.get(node_id)
        committed = 0
        for key, size in zip(keys, sizes, strict=True):
            pending = self._pending.get(key)
            if pending is not None and pending.node_id == node_id:
                del self._pending[key]
            if entry is None:
                continue  # the node died meanwhile: its bytes are gone with it
            if self._add_replica(entry, key, size, "cpu"):
                committed += 1
                self._c.puts_committed += 1
                self._c.bytes_committed += size
        return committed

    async def put_revoke(self, node_id: NodeId, keys: Sequence[ChunkKey]) -> int:
        revoked = 0
        for key in keys:
            pending = self._pending.get(key)
            if pending is not None and pending.node_id == node_id:
                del self._pending[key]
                revoked += 1
        return revoked

    async def lookup(
        self,
        keys: Sequence[ChunkKey],
        client_node_id: NodeId,
        counting: LookupCounting | int = 0,
    ) -> LookupResult:
        locations: list[KeyLocation] = []
        chunks, generation = self._chunks, self._generation
        for key in keys:
            chunk = chunks.get(key)
            if chunk is None or not chunk.replicas:
                break
            loc = chunk.location
            if loc is None or chunk.generation != generation:
                loc = self._location(chunk)
            first = loc.replicas[0].node_id
            if len(loc.replicas) > 1 and client_node_id and first != client_node_id:
                # The client's own replica first, the others still by tier speed.
                mine = tuple(r for r in loc.replicas if r.node_id == client_node_id)
                if mine:
                    rest = tuple(r for r in loc.replicas if r.node_id != client_node_id)
                    loc = KeyLocation(loc.size, mine + rest)
            locations.append(loc)
        hits = len(locations)
        if isinstance(counting, int):
            counting = LookupCounting(counting)
        c = self._c
        for name, delta in counting.deltas(len(keys), hits).items():
            setattr(c, name, getattr(c, name) + delta)
        return LookupResult(hits, tuple(locations))

    def _location(self, chunk: _Chunk) -> KeyLocation:
        # Built once per change of the chunk's replicas and shared by every
        # answer: building it per key was most of a lookup's cost.
        cache = self._replica_cache
        replicas = []
        for pair in chunk.replicas.items():
            r = cache.get(pair)
            if r is None:
                nid, tier = pair
                r = cache[pair] = Replica(nid, self._nodes[nid].info.address, tier)
            replicas.append(r)
        if len(replicas) > 1:
            replicas.sort(key=lambda r: TIER_RANK.get(r.tier, 9))
        loc = chunk.location = KeyLocation(chunk.size, tuple(replicas))
        chunk.generation = self._generation
        return loc

    async def expire(self, now: float) -> tuple[int, int]:
        dead = [nid for nid, n in self._nodes.items() if n.expires_at <= now]
        for nid in dead:
            entry = self._nodes.pop(nid)
            self._forget_replicas()
            self._drop_replicas(nid, entry.keys)
            logger.warning("node %s lease expired: dropped with %d chunks", nid, len(entry.keys))
        stale = [k for k, p in self._pending.items() if p.expires_at <= now]
        for key in stale:
            del self._pending[key]
        self._c.nodes_expired += len(dead)
        self._c.allocations_expired += len(stale)
        return len(dead), len(stale)

    async def stats(self, now: float) -> IndexStats:
        c = self._c
        nodes = tuple(
            NodeStatus(n.info, len(n.keys), max(0.0, n.expires_at - now))
            for n in self._nodes.values()
        )
        return IndexStats(
            nodes=nodes,
            chunks=len(self._chunks),
            lookups=c.lookups,
            hit_keys=c.hit_keys,
            miss_keys=c.miss_keys,
            hit_tokens=c.hit_tokens,
            miss_tokens=c.miss_tokens,
            puts_committed=c.puts_committed,
            chunks_deduplicated=c.chunks_deduplicated,
            bytes_saved=c.bytes_saved,
            bytes_committed=c.bytes_committed,
            nodes_expired=c.nodes_expired,
            allocations_expired=c.allocations_expired,
        )

    def _add_replica(self, node: _Node, key: ChunkKey, size: int, tier: str) -> bool:
        chunk = self._chunks.get(key)
        if chunk is None:
            chunk = self._chunks[key] = _Chunk(size)
        is_new = node.info.node_id not in chunk.replicas
        chunk.replicas[node.info.node_id] = tier
        chunk.location = None
        node.keys.add(key)
        return is_new

    def _drop_replicas(self, node_id: NodeId, keys: Sequence[ChunkKey] | set[ChunkKey]) -> None:
        for key in keys:
            chunk = self._chunks.get(key)
            if chunk is None:
                continue
            chunk.replicas.pop(node_id, None)
            chunk.location = None
            if not chunk.replicas:
                del self._chunks[key]
