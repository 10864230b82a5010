"""The Redis index: several stateless metadata replicas share one Redis or Redis Cluster.

Semantics are those of :class:`~kvdepot.metadata.index.memory.MemoryIndex`; what
differs is that every replica may serve any request at any time, so the state
lives in Redis and every change that must be atomic is one Lua script on one
key slot (:mod:`kvdepot.metadata.index.redis_scripts`; how they reach a
server or a cluster is :mod:`kvdepot.metadata.index.redis_client`).

Key layout (``P`` is the key prefix, ``kvd`` by default; ``{…}`` is the Redis
Cluster hash tag, so that what one script touches is on one slot)::

    P:c:{<key hex>}       hash    chunk: "size" -> bytes, "n:<node>" -> "<tier> <epoch>"
    P:p:{<key hex>}       string  pending allocation "<batch>:<deadline ms>:<node>"; the batch
                                  is a uuid, with "-<request id hex>" when the put sent one
    P:n:{<node>}          hash    the node's lease (PX lease TTL): epoch, address, grpc, tiers,
                                  xfer (recent transfer rates), inst (the store instance
                                  that owns the id while the lease lives)
    P:n:{<node>}:epoch    string  the node's last registration epoch (never reused)
    P:n:{<node>}:keys     set     chunk keys the current epoch registered or committed
    P:n:{<node>}:gc       set     chunk keys of ended epochs, still to be cleaned up
    P:nodes               hash    registry: node -> epoch (placement, reaping, stats)
    P:allocs              zset    allocation batches by deadline (to count expired ones)
    P:alloc:<batch>       set     chunk keys of one allocation batch
    P:stats               hash    cluster-wide counters (HINCRBY)

PutStart decides each key in Python with the rule both backends share
(:func:`kvdepot.metadata.admission.admit`) on the state read in its first
round trip; what makes it safe among racing replicas is the ALLOC script of
its second, which lets one allocation per key win (the losers are settled by
:func:`~kvdepot.metadata.admission.settle_lost`).

A put's request id rides in its batch name, so a pending value keeps the
format that every script (and an older replica sharing the index) parses; a
retry of that put, whose first reply was lost, finds its own live allocations
by it and gets them again.

A chunk and its pending allocation share a slot, so one script commits both;
a node's lease, epoch and key sets share another. Every registration gets a
new epoch, written into the chunk fields it creates, and a replica counts only
while its node's lease exists *and* carries that epoch. So a lookup never
returns a replica on a node whose lease is gone, even before any reaper ran,
and a reaper cleaning up after a dead epoch never deletes what a new
registration of the same node wrote meanwhile. Cleanup is idempotent: every
metadata replica runs :meth:`RedisIndex.expire` and they may overlap.

An index loss (``FLUSHALL``, a restart without persistence) deletes the lease
with everything else: the next heartbeat returns False, the store daemon
registers again with its inventory, and the index is rebuilt.

Round trips: a lookup is one (the chunk hashes and the leases of the known
nodes together), a put is two for ``put_start`` and two for ``put_end``. On a
single server each batch of per-chunk work is one script call with one reply,
because redis-py spends more time per reply than Redis spends per command; on
a cluster the same scripts run once per chunk in a pipeline split by node.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import astuple, fields
from typing import Any

from redis.asyncio import Redis, RedisCluster

from kvdepot.errors import InvalidArgument
from kvdepot.keys import ChunkKey
from kvdepot.metadata.admission import Admission, KeyState, admit, settle_lost
from kvdepot.metadata.index import redis_scripts as scripts
from kvdepot.metadata.index.base import (
    IndexBackend,
    IndexConfig,
    node_id_taken,
    stale_registration,
)
from kvdepot.metadata.index.redis_client import Connection, connect, flat, guarded, split_url
from kvdepot.metadata.replica_tiers import ReplicaTierIndex
from kvdepot.records import TierStats, TransferRate
from kvdepot.repeat_log import RepeatLog
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

DEFAULT_PREFIX = "kvd"
# A lookup prefetches the leases of at most this many known nodes in its one
# round trip; with more nodes it fetches those its chunks name (two round trips).
_PREFETCH_NODES = 64
_KNOWN_MAX = 1024
# Counters reach Redis at most this late (other replicas' stats lag as much).
_FLUSH_DELAY_S = 0.05
# The counters IndexStats carries, kept in the P:stats hash under these names.
_COUNTERS = tuple(f.name for f in fields(IndexStats) if f.name not in ("nodes", "extra"))


def _tag(node_id: NodeId) -> str:
    # Braces in a node id would change which part of the key Redis Cluster
    # hashes; escaping keeps a node's keys on one slot and stays injective.
    return node_id.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")


def _tiers_json(tiers: Sequence[TierStats]) -> str:
    return json.dumps([list(astuple(t)) for t in tiers], separators=(",", ":"))


def _tiers_parse(raw: bytes | None) -> tuple[TierStats, ...]:
    if not raw:
        return ()
    return tuple(TierStats(*row) for row in json.loads(raw))


def _transfer_json(transfer: TransferRate) -> str:
    return json.dumps(list(astuple(transfer)), separators=(",", ":"))


def _transfer_parse(raw: bytes | None) -> TransferRate:
    if not raw:
        return TransferRate()
    return TransferRate(*json.loads(raw))


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _now_ms() -> int:
    return int(time.time() * 1000)


def _field_epoch(value: bytes) -> bytes:
    return value.rpartition(b" ")[2]


def _pending_live(value: bytes | None, now_ms: int) -> bool:
    if value is None:
        return False
    parts = value.split(b":", 2)
    return len(parts) == 3 and int(parts[1]) > now_ms


def _batch_id(request_id: bytes) -> str:
    """A new allocation batch, naming the put's request id when it sent one."""
    batch = uuid.uuid4().hex
    return f"{batch}-{request_id.hex()}" if request_id else batch


