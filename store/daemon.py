"""The store daemon: DRAM tier, data-plane server, gRPC stats, metadata lease.

Concurrency: the data plane runs on its own threads (blocking sockets release
the GIL); the control plane (gRPC server, heartbeats, removal reports) runs on
one asyncio loop. Evictions cross from data-plane threads to the loop through
``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import grpc

from kvdepot.endpoints import parse_endpoints
from kvdepot.errors import InvalidArgument, Unavailable
from kvdepot.keys import ChunkKey, validate_keys
from kvdepot.metadata_client import MetadataClient
from kvdepot.metrics import MetricsServer, StoreCollector, on_loop
from kvdepot.proto.gen import common_pb2, metadata_pb2, store_pb2, store_pb2_grpc
from kvdepot.rpc.health import HealthState
from kvdepot.rpc.security import add_port, aio_channel, aio_server
from kvdepot.rpc.security_config import NO_SECURITY, SecurityConfig
from kvdepot.shutdown import cancel_and_wait, finish, uninterrupted
from kvdepot.store.chunks import ChunkStore
from kvdepot.store.config import StoreConfig
from kvdepot.store.dataplane import DataPlaneServer
from kvdepot.store.identity import instance_identity
from kvdepot.store.indexer import INDEX_RETRY, IndexCommitter, Indexer, WriterId
from kvdepot.store.lease import InventoryColumns, MetadataLease
from kvdepot.store.nixl_agent import StoreNixlAgent
from kvdepot.store.reconcile import Reconciler
from kvdepot.store.table_factory import build_chunk_store
from kvdepot.store.throughput import ThroughputMeter
from kvdepot.types import TIER_RANK
from kvdepot.wire.host import default_arena_path, rdma_devices, reap_stale_arenas
from kvdepot.wire.nixl import nixl_available
from kvdepot.wire.protocol import AttachFlags, IndexCode, IndexSettled, ProtocolLimits
from kvdepot.wire.records import tier_stats_to_proto, transfer_to_proto

logger = logging.getLogger(__name__)


def group_removed(
    keys: list[ChunkKey], reasons: dict[ChunkKey, tuple[str, str]]
) -> list[tuple[tuple[str, str], list[ChunkKey]]]:
    """Removed keys by (reason, tier), for one report each (("", ""): not known)."""
    groups: dict[tuple[str, str], list[ChunkKey]] = {}
    for key in keys:
        groups.setdefault(reasons.get(key, ("", "")), []).append(key)
    return list(groups.items())


_REPORT_GATHER_S = 0.02
"""Evictions and tier moves gathered into one report to the metadata service."""

READY_PREFIX = "KVDEPOT READY "
# Transfer rates are reported over this window, sampled every SAMPLE_S.
RATE_WINDOW_S = 10.0
SAMPLE_S = 1.0
# Evictions are logged as one summary line at most this often.
REMOVED_SUMMARY_S = 10.0
# Keys per ReportMoved call.
MOVED_BATCH = 4096
MAX_DESCRIBE_KEYS = 8192
"""Keys one ``DescribeChunks`` may ask about (as many as one ``Explain``)."""


class StoreServicer(store_pb2_grpc.StoreServicer):
    """The store's own gRPC service: statistics and transfer info of this node."""

    def __init__(self, daemon: StoreDaemon) -> None:
        self._daemon = daemon

    async def GetStats(
        self, request: store_pb2.StoreStatsRequest, context: grpc.aio.ServicerContext
    ) -> store_pb2.StoreStats:
        return self._daemon.stats_proto()

    async def GetTransferInfo(
        self, request: store_pb2.TransferInfoRequest, context: grpc.aio.ServicerContext
    ) -> store_pb2.TransferInfo:
        return self._daemon.transfer_info_proto()

    async def DescribeChunks(
        self, request: store_pb2.DescribeChunksRequest, context: grpc.aio.ServicerContext
    ) -> store_pb2.DescribeChunksResponse:
        try:
            keys = validate_keys(request.keys, MAX_DESCRIBE_KEYS, "describe")
        except InvalidArgument as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return store_pb2.DescribeChunksResponse(
            chunks=[
                store_pb2.ChunkDescription(held=True, tier=d[0], committed_at=d[1])
                if d is not None
                else store_pb2.ChunkDescription()
                for d in self._daemon.chunks.describe(keys)
            ]
        )


