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
import time
from collections.abc import Callable
from typing import Any

import grpc

from kvdepot.connector.metadata import parse_endpoints
from kvdepot.errors import (
    InvalidArgument,
    KVDepotError,
    NodeIdTaken,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from kvdepot.health import HealthState
from kvdepot.metadata.keys import ChunkKey
from kvdepot.metadata.types import LEASE_REMAINING_KEY
from kvdepot.metrics import MetricsServer, StoreCollector, on_loop
from kvdepot.proto.gen import common_pb2, metadata_pb2, metadata_pb2_grpc, store_pb2, store_pb2_grpc
from kvdepot.security import NO_SECURITY, SecurityConfig, add_port, aio_channel, aio_server
from kvdepot.shutdown import finish
from kvdepot.store.chunks import ChunkStore
from kvdepot.store.config import StoreConfig
from kvdepot.store.dataplane import DataPlaneServer
from kvdepot.store.host import default_arena_path, rdma_devices, reap_stale_arenas
from kvdepot.store.identity import instance_identity
from kvdepot.store.nixl_agent import StoreNixlAgent, nixl_available
from kvdepot.store.protocol import AttachFlags, ProtocolLimits
from kvdepot.store.repeat_log import RepeatLog
from kvdepot.store.throughput import ThroughputMeter
from kvdepot.store.tiers.factory import build_chunk_store

logger = logging.getLogger(__name__)

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
# A node id held by an instance that no longer heartbeats (a store restarted
# without its SSD directory) is waited for, until its lease runs out; a lease
# whose end moved later by more than this was renewed: the holder is alive.
RENEWED_SLACK_S = 0.5
# Attempts to reach an unanswering metadata service back off up to this
# (or register_retry_s, if longer): well inside a lease.
RETRY_CAP_S = 2.0

_TOKEN_HINT = "; give it the cluster token (--auth-token-file / KVDEPOT_AUTH_TOKEN)"
# Refusals of a registration that retrying cannot change, and what they raise.
_REFUSALS: dict[grpc.StatusCode, tuple[type[KVDepotError], str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (InvalidArgument, ""),
    grpc.StatusCode.UNAUTHENTICATED: (Unauthenticated, _TOKEN_HINT),
    grpc.StatusCode.PERMISSION_DENIED: (PermissionDenied, ""),
    grpc.StatusCode.UNIMPLEMENTED: (
        Unavailable,
        " (is that address a kvdepot metadata service?)",
    ),
}


@dataclasses.dataclass(slots=True)
class _Lease:
    """Where this store stands with the metadata service."""

    last_ok: float
    registered: bool = False
    failures: int = 0  # attempts in a row that found no service
    # The end of another instance's lease on our node id, while we wait for it.
    held_until: float | None = None
    waited_from: float = 0.0


def _lease_remaining(exc: grpc.aio.AioRpcError) -> float | None:
    """Seconds left of the holder's lease, from a refused RegisterNode."""
    # grpc.aio's Metadata iterates (key, value) pairs, whatever the stubs say.
    trailing: Any = exc.trailing_metadata() or ()
    for key, value in trailing:
        if key == LEASE_REMAINING_KEY:
            with contextlib.suppress(ValueError):
                return max(0.0, int(value) / 1000)
    return None


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
        )
        self.node_id = config.node_id
        self.address = ""
        self.grpc_address = ""
        self._server: grpc.aio.Server | None = None
        self._endpoints = parse_endpoints(config.metadata)
        self._channels: list[grpc.aio.Channel] = []
        self._current = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._heartbeat_s = 1.0
        # The epoch of this instance's registration (0 before the first);
        # heartbeats carry it, so that a replaced registration is never renewed.
        self.epoch = 0
        # Taking the node id over from a live instance is asked at start only:
        # never again once registered, so two forcing stores cannot flap.
        self._force = config.force_node_id
        self._lease_s = 5.0  # until the metadata service tells its lease
        self.registered = asyncio.Event()
        self._repeats = RepeatLog(logger)
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
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # loop shutting down
            loop.call_soon_threadsafe(self._queue_removed, keys)

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

    def _queue_removed(self, keys: list[ChunkKey]) -> None:
        self._removed.update(keys)
        if not self._removed_count:
            self._removed_since = time.monotonic()
        self._removed_count += len(keys)
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
        self._tasks = [
            asyncio.create_task(self._lease_forever()),
            asyncio.create_task(self._report_forever()),
            asyncio.create_task(self._sample_forever()),
        ]
        logger.info(
            "store %s: data plane %s, gRPC %s, arena %d bytes, tiers %s",
            self.node_id,
            self.address,
            self.grpc_address,
            self.config.capacity_bytes,
            ",".join(self.chunks.tiers),
        )

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
        lease = self._tasks[0]
        registered = asyncio.ensure_future(self.registered.wait())
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
                if self.nixl is not None:
                    self.nixl.close()
            finally:
                self.chunks.close()

    async def _stop_serving(self) -> None:
        if self.metrics is not None:
            await asyncio.to_thread(self.metrics.close)
            self.metrics = None
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            if task.done() and not task.cancelled():
                task.exception()  # what ended it was raised by wait() already
                continue
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._server is not None:
            await self._server.stop(0.5)
            self._server = None
        for channel in self._channels:
            await channel.close(None)

    # -- metadata lease -------------------------------------------------------
    def _tiers(self) -> list[common_pb2.TierStats]:
        return [
            common_pb2.TierStats(
                name=t.name,
                capacity_bytes=t.capacity_bytes,
                used_bytes=t.used_bytes,
                chunks=t.chunks,
                hits=t.hits,
                misses=t.misses,
                evictions=t.evictions,
                promotions=t.promotions,
                demotions=t.demotions,
            )
            for t in self.chunks.tier_stats()
        ]

    async def _register(self, stub: metadata_pb2_grpc.MetadataStub) -> None:
        inventory = [
            common_pb2.ChunkRef(key=h.key, size=h.size, tier=h.tier) for h in self.chunks.holdings()
        ]
        # The inventory is authoritative: removals and moves queued before it are moot.
        self._removed.clear()
        self._moved.clear()
        self._moves_recorded = True
        reply = await stub.RegisterNode(
            metadata_pb2.RegisterNodeRequest(
                node_id=self.node_id,
                address=self.address,
                grpc_address=self.grpc_address,
                tiers=self._tiers(),
                inventory=inventory,
                instance_id=self.instance_id,
                force=self._force,
            ),
            timeout=10,
        )
        self._force = False
        self.epoch = reply.epoch
        self._heartbeat_s = max(0.05, reply.heartbeat_interval_ms / 1000)
        if reply.lease_ttl_ms:
            self._lease_s = reply.lease_ttl_ms / 1000
        logger.info(
            "registered with metadata %s (%d chunks, epoch %d)",
            self._endpoints[self._current],
            len(inventory),
            self.epoch,
            extra={
                "event": "registered",
                "node": self.node_id,
                "chunks": len(inventory),
                "epoch": self.epoch,
            },
        )
        self.registered.set()

    def _stub(self) -> metadata_pb2_grpc.MetadataStub:
        return metadata_pb2_grpc.MetadataStub(self._channels[self._current])

    def _fail_over(self) -> None:
        # Replicas share the index: any of them can take our heartbeats.
        if len(self._channels) > 1:
            self._current = (self._current + 1) % len(self._channels)
            self._repeats.failed(
                "failover", logging.WARNING, "failing over to metadata %s", self._endpoint()
            )

    def _endpoint(self) -> str:
        return self._endpoints[self._current]

    async def _lease_forever(self) -> None:
        health = self.health
        assert health is not None
        lease = _Lease(last_ok=time.monotonic())
        while True:
            try:
                await self._renew(lease)
            except grpc.aio.AioRpcError as exc:
                delay = self._lease_refused(exc, lease)
                if delay is None:
                    delay = self._outage(exc, lease)
                    lost_s = time.monotonic() - lease.last_ok
                    if lost_s > self._lease_s:
                        # Our lease has run out: the cluster no longer sees this node.
                        await health.set(
                            False, f"no metadata service for {lost_s:.1f} s: {exc.code().name}"
                        )
                if delay:
                    await asyncio.sleep(delay)
                continue
            self._lease_answered(lease)
            await health.set(True, "holds a metadata lease")
            await asyncio.sleep(self._heartbeat_s)

    async def _renew(self, lease: _Lease) -> None:
        """Register (when not registered) or heartbeat, once."""
        stub = self._stub()
        if not lease.registered:
            await self._register(stub)
            lease.registered = True
            lease.held_until = None
            return
        reply = await stub.Heartbeat(
            metadata_pb2.HeartbeatRequest(
                node_id=self.node_id,
                tiers=self._tiers(),
                transfer=self._transfer(),
                epoch=self.epoch,
            ),
            timeout=max(1.0, self._heartbeat_s * 2),
        )
        if reply.lease_ttl_ms:
            self._lease_s = reply.lease_ttl_ms / 1000

    def _lease_refused(self, exc: grpc.aio.AioRpcError, lease: _Lease) -> float | None:
        """What a refusal of the service means: the delay before the next
        attempt, or ``None`` for a failure to retry with backoff.

        Raises:
            KVDepotError: A refusal that retrying cannot change: this store
                cannot serve (see :meth:`wait`).
        """
        code = exc.code()
        if code == grpc.StatusCode.NOT_FOUND:
            # Our lease expired or the index was lost: re-announce.
            self._repeats.failed(
                "forgotten", logging.WARNING, "metadata forgot this node; registering again"
            )
            lease.registered = False
            return 0.0
        if code == grpc.StatusCode.ALREADY_EXISTS and not lease.registered:
            return self._node_id_held(exc, lease)
        if code == grpc.StatusCode.FAILED_PRECONDITION and lease.registered:
            # Our registration was replaced (the id was taken over): this
            # instance no longer owns it. Registering again is refused while
            # the other instance lives, which stops us.
            logger.error(
                "metadata %s refused this store's heartbeat: %s",
                self._endpoint(),
                exc.details(),
                extra={"event": "heartbeat_refused", "node": self.node_id},
            )
            lease.registered = False
            return 0.0
        fatal = _REFUSALS.get(code)
        if fatal is not None and not lease.registered:
            # The request is ours and will not change: retrying it is
            # refused forever (INVALID_ARGUMENT); a token, or the service at
            # that address, is fixed until a restart. Once this store has
            # served, it keeps its chunks for the clients that reach it.
            cls, hint = fatal
            if code == grpc.StatusCode.INVALID_ARGUMENT or not self.registered.is_set():
                raise cls(
                    f"metadata {self._endpoint()} refused store {self.node_id!r}: "
                    f"{exc.details() or code.name}{hint}"
                ) from None
        return None

    def _node_id_held(self, exc: grpc.aio.AioRpcError, lease: _Lease) -> float:
        # Another instance holds the node id. Serving under it would corrupt
        # the index: fatal (see wait()), unless its lease is running out
        # unrenewed (it crashed or stopped).
        now = time.monotonic()
        remaining = _lease_remaining(exc)
        if remaining is not None and lease.held_until is None:
            lease.held_until, lease.waited_from = now + remaining, now
            logger.info(
                "node id %s is held by another instance; waiting up to %.1f s "
                "for its lease to run out",
                self.node_id,
                remaining,
            )
        if (
            remaining is None
            or lease.held_until is None
            or now + remaining > lease.held_until + RENEWED_SLACK_S
            or now - lease.waited_from > remaining + self._lease_s + 10
        ):
            raise NodeIdTaken(
                f"metadata {self._endpoint()} refused store {self.node_id}: {exc.details()}"
            ) from None
        return min(self.config.register_retry_s, remaining + 0.05)

    def _outage(self, exc: grpc.aio.AioRpcError, lease: _Lease) -> float:
        """Log a failed attempt (at most one line per kind and interval, with
        a count) and fail over; returns the delay before the next attempt."""
        code = exc.code()
        extra = {"event": "metadata_unreachable", "node": self.node_id, "code": code.name}
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            self._repeats.failed(
                "refused",
                logging.ERROR,
                "metadata %s refused this store (%s: %s)%s",
                self._endpoint(),
                code.name,
                exc.details(),
                _TOKEN_HINT,
                extra=extra,
            )
        else:
            self._repeats.failed(
                "unreachable",
                logging.WARNING,
                "metadata %s unreachable (%s: %s)",
                self._endpoint(),
                code.name,
                exc.details(),
                extra=extra,
            )
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            self._fail_over()
        lease.failures += 1
        # Every replica is tried at the base delay; each round that all of
        # them failed doubles it, up to a cap well inside a lease.
        rounds = min(lease.failures // len(self._endpoints), 8)
        base = self.config.register_retry_s
        return float(min(max(base, RETRY_CAP_S), base * 2**rounds))

    def _lease_answered(self, lease: _Lease) -> None:
        lease.last_ok = time.monotonic()
        lease.failures = 0
        for kind in ("failover", "forgotten"):
            self._repeats.ended(kind)
        for kind in ("unreachable", "refused"):
            ended = self._repeats.ended(kind)
            if ended is not None:
                logger.info(
                    "metadata %s answers again, after %d failed attempts in %.1f s",
                    self._endpoint(),
                    ended[0],
                    ended[1],
                    extra={"event": "metadata_reachable", "node": self.node_id},
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
            await self.registered.wait()
            # A key written again since its eviction is still held.
            keys = [k for k in self._removed if not self.chunks.contains(k)]
            self._removed.clear()
            try:
                if keys:
                    await self._stub().ReportRemoved(
                        metadata_pb2.ReportRemovedRequest(node_id=self.node_id, keys=keys),
                        timeout=5,
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
                try:
                    reply = await self._stub().ReportMoved(
                        metadata_pb2.ReportMovedRequest(
                            node_id=self.node_id, keys=batch, tier=tier
                        ),
                        timeout=5,
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
        r = self._meter.rate()
        return common_pb2.TransferRate(
            bytes_in_per_s=r.bytes_in_per_s, bytes_out_per_s=r.bytes_out_per_s, window_s=r.window_s
        )

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
        await daemon.start()
        # READY says a client can use this store: not before it registered.
        await daemon.wait_registered()
        if announce is not None:
            announce(daemon.ready_line())
        await daemon.wait()
    finally:
        # A second signal, or one while stopping on an error, must not cut
        # the cleanup short: the arena file would stay in /dev/shm.
        await finish(daemon.stop())
