"""Configuration of the store daemon."""

from __future__ import annotations

from dataclasses import dataclass

from kvdepot.errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Configuration of one store daemon.

    Attributes:
        node_id: Name of this node in the cluster; empty derives one from the
            advertised data-plane address.
        host: Address the data plane and gRPC listeners bind.
        port: Data-plane TCP port; 0 picks a free one.
        grpc_port: Port of the store's own gRPC service (stats); 0 picks one.
        advertise_host: Host other nodes use to reach this one; defaults to ``host``.
        metadata: Metadata service address ``host:port``, or several replicas
            ``host:port,host:port`` to fail over between.
        capacity_bytes: Size of the DRAM arena, allocated up front.
        arena_path: File to back the arena; empty picks one under /dev/shm
            (unique per node and process, mode 0600, unlinked at stop) when
            ``shm`` is on, else anonymous memory.
        shm: Share the arena with same-host clients (the ``shm`` transport)
            through a file under /dev/shm.
        nixl: Register the arena with a NIXL agent for one-sided RDMA:
            ``auto`` (where RDMA devices exist and NIXL is installed), ``on``
            (fail to start without it) or ``off``.
        max_chunk_bytes: Largest chunk accepted; 0 means the arena size.
        idle_timeout_s: Data-plane connections idle this long are closed.
        io_timeout_s: A request whose bytes stall this long is aborted.
        min_rate_bytes: Bytes per second a data-plane client must at least
            move within a request: one that takes longer than twice
            ``io_timeout_s`` plus its payload at this rate is cut off (however
            steadily it trickles).
        hold_timeout_s: A data-plane connection (``shm``, ``nixl`` client) that
            holds reservations or read leases without a break for this long is
            closed, and what it held is freed.
        max_connections: Data-plane connections served at once; more are refused.
        verify_shm_commits: Hash again what a same-host ``shm`` client copied
            into the arena before committing it. Off (the default), the
            checksum the client took of its source while copying it is
            recorded as sent: every reader verifies it, so a wrong one is a
            miss, never wrong data, and a put saves one pass over memory.
        register_retry_s: Delay between attempts to reach the metadata service.
        force_node_id: Take ``node_id`` over at start even while another live
            store instance holds it (its heartbeats are refused from then on
            and it stops). Off (the default), such a registration is refused
            and this store exits with status 1: two stores under one id would
            corrupt the index. A store restarted on its own SSD directory
            takes its id back without this (it is the same instance).
        metrics_port: Port of the Prometheus ``/metrics`` HTTP endpoint, bound
            on ``host``; ``None`` (the default) serves none, 0 picks a free port.
        cpu_watermarks: ``HIGH:LOW`` fractions of the DRAM tier: above HIGH its
            coldest chunks move to SSD in the background, down to LOW.
        pin_memory: Page-lock the DRAM arena for CUDA: ``auto`` (when a GPU
            tier on a CUDA device is configured), ``on`` or ``off``.
        gpu_capacity_bytes: Size of the GPU tier (a torch tensor on
            ``gpu_device``); 0 (the default) has none.
        gpu_device: torch device of the GPU tier, e.g. ``cuda:0``.
        gpu_watermarks: ``HIGH:LOW`` of the GPU tier (it demotes to DRAM).
        ssd_dir: Directory of the SSD tier; empty (the default) has none. A
            store restarted on the same directory serves its chunks again.
        ssd_capacity_bytes: Most bytes of the SSD tier's files; 0 takes 90%
            of the space free on ``ssd_dir``'s file system at start.
        ssd_watermarks: ``HIGH:LOW`` of the SSD tier (it drops its coldest).
        ssd_segment_bytes: Size of the SSD tier's segment files; 0 picks
            ``min(64 MiB, ssd capacity / 8)``.
        ssd_fsync: ``always``, ``segment`` (when a segment is full) or ``never``.
        ssd_io_threads: Threads that write to (and compact) the SSD tier.
        ssd_verify_on_open: Check every SSD chunk against its checksum at
            start (reads are checked regardless).
        ssd_compact_ratio: Share of freed space at which an SSD segment is
            compacted; 0 only reclaims segments freed entirely.
        eviction_policy: Order in which each tier gives chunks up (``lru``).
        promote_hits: Reads of an SSD chunk that promote it into DRAM; 0 never
            (clients that map DRAM promote regardless).
        gpu_promote_hits: Reads of a DRAM chunk that move it up into the GPU
            tier; 0 never.
        demotion_buffer_bytes: Most bytes of chunks on their way from DRAM
            to SSD at once; beyond it, chunks that must leave DRAM at once are
            dropped instead of demoted.
    """

    node_id: str = ""
    host: str = "127.0.0.1"
    port: int = 7800
    grpc_port: int = 0
    advertise_host: str = ""
    metadata: str = "127.0.0.1:7700"
    capacity_bytes: int = 1 << 30
    arena_path: str = ""
    shm: bool = True
    nixl: str = "auto"
    max_chunk_bytes: int = 0
    idle_timeout_s: float = 60.0
    io_timeout_s: float = 30.0
    min_rate_bytes: int = 1 << 20
    hold_timeout_s: float = 60.0
    max_connections: int = 1024
    verify_shm_commits: bool = False
    register_retry_s: float = 0.5
    force_node_id: bool = False
    metrics_port: int | None = None
    cpu_watermarks: str = "0.95:0.85"
    pin_memory: str = "auto"
    gpu_capacity_bytes: int = 0
    gpu_device: str = "cuda"
    gpu_watermarks: str = "0.95:0.85"
    ssd_dir: str = ""
    ssd_capacity_bytes: int = 0
    ssd_watermarks: str = "0.95:0.9"
    ssd_segment_bytes: int = 0
    ssd_fsync: str = "segment"
    ssd_io_threads: int = 4
    ssd_verify_on_open: bool = True
    ssd_compact_ratio: float = 0.5
    eviction_policy: str = "lru"
    promote_hits: int = 1
    gpu_promote_hits: int = 2
    demotion_buffer_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        for name in ("port", "grpc_port"):
            value = getattr(self, name)
            if not 0 <= value < 65536:
                raise InvalidArgument(f"bad {name} {value}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise InvalidArgument(f"bad metrics_port {self.metrics_port}")
        if self.capacity_bytes < 4096:
            raise InvalidArgument("capacity_bytes must be at least 4 KiB")
        if self.max_chunk_bytes < 0 or self.max_chunk_bytes > self.capacity_bytes:
            raise InvalidArgument("max_chunk_bytes must be between 0 and capacity_bytes")
        if self.nixl not in ("auto", "on", "off"):
            raise InvalidArgument(f"nixl must be auto, on or off, got {self.nixl!r}")
        if min(self.idle_timeout_s, self.io_timeout_s, self.hold_timeout_s) <= 0:
            raise InvalidArgument("timeouts must be positive")
        if self.register_retry_s <= 0:
            raise InvalidArgument("register_retry_s must be positive")
        if not isinstance(self.force_node_id, bool):
            raise InvalidArgument(
                f"force_node_id must be true or false, got {self.force_node_id!r}"
            )
        if self.min_rate_bytes <= 0 or self.max_connections <= 0:
            raise InvalidArgument("min_rate_bytes and max_connections must be positive")
        self._check_tiers()
        from kvdepot.connector.metadata import parse_endpoints

        parse_endpoints(self.metadata)

    def _check_tiers(self) -> None:
        from kvdepot.store.tiers.base import TierLimits
        from kvdepot.store.tiers.policy import TieringOptions
        from kvdepot.store.tiers.ssd import FSYNC_POLICIES

        for name in ("cpu_watermarks", "gpu_watermarks", "ssd_watermarks"):
            TierLimits.parse(getattr(self, name))
        if self.pin_memory not in ("auto", "on", "off"):
            raise InvalidArgument(f"pin_memory must be auto, on or off, got {self.pin_memory!r}")
        if self.gpu_capacity_bytes < 0 or self.ssd_capacity_bytes < 0:
            raise InvalidArgument("tier capacities must not be negative")
        if self.ssd_segment_bytes < 0 or self.ssd_io_threads < 1:
            raise InvalidArgument("ssd_segment_bytes must be >= 0 and ssd_io_threads >= 1")
        if self.ssd_fsync not in FSYNC_POLICIES:
            raise InvalidArgument(f"ssd_fsync must be one of {', '.join(FSYNC_POLICIES)}")
        if not 0 <= self.ssd_compact_ratio < 1:
            raise InvalidArgument("ssd_compact_ratio must be in [0, 1)")
        TieringOptions(
            policy=self.eviction_policy,
            promote_hits=self.promote_hits,
            gpu_promote_hits=self.gpu_promote_hits,
            demotion_buffer_bytes=self.demotion_buffer_bytes,
        )