class _StartedIndexer(Indexer):
    """The daemon's committer once ``start`` made it (the node id is known
    then); before, nothing is indexed."""

    def __init__(self) -> None:
        self.target: IndexCommitter | None = None

    def commit(self, keys: Sequence[ChunkKey], sizes: Sequence[int]) -> list[IndexCode]:
        t = self.target
        return t.commit(keys, sizes) if t is not None else [IndexCode.NOT_INDEXED] * len(keys)

    def defer(self, writer: WriterId, keys: Sequence[ChunkKey], sizes: Sequence[int]) -> bool:
        t = self.target
        return t is not None and t.defer(writer, keys, sizes)

    def sync(self, writer: WriterId, wait_s: float) -> IndexSettled:
        t = self.target
        return t.sync(writer, wait_s) if t is not None else IndexSettled()


class StoreDaemon:
    """One store node: owns the arena and serves it.

    Args:
        config: The daemon's configuration.
        security: Token(s) its gRPC service and data plane require, the token
            it presents to the metadata service, and TLS; none by default.
    """

    def __init__(self, config: StoreConfig, security: SecurityConfig | None = None) -> None:
        self.config = config
        self.security = security or NO_SECURITY
        self._loop: asyncio.AbstractEventLoop | None = None
        self._removed: set[ChunkKey] = set()
        # Removals from data-plane threads, taken by the reporter: the first
        # after each report wakes the loop; the rest of its gathering moment
        # only queue (a full store evicts on nearly every put, and a wakeup
        # costs the evicting thread a syscall and the loop's thread the GIL).
        self._inbox: list[ChunkKey] = []
        self._inbox_lock = threading.Lock()
        self._inbox_armed = False  # the loop was woken for what is queued
        # Chunks that changed tier, reported with the tier they are in then.
        self._moved: set[ChunkKey] = set()
        self._moves_recorded = True  # until the metadata service says otherwise
        self._removed_event = asyncio.Event()
        arena_path = config.arena_path
        if not arena_path and config.shm:
            reap_stale_arenas()
            arena_path = default_arena_path(config.node_id or "store")
        self.chunks: ChunkStore = build_chunk_store(
            config,
            arena_path=arena_path or None,
            on_removed=self._on_removed,
            on_moved=self._on_moved,
        )
        try:
            # After the SSD tier locked its directory: one live process per id file.
            self.instance_id = instance_identity(config.ssd_dir)
            self.nixl = self._start_nixl(config)
        except BaseException:
            self.chunks.close()
            raise
        limits = ProtocolLimits(max_chunk_bytes=config.max_chunk_bytes or config.capacity_bytes)
        self._index = _StartedIndexer()
        self.dataplane = DataPlaneServer(
            self.chunks,
            host=config.host,
            port=config.port,
            limits=limits,
            idle_timeout_s=config.idle_timeout_s,
            io_timeout_s=config.io_timeout_s,
            on_nixl_held=self.nixl.on_held if self.nixl is not None else None,
            min_rate=config.min_rate_bytes,
            hold_timeout_s=config.hold_timeout_s,
            max_connections=config.max_connections,
            auth=self.security.authenticator() if self.security.auth else None,
            verify_shm_commits=config.verify_shm_commits,
            index=self._index,
        )
        # Commits what own-node writers asked the data plane to index (from
        # start()), from the data-plane threads: blocking calls, so a client
        # of its own beside the lease's asyncio one.
        self._indexer: IndexCommitter | None = None
        self._index_client: MetadataClient | None = None
        self.node_id = config.node_id
        self.address = ""
        self.grpc_address = ""
        self._server: grpc.aio.Server | None = None
        self._endpoints = parse_endpoints(config.metadata)
        self._channels: list[grpc.aio.Channel] = []
        self._tasks: list[asyncio.Task[None]] = []
        self.lease: MetadataLease | None = None  # from start()
        self.reconciler: Reconciler | None = None  # from start()
        self._meter = ThroughputMeter(RATE_WINDOW_S)
        self._removed_count = 0  # since the last summary line
        self._removed_since = 0.0  # when the first of them left
        self.health: HealthState | None = None
        self.metrics: MetricsServer | None = None

    def _start_nixl(self, config: StoreConfig) -> StoreNixlAgent | None:
        if config.nixl == "off":
            return None
        if config.nixl == "auto" and not (rdma_devices() and nixl_available()):
            return None
        arena = self.chunks.arena
        name = f"kvdepot-{config.node_id or 'store'}-{arena.generation:016x}"
        try:
            return StoreNixlAgent(arena, name)
        except Unavailable as exc:
            if config.nixl == "on":
                raise
            logger.warning("NIXL not started: %s", str(exc))
            return None

    # -- removal reports: called from data-plane threads --------------------
    def _on_removed(self, keys: list[ChunkKey]) -> None:
        loop = self._loop
        with self._inbox_lock:
            self._inbox.extend(keys)
            # Not serving yet: nothing to wake (the registration's inventory has them).
            if self._inbox_armed or loop is None or loop.is_closed():
                return
            self._inbox_armed = True
        with contextlib.suppress(RuntimeError):  # loop shutting down
            loop.call_soon_threadsafe(self._removed_event.set)

    def _registered(self) -> bool:
        """Whether this store holds its lease now (from a data-plane thread)."""
        return self.lease is not None and self.lease.holds

    def _on_moved(self, moves: list[tuple[ChunkKey, str]]) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # loop shutting down
            loop.call_soon_threadsafe(self._queue_moved, [key for key, _ in moves])

    def _queue_moved(self, keys: list[ChunkKey]) -> None:
        if self._moves_recorded:
            self._moved.update(keys)
            self._removed_event.set()

    def _take_removed(self) -> None:
        """On the loop: the removals the data-plane threads queued, into the next report."""
        with self._inbox_lock:
            keys, self._inbox = self._inbox, []
            self._inbox_armed = False
        if not keys:
            return
        self._removed.update(keys)
        if not self._removed_count:
            self._removed_since = time.monotonic()
        self._removed_count += len(keys)

    def _queue_unheld(self, keys: list[ChunkKey]) -> None:
        # Named by the index for this node, not held (reconciliation): reported
        # as removals are, not counted as chunks that left.
        self._removed.update(keys)
        self._removed_event.set()

    # -- lifecycle ------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.dataplane.start()
        host, port = self.dataplane.address
        advertise = self.config.advertise_host or host
        self.address = f"{advertise}:{port}"
        if not self.node_id:
            self.node_id = f"store-{advertise}-{port}"
        server = aio_server(self.security, f"store {self.node_id} gRPC")
        store_pb2_grpc.add_StoreServicer_to_server(StoreServicer(self), server)
        health = HealthState(
            server,
            [store_pb2.DESCRIPTOR.services_by_name["Store"].full_name],
            f"store {self.node_id}",
        )
        self.health = health
        grpc_port = add_port(
            server,
            f"{self.config.host}:{self.config.grpc_port}",
            self.security,
            f"store {self.node_id} gRPC",
        )
        if grpc_port == 0:
            raise InvalidArgument(f"cannot bind {self.config.host}:{self.config.grpc_port}")
        await server.start()
        # SERVING once registered with a metadata service (a client cannot
        # find this node before), until it is gone for longer than a lease.
        await health.set(False, "not registered with a metadata service yet")
        self._server = server
        if self.config.metrics_port is not None:
            self.metrics = MetricsServer(
                StoreCollector(
                    on_loop(asyncio.get_running_loop(), self.current_stats),
                    lambda: health.serving,
                ),
                self.config.host,
                self.config.metrics_port,
            )
        self.grpc_address = f"{advertise}:{grpc_port}"
        flags = self.dataplane.attach_info.flags
        if self.nixl is not None:
            flags |= AttachFlags.NIXL
        self.dataplane.attach_info = dataclasses.replace(
            self.dataplane.attach_info, flags=flags, control_address=self.grpc_address
        )
        self._channels = [aio_channel(e, self.security) for e in self._endpoints]
        self.lease = MetadataLease(
            node_id=self.node_id,
            endpoints=self._endpoints,
            channels=self._channels,
            health=health,
            registration=self._registration,
            inventory=self._inventory,
            heartbeat=self._heartbeat,
            retry_s=self.config.register_retry_s,
            force=self.config.force_node_id,
            answered=self._index_answered,
            heartbeat_answered=self._heartbeat_answered,
        )
        self.reconciler = self._reconciler(self.lease)
        self._start_indexer()
        self._tasks = [
            asyncio.create_task(self.lease.run()),
            asyncio.create_task(self._report_forever()),
            asyncio.create_task(self._sample_forever()),
            asyncio.create_task(self.reconciler.run()),
        ]
        logger.info(
            "store %s: data plane %s, gRPC %s, arena %d bytes, tiers %s",
            self.node_id,
            self.address,
            self.grpc_address,
            self.config.capacity_bytes,
            ",".join(self.chunks.tiers),
        )

    def _start_indexer(self) -> None:
        """The committer of own-node writers' index commits, now that the
        node id is known; the data plane hands them to it from then on."""
        timeout_s = self.config.index_commit_timeout_s
        self._index_client = MetadataClient(
            self.config.metadata, timeout_s, self.security, retry=INDEX_RETRY
        )
        self._indexer = IndexCommitter(
            self.node_id,
            self._index_client,
            timeout_s,
            registered=self._registered,
            holds=self.chunks.contains,
        )
        self._index.target = self._indexer

    def _reconciler(self, lease: MetadataLease) -> Reconciler:
        """Reconciles this store's inventory with the index after heartbeats."""
        return Reconciler(
            node_id=self.node_id,
            chunks=self.chunks,
            lease=lease,
            channels=self._channels,
            removed=self._queue_unheld,
            max_keys=self.config.reconcile_keys,
            scrub_s=self.config.reconcile_scrub_s,
        )

    def _heartbeat_answered(self, reply: metadata_pb2.HeartbeatResponse) -> None:
        # Its inventory digest check: a round of reconciliation may follow.
        if self.reconciler is not None:
            self.reconciler.observe(reply)

    def _index_answered(self) -> None:
        # The lease's heartbeat went through: the index takes commits again.
        if self._indexer is not None:
            self._indexer.answered()

    def ready_line(self) -> str:
        """One machine-readable line announcing where this daemon listens."""
        _, port = self.dataplane.address
        return READY_PREFIX + json.dumps(
            {
                "role": "store",
                "node_id": self.node_id,
                "address": self.address,
                "grpc_address": self.grpc_address,
                "port": port,
                "arena_path": self.chunks.arena.path or "",
                "generation": self.chunks.arena.generation,
                "nixl": self.nixl is not None,
                "metrics_port": self.metrics.port if self.metrics is not None else None,
                "tiers": list(self.chunks.tiers),
                "ssd_dir": self.config.ssd_dir,
            }
        )

    async def wait_registered(self) -> None:
        """Return once registered with a metadata service (a client can find
        this store then), or raise why it cannot be (see :meth:`wait`).

        A metadata service that does not answer is retried, with backoff,
        for as long as it takes: whoever waits for this bounds the wait.
        """
        assert self.lease is not None
        lease = self._tasks[0]
        registered = asyncio.ensure_future(self.lease.registered.wait())
        try:
            await asyncio.wait((lease, registered), return_when=asyncio.FIRST_COMPLETED)
        finally:
            registered.cancel()
        if lease.done():
            lease.result()

    async def wait(self) -> None:
        """Serve until cancelled, or raise why this store cannot go on serving.

        Raises:
            NodeIdTaken: The metadata service refused the node id: another
                live store instance holds it.
            InvalidArgument: The metadata service refused the registration
                as invalid (its message says why); it would forever.
            Unauthenticated: This store's token is not the cluster's (or,
                as ``PermissionDenied``, may not register a store), before
                it ever registered.
            Unavailable: The address is not a metadata service.
        """
        await self._tasks[0]  # the lease: it ends only by raising

    async def stop(self) -> None:
        """Stop serving and free the arena; the arena is freed whatever
        fails before (its file in /dev/shm is RAM until unlinked)."""
        try:
            await self._stop_serving()
        finally:
            try:
                self.dataplane.stop()
                if self._index_client is not None:
                    self._index_client.close()
                if self.nixl is not None:
                    self.nixl.close()
            finally:
                self.chunks.close()

    async def _stop_serving(self) -> None:
        if self._indexer is not None:
            self._indexer.close()  # writers asking from now on commit themselves
        if self.metrics is not None:
            await asyncio.to_thread(self.metrics.close)
            self.metrics = None
        # What ended one before was raised by wait() already.
        await cancel_and_wait(self._tasks, f"store {self.node_id}")
        if self._server is not None:
            await self._server.stop(0.5)
            self._server = None
        for channel in self._channels:
            await channel.close(None)

    # -- metadata lease -------------------------------------------------------
    def _tiers(self) -> list[common_pb2.TierStats]:
        return tier_stats_to_proto(self.chunks.tier_stats())

    def _registration(self) -> metadata_pb2.RegisterNodeRequest:
        return metadata_pb2.RegisterNodeRequest(
            node_id=self.node_id,
            address=self.address,
            grpc_address=self.grpc_address,
            tiers=self._tiers(),
            instance_id=self.instance_id,
        )

    def _inventory(self, page_chunks: int) -> Iterator[InventoryColumns]:
        """This moment's chunks, in pages; each page keeps only what is still
        held, and looks it up under one short hold of the table's lock."""
        keys = self.chunks.keys()
        # The inventory is authoritative: removals and moves queued before it are moot.
        with self._inbox_lock:
            self._inbox.clear()
        self._removed.clear()
        self._moved.clear()
        self._moves_recorded = True
        for start in range(0, len(keys), page_chunks):
            page = self.chunks.holdings_of(keys[start : start + page_chunks])
            yield (
                b"".join(h.key for h in page),
                [h.size for h in page],
                bytes(TIER_RANK[h.tier] for h in page),
            )

    def _heartbeat(self) -> metadata_pb2.HeartbeatRequest:
        return metadata_pb2.HeartbeatRequest(
            node_id=self.node_id,
            tiers=self._tiers(),
            transfer=self._transfer(),
            held=self.reconciler.held() if self.reconciler is not None else None,
        )

    async def _sample_forever(self) -> None:
        """Sample the transfer counters; summarise evictions in one line."""
        summary_at = -REMOVED_SUMMARY_S
        while True:
            now = time.monotonic()
            d = self.dataplane.stats()
            self._meter.sample(now, d.bytes_in, d.bytes_out)
            if self._removed_count and now - summary_at >= REMOVED_SUMMARY_S:
                period = now - self._removed_since
                logger.info(
                    "%d chunks left the store (evicted or deleted) in the last %.1f s",
                    self._removed_count,
                    period,
                    extra={
                        "event": "evictions",
                        "node": self.node_id,
                        "chunks": self._removed_count,
                        "period_s": round(period, 1),
                    },
                )
                self._removed_count = 0
                summary_at = now
            await asyncio.sleep(SAMPLE_S)

    async def _report_forever(self) -> None:
        while True:
            await self._removed_event.wait()
            # A full store evicts on nearly every put: gathering a moment's
            # evictions into one report spares the metadata service a call
            # per put (a lookup meanwhile may name a chunk that is gone: a miss).
            await asyncio.sleep(_REPORT_GATHER_S)
            self._removed_event.clear()
            assert self.lease is not None
            await self.lease.settled.wait()
            self._take_removed()
            # A key written again since its eviction is still held.
            reasons = self.chunks.removal_reasons(self._removed)
            keys = [k for k in self._removed if not self.chunks.contains(k)]
            self._removed.clear()
            try:
                for why, group in group_removed(keys, reasons):
                    await self.lease.client.report_removed(
                        metadata_pb2.ReportRemovedRequest(
                            node_id=self.node_id, keys=group, reason=why[0], tier=why[1]
                        ),
                        5,
                    )
                keys = []
                await self._report_moved()
            except grpc.aio.AioRpcError as exc:
                logger.debug("removal or move report failed (%s); will retry", exc.code())
                self._removed.update(keys)
                await asyncio.sleep(self.config.register_retry_s)
                self._removed_event.set()

    async def _report_moved(self) -> None:
        """Tell the metadata service the tier each moved chunk is in now."""
        by_tier: dict[str, list[ChunkKey]] = {}
        for key in self._moved:
            tier = self.chunks.tier_of(key)
            if tier is not None:  # else its removal is reported
                by_tier.setdefault(tier, []).append(key)
        self._moved.clear()
        for tier, keys in sorted(by_tier.items()):
            for i in range(0, len(keys), MOVED_BATCH):
                batch = keys[i : i + MOVED_BATCH]
                assert self.lease is not None
                try:
                    reply = await self.lease.client.report_moved(
                        metadata_pb2.ReportMovedRequest(
                            node_id=self.node_id, keys=batch, tier=tier
                        ),
                        5,
                    )
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                        self._moved.update(k for ks in by_tier.values() for k in ks)
                        raise
                    reply = metadata_pb2.ReportMovedResponse(recorded=False)
                if not reply.recorded:
                    # Tiers are then only refreshed by registering again.
                    logger.info("metadata service does not record tier moves; not reporting them")
                    self._moves_recorded = False
                    return

    # -- stats ------------------------------------------------------------------
    def transfer_info_proto(self) -> store_pb2.TransferInfo:
        """How clients can reach this store's arena beyond the tcp data plane."""
        info = self.dataplane.attach_info
        reply = store_pb2.TransferInfo(
            node_id=self.node_id,
            data_address=self.address,
            generation=info.generation,
            host_id=info.host_id,
        )
        if info.flags & AttachFlags.SHM:
            reply.shm.CopyFrom(
                store_pb2.ShmInfo(
                    path=info.arena_path,
                    size=info.arena_size,
                    file_dev=info.file_dev,
                    file_ino=info.file_ino,
                )
            )
        if self.nixl is not None:
            n = self.nixl.info
            reply.nixl.CopyFrom(
                store_pb2.NixlInfo(
                    agent_name=n.agent_name,
                    agent_metadata=n.agent_metadata,
                    arena_address=n.arena_address,
                    arena_size=n.arena_size,
                    backend="UCX",
                )
            )
        return reply

    def _transfer(self) -> common_pb2.TransferRate:
        return transfer_to_proto(self._meter.rate())

    async def current_stats(self) -> store_pb2.StoreStats:
        """:meth:`stats_proto`, as a coroutine for readers on other threads."""
        return self.stats_proto()

    def stats_proto(self) -> store_pb2.StoreStats:
        d = self.dataplane.stats()
        c = self.chunks.stats()
        return store_pb2.StoreStats(
            node_id=self.node_id,
            address=self.address,
            tiers=self._tiers(),
            puts=d.puts,
            gets=d.gets,
            get_misses=d.get_misses,
            bytes_in=d.bytes_in,
            bytes_out=d.bytes_out,
            put_rejected=d.put_rejected,
            corrupt_puts=d.corrupt_puts,
            protocol_errors=d.protocol_errors,
            connections=d.connections_total,
            transfer=self._transfer(),
            chunks_corrupt=c.corrupt,
            chunks_recovered=c.recovered,
            tier_write_errors=c.write_errors,
            tier_read_errors=c.read_errors,
            # Still SERVING: the tiers left serve. This says what it lost.
            degraded=c.degraded,
            reconcile=self.reconciler.stats_proto() if self.reconciler is not None else None,
        )


async def run_store(
    config: StoreConfig,
    announce: Callable[[str], None] | None = None,
    security: SecurityConfig | None = None,
) -> None:
    """Run a store daemon until cancelled; ``announce`` its READY line once
    it is registered with a metadata service.

    Raises:
        KVDepotError: Why it cannot serve (see :meth:`StoreDaemon.wait`).
    """
    daemon = StoreDaemon(config, security)
    try:
        # Inside: a start that fails (a port in use) still frees the arena.
        await uninterrupted(daemon.start())
        # READY says a client can use this store: not before it registered.
        await daemon.wait_registered()
        if announce is not None:
            announce(daemon.ready_line())
        await daemon.wait()
    finally:
        # A second signal, or one while stopping on an error, must not cut
        # the cleanup short: the arena file would stay in /dev/shm.
        await finish(daemon.stop())
