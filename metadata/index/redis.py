"""The Redis index: several stateless metadata replicas share one Redis or Redis Cluster.

Semantics are those of :class:`~kvdepot.metadata.index.memory.MemoryIndex`; what
differs is that every replica may serve any request at any time, so the state
lives in Redis and every change that must be atomic is one Lua script on one
key slot (:mod:`~kvdepot.metadata.index.redis_scripts`; how they reach a server
or a cluster: :mod:`~kvdepot.metadata.index.redis_client`; names, values and
the sweep: :mod:`~kvdepot.metadata.index.redis_layout`).

Key layout (``P`` is the key prefix, ``kvd`` by default; ``{…}`` is the Redis
Cluster hash tag, so that what one script touches is on one slot)::

    P:b:{<bucket hex>}   hash    chunk bucket: the chunks whose keys start with its
                                 ``bucket_bits`` bits. Field: the key's bytes after the
                                 bucket's whole bytes; value: size (6 bytes), then per
                                 replica its registration's epoch (6) and tier code (1).
                                 36-44 bytes a chunk (at 5-1 M) in Redis's listpack encoding,
                                 kept while a bucket has at most hash-max-listpack-entries
    P:p:{<bucket hex>}<key hex>  string  pending allocation "<batch>:<deadline ms>:<node>";
                                 the batch is a uuid, "-<request id hex>" added if given
    P:n:{<node>}         hash    the node's lease (PX lease TTL): epoch, address, grpc, tiers,
                                 xfer (transfer rates), inst (the store instance owning the id),
                                 held, sync (the node's count and digest check, last heartbeat)
    P:n:{<node>}:reg     hash    its last registration: epoch, chunks (its replica count;
                                 deleted once a reaper counted the registration dead)
    P:n:{<node>}:dg      string  the registration's inventory digest: int64 cells
                                 (BITFIELD), see :mod:`~kvdepot.metadata.index.redis_inventory`
    P:r:{P}:last         string  the last registration epoch handed out (to any node)
    P:r:{P}:map          hash    epoch -> node, of the registrations that may hold replicas
    P:r:{P}:dead         hash    epoch -> "<ended ms> <replicas then> <node>": ended
                                 registrations whose replicas the sweep deletes
    P:r:{P}:swept        hash    epoch -> replicas of it the sweep deleted so far
    P:r:{P}:sweep        string  the sweep's lock (PX): one metadata replica sweeps at a time
    P:cfg                hash    bucket_bits (the first replica sets it; every replica uses it)
    P:nodes              hash    registry: node -> epoch (placement, reaping, stats)
    P:allocs             zset    allocation batches by deadline (to count expired ones)
    P:alloc:<batch>      set     chunk keys of one allocation batch
    P:stats              hash    cluster-wide counters (HINCRBY)

Registration epochs are unique across nodes and never reused (above the clock
in ms, even after an index loss), and a replica counts only while its node's
lease carries its epoch: a lookup never returns a replica of a dead or
replaced registration, even before any reaper ran, and nothing is deleted
when a registration ends. The reaper (:meth:`RedisIndex.expire`) records it
as ended (O(1) a node), and a sweep deletes its replicas later, in bounded
steps (:class:`~kvdepot.metadata.index.redis_layout.Sweeper`). As in the
memory index, ``IndexStats.chunks`` counts the live registrations' replicas.
An inventory arrives in pages (:meth:`RedisIndex.register_page`), each
written in round trips of at most ``_ITEMS_PER_TRIP`` chunks.

PutStart decides each key in Python with the rule both backends share
(:func:`kvdepot.metadata.admission.admit`) on the state read in its first
round trip; the ALLOC script of its second lets one allocation per key win
among racing replicas (the losers: :func:`~kvdepot.metadata.admission.settle_lost`).
A retry of a put whose reply was lost finds its own live allocations by the
request id in their batch name, and gets them again.

Cleanup is idempotent: every metadata replica runs :meth:`RedisIndex.expire`
and they may overlap. An index loss (``FLUSHALL``, a restart without
persistence) deletes the lease with everything else: the next heartbeat
returns False, the store registers again with its inventory, and the index
is rebuilt.

Round trips: a lookup is one (the chunks and the leases of the known nodes),
a put two for ``put_start`` and two for ``put_end``. On a single server a
batch of per-chunk work is one script call with one reply; on a cluster the
same scripts run once per chunk in a pipeline split by node.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from redis.asyncio import Redis, RedisCluster

from kvdepot.errors import InvalidArgument, KVDepotError
from kvdepot.keys import KEY_BYTES, ChunkKey
from kvdepot.metadata.admission import Admission, KeyState, admit, settle_lost
from kvdepot.metadata.index import redis_scripts as scripts
from kvdepot.metadata.index.base import (
    IndexBackend,
    IndexConfig,
    InventoryPage,
    node_id_taken,
)
from kvdepot.metadata.index.redis_client import (
    Connection,
    Counters,
    connect,
    flat,
    guarded,
    split_options,
    split_url,
)
from kvdepot.metadata.index.redis_history import RedisHistory
from kvdepot.metadata.index.redis_inventory import RedisInventory
from kvdepot.metadata.index.redis_layout import (
    DEFAULT_BUCKET_BITS,
    EPOCH_BYTES,
    REPLICA_BYTES,
    SIZE_BYTES,
    Buckets,
    LeaseCache,
    Sweeper,
    batch_id,
    check_bucket_bits,
    epoch_bytes,
    live_replicas,
    ms,
    pending_live,
    record,
    records,
    registration_reply,
    replicas,
    retried,
    tag,
    tier_code,
    tiers_json,
    tiers_parse,
    transfer_parse,
    wall_ms,
)
from kvdepot.metadata.placement import Placement
from kvdepot.metadata.replica_tiers import ReplicaTierIndex
from kvdepot.types import (
    TIER_RANK,
    Action,
    Allocation,
    IndexStats,
    KeyLocation,
    LookupCounting,
    LookupResult,
    NodeId,
    NodeInfo,
    NodeStatus,
    Replica,
)
from kvdepot.wire.digest import words

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_PREFIX", "RedisIndex", "connect", "split_url"]

DEFAULT_PREFIX = "kvd"
# A lookup prefetches the leases of at most this many known nodes in its one
# round trip; with more nodes it fetches those its chunks name (two round trips).
_PREFETCH_NODES = 64
_LEASE_CACHE_S = 0.2  # a lease read this recently is not read again by a lookup
_KNOWN_MAX = 1024
_OWNERS_MAX = 1 << 16
# The counters IndexStats carries, kept in the P:stats hash under these names.
_COUNTERS = tuple(f.name for f in fields(IndexStats) if f.name not in ("nodes", "extra"))
# Chunks of an inventory page written per round trip: each script call holds
# Redis (and every lookup behind it) about a quarter of a millisecond.
_ITEMS_PER_TRIP = 256
# How long one expire() sweeps at most (a step more).
SWEEP_BUDGET_S = 0.2
_CPU = bytes((TIER_RANK["cpu"],))


class RedisIndex(RedisInventory, RedisHistory, IndexBackend, ReplicaTierIndex):
    """The index in Redis or Redis Cluster, shared by any number of metadata replicas.

    Args:
        config: Index configuration; ``config.url`` names the server(s) and may
            carry ``?prefix=…`` and ``?bucket_bits=…`` (8-24, default 17: for
            up to about 10 M chunks; the first replica to use an index sets it
            for all).
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
        url, own = split_options(config.url)
        p = prefix or own.get("prefix") or DEFAULT_PREFIX
        if any(c in p for c in "{} \t\n"):
            raise InvalidArgument(f"index key prefix {p!r} must not contain braces or spaces")
        bits = own.get("bucket_bits")
        self._want_bits = check_bucket_bits(bits) if bits is not None else None
        self._p = p
        self._r = client if client is not None else connect(url)
        self._db = Connection(self._r)
        self._lease_ms = ms(config.lease_ttl_s)
        self._alloc_ms = ms(config.allocation_ttl_s)
        self.placement = Placement(config.placement)  # this replica's view of its puts
        # Redis drops a pending key by itself only if no reaper counted it in
        # time (every metadata replica down): a safety net, not the deadline.
        self._backstop_ms = 2 * self._alloc_ms + 60_000
        self._k_nodes = f"{p}:nodes"
        self._k_stats = f"{p}:stats"
        self._k_allocs = f"{p}:allocs"
        self._k_cfg = f"{p}:cfg"
        regs = f"{p}:r:{{{p}}}"
        self._k_last, self._k_map, self._k_dead = f"{regs}:last", f"{regs}:map", f"{regs}:dead"
        self._k_swept, self._k_sweep = f"{regs}:swept", f"{regs}:sweep"
        self._b: Buckets | None = None  # read from Redis on first use
        self._sweeper: Sweeper | None = None
        self.sweep_budget_s = SWEEP_BUDGET_S
        self._known: dict[NodeId, None] = {}  # nodes whose leases lookups prefetch
        self._lease_cache = LeaseCache(_LEASE_CACHE_S)
        self._owners: dict[int, NodeId] = {}  # registration epoch -> node (never changes)
        self._counters = Counters(
            self._db,
            self._k_stats,
            lambda nid, epoch, n, cells: scripts.NODE_DELTA.cmd(
                self._node_keys(nid), [epoch, n, *cells]
            ),
            logger,
        )
        self._count = self._counters.add
        self._init_history(config)

    # -- keys -----------------------------------------------------------------
    def _node(self, node_id: NodeId, part: str = "") -> str:
        return f"{self._p}:n:{{{tag(node_id)}}}{part}"

    def _node_keys(self, node_id: NodeId) -> list[str]:
        return self._keys3(node_id)  # lease, registration record, digest

    def _bits_cmd(self) -> tuple[Any, ...]:
        bits = self._b.bits if self._b is not None else self._want_bits or DEFAULT_BUCKET_BITS
        return ("HSETNX", self._k_cfg, "bucket_bits", bits)

    async def _layout(self) -> Buckets:
        """The bucket layout every replica of this index uses (Redis keeps it)."""
        if self._b is None:
            _, raw = await self._db.exec([self._bits_cmd(), ("HGET", self._k_cfg, "bucket_bits")])
            bits = check_bucket_bits(raw.decode())
            if self._want_bits is not None and bits != self._want_bits:
                logger.warning(
                    "redis index %s: bucket_bits=%d in the URL, but the index has %d: using %d",
                    self._p,
                    self._want_bits,
                    bits,
                    bits,
                )
            self._b = Buckets(self._p, bits)
            keys = (self._k_last, self._k_map, self._k_dead, self._k_swept, self._k_sweep)
            self._sweeper = Sweeper(self._db, self._b, keys, *self._lost_listener())
        return self._b

    # -- plumbing -------------------------------------------------------------
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

    async def _resolve(self, epochs: set[int]) -> None:
        """Learn the nodes of registration epochs not known yet (a round trip if any)."""
        unknown = [e for e in epochs if e not in self._owners]
        if not unknown:
            return
        if len(self._owners) > _OWNERS_MAX:
            self._owners.clear()
        out = await self._db.one(("HMGET", self._k_map, *unknown))
        for e, nid in zip(unknown, out, strict=True):
            if nid is not None:  # else forgotten: an ended registration
                self._owners[e] = nid.decode()

    # -- nodes ----------------------------------------------------------------
    @guarded
    async def register_begin(
        self,
        node: NodeInfo,
        now: float,
        instance: str = "",
        force: bool = False,
    ) -> int:
        await self._layout()
        nid = node.node_id
        args = [
            self._lease_ms,
            node.address,
            node.grpc_address,
            tiers_json(node.tiers),
            instance,
            "1" if force else "0",
        ]
        floor = 0
        for _ in range(3):
            # The bucket layout is asserted again: an index rebuilt after a loss keeps it.
            _, raw = await self._db.exec(
                [self._bits_cmd(), scripts.REG_NEW.cmd([self._k_last, self._k_map], [nid, floor])]
            )
            epoch = int(raw)
            reply = await self._db.one(scripts.REGISTER.cmd(self._node_keys(nid), [*args, epoch]))
            code = int(reply[0])
            if code in (0, 3):  # never used: no replica can name it
                await self._db.one(("HDEL", self._k_map, epoch))
            if code == 0:
                raise node_id_taken(nid, reply[1].decode(), max(0, int(reply[2])) / 1000)
            if code != 3:
                break
            floor = int(reply[1])  # the node's own last epoch is ahead of the counter
        else:
            raise KVDepotError(f"no new registration epoch for node {nid!r}")
        old, count, took = reply[1], int(reply[2]), reply[3]
        if code == 2:
            logger.warning(
                "node %s taken over (forced) from the instance at %s", nid, took.decode()
            )
        if old:
            # Recorded before the registry moves on: a reaper that finds the
            # registry behind the lease records it too (if this call dies here).
            await self._db.one(scripts.DEAD_ADD.cmd([self._k_dead], [old, count, nid]))
        await self._db.one(scripts.NODES_SET.cmd([self._k_nodes], [nid, epoch]))
        self._owners[epoch] = nid
        self._remember([nid])
        self._lease_cache.drop(nid)
        self.placement.joined(nid)
        logger.debug("node %s registering at %s (epoch %d)", nid, node.address, epoch)
        return epoch

    @guarded
    async def register_page(
        self, node_id: NodeId, epoch: int, page: InventoryPage, now: float, last: bool = False
    ) -> tuple[int, int]:
        b = await self._layout()
        keys = self._node_keys(node_id)
        # The lease is checked and renewed as the page starts, with every
        # round trip (a slow page does not let it run out), and as it ends.
        renew = scripts.PAGE.cmd(keys, [epoch, self._lease_ms, 0])
        registration_reply(node_id, epoch, await self._db.one(renew))
        reg = epoch_bytes(epoch)
        added = 0
        for start in range(0, len(page), _ITEMS_PER_TRIP):
            end = min(len(page), start + _ITEMS_PER_TRIP)
            names, fields = b.columns(page.keys[start * KEY_BYTES : end * KEY_BYTES])
            calls = self._db.cols(
                scripts.PAGE_ADD,
                [[n] for n in names],
                [reg, b.width],
                [
                    (fields, b.width),
                    (records(page.sizes[start:end]), SIZE_BYTES),
                    (page.tiers[start:end].tobytes(), 1),
                ],
            )
            # One round trip of at most _ITEMS_PER_TRIP chunks, under a deadline.
            out = await self._db.exec([renew, *calls])
            new = [i for i, r in enumerate(flat(out[1:])) if r & 1]
            added += len(new)
            self._counters.add_keys(node_id, epoch, words(page.keys)[start:end][new])
            if int(out[0][0]) != 1:
                break  # the lease ran out or was replaced: the PAGE below says which
        delta = added + self._counters.take_node(node_id, epoch)
        reply = await self._db.one(scripts.PAGE.cmd(keys, [epoch, self._lease_ms, delta]))
        return added, registration_reply(node_id, epoch, reply)

    async def _live_epoch(self, node_id: NodeId) -> int | None:
        epoch = await self._db.one(("HGET", self._node(node_id), "epoch"))
        return int(epoch) if epoch is not None else None

    @guarded
    async def set_replica_tier(self, node_id: NodeId, keys: Sequence[ChunkKey], tier: str) -> int:
        code = tier_code(tier)
        if not keys:
            return 0
        b = await self._layout()
        epoch = await self._live_epoch(node_id)
        if epoch is None:
            return 0
        calls = self._db.cols(
            scripts.RETIER,
            [[b.bucket(k)] for k in keys],
            [epoch_bytes(epoch), code, b.width],
            [(b"".join(b.field(k) for k in keys), b.width)],
        )
        return sum(flat(await self._db.exec(calls)))

    @guarded
    async def remove_replicas(self, node_id: NodeId, keys: Sequence[ChunkKey]) -> int:
        if not keys:
            return 0
        b = await self._layout()
        epoch = await self._live_epoch(node_id)
        if epoch is None:
            return 0
        times = Counter(bytes(k) for k in keys)
        uniq = list(times)
        calls = self._db.cols(
            scripts.DROP,
            [[b.bucket(k)] for k in uniq],
            [epoch_bytes(epoch), b.width],
            [(b"".join(b.field(k) for k in uniq), b.width)],
        )
        out = flat(await self._db.exec(calls))
        self._counters.add_node(node_id, epoch, -sum(1 for r in out if r))
        gone = b"".join(k for k, r in zip(uniq, out, strict=True) if r)
        self._counters.add_keys(node_id, epoch, words(gone), -1)
        # As many as it held, a key named twice counted twice.
        return sum(times[k] for k, r in zip(uniq, out, strict=True) if r)

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
                    tiers_parse(tiers),
                )
                live[nid] = (epoch or b"0", info)
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
        b = await self._layout()
        request_hex = request_id.hex().encode()
        states, nodes, now_ms = await self._put_state(b, keys, request_hex)
        decided = admit(keys, sizes, states, nodes, writer_node_id, self.placement)
        dedup, saved = decided.deduplicated, decided.bytes_saved
        lost = (
            await self._allocate(b, keys, decided, request_id, now_ms) if decided.placements else []
        )
        values: list[bytes | None] = [None] * len(lost)
        if request_id and lost:
            # A first attempt of this put, slow rather than dead, may have
            # allocated the key between the state read and ALLOC.
            values = await self._db.read([("GET", b.pending(keys[i])) for i in lost])
        for i, value in zip(lost, values, strict=True):
            answer = decided.allocations[i] = settle_lost(
                retried(value, request_hex, now_ms), nodes
            )
            if answer.action is Action.SKIP_PENDING:
                dedup, saved = dedup + 1, saved + sizes[i]
        self._count(chunks_deduplicated=dedup, bytes_saved=saved)
        return [a for a in decided.allocations if a is not None]

    async def _put_state(
        self, b: Buckets, keys: Sequence[ChunkKey], request_hex: bytes
    ) -> tuple[list[KeyState], dict[NodeId, NodeInfo], int]:
        """The state of ``keys`` and the live nodes, read in one round trip, and the time."""
        uniq = list(dict.fromkeys(keys))
        u = len(uniq)
        known = list(self._known)
        # One round trip: chunks, pending allocations, the registry, leases.
        out = await self._db.read(
            [("HGET", b.bucket(k), b.field(k)) for k in uniq]
            + [("GET", b.pending(k)) for k in uniq]
            + [("HKEYS", self._k_nodes)]
            + [("HMGET", self._node(n), "epoch", "address", "grpc", "tiers") for n in known]
        )
        prefetched = {
            n: (r if r[0] is not None else None)
            for n, r in zip(known, out[2 * u + 1 :], strict=True)
        }
        live = await self._live_nodes(out[2 * u], prefetched)
        # Epochs are unique across nodes: a replica is live if its epoch is a lease's.
        epochs = {int(epoch) for epoch, _ in live.values()}
        now_ms = wall_ms()
        state: dict[ChunkKey, KeyState] = {}
        for key, chunk, value in zip(uniq, out[:u], out[u : 2 * u], strict=True):
            if chunk is not None and any(e in epochs for e, _ in replicas(chunk)):
                state[key] = KeyState(exists=True)
            else:
                state[key] = KeyState(
                    pending=pending_live(value, now_ms),
                    retried=retried(value, request_hex, now_ms),
                )
        nodes = {nid: info for nid, (_, info) in live.items()}
        return [state[k] for k in keys], nodes, now_ms

    async def _allocate(
        self,
        b: Buckets,
        keys: Sequence[ChunkKey],
        decided: Admission,
        request_id: bytes,
        now_ms: int,
    ) -> list[int]:
        """Allocate the keys ``decided`` places; return those another put won.

        Atomic per key: of all replicas racing for a key, one script call wins
        it; the others settle it with :func:`settle_lost`.
        """
        wanted = decided.placements
        batch = batch_id(request_id)
        members = f"{self._p}:alloc:{batch}"
        # Same slot as the ALLOC of the key, so it runs first, on a cluster too.
        revokes = [
            c
            for nid, ks in decided.revoked.items()
            for c in self._db.vec(scripts.REVOKE, [[b.pending(k)] for k in ks], [nid])
        ]
        calls = self._db.vec(
            scripts.ALLOC,
            [[b.pending(keys[i])] for i, _ in wanted],
            [batch, self._alloc_ms, self._backstop_ms],
            [(n.node_id,) for _, n in wanted],
        )
        out = await self._db.exec(
            [
                *revokes,
                *calls,
                ("SADD", members, *(bytes(keys[i]) for i, _ in wanted)),
                ("PEXPIRE", members, self._backstop_ms),
                ("ZADD", self._k_allocs, now_ms + self._alloc_ms, batch),
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
        b = await self._layout()
        epoch = await self._live_epoch(node_id)
        if epoch is None:
            # The node died meanwhile: its bytes are gone with it.
            await self._db.exec(
                self._db.vec(scripts.REVOKE, [[b.pending(k)] for k in keys], [node_id])
            )
            return 0
        calls = self._db.cols(
            scripts.COMMIT,
            [[b.bucket(k), b.pending(k)] for k in keys],
            [node_id, epoch_bytes(epoch), _CPU, b.width],
            [
                (b"".join(b.field(k) for k in keys), b.width),
                (b"".join(record(s) for s in sizes), SIZE_BYTES),
            ],
        )
        committed = nbytes = 0
        new = []
        for i, (r, size) in enumerate(zip(flat(await self._db.exec(calls)), sizes, strict=True)):
            if r & 1:
                committed += 1
                nbytes += size
                new.append(keys[i])
        self._count(puts_committed=committed, bytes_committed=nbytes)
        self._counters.add_node(node_id, epoch, committed)
        self._counters.add_keys(node_id, epoch, words(b"".join(new)))
        return committed

    @guarded
    async def put_revoke(self, node_id: NodeId, keys: Sequence[ChunkKey]) -> int:
        b = await self._layout()
        calls = self._db.vec(scripts.REVOKE, [[b.pending(k)] for k in keys], [node_id])
        done = [k for k, r in zip(keys, flat(await self._db.exec(calls)), strict=True) if r]
        await self._history.record(node_id, done, "revoked")
        self.placement.failed(node_id, len(done))  # the writer could not write there
        return len(done)

    # -- lookup ---------------------------------------------------------------
    @guarded
    async def lookup(
        self,
        keys: Sequence[ChunkKey],
        client_node_id: NodeId,
        counting: LookupCounting | int = 0,
    ) -> LookupResult:
        b = await self._layout()
        leases, known = self._lease_cache.split(list(self._known))
        known = known[:_PREFETCH_NODES]
        # One round trip: every chunk's record and the leases of the known nodes
        # not read lately, together, so that a lease gone makes its replicas vanish.
        out = await self._db.read(
            [("HGET", b.bucket(k), b.field(k)) for k in keys]
            + [("HMGET", self._node(n), "epoch", "address") for n in known]
        )
        values: list[bytes] = []
        for v in out[: len(keys)]:
            if v is None:
                break  # only the leading hits matter
            values.append(v)
        tail = out[len(keys) :]
        read = {n: (r if r[0] is not None else None) for n, r in zip(known, tail, strict=True)}
        # The same few replica lists recur across all the keys: each is read once.
        tails = {v[SIZE_BYTES:] for v in values}
        epochs = {
            int.from_bytes(t[i : i + EPOCH_BYTES], "big")
            for t in tails
            for i in range(0, len(t), REPLICA_BYTES)
        }
        await self._resolve(epochs)
        named = {self._owners[e] for e in epochs if e in self._owners}
        leases.update(read)
        read.update(await self._leases(sorted(named.difference(leases)), ("epoch", "address")))
        self._lease_cache.put(read)
        leases.update(read)
        made = {t: live_replicas(t, leases, self._owners, client_node_id) for t in tails}
        locations: list[KeyLocation] = []
        for v in values:
            found = made[v[SIZE_BYTES:]]
            if not found:
                break
            locations.append(KeyLocation(int.from_bytes(v[:SIZE_BYTES], "big"), found))
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
        """Reap dead nodes and expired allocations, then sweep a while.

        Bounded: a dead registration is recorded as ended at once (its
        replicas stop counting as its lease goes, and the sweep deletes them
        later); allocations go 1024 batches a call; the sweep runs for
        :attr:`sweep_budget_s` at most, a step of about 64 buckets more.
        """
        await self._layout()
        registry, due = await self._db.exec(
            [
                ("HGETALL", self._k_nodes),
                ("ZRANGEBYSCORE", self._k_allocs, "-inf", wall_ms(), "LIMIT", 0, 1024),
            ]
        )
        nodes_expired = await self._reap({n.decode(): int(e) for n, e in registry.items()})
        allocations_expired = await self._expire_allocations(due) if due else 0
        self._count(nodes_expired=nodes_expired, allocations_expired=allocations_expired)
        assert self._sweeper is not None
        await self._sweeper.run(self.sweep_budget_s)
        return nodes_expired, allocations_expired

    async def _reap(self, registry: dict[NodeId, int]) -> int:
        """Record the ended registrations the registry names; returns the
        nodes found dead (each counted by one replica only)."""
        ids = list(registry)
        self._remember(ids)
        out = await self._db.exec(
            [
                c
                for n in ids
                for c in (
                    ("HGET", self._node(n), "epoch"),
                    ("HMGET", self._node(n, ":reg"), "epoch", "chunks"),
                )
            ]
        )
        expired = 0
        for nid, lease, (rec_epoch, rec_chunks) in zip(ids, out[::2], out[1::2], strict=True):
            epoch = registry[nid]
            if rec_epoch is not None and int(rec_epoch) != epoch:
                # The registry is behind (a registration cut short between its
                # steps): the registration it names has ended.
                await self._db.one(scripts.DEAD_ADD.cmd([self._k_dead], [epoch, -1, nid]))
                await self._db.one(scripts.NODES_SET.cmd([self._k_nodes], [nid, rec_epoch]))
                epoch = int(rec_epoch)
            if lease is not None:
                continue  # live: the lease and the record carry one epoch
            count = int(rec_chunks) if rec_chunks is not None else -1
            await self._db.one(scripts.DEAD_ADD.cmd([self._k_dead], [epoch, count, nid]))
            reaped = int(await self._db.one(scripts.REAP.cmd(self._node_keys(nid), [epoch])))
            await self._db.one(scripts.NODES_DEL.cmd([self._k_nodes], [nid, epoch]))
            if reaped >= 0:
                expired += 1
                logger.warning(
                    "node %s lease expired: dropped with %d chunks (its replicas are "
                    "swept from the index in the background)",
                    nid,
                    reaped,
                    extra={"event": "node_expired", "node": nid, "chunks": reaped},
                )
        return expired

    async def _expire_allocations(self, due: Sequence[bytes]) -> int:
        b = await self._layout()
        # ZREM decides which replica handles (and counts) each batch.
        won = await self._db.exec([("ZREM", self._k_allocs, batch) for batch in due])
        claimed = [batch.decode() for batch, w in zip(due, won, strict=True) if w]
        sets = [f"{self._p}:alloc:{batch}" for batch in claimed]
        members = await self._db.exec([("SMEMBERS", s) for s in sets])
        calls = [
            c
            for batch, ks in zip(claimed, members, strict=True)
            for c in self._db.vec(scripts.EXPIRE_ALLOC, [[b.pending(k)] for k in ks], [batch])
        ]
        out = await self._db.exec([*calls, *(("DEL", s) for s in sets)])
        # Nodes of the allocations that expired, key by key, in the calls' order.
        nodes = [r for reply in out[: len(calls)] for r in reply]
        keys = [k for ks in members for k in ks]
        lapsed: dict[str, list[ChunkKey]] = {}
        for key, node in zip(keys, nodes, strict=True):
            if node != 0:
                name = node.decode() if isinstance(node, bytes) else str(node)
                lapsed.setdefault(name, []).append(ChunkKey(bytes(key)))
        for node_id, ks in lapsed.items():
            await self._history.record(NodeId(node_id), ks, "expired")
        return sum(len(ks) for ks in lapsed.values())

    @guarded
    async def stats(self, now: float) -> IndexStats:
        await self._counters.sync()
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
                    ("HMGET", self._node(n, ":reg"), "epoch", "chunks"),
                )
            ]
        )
        nodes = []
        for i, nid in enumerate(ids):
            lease, pttl, (epoch, count) = out[3 * i : 3 * i + 3]
            if not lease:
                continue  # dead, not reaped yet
            info = NodeInfo(
                nid,
                lease.get(b"address", b"").decode(),
                lease.get(b"grpc", b"").decode(),
                tiers_parse(lease.get(b"tiers")),
                transfer_parse(lease.get(b"xfer")),
            )
            chunks = int(count or 0) if epoch == lease.get(b"epoch") else 0
            held = lease.get(b"held")
            nodes.append(
                NodeStatus(
                    info,
                    max(0, chunks),
                    max(0.0, int(pttl) / 1000),
                    int(held) if held is not None else None,
                    lease.get(b"sync") == b"1",
                )
            )
        c: dict[str, Any] = {n: int(counters.get(n.encode(), 0)) for n in _COUNTERS}
        # As the memory index: the replicas of the live registrations.
        c["chunks"] = sum(n.chunks_indexed for n in nodes)
        return IndexStats(nodes=tuple(nodes), **c)

    async def close(self) -> None:
        """Flush the counters still buffered and close the connection pool."""
        try:
            await self._counters.sync()
        finally:
            await self._r.aclose()
