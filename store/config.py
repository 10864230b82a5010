"""Configuration of the store daemon."""

from __future__ import annotations

from dataclasses import dataclass

from kvdepot.config import (
    Choice,
    Directory,
    FilePath,
    InvalidSetting,
    Number,
    Parsed,
    Port,
    positive,
    setting,
    validate,
)
from kvdepot.endpoints import parse_endpoints

TIERS = "tiers (GPU, DRAM, SSD)"
"""The ``--help`` section of the tiers' options."""

FSYNC_POLICIES = ("always", "segment", "never")
"""When the SSD tier syncs its files (see ``kvdepot.store.tiers.ssd``)."""


# The parsers live with the code that uses the values; imported on use, as
# those modules import this one.
def _watermarks(text: str) -> None:
    from kvdepot.store.tiers.base import TierLimits

    TierLimits.parse(text)


def _node_id(text: str) -> None:
    # The metadata service's own rule: a store it would refuse never starts.
    from kvdepot.validation import check_text

    check_text(text, "a node id", required=False)


def _eviction_policy(name: str) -> None:
    from kvdepot.store.tiers.policy import create_policy

    create_policy(name)


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Configuration of one store daemon.

    Attributes:
        node_id: Name of this node in the cluster (at most 256 printable
            characters, no spaces); empty derives one from the
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
        index_commit_timeout_s: Longest a put from a writer of this node waits
            for the store to commit its chunks into the index (the writer asks
            for it in its data-plane request); after it, the reply says "not
            indexed" and the writer commits them itself.
        reconcile_keys: Most keys the store sends per heartbeat to reconcile
            its inventory with the index (a bucket larger than this goes alone).
        reconcile_scrub_s: Seconds between two buckets the store sends to the
            index even though their digests agree (a slow scrub that finds
            chunks lost from the index behind its back, e.g. a Redis shard's);
            a full pass over 4096 buckets takes 4096 times this (34 hours at
            the default 30 s, a bucket's keys each time). 0: none.
        force_node_id: Take ``node_id`` over at start even while another live
            store instance holds it (its heartbeats are refused from then on
            and it stops). Off (the default), such a registration is refused
            and this store exits with status 1: two stores under one id would
            corrupt the index. A store restarted on its own SSD directory
            takes its id back without this (it is the same instance).
        metrics_port: Port of the Prometheus ``/metrics`` HTTP endpoint, bound
            on ``host``; ``None`` (the default) serves none, 0 picks a free port.
        stop_timeout_s: Longest the process takes to exit after SIGTERM or
            SIGINT (its cleanup frees the arena and closes the tiers); past it,
            it writes its threads' stacks to stderr and exits with status 1
            (see :mod:`kvdepot.shutdown`; a later start removes an arena file
            left behind).
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
            The store creates the directory itself but not its parent: a
            missing parent is refused as a mistyped path.
        ssd_capacity_bytes: Most bytes of the SSD tier's files; 0 takes 90%
            of the space free on ``ssd_dir``'s file system at start (the
            store logs the size it took, and stats show it).
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

    node_id: str = setting(
        "", Parsed(_node_id), flag="--node-id", help="node name (default derived from the address)"
    )
    host: str = setting("127.0.0.1", flag="--host", help="bind address (default 127.0.0.1)")
    port: int = setting(
        7800, Port(), flag="--port", help="data-plane port (default 7800; 0 picks one)"
    )
    grpc_port: int = setting(
        0, Port(), flag="--grpc-port", help="gRPC stats port (default 0: pick one)"
    )
    advertise_host: str = setting(
        "", flag="--advertise-host", help="host other nodes reach this one at"
    )
    metadata: str = setting(
        "127.0.0.1:7700",
        Parsed(parse_endpoints),
        flag="--metadata",
        help="metadata service host:port (default 127.0.0.1:7700)",
    )
    capacity_bytes: int = setting(
        1 << 30,
        Number(low=4096),
        flag="--capacity",
        help="DRAM arena size, e.g. 4GiB (default 1GiB)",
    )
    arena_path: str = setting(
        "", FilePath(), flag="--arena-path", help="file backing the arena, e.g. /dev/shm/kvdepot"
    )
    shm: bool = setting(True, flag="--no-shm", help="do not offer same-host shared memory")
    nixl: str = setting(
        "auto", Choice(("auto", "on", "off")), flag="--nixl", help="offer NIXL (RDMA) transfers"
    )
    max_chunk_bytes: int = setting(
        0,
        Number(low=0),
        flag="--max-chunk",
        help="largest chunk accepted (default: the arena size)",
    )
    idle_timeout_s: float = setting(60.0, positive())
    io_timeout_s: float = setting(30.0, positive())
    min_rate_bytes: int = setting(1 << 20, Number(low=1))
    hold_timeout_s: float = setting(60.0, positive())
    max_connections: int = setting(1024, Number(low=1))
    verify_shm_commits: bool = setting(
        False,
        flag="--verify-shm-commits",
        help="hash chunks shm clients wrote again before committing them",
    )
    register_retry_s: float = setting(0.5, positive())
    index_commit_timeout_s: float = setting(2.0, positive())
    reconcile_keys: int = setting(4096, Number(low=1, high=65536))
    reconcile_scrub_s: float = setting(30.0, Number(low=0))
    force_node_id: bool = setting(
        False,
        flag="--force-node-id",
        help="take --node-id over even while another live store holds it (default: refuse)",
    )
    metrics_port: int | None = setting(
        None,
        Port(),
        flag="--metrics-port",
        help="serve Prometheus /metrics on this port (default off)",
    )
    stop_timeout_s: float = setting(
        60.0, positive(), flag="--stop-timeout", help="seconds a stop may take (default 60)"
    )
    cpu_watermarks: str = setting("0.95:0.85", Parsed(_watermarks), flag="--watermarks cpu=")
    pin_memory: str = setting(
        "auto",
        Choice(("auto", "on", "off")),
        flag="--pin-memory",
        help="page-lock DRAM for CUDA",
        group=TIERS,
    )
    gpu_capacity_bytes: int = setting(
        0,
        Number(low=0),
        flag="--gpu-capacity",
        help="GPU tier size, e.g. 8GiB (default: no GPU tier)",
        group=TIERS,
    )
    gpu_device: str = setting(
        "cuda", flag="--gpu-device", help="torch device of the GPU tier (default cuda)", group=TIERS
    )
    gpu_watermarks: str = setting("0.95:0.85", Parsed(_watermarks), flag="--watermarks gpu=")
    ssd_dir: str = setting(
        "",
        Directory(),
        flag="--ssd-dir",
        help="directory of the SSD tier (default: no SSD tier)",
        group=TIERS,
    )
    ssd_capacity_bytes: int = setting(
        0,
        Number(low=0),
        flag="--ssd-capacity",
        help="SSD tier size (default 90%% of the free space)",
        group=TIERS,
    )
    ssd_watermarks: str = setting("0.95:0.9", Parsed(_watermarks), flag="--watermarks ssd=")
    ssd_segment_bytes: int = setting(
        0,
        Number(low=0),
        flag="--ssd-segment",
        help="SSD segment file size (default min(64MiB, cap/8))",
        group=TIERS,
    )
    ssd_fsync: str = setting(
        "segment", Choice(FSYNC_POLICIES), flag="--ssd-fsync", help="default segment", group=TIERS
    )
    ssd_io_threads: int = setting(
        4,
        Number(low=1, high=256),
        flag="--ssd-io-threads",
        help="SSD writer threads (default 4)",
        group=TIERS,
    )
    ssd_verify_on_open: bool = setting(
        True, flag="--no-ssd-verify", help="do not check SSD chunks at start", group=TIERS
    )
    ssd_compact_ratio: float = setting(
        0.5,
        Number(low=0, high=1, high_open=True),
        flag="--ssd-compact-ratio",
        help="freed share that compacts (0.5)",
        group=TIERS,
    )
    eviction_policy: str = setting(
        "lru",
        Parsed(_eviction_policy),
        flag="--eviction-policy",
        help="order tiers give chunks up in (default lru)",
        group=TIERS,
    )
    promote_hits: int = setting(
        1,
        Number(low=0),
        flag="--promote-hits",
        help="SSD reads that promote to DRAM (1)",
        group=TIERS,
    )
    gpu_promote_hits: int = setting(
        2,
        Number(low=0),
        flag="--gpu-promote-hits",
        help="DRAM reads that promote to GPU (2)",
        group=TIERS,
    )
    demotion_buffer_bytes: int = setting(
        256 << 20,
        Number(low=0),
        flag="--demotion-buffer",
        help="most bytes on their way to SSD (default 256MiB)",
        group=TIERS,
    )

    def __post_init__(self) -> None:
        validate(self)
        if self.max_chunk_bytes > self.capacity_bytes:
            raise InvalidSetting(
                ("max_chunk_bytes", "capacity_bytes"),
                f"must not exceed capacity_bytes ({self.capacity_bytes})",
                self.max_chunk_bytes,
            )
