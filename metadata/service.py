"""The gRPC ``Metadata`` service over an index backend (``grpc.aio``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import grpc
import numpy as np

from kvdepot.errors import (
    InvalidArgument,
    KVDepotError,
    NodeIdTaken,
    NotFound,
    StaleRegistration,
    Unavailable,
)
from kvdepot.keys import KEY_BYTES, ChunkKey, validate_keys
from kvdepot.metadata import reconcile
from kvdepot.metadata.config import MetadataConfig
from kvdepot.metadata.events import EventsConfig, KVEventPublisher
from kvdepot.metadata.explain import ExplainRPCs
from kvdepot.metadata.frames import FrameServer
from kvdepot.metadata.hot_keys import HotKeys, HotKeysConfig
from kvdepot.metadata.index import IndexBackend, IndexConfig, create_backend
from kvdepot.metadata.index.base import InventoryPage
from kvdepot.metadata.index.departures import DepartureConfig, check_reason
from kvdepot.metadata.namespaces import (
    NamespaceRPCs,
    NamespaceTally,
    check_namespace,
    lookup_deltas,
    namespace_stats,
)
from kvdepot.metadata.placement import PlacementConfig
from kvdepot.metadata.replica_tiers import record_moves
from kvdepot.metadata.routing import Candidate, RoutingWeights, best, score_candidates
from kvdepot.metrics import ClusterCollector, MetricsServer, on_loop
from kvdepot.proto.gen import common_pb2, metadata_pb2, metadata_pb2_grpc
from kvdepot.repeat_log import RepeatLog
from kvdepot.rpc.health import HealthState
from kvdepot.rpc.request_guard import abort_with
from kvdepot.rpc.security import add_port, aio_server
from kvdepot.rpc.security_config import NO_SECURITY, SecurityConfig
from kvdepot.shutdown import cancel_and_wait
from kvdepot.types import (
    COUNT_NONE,
    LEASE_REMAINING_KEY,
    TIER_BY_CODE,
    Action,
    IndexStats,
    InventoryItem,
    LookupCounting,
    NodeInfo,
    Replica,
)
from kvdepot.validation import (
    check_address,
    check_request_id,
    check_sizes,
    check_text,
    check_tier,
    check_tier_stats,
    check_transfer,
)
from kvdepot.wire import frames
from kvdepot.wire.lookup import pack_lookup
from kvdepot.wire.records import (
    tier_stats_from_proto,
    tier_stats_to_proto,
    transfer_from_proto,
    transfer_to_proto,
)

logger = logging.getLogger(__name__)

_REFUSAL_LOG_S = 10.0
"""One log line per refused store (node id and address) this often at most."""

_FAILURES = (KVDepotError, Unavailable)

_ACTIONS = {
    Action.WRITE: metadata_pb2.Allocation.WRITE,
    Action.SKIP_EXISTS: metadata_pb2.Allocation.SKIP_EXISTS,
    Action.SKIP_PENDING: metadata_pb2.Allocation.SKIP_PENDING,
}


def _replica_pb(r: Replica) -> common_pb2.Replica:
    return common_pb2.Replica(node_id=r.node_id, address=r.address, tier=r.tier)


def stats_to_proto(
    s: IndexStats, namespaces: Sequence[metadata_pb2.NamespaceStats] = ()
) -> metadata_pb2.ClusterStats:
    return metadata_pb2.ClusterStats(
        nodes=[
            metadata_pb2.NodeStats(
                node_id=n.info.node_id,
                address=n.info.address,
                grpc_address=n.info.grpc_address,
                tiers=tier_stats_to_proto(n.info.tiers),
                chunks_indexed=n.chunks_indexed,
                lease_remaining_s=n.lease_remaining_s,
                transfer=transfer_to_proto(n.info.transfer),
                chunks_held=n.chunks_held,
                in_sync=n.in_sync,
            )
            for n in s.nodes
        ],
        chunks=s.chunks,
        lookups=s.lookups,
        hit_keys=s.hit_keys,
        miss_keys=s.miss_keys,
        hit_tokens=s.hit_tokens,
        miss_tokens=s.miss_tokens,
        puts_committed=s.puts_committed,
        chunks_deduplicated=s.chunks_deduplicated,
        bytes_saved=s.bytes_saved,
        bytes_committed=s.bytes_committed,
        nodes_expired=s.nodes_expired,
        allocations_expired=s.allocations_expired,
        served_tokens=sum(n.served_tokens for n in namespaces),
        namespaces=namespaces,
    )


class MetadataServicer(metadata_pb2_grpc.MetadataServicer):
    """Validates requests, calls the index, maps errors to gRPC statuses."""

    def __init__(
        self,
        index: IndexBackend,
        config: MetadataConfig,
        events: KVEventPublisher | None = None,
    ) -> None:
        self._index = index
        self.tally = NamespaceTally(index)
        self._events = events
        self._config = config
        self._hot = HotKeys(
            HotKeysConfig(
                hot_reads=config.hot_reads,
                max_replicas=config.hot_max_replicas,
                window_s=config.hot_window_s,
            )
        )
        # (node id, address) -> when its refused registration was last logged:
        # a store waiting out a lease retries twice a second.
        self._refusals_logged: dict[tuple[str, str], float] = {}
        # While the index backend is down every call fails the same way.
        self.failures = RepeatLog(logger)
        # Lookup and PutStart replies name the framed socket's port, if any.
        self.advertised: tuple[tuple[str, str], ...] = ()
        self._namespaces = NamespaceRPCs(index, self.tally, self._guard)
        self._explain = ExplainRPCs(index, self._guard)

    def _log_refusal(self, node_id: str, address: str, exc: NodeIdTaken) -> None:
        now = time.monotonic()
        key = (node_id, address)
        if now - self._refusals_logged.get(key, -_REFUSAL_LOG_S) < _REFUSAL_LOG_S:
            return
        if len(self._refusals_logged) > 1024:
            self._refusals_logged.clear()
        self._refusals_logged[key] = now
        logger.warning("refused the registration of a store at %s: %s", address, exc)

    # -- validation -------------------------------------------------------
    def _keys(self, keys: Sequence[bytes]) -> list[ChunkKey]:
        if len(keys) > self._config.max_keys_per_request:
            raise InvalidArgument(
                f"{len(keys)} keys in one request; the limit is {self._config.max_keys_per_request}"
            )
        return validate_keys(keys)

    @staticmethod
    def _sizes(keys: Sequence[ChunkKey], sizes: Sequence[int]) -> list[int]:
        return check_sizes(sizes, len(keys))

    @staticmethod
    def _node_id(node_id: str, required: bool = True) -> str:
        return check_text(node_id, "node_id", required=required)

    async def _guard(
        self,
        context: grpc.aio.ServicerContext,
        exc: KVDepotError,
        trailing: tuple[tuple[str, str], ...] = (),
    ) -> None:
        # Unavailable (the index backend down, no store to place on) and
        # errors of no subclass (the backend's own) are the service's failures,
        # worth an operator's look; the others answer a request.
        if type(exc) in _FAILURES:
            self.failures.warn(
                type(exc).__name__,
                "metadata calls failing: %s",
                exc,
                extra={"event": "repeated_failure"},
            )
        await abort_with(context, exc, trailing)

    # -- RPCs ---------------------------------------------------------------
    async def RegisterNamespace(
        self, request: metadata_pb2.RegisterNamespaceRequest, context: grpc.aio.ServicerContext
    ) -> metadata_pb2.RegisterNamespaceResponse:
        return await self._namespaces.RegisterNamespace(request, context)

    async def ListNamespaces(
        self, request: metadata_pb2.ListNamespacesRequest, context: grpc.aio.ServicerContext
    ) -> metadata_pb2.ListNamespacesResponse:
        return await self._namespaces.ListNamespaces(request, context)

    async def ReportUsage(
        self, request: metadata_pb2.ReportUsageRequest, context: grpc.aio.ServicerContext
    ) -> metadata_pb2.ReportUsageResponse:
        return await self._namespaces.ReportUsage(request, context)

    async def Explain(
        self, request: metadata_pb2.ExplainRequest, context: grpc.aio.ServicerContext
    ) -> metadata_pb2.ExplainResponse:
        return await self._explain.Explain(request, context)

    async def RegisterNode(
        self, request: metadata_pb2.RegisterNodeRequest, context: grpc.aio.ServicerContext
    ) -> metadata_pb2.RegisterNodeResponse:
        try:
            node_id = self._node_id(request.node_id)
            check_address(request.address, "address")
            check_address(request.grpc_address, "grpc_address", required=False)
            instance = check_text(request.instance_id, "instance_id", required=False)
            check_tier_stats(request.tiers)
            if request.paged and request.inventory:
                raise InvalidArgument("a paged registration carries no inventory of its own")
            pages = self._inventory_pages(request.inventory)
            info = NodeInfo(
                node_id, request.address, request.grpc_address, tier_stats_from_proto(request.tiers)
            )
            epoch = await self._index.register_begin(
                info, time.monotonic(), instance, request.force
            )
            if request.paged and self._events is not None:
                self._events.registered(node_id, ())  # its pages follow as BlockStored
            # An inventory in the message (a store that does not page) is
            # indexed page by page like a paged one, then completed, and
            # announced in one event batch as before.
            for page in pages:
                await self._register_page(node_id, epoch, page, last=False, events=False)
            if not request.paged:
                empty = InventoryPage.of(b"", ())
                await self._register_page(node_id, epoch, empty, last=True, events=False)
                if self._events is not None:
                    self._events.registered(
                        node_id, [(i.key, i.tier) for p in pages for i in p.items()]
                    )
        except NodeIdTaken as exc:
            self._log_refusal(request.node_id, request.address, exc)
            # Tells the refused store whether the holder is renewing its lease.
            remaining_ms = str(int(exc.lease_remaining_s * 1000))
            await self._guard(context, exc, ((LEASE_REMAINING_KEY, remaining_ms),))
        except KVDepotError as exc:
            await self._guard(context, exc)
        return metadata_pb2.RegisterNodeResponse(
            lease_ttl_ms=int(self._config.lease_ttl_s * 1000),
            heartbeat_interval_ms=int(self._config.heartbeat_interval_s * 1000),
            epoch=epoch,
            max_page_chunks=self._config.max_page_chunks,
        )

    def _inventory_pages(self, inventory: Sequence[common_pb2.ChunkRef]) -> list[InventoryPage]:
        """An unpaged registration's inventory, validated, as pages."""
        keys = validate_keys([c.key for c in inventory])
        check_sizes([c.size for c in inventory], len(keys))
        step = self._config.max_page_chunks
        pages = []
        for start in range(0, len(keys), step):
            refs = inventory[start : start + step]
            pages.append(
                InventoryPage.from_items(
                    [
                        InventoryItem(k, c.size, check_tier(c.tier or "cpu"))
                        for k, c in zip(keys[start : start + step], refs, strict=True)
                    ]
                )
            )
        return pages

    async def _register_page(
        self, node_id: str, epoch: int, page: InventoryPage, *, last: bool, events: bool = True
    ) -> tuple[int, int]:
        added, chunks = await self._index.register_page(
            node_id, epoch, page, time.monotonic(), last
        )
        if events and self._events is not None and len(page):
            for code in np.unique(page.tiers).tolist():
                tier = TIER_BY_CODE[code]
                rows = np.flatnonzero(page.tiers == code).tolist()
                self._events.stored(node_id, [page.key(i) for i in rows], tier)
        if last:
            logger.info(
                "node %s registered with %d chunks (epoch %d)",
                node_id,
                chunks,
                epoch,
                extra={"event": "node_registered", "node": node_id, "chunks": chunks},
            )
        return added, chunks

    async def RegisterInventory(
        self, request: metadata_pb2.RegisterInventoryRequest, context: grpc.aio.ServicerContext
    ) -> metadata_pb2.RegisterInventoryResponse:
        try:
            node_id = self._node_id(request.node_id)
            if not request.epoch:
                raise InvalidArgument("an inventory page needs the epoch RegisterNode answered")
            count = len(request.keys) // KEY_BYTES
            if count > self._config.max_page_chunks:
                raise InvalidArgument(
                    f"{count} chunks in one inventory page; the limit is "
                    f"{self._config.max_page_chunks} (RegisterNodeResponse.max_page_chunks)"
                )
            page = InventoryPage.of(request.keys, request.sizes, request.tiers)
            added, chunks = await self._register_page(
                node_id, request.epoch, page, last=request.last
            )
        except StaleRegistration as exc:
            logger.warning("refused an inventory page: %s", exc)
            await self._guard(context, exc)
        except KVDepotError as exc:
            await self._guard(context, exc)
        return metadata_pb2.RegisterInventoryResponse(
            added=added, lease_ttl_ms=int(self._config.lease_ttl_s * 1000), chunks=chunks
        )

    async def Heartbeat(
        self, request: metadata_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> metadata_pb2.HeartbeatResponse:
        try:
            node_id = self._node_id(request.node_id)
            check_tier_stats(request.tiers)
            transfer = None
            if request.HasField("transfer"):
                t = request.transfer
                check_transfer(t)
                transfer = transfer_from_proto(t)
            tiers = tier_stats_from_proto(request.tiers)
            # With the node's inventory digest, compared with the index's.
            known, reply = await reconcile.heartbeat(self._index, request, tiers, transfer)
        except StaleRegistration as exc:
            logger.warning("refused a heartbeat: %s", exc)
            await self._guard(context, exc)
        except KVDepotError as exc:
            await self._guard(context, exc)
        if not known:
            await abort_with(context, NotFound(f"node {node_id} is not registered"))
        reply.lease_ttl_ms = int(self._config.lease_ttl_s * 1000)
        return reply

    async def ReconcileDigests(
        self, request: metadata_pb2.ReconcileDigestsRequest, context: grpc.aio.ServicerContext
    ) -> metadata_pb2.ReconcileDigestsResponse:
        try:
            reply = await reconcile.reconcile_digests(self._index, request)
        except KVDepotError as exc:
            await self._guard(context, exc)
        return reply

    async def ReconcileBuckets(
        self, request: metadata_pb2.ReconcileBucketsRequest, context: grpc.aio.ServicerContext
    ) -> metadata_pb2.ReconcileBucketsResponse:
        try:
            reply = await reconcile.reconcile_buckets(self._index, request, self._events)
        except KVDepotError as exc:
            await self._guard(context, exc)
        return reply

    async def ReportRemoved(
        self, request: metadata_pb2.ReportRemovedRequest, context: grpc.aio.ServicerContext
    ) -> metadata_pb2.ReportRemovedResponse:
        try:
            node_id = self._node_id(request.node_id)
            gone = self._keys(request.keys)
            reason = check_reason(request.reason)
            tier = check_tier(request.tier) if request.tier else ""
            removed = await self._index.remove_replicas(node_id, gone)
            if removed and self._events is not None:
                self._events.removed(node_id, gone)
            if removed:
                await self._index.departures.record(node_id, gone, reason, tier)
        except KVDepotError as exc:
            await self._guard(context, exc)
        return metadata_pb2.ReportRemovedResponse(removed=removed)

    async def ReportMoved(
        self, request: metadata_pb2.ReportMovedRequest, context: grpc.aio.ServicerContext
    ) -> metadata_pb2.ReportMovedResponse:
        try:
            node_id = self._node_id(request.node_id)
            keys = self._keys(request.keys)
            moved, recorded = await record_moves(self._index, node_id, keys, request.tier)
        except KVDepotError as exc:
            await self._guard(context, exc)
        return metadata_pb2.ReportMovedResponse(moved=moved, recorded=recorded)

    async def PutStart(
        self, request: metadata_pb2.PutStartRequest, context: grpc.aio.ServicerContext
    ) -> metadata_pb2.PutStartResponse:
        committed = False
        try:
            keys = self._keys(request.keys)
            sizes = self._sizes(keys, request.sizes)
            writer = self._node_id(request.writer_node_id, required=bool(request.written))
            request_id = check_request_id(request.request_id)
            written = self._written(keys, request.written)
            if written and len(written) == len(keys):
                # A store's own index commit (every chunk in its store already).
                allocations, n = await self._index.commit_written(
                    writer, keys, sizes, time.monotonic(), request_id
                )
                committed = await self._stored(writer, keys, n)
            else:
                allocations = await self._index.put_start(
                    keys, sizes, writer, time.monotonic(), request_id
                )
                if written:
                    committed = await self._commit_written(writer, keys, sizes, written)
        except KVDepotError as exc:
            await self._guard(context, exc)
        if self.advertised:
            context.set_trailing_metadata(self.advertised)
        return metadata_pb2.PutStartResponse(
            allocations=[
                metadata_pb2.Allocation(
                    action=_ACTIONS[a.action],
                    node=_replica_pb(a.node) if a.node is not None else None,
                )
                for a in allocations
            ],
            allocation_ttl_ms=int(self._config.allocation_ttl_s * 1000),
            written_committed=committed,
        )

    @staticmethod
    def _written(keys: Sequence[ChunkKey], written: Sequence[bool]) -> list[int]:
        """Indexes of the keys a PutStart says are written already."""
        if written and len(written) != len(keys):
            raise InvalidArgument(f"{len(keys)} keys but {len(written)} written flags")
        return [i for i, w in enumerate(written) if w]

    async def _commit_written(
        self, writer: str, keys: Sequence[ChunkKey], sizes: Sequence[int], written: list[int]
    ) -> bool:
        # Their bytes are readable on the writer's store already: commit them
        # as PutEnd does, after admission counted what was stored before (a
        # key stored elsewhere gets this node as one more replica: its bytes
        # are here anyway, and never crossed the network).
        done = [keys[i] for i in written]
        n = await self._index.put_end(writer, done, [sizes[i] for i in written])
        return await self._stored(writer, done, n)

    async def _stored(self, writer: str, keys: Sequence[ChunkKey], committed: int) -> bool:
        """Whether the written chunks are the writer's replicas in the index
        now (``committed`` of them new ones); the KV events say so."""
        if committed:
            if self._events is not None:
                self._events.stored(writer, keys)
            return True
        # None new: the writer is no live node, or this is a retry whose
        # first attempt committed them (a written key is one its store did
        # not hold before), which must not read as "not indexed".
        where = await self._index.probe(keys)
        return bool(keys) and all(
            w is not None and any(r.node_id == writer for r in w.replicas) for w in where
        )

    async def PutEnd(
        self, request: metadata_pb2.PutEndRequest, context: grpc.aio.ServicerContext
    ) -> metadata_pb2.PutEndResponse:
        try:
            node_id = self._node_id(request.node_id)
            keys = self._keys(request.keys)
            sizes = self._sizes(keys, request.sizes)
            committed = await self._index.put_end(node_id, keys, sizes)
            if committed and self._events is not None:
                self._events.stored(node_id, keys)
        except KVDepotError as exc:
            await self._guard(context, exc)
        return metadata_pb2.PutEndResponse(committed=committed)

    async def PutRevoke(
        self, request: metadata_pb2.PutRevokeRequest, context: grpc.aio.ServicerContext
    ) -> metadata_pb2.PutRevokeResponse:
        try:
            node_id = self._node_id(request.node_id)
            revoked = await self._index.put_revoke(node_id, self._keys(request.keys))
        except KVDepotError as exc:
            await self._guard(context, exc)
        return metadata_pb2.PutRevokeResponse(revoked=revoked)

    async def Lookup(
        self, request: metadata_pb2.LookupRequest, context: grpc.aio.ServicerContext
    ) -> metadata_pb2.LookupResponse:
        try:
            keys = self._keys(request.keys)
            client = self._node_id(request.client_node_id, required=False)
            if request.key_tokens and len(request.key_tokens) != len(keys):
                raise InvalidArgument(f"{len(request.key_tokens)} key_tokens for {len(keys)} keys")
            if not 0 <= int(request.count) <= COUNT_NONE:
                raise InvalidArgument(f"unknown lookup count mode {int(request.count)}")
            counting = LookupCounting(
                request.tokens_per_key, tuple(request.key_tokens), int(request.count)
            )
            namespace = check_namespace(request.namespace)
            result = self._hot.observe(
                keys, await self._index.lookup(keys, client, counting), client
            )
            if namespace:
                self.tally.add(namespace, lookup_deltas(counting.deltas(len(keys), result.hits)))
        except KVDepotError as exc:
            await self._guard(context, exc)
        if self.advertised:
            context.set_trailing_metadata(self.advertised)
        if request.packed:
            return pack_lookup(result)
        return metadata_pb2.LookupResponse(
            hits=result.hits,
            replicate=result.replicate,
            locations=[
                metadata_pb2.KeyLocation(
                    size=loc.size, replicas=[_replica_pb(r) for r in loc.replicas]
                )
                for loc in result.locations
            ],
        )

    async def GetStats(
        self, request: metadata_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> metadata_pb2.ClusterStats:
        try:
            stats = await self._index.stats(time.monotonic())
            namespaces = await namespace_stats(self._index, self.tally)
        except KVDepotError as exc:
            await self._guard(context, exc)
        return stats_to_proto(stats, namespaces)

    async def Route(
        self, request: metadata_pb2.RouteRequest, context: grpc.aio.ServicerContext
    ) -> metadata_pb2.RouteResponse:
        cfg = self._config
        try:
            keys = self._keys(request.keys)
            candidates = [
                Candidate(c.id, self._node_id(c.node_id, required=False), c.load)
                for c in request.candidates
            ]
            weights = RoutingWeights(
                link_bytes_per_s=request.link_bytes_per_s or cfg.route_link_bytes_per_s,
                prefill_tokens_per_s=request.prefill_tokens_per_s or cfg.route_prefill_tokens_per_s,
                load_penalty_s=request.load_penalty_s or cfg.route_load_penalty_s,
            )
            # tokens_per_key=0: the engine's own lookup counts these tokens.
            result = await self._index.lookup(keys, "", 0)
            scores = score_candidates(
                result, len(keys), request.tokens_per_key, candidates, weights
            )
        except KVDepotError as exc:
            await self._guard(context, exc)
        return metadata_pb2.RouteResponse(
            hits=result.hits,
            scores=[
                metadata_pb2.RouteScore(
                    candidate_id=s.candidate_id,
                    local_tokens=s.local_tokens,
                    remote_tokens=s.remote_tokens,
                    none_tokens=s.none_tokens,
                    remote_bytes=s.remote_bytes,
                    estimated_s=s.estimated_s,
                    score=s.score,
                )
                for s in scores
            ],
            best=best(scores),
        )


class LeaseGrace:
    """No lease expires right after this process itself did not run.

    A store's heartbeats reach only a running service: one that was paused
    (SIGSTOP, a stalled host, a long stop-the-world pause) would, on waking,
    find every lease run out and drop every store at once, though none of them
    failed. When the reaper wakes later than it could have by more than half a
    lease, no node expires for one more lease: the live stores heartbeat within
    it, the dead ones expire after it. (With the Redis index, leases expire in
    Redis, which other replicas keep renewing; this covers the embedded index,
    whose leases only this process keeps.)
    """

    def __init__(self, interval_s: float, lease_ttl_s: float) -> None:
        self._late_s = interval_s + lease_ttl_s / 2
        self._lease_ttl_s = lease_ttl_s
        self._last = time.monotonic()
        self._until = 0.0

    def holds(self, now: float) -> bool:
        """Whether expiry waits at ``now`` (one reaper pass)."""
        if now - self._last > self._late_s:
            self._until = now + self._lease_ttl_s
            logger.warning(
                "the metadata service did not run for %.1f s: no store expires for %.1f s",
                now - self._last,
                self._lease_ttl_s,
                extra={"event": "lease_grace", "paused_s": round(now - self._last, 3)},
            )
        self._last = now
        return now < self._until


class MetadataServer:
    """A running metadata service: gRPC server, index, lease reaper.

    Args:
        config: The service's configuration.
        security: Token(s) every call must carry and TLS settings; none by default.
    """

    def __init__(self, config: MetadataConfig, security: SecurityConfig | None = None) -> None:
        self.config = config
        self.security = security or NO_SECURITY
        self.index = create_backend(
            IndexConfig(
                url=config.index,
                lease_ttl_s=config.lease_ttl_s,
                allocation_ttl_s=config.allocation_ttl_s,
                placement=PlacementConfig(
                    warmup_s=config.placement_warmup_s,
                    warmup_share=config.placement_warmup_share,
                    backoff_s=config.placement_backoff_s,
                ),
                departures=DepartureConfig(config.departures_per_node, config.departure_nodes),
                max_namespaces=config.max_namespaces,
            )
        )
        self._server: grpc.aio.Server | None = None
        self._reaper: asyncio.Task[None] | None = None
        self.servicer: MetadataServicer | None = None
        self.port = 0
        self.events: KVEventPublisher | None = None
        self.health: HealthState | None = None
        self.metrics: MetricsServer | None = None
        self.frames: FrameServer | None = None

    async def start(self) -> int:
        """Bind and start serving; returns the bound port."""
        server = aio_server(
            self.security,
            "metadata gRPC",
            options=[
                ("grpc.max_receive_message_length", 64 << 20),
                ("grpc.so_reuseport", 0),
            ],
        )
        self.servicer = MetadataServicer(self.index, self.config, await self._start_events())
        metadata_pb2_grpc.add_MetadataServicer_to_server(self.servicer, server)
        self.health = HealthState(
            server, [metadata_pb2.DESCRIPTOR.services_by_name["Metadata"].full_name], "metadata"
        )
        self.port = add_port(
            server, f"{self.config.host}:{self.config.port}", self.security, "metadata gRPC"
        )
        if self.port == 0:
            raise InvalidArgument(f"cannot bind {self.config.host}:{self.config.port}")
        await server.start()
        await self._start_frames()
        # SERVING while the index backend answers: the reaper checks it.
        await self.health.set(True)
        self._server = server
        if self.config.metrics_port is not None:
            health = self.health
            self.metrics = MetricsServer(
                ClusterCollector(
                    on_loop(asyncio.get_running_loop(), self.cluster_stats), lambda: health.serving
                ),
                self.config.host,
                self.config.metrics_port,
            )
        self._reaper = asyncio.create_task(self._reap_forever())
        logger.info("metadata service listening on %s:%d", self.config.host, self.port)
        return self.port

    async def _reap_forever(self) -> None:
        health = self.health
        assert health is not None
        grace = LeaseGrace(self.config.reap_interval_s, self.config.lease_ttl_s)
        while True:
            await asyncio.sleep(self.config.reap_interval_s)
            if self.servicer is not None:
                self.servicer.failures.flush()
            now = time.monotonic()
            if grace.holds(now):
                continue
            try:
                # Not asyncio.wait_for: in Python 3.11 it swallows a cancellation
                # that lands as the pass completes, and the reaper, stopped, went on.
                async with asyncio.timeout(max(2.0, self.config.lease_ttl_s)):
                    dead, reclaimed = await self.index.expire(now)
                    if self.servicer is not None:
                        await self.servicer.tally.flush()
                if dead and self.events is not None:
                    live = await self.index.stats(time.monotonic())
                    self.events.nodes_gone(n.info.node_id for n in live.nodes)
            except Exception as exc:  # keep reaping whatever one pass hit
                # One warning when the health changes, not a traceback per pass.
                logger.debug("reaper pass failed", exc_info=True)
                await health.set(False, f"index backend: {str(exc) or type(exc).__name__}")
                continue
            await health.set(True, "index backend answers")
            if reclaimed:
                logger.info(
                    "reclaimed %d uncommitted put allocations",
                    reclaimed,
                    extra={"event": "allocations_expired", "allocations": reclaimed},
                )

    @property
    def metrics_port(self) -> int | None:
        """The port of ``/metrics``, or None when the service serves none."""
        return self.metrics.port if self.metrics is not None else None

    async def cluster_stats(self) -> metadata_pb2.ClusterStats:
        """What ``GetStats`` answers (raises when the index backend fails)."""
        stats = await self.index.stats(time.monotonic())
        if self.servicer is None:
            return stats_to_proto(stats)
        return stats_to_proto(stats, await namespace_stats(self.index, self.servicer.tally))

    async def wait(self) -> None:
        assert self._server is not None
        await self._server.wait_for_termination()

    async def stop(self, grace: float = 1.0) -> None:
        if self.metrics is not None:
            await asyncio.to_thread(self.metrics.close)
            self.metrics = None
        if self._reaper is not None:
            await cancel_and_wait([self._reaper], "the metadata service's reaper")
        if self.frames is not None:
            await self.frames.close()
        if self._server is not None:
            await self._server.stop(grace)
        if self.events is not None:
            await self.events.close()
        await self.index.close()

    async def _start_frames(self) -> None:
        if not self.config.frames or self.security.tls_enabled:
            return
        assert self.servicer is not None
        self.frames = FrameServer(self.servicer, self.security.authenticator())
        port = await self.frames.start(self.config.host, self.config.frames_port)
        self.servicer.advertised = ((frames.PORT_KEY, str(port)),)

    async def _start_events(self) -> KVEventPublisher | None:
        if not self.config.kv_events:
            return None
        self.events = KVEventPublisher(
            EventsConfig(
                endpoint=self.config.kv_events,
                replay_endpoint=self.config.kv_events_replay,
                block_size=self.config.kv_events_block_size,
            )
        )
        await self.events.start()
        return self.events