def _retried(value: bytes | None, request_hex: bytes, now_ms: int) -> NodeId | None:
    """The node of ``value`` if it is a live allocation made by the put whose
    request id is ``request_hex`` (hex, ``b""`` for none), else None."""
    if value is None or not request_hex or not _pending_live(value, now_ms):
        return None
    batch, _, rest = value.partition(b":")
    if batch.partition(b"-")[2] != request_hex:
        return None
    return rest.partition(b":")[2].decode()


class RedisIndex(IndexBackend, ReplicaTierIndex):
    """The index in Redis or Redis Cluster, shared by any number of metadata replicas.

    Args:
        config: Index configuration; ``config.url`` names the server(s) and may
            carry ``?prefix=…``.
        prefix: Key prefix; overrides the URL's (default ``kvd``), so that
            several indexes (e.g. tests) can share one server.
        client: A redis-py asyncio client to use instead of connecting to
            ``config.url``; :meth:`close` closes it.
    """

    def __init__(
        self,
        config: IndexConfig,
        *,
        prefix: str | None = None,
        client: Redis | RedisCluster | None = None,
    ) -> None:
        url, url_prefix = split_url(config.url)
        p = prefix or url_prefix or DEFAULT_PREFIX
        if any(c in p for c in "{} \t\n"):
            raise InvalidArgument(f"index key prefix {p!r} must not contain braces or spaces")
        self._p = p
        self._r = client if client is not None else connect(url)
        self._db = Connection(self._r)
        self._lease_ms = _ms(config.lease_ttl_s)
        self._alloc_ms = _ms(config.allocation_ttl_s)
        # Redis drops a pending key by itself only if no reaper counted it in
        # time (every metadata replica down): a safety net, not the deadline.
        self._backstop_ms = 2 * self._alloc_ms + 60_000
        self._k_nodes = f"{p}:nodes"
        self._k_stats = f"{p}:stats"
        self._k_allocs = f"{p}:allocs"
        self._known: dict[NodeId, None] = {}  # nodes whose leases lookups prefetch
        self._deltas: Counter[str] = Counter()
        self._flusher: asyncio.Task[None] | None = None
        self._flush_now = asyncio.Event()
        # A flush follows every counted call: one line per failed one would
        # flood the log while Redis is down.
        self._flush_failures = RepeatLog(logger)

    # -- keys -----------------------------------------------------------------
    def _chunk(self, key: bytes) -> str:
        return f"{self._p}:c:{{{key.hex()}}}"

    def _pending(self, key: bytes) -> str:
        return f"{self._p}:p:{{{key.hex()}}}"

    def _node(self, node_id: NodeId, part: str = "") -> str:
        return f"{self._p}:n:{{{_tag(node_id)}}}{part}"

    def _node_keys(self, node_id: NodeId) -> list[str]:
        n = self._node(node_id)
        return [n, n + ":epoch", n + ":keys", n + ":gc"]

    # -- plumbing -------------------------------------------------------------
    def _count(self, **deltas: int) -> None:
        """Add to the shared counters without a round trip on the caller's path.

        A flush starts at most every ``_FLUSH_DELAY_S`` and takes everything
        accumulated meanwhile, so many requests share one HINCRBY pipeline;
        :meth:`stats` flushes first, so this replica always sees its own.
        """
        for name, n in deltas.items():
            if n:
                self._deltas[name] += n
        if self._deltas and (self._flusher is None or self._flusher.done()):
            self._flusher = asyncio.get_running_loop().create_task(self._flush_later())

    async def _flush_later(self) -> None:
        self._flush_now.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._flush_now.wait(), _FLUSH_DELAY_S)
        await self._flush_counts()

    async def _flush_counts(self) -> None:
        while self._deltas:
            deltas, self._deltas = self._deltas, Counter()
            try:
                out = await self._db.pipeline(
                    [("HINCRBY", self._k_stats, k, v) for k, v in deltas.items()]
                )
            except Exception as exc:  # kept for the next flush, never lost silently
                out = [exc] * len(deltas)
            failed = {
                k: v
                for (k, v), r in zip(deltas.items(), out, strict=True)
                if isinstance(r, BaseException)
            }
            if failed:
                self._deltas.update(failed)
                error = next(r for r in out if isinstance(r, BaseException))
                self._flush_failures.warn(
                    "flush",
                    "redis index: counters not flushed: %s; kept for the next flush",
                    error,
                    extra={"event": "repeated_failure"},
                )
                return
        self._flush_failures.flush()

    async def _sync_counts(self) -> None:
        if self._flusher is not None and not self._flusher.done():
            self._flush_now.set()  # rather than after the delay
            await self._flusher
        await self._flush_counts()

    async def _leases(
        self, node_ids: Sequence[NodeId], fields: Sequence[str]
    ) -> dict[NodeId, list[bytes | None] | None]:
        if not node_ids:
            return {}
        out = await self._db.read([("HMGET", self._node(n), *fields) for n in node_ids])
        self._remember(node_ids)
        return {n: (r if r[0] is not None else None) for n, r in zip(node_ids, out, strict=True)}

    def _remember(self, node_ids: Sequence[NodeId]) -> None:
        if len(self._known) > _KNOWN_MAX:
            self._known.clear()
        self._known.update(dict.fromkeys(node_ids))

    async def _collect(self, node_id: NodeId, bound: int) -> int:
        """Delete the chunk fields of ``node_id``'s ended epochs (below ``bound``).

        Safe to run concurrently from several replicas: each field is deleted
        by one script call, and the gc set loses members only after that.
        """
        gc = self._node(node_id, ":gc")
        field = f"n:{node_id}"
        cursor = 0
        dropped = 0
        while True:
            cursor, members = await self._db.one(("SSCAN", gc, cursor, "COUNT", 1024))
            cursor = int(cursor)
            if members:
                calls = self._db.vec(
                    scripts.DROP, [[self._chunk(m)] for m in members], [field, bound]
                )
                out = await self._db.exec([*calls, ("SREM", gc, *members)])
                results = flat(out[:-1])
                dropped += sum(1 for r in results if r)
                self._count(chunks=-results.count(2))
            if cursor == 0:
                return dropped

    # -- nodes ----------------------------------------------------------------
    @guarded
    async def register_node(
        self,
        node: NodeInfo,
        inventory: Sequence[InventoryItem],
        now: float,
        instance: str = "",
        force: bool = False,
    ) -> int:
        raw = [bytes(item.key) for item in inventory]
        args = [
            self._lease_ms,
            node.address,
            node.grpc_address,
            _tiers_json(node.tiers),
            instance,
            "1" if force else "0",
            *raw,
        ]
        reply = await self._db.one(scripts.REGISTER.cmd(self._node_keys(node.node_id), args))
        if int(reply[0]) == 0:
            raise node_id_taken(node.node_id, reply[1].decode(), max(0, int(reply[2])) / 1000)
        if int(reply[0]) == 2:
            logger.warning(
                "node %s taken over (forced) from the instance at %s",
                node.node_id,
                reply[2].decode(),
            )
        epoch = int(reply[1])
        calls = self._db.vec(
            scripts.ADD,
            [[self._chunk(item.key)] for item in inventory],
            [f"n:{node.node_id}", epoch],
            [(item.size, item.tier) for item in inventory],
        )
        out = await self._db.exec(
            [*calls, scripts.NODES_SET.cmd([self._k_nodes], [node.node_id, epoch])]
        )
        self._count(chunks=sum(flat(out[:-1])))
        self._remember([node.node_id])
        # Fields of the previous registration that the new inventory lacks.
        await self._collect(node.node_id, epoch)
        logger.info(
            "node %s registered at %s with %d chunks (epoch %d)",
            node.node_id,
            node.address,
            len(inventory),
            epoch,
        )
        return epoch

    @guarded
    async def heartbeat(
        self,
        node_id: NodeId,
        tiers: Sequence[TierStats],
        now: float,
        transfer: TransferRate | None = None,
        epoch: int = 0,
    ) -> bool:
        # A lease that ran out is not revived even if no reaper ran yet: one
        # may already be deleting that epoch's chunks, so the node registers
        # again with its inventory, exactly as after an index loss.
        args = [
            self._lease_ms,
            _tiers_json(tiers) if tiers else "",
            _transfer_json(transfer) if transfer is not None else "",
            epoch,
        ]
        current = int(await self._db.one(scripts.HEARTBEAT.cmd([self._node(node_id)], args)) or 0)
        if current < 0:
            raise stale_registration(node_id, epoch, -current)
        if not current:
            return False
        # Re-assert the registry entry: on a cluster it may sit on a shard
        # that lost its data while this node's own shard did not.
        await self._db.one(scripts.NODES_SET.cmd([self._k_nodes], [node_id, current]))
        return True

    @guarded
    async def set_replica_tier(self, node_id: NodeId, keys: Sequence[ChunkKey], tier: str) -> int:
        if not keys:
            return 0
        epoch = await self._db.one(("HGET", self._node(node_id), "epoch"))
        if epoch is None:
            return 0
        calls = self._db.vec(
            scripts.RETIER, [[self._chunk(k)] for k in keys], [f"n:{node_id}", int(epoch), tier]
        )
        return sum(flat(await self._db.exec(calls)))

    @guarded
    async def remove_replicas(self, node_id: NodeId, keys: Sequence[ChunkKey]) -> int:
        if not keys:
            return 0
        n = self._node(node_id)
        epoch = await self._db.one(("HGET", n, "epoch"))
        if epoch is None:
            return 0
        # Chunk fields go before key set entries: an entry without a field is
        # harmless, a field without an entry would never be cleaned up.
        calls = self._db.vec(
            scripts.DROP, [[self._chunk(k)] for k in keys], [f"n:{node_id}", int(epoch) + 1]
        )
        out = await self._db.exec([*calls, scripts.FORGET.cmd([n, n + ":keys"], [epoch, *keys])])
        self._count(chunks=-flat(out[:-1]).count(2))
        return int(out[-1])

    # -- puts -----------------------------------------------------------------
    async def _live_nodes(
        self, registry: Sequence[bytes], prefetched: dict[NodeId, list[bytes | None] | None]
    ) -> dict[NodeId, tuple[bytes, NodeInfo]]:
        """The live nodes, with epoch and info, among the registry and ``prefetched``."""
        leases = dict(prefetched)
        extra = [n for n in (r.decode() for r in registry) if n not in leases]
        leases.update(await self._leases(extra, ("epoch", "address", "grpc", "tiers")))
        live: dict[NodeId, tuple[bytes, NodeInfo]] = {}
        for nid, lease in leases.items():
            if lease is not None:
                epoch, address, grpc_address, tiers = lease
                info = NodeInfo(
                    nid,
                    (address or b"").decode(),
                    (grpc_address or b"").decode(),
                    _tiers_parse(tiers),
                )
                live[nid] = (epoch or b"", info)
        return live

    @guarded
    async def put_start(
        self,
        keys: Sequence[ChunkKey],
        sizes: Sequence[int],
        writer_node_id: NodeId,
        now: float,
        request_id: bytes = b"",
    ) -> list[Allocation]:
        if len(keys) != len(sizes):
            raise InvalidArgument(f"{len(keys)} keys but {len(sizes)} sizes")
        if not keys:
            return []
        request_hex = request_id.hex().encode()
        states, nodes, now_ms = await self._put_state(keys, request_hex)
        decided = admit(keys, sizes, states, nodes, writer_node_id)
        dedup, saved = decided.deduplicated, decided.bytes_saved
        lost = await self._allocate(keys, decided, request_id, now_ms) if decided.placements else []
        values: list[bytes | None] = [None] * len(lost)
        if request_id and lost:
            # A first attempt of this put, slow rather than dead, may have
            # allocated the key between the state read and ALLOC.
            values = await self._db.read([("GET", self._pending(keys[i])) for i in lost])
        for i, value in zip(lost, values, strict=True):
            answer = decided.allocations[i] = settle_lost(
                _retried(value, request_hex, now_ms), nodes
            )
            if answer.action is Action.SKIP_PENDING:
                dedup, saved = dedup + 1, saved + sizes[i]
        self._count(chunks_deduplicated=dedup, bytes_saved=saved)
        return [a for a in decided.allocations if a is not None]

    async def _put_state(
        self, keys: Sequence[ChunkKey], request_hex: bytes
    ) -> tuple[list[KeyState], dict[NodeId, NodeInfo], int]:
        """The state of ``keys`` and the live nodes, read in one round trip, and the time."""
        uniq = list(dict.fromkeys(keys))
        u = len(uniq)
        known = list(self._known)
        # One round trip: chunks, pending allocations, the registry, leases.
        out = await self._db.read(
            [("HGETALL", self._chunk(k)) for k in uniq]
            + [("GET", self._pending(k)) for k in uniq]
            + [("HKEYS", self._k_nodes)]
            + [("HMGET", self._node(n), "epoch", "address", "grpc", "tiers") for n in known]
        )
        prefetched = {
            n: (r if r[0] is not None else None)
            for n, r in zip(known, out[2 * u + 1 :], strict=True)
        }
        live = await self._live_nodes(out[2 * u], prefetched)
        epochs = {f"n:{nid}".encode(): epoch for nid, (epoch, _) in live.items()}
        now_ms = _now_ms()
        state: dict[ChunkKey, KeyState] = {}
        for key, chunk, value in zip(uniq, out[:u], out[u : 2 * u], strict=True):
            if any(epochs.get(f) == _field_epoch(v) for f, v in chunk.items()):
                state[key] = KeyState(exists=True)
            else:
                state[key] = KeyState(
                    pending=_pending_live(value, now_ms),
                    retried=_retried(value, request_hex, now_ms),
                )
        nodes = {nid: info for nid, (_, info) in live.items()}
        return [state[k] for k in keys], nodes, now_ms

    async def _allocate(
        self, keys: Sequence[ChunkKey], decided: Admission, request_id: bytes, now_ms: int
    ) -> list[int]:
        """Allocate the keys ``decided`` places; return those another put won.

        Atomic per key: of all replicas racing for a key, one script call wins
        it; the others settle it with :func:`settle_lost`.
        """
        wanted = decided.placements
        batch_id = _batch_id(request_id)
        members = f"{self._p}:alloc:{batch_id}"
        # Same slot as the ALLOC of the key, so it runs first, on a cluster too.
        revokes = [
            c
            for nid, ks in decided.revoked.items()
            for c in self._db.vec(scripts.REVOKE, [[self._pending(k)] for k in ks], [nid])
        ]
        calls = self._db.vec(
            scripts.ALLOC,
            [[self._pending(keys[i])] for i, _ in wanted],
            [batch_id, self._alloc_ms, self._backstop_ms],
            [(n.node_id,) for _, n in wanted],
        )
        out = await self._db.exec(
            [
                *revokes,
                *calls,
                ("SADD", members, *(bytes(keys[i]) for i, _ in wanted)),
                ("PEXPIRE", members, self._backstop_ms),
                ("ZADD", self._k_allocs, now_ms + self._alloc_ms, batch_id),
            ]
        )
        won = flat(out[len(revokes) : len(revokes) + len(calls)])
        lost: list[int] = []
        for (i, node), w in zip(wanted, won, strict=True):
            if w:
                replica = Replica(node.node_id, node.address, "cpu")
                decided.allocations[i] = Allocation(Action.WRITE, replica)
            else:
                lost.append(i)
        return lost

    @guarded
    async def put_end(self, node_id: NodeId, keys: Sequence[ChunkKey], sizes: Sequence[int]) -> int:
        if len(keys) != len(sizes):
            raise InvalidArgument(f"{len(keys)} keys but {len(sizes)} sizes")
        if not keys:
            return 0
        n = self._node(node_id)
        epoch = await self._db.one(scripts.CLAIM.cmd([n, n + ":keys"], [bytes(k) for k in keys]))
        if epoch is None:
            # The node died meanwhile: its bytes are gone with it.
            await self._db.exec(
                self._db.vec(scripts.REVOKE, [[self._pending(k)] for k in keys], [node_id])
            )
            return 0
        calls = self._db.vec(
            scripts.COMMIT,
            [[self._chunk(k), self._pending(k)] for k in keys],
            [node_id, f"n:{node_id}", b"cpu " + epoch, epoch],
            [(s,) for s in sizes],
        )
        committed = nbytes = created = 0
        for r, size in zip(flat(await self._db.exec(calls)), sizes, strict=True):
            created += r >> 1
            if r & 1:
                committed += 1
                nbytes += size
        self._count(chunks=created, puts_committed=committed, bytes_committed=nbytes)
        return committed

    @guarded
    async def put_revoke(self, node_id: NodeId, keys: Sequence[ChunkKey]) -> int:
        calls = self._db.vec(scripts.REVOKE, [[self._pending(k)] for k in keys], [node_id])
        return sum(flat(await self._db.exec(calls)))

    # -- lookup ---------------------------------------------------------------
    @guarded
    async def lookup(
        self,
        keys: Sequence[ChunkKey],
        client_node_id: NodeId,
        counting: LookupCounting | int = 0,
    ) -> LookupResult:
        known = list(self._known) if len(self._known) <= _PREFETCH_NODES else []
        # One round trip: every chunk's hash and the leases of the known nodes,
        # read together, so that a lease gone makes its replicas vanish.
        out = await self._db.read(
            [("HGETALL", self._chunk(k)) for k in keys]
            + [("HMGET", self._node(n), "epoch", "address") for n in known]
        )
        hashes: list[dict[bytes, bytes]] = out[: len(keys)]
        leases = {
            n: (r if r[0] is not None else None)
            for n, r in zip(known, out[len(keys) :], strict=True)
        }
        named = {f[2:].decode() for h in hashes for f in h if f != b"size"}
        leases.update(await self._leases(sorted(named.difference(leases)), ("epoch", "address")))

        # The same few (node, tier, epoch) values recur across all the keys:
        # each becomes one Replica (immutable), shared by every key holding it.
        made: dict[tuple[bytes, bytes], Replica | None] = {}
        locations: list[KeyLocation] = []
        for h in hashes:
            replicas: list[Replica] = []
            for f, v in h.items():
                if f == b"size":
                    continue
                if (f, v) not in made:
                    nid = f[2:].decode()
                    lease = leases.get(nid)
                    live = lease is not None and _field_epoch(v) == lease[0]
                    # Not live: the node is dead, or an ended registration wrote it.
                    made[f, v] = (
                        Replica(nid, (lease[1] or b"").decode(), v.rpartition(b" ")[0].decode())
                        if live and lease is not None
                        else None
                    )
                r = made[f, v]
                if r is not None:
                    replicas.append(r)
            if not replicas:
                break
            if len(replicas) > 1:
                replicas.sort(key=lambda r: (r.node_id != client_node_id, TIER_RANK.get(r.tier, 9)))
            locations.append(KeyLocation(int(h[b"size"]), tuple(replicas)))
        hits = len(locations)
        if isinstance(counting, int):
            counting = LookupCounting(counting)
        deltas = counting.deltas(len(keys), hits)
        if deltas:
            self._count(**deltas)
        return LookupResult(hits, tuple(locations))

    # -- maintenance ----------------------------------------------------------
    @guarded
    async def expire(self, now: float) -> tuple[int, int]:
        registry, due = await self._db.exec(
            [
                ("HGETALL", self._k_nodes),
                ("ZRANGEBYSCORE", self._k_allocs, "-inf", _now_ms(), "LIMIT", 0, 1024),
            ]
        )
        ids = [n.decode() for n in registry]
        self._remember(ids)
        alive = await self._db.exec([("EXISTS", self._node(n)) for n in ids])
        nodes_expired = 0
        for nid in (n for n, ok in zip(ids, alive, strict=True) if not ok):
            epoch = int(await self._db.one(scripts.REAP.cmd(self._node_keys(nid), [])))
            if epoch < 0:
                continue  # registered again since
            dropped = await self._collect(nid, epoch + 1)
            if await self._db.one(scripts.NODES_DEL.cmd([self._k_nodes], [nid, epoch])):
                nodes_expired += 1
                logger.warning("node %s lease expired: dropped with %d chunks", nid, dropped)

        allocations_expired = 0
        if due:
            # ZREM decides which replica handles (and counts) each batch.
            won = await self._db.exec([("ZREM", self._k_allocs, b) for b in due])
            claimed = [b.decode() for b, w in zip(due, won, strict=True) if w]
            sets = [f"{self._p}:alloc:{b}" for b in claimed]
            members = await self._db.exec([("SMEMBERS", s) for s in sets])
            calls = [
                c
                for b, ks in zip(claimed, members, strict=True)
                for c in self._db.vec(scripts.EXPIRE_ALLOC, [[self._pending(k)] for k in ks], [b])
            ]
            out = await self._db.exec([*calls, *(("DEL", s) for s in sets)])
            allocations_expired = sum(flat(out[: len(calls)]))
        self._count(nodes_expired=nodes_expired, allocations_expired=allocations_expired)
        return nodes_expired, allocations_expired

    @guarded
    async def stats(self, now: float) -> IndexStats:
        await self._sync_counts()
        counters, registry = await self._db.exec(
            [("HGETALL", self._k_stats), ("HKEYS", self._k_nodes)]
        )
        ids = [n.decode() for n in registry]
        out = await self._db.exec(
            [
                c
                for n in ids
                for c in (
                    ("HGETALL", self._node(n)),
                    ("PTTL", self._node(n)),
                    ("SCARD", self._node(n, ":keys")),
                )
            ]
        )
        nodes = []
        for i, nid in enumerate(ids):
            lease, pttl, count = out[3 * i : 3 * i + 3]
            if not lease:
                continue  # dead, not reaped yet
            info = NodeInfo(
                nid,
                lease.get(b"address", b"").decode(),
                lease.get(b"grpc", b"").decode(),
                _tiers_parse(lease.get(b"tiers")),
                _transfer_parse(lease.get(b"xfer")),
            )
            nodes.append(NodeStatus(info, int(count), max(0.0, int(pttl) / 1000)))
        c: dict[str, Any] = {n: int(counters.get(n.encode(), 0)) for n in _COUNTERS}
        c["chunks"] = max(0, c["chunks"])  # a count that drifted below 0 after a crash
        return IndexStats(nodes=tuple(nodes), **c)

    async def close(self) -> None:
        """Flush the counters still buffered and close the connection pool."""
        try:
            await self._sync_counts()
        finally:
            await self._r.aclose()
