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

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvdepot.connector.metadata import parse_endpoints
from kvdepot.errors import InvalidArgument, Unavailable
from kvdepot.metadata.keys import ChunkKey
from kvdepot.proto.gen import common_pb2, metadata_pb2, metadata_pb2_grpc, store_pb2, store_pb2_grpc
from kvdepot.store.chunks import ChunkStore
from kvdepot.store.config import StoreConfig
from kvdepot.store.dataplane import DataPlaneServer
from kvdepot.store.host import default_arena_path, rdma_devices, reap_stale_arenas
from kvdepot.store.nixl_agent import StoreNixlAgent, nixl_available
from kvdepot.store.protocol import AttachFlags, ProtocolLimits

logger = logging.getLogger(__name__)

READY_PREFIX = "KVDEPOT READY "


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
    """One store node: owns the arena and serves it."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self._loop: asyncio.AbstractEventLoop | None = None
        self._removed: set[ChunkKey] = set()
        self._removed_event = asyncio.Event()
        arena_path = config.arena_path
        if not arena_path and config.shm:
            reap_stale_arenas()
            arena_path = default_arena_path(config.node_id or "store")
        self.chunks = ChunkStore(
            config.capacity_bytes,
            arena_path=arena_path or None,
            on_removed=self._on_removed,
            max_chunk_bytes=config.max_chunk_bytes or None,
        )
        try:
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
        self.registered = asyncio.Event()

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

    def _queue_removed(self, keys: list[ChunkKey]) -> None:
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
        server = grpc.aio.server()
        store_pb2_grpc.add_StoreServicer_to_server(StoreServicer(self), server)
        health_servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]  # stubs predate aio
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        names = (
            store_pb2.DESCRIPTOR.services_by_name["Store"].full_name,
            health.SERVICE_NAME,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(names, server)
        grpc_port = server.add_insecure_port(f"{self.config.host}:{self.config.grpc_port}")
        if grpc_port == 0:
            raise InvalidArgument(f"cannot bind {self.config.host}:{self.config.grpc_port}")
        await server.start()
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        self._server = server
        self.grpc_address = f"{advertise}:{grpc_port}"
        flags = self.dataplane.attach_info.flags
        if self.nixl is not None:
            flags |= AttachFlags.NIXL
        self.dataplane.attach_info = dataclasses.replace(
            self.dataplane.attach_info, flags=flags, control_address=self.grpc_address
        )
        self._channels = [grpc.aio.insecure_channel(e) for e in self._endpoints]
        self._tasks = [
            asyncio.create_task(self._lease_forever()),
            asyncio.create_task(self._report_forever()),
        ]
        logger.info(
            "store %s: data plane %s, gRPC %s, arena %d bytes",
            self.node_id,
            self.address,
            self.grpc_address,
            self.config.capacity_bytes,
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
            }
        )

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._server is not None:
            await self._server.stop(0.5)
        for channel in self._channels:
            await channel.close(None)
        self.dataplane.stop()
        if self.nixl is not None:
            self.nixl.close()
        self.chunks.close()

    # -- metadata lease -------------------------------------------------------
    def _tiers(self) -> list[common_pb2.TierStats]:
        s = self.chunks.stats()
        return [
            common_pb2.TierStats(
                name="cpu",
                capacity_bytes=s.capacity_bytes,
                used_bytes=s.used_bytes,
                chunks=s.chunks,
                hits=s.hits,
                misses=s.misses,
                evictions=s.evictions,
            )
        ]

    async def _register(self, stub: metadata_pb2_grpc.MetadataStub) -> None:
        inventory = [
            common_pb2.ChunkRef(key=k, size=size, tier="cpu") for k, size in self.chunks.inventory()
        ]
        # The inventory is authoritative: removals queued before it are moot.
        self._removed.clear()
        reply = await stub.RegisterNode(
            metadata_pb2.RegisterNodeRequest(
                node_id=self.node_id,
                address=self.address,
                grpc_address=self.grpc_address,
                tiers=self._tiers(),
                inventory=inventory,
            ),
            timeout=10,
        )
        self._heartbeat_s = max(0.05, reply.heartbeat_interval_ms / 1000)
        logger.info("registered with metadata %s (%d chunks)", self.config.metadata, len(inventory))
        self.registered.set()

    def _stub(self) -> metadata_pb2_grpc.MetadataStub:
        return metadata_pb2_grpc.MetadataStub(self._channels[self._current])

    def _fail_over(self) -> None:
        # Replicas share the index: any of them can take our heartbeats.
        if len(self._channels) > 1:
            self._current = (self._current + 1) % len(self._channels)
            logger.warning("failing over to metadata %s", self._endpoints[self._current])

    async def _lease_forever(self) -> None:
        registered = False
        warned = False
        while True:
            stub = self._stub()
            try:
                if not registered:
                    await self._register(stub)
                    registered = True
                    warned = False
                else:
                    await stub.Heartbeat(
                        metadata_pb2.HeartbeatRequest(node_id=self.node_id, tiers=self._tiers()),
                        timeout=max(1.0, self._heartbeat_s * 2),
                    )
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    # Our lease expired or the index was lost: re-announce.
                    logger.warning("metadata forgot this node; registering again")
                    registered = False
                    continue
                if not warned:
                    logger.warning(
                        "metadata %s unreachable: %s", self._endpoints[self._current], exc.code()
                    )
                    warned = True
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    self._fail_over()
                await asyncio.sleep(self.config.register_retry_s)
                continue
            await asyncio.sleep(self._heartbeat_s)

    async def _report_forever(self) -> None:
        while True:
            await self._removed_event.wait()
            self._removed_event.clear()
            await self.registered.wait()
            # A key written again since its eviction is still held.
            keys = [k for k in self._removed if not self.chunks.contains(k)]
            self._removed.clear()
            if not keys:
                continue
            try:
                await self._stub().ReportRemoved(
                    metadata_pb2.ReportRemovedRequest(node_id=self.node_id, keys=keys), timeout=5
                )
            except grpc.aio.AioRpcError as exc:
                logger.debug("removal report failed (%s); will retry", exc.code())
                self._removed.update(keys)
                await asyncio.sleep(self.config.register_retry_s)
                self._removed_event.set()

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

    def stats_proto(self) -> store_pb2.StoreStats:
        d = self.dataplane.stats()
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
        )


async def run_store(config: StoreConfig, announce: Callable[[str], None] | None = None) -> None:
    """Run a store daemon until cancelled."""
    daemon = StoreDaemon(config)
    await daemon.start()
    try:
        if announce is not None:
            announce(daemon.ready_line())
        started = time.monotonic()
        while True:
            await asyncio.sleep(3600)
            logger.debug("up for %.0f s", time.monotonic() - started)
    finally:
        await daemon.stop()
