"""Configuration of the metadata service."""

from __future__ import annotations

from dataclasses import dataclass

from kvdepot.config import InvalidSetting, Number, Port, positive, setting, validate
from kvdepot.metadata.index.base import DEFAULT_PAGE_CHUNKS, MAX_PAGE_CHUNKS


@dataclass(frozen=True, slots=True)
class MetadataConfig:
    """Configuration of one metadata service process.

    Attributes:
        host: Address the gRPC server binds (loopback unless told otherwise).
        port: gRPC port; 0 picks a free one.
        index: Index backend URL: ``memory://`` (embedded).
        lease_ttl_s: Seconds without a heartbeat after which a store is dropped.
        heartbeat_interval_s: How often stores are told to heartbeat.
        allocation_ttl_s: Seconds an uncommitted ``PutStart`` allocation lives.
        reap_interval_s: How often expired nodes and allocations are reclaimed.
        max_keys_per_request: Upper bound on keys in one request.
        placement_warmup_s: A store registered less than this long ago takes
            a bounded share of new writes placed by the service.
        placement_warmup_share: That share, as a multiple of the fair share
            (1 / number of stores).
        placement_backoff_s: A store whose allocations failed (revoked, or
            expired uncommitted) is avoided this long.
        hot_reads: Reads of a chunk from nodes without a replica (within
            about ``hot_window_s``) that make it hot: readers with a store are
            then asked to copy it there; 0: never.
        hot_max_replicas: Replicas a hot chunk is copied to at most.
        hot_window_s: Half-life of the read counts of hot chunks.
        max_page_chunks: Upper bound on chunks in one page of a store's
            inventory (``RegisterInventory``); stores are told it when they register.
        kv_events: ZeroMQ endpoint to publish KV events on (vLLM's wire
            format), e.g. ``tcp://127.0.0.1:5557``; empty: off.
        kv_events_replay: Endpoint of the replay socket; empty: event port + 1.
        kv_events_block_size: Tokens per chunk, reported in the events.
        route_link_bytes_per_s: Default link speed of the ``Route`` cost model.
        route_prefill_tokens_per_s: Default prefill rate of the ``Route`` cost model.
        route_load_penalty_s: Default seconds per unit of load in ``Route``.
        metrics_port: Port of the Prometheus ``/metrics`` HTTP endpoint, bound
            on ``host``; ``None`` (the default) serves none, 0 picks a free port.
        frames: Also serve ``Lookup`` and ``PutStart`` on a framed TCP socket
            (:mod:`kvdepot.wire.frames`): the same calls at a fraction of a gRPC
            round trip. Never with TLS (the socket is not encrypted).
        frames_port: Its port, bound on ``host``; 0 (the default) picks a free
            one, which the gRPC replies advertise to clients.
        departures_per_node: Chunk departures (evictions, losses, ...) the
            index keeps per node for ``kvdepot explain``; 0 keeps none.
        departure_nodes: Nodes whose departures are kept (the most recent).
        max_namespaces: Namespaces the index keeps (the most recently seen).
        stop_timeout_s: Longest the process takes to exit after SIGTERM or
            SIGINT; past it, it writes its threads' stacks to stderr and exits
            with status 1 (see :mod:`kvdepot.shutdown`).
    """

    host: str = setting("127.0.0.1", flag="--host", help="bind address (default 127.0.0.1)")
    port: int = setting(7700, Port(), flag="--port", help="gRPC port (default 7700; 0 picks one)")
    index: str = setting("memory://", flag="--index", help="index backend URL (default memory://)")
    lease_ttl_s: float = setting(
        5.0, positive(), flag="--lease-ttl", help="store lease in seconds (default 5)"
    )
    heartbeat_interval_s: float = setting(
        1.0, positive(), flag="--heartbeat-interval", help="store heartbeat seconds (default 1)"
    )
    allocation_ttl_s: float = setting(
        30.0, positive(), flag="--allocation-ttl", help="uncommitted put lifetime (default 30)"
    )
    reap_interval_s: float = setting(0.5, positive())
    max_keys_per_request: int = setting(65536, Number(low=1))
    placement_warmup_s: float = setting(30.0, Number(low=0))
    placement_warmup_share: float = setting(1.5, Number(low=1))
    placement_backoff_s: float = setting(10.0, Number(low=0))
    hot_reads: int = setting(8, Number(low=0))
    hot_max_replicas: int = setting(3, Number(low=1))
    hot_window_s: float = setting(10.0, positive())
    max_page_chunks: int = setting(DEFAULT_PAGE_CHUNKS, Number(low=1, high=MAX_PAGE_CHUNKS))
    kv_events: str = setting(
        "",
        flag="--kv-events",
        metavar="ENDPOINT",
        help="publish KV events (vLLM ZeroMQ format) on e.g. tcp://127.0.0.1:5557 (default off)",
    )
    kv_events_replay: str = setting(
        "", flag="--kv-events-replay", metavar="ENDPOINT", help="replay socket (default port+1)"
    )
    kv_events_block_size: int = setting(
        256, Number(low=1), flag="--kv-events-block-size", help="tokens per chunk in events (256)"
    )
    route_link_bytes_per_s: float = setting(12.5e9, positive())
    route_prefill_tokens_per_s: float = setting(10_000.0, positive())
    route_load_penalty_s: float = setting(0.05, Number(low=0))
    metrics_port: int | None = setting(
        None,
        Port(),
        flag="--metrics-port",
        help="serve Prometheus /metrics on this port (default off)",
    )
    frames: bool = setting(
        True, flag="--no-frames", help="serve Lookup and PutStart over gRPC only"
    )
    frames_port: int = setting(
        0, Port(), flag="--frames-port", help="port of the framed Lookup/PutStart socket (0: any)"
    )
    departures_per_node: int = setting(
        65536,
        Number(low=0, high=1 << 24),
        flag="--departures-per-node",
        help="chunk departures kept per node for explain (default 65536; 0: none)",
    )
    departure_nodes: int = setting(256, Number(low=1))
    max_namespaces: int = setting(1024, Number(low=1))
    stop_timeout_s: float = setting(
        30.0, positive(), flag="--stop-timeout", help="seconds a stop may take (default 30)"
    )

    def __post_init__(self) -> None:
        validate(self)
        if self.heartbeat_interval_s * 2 > self.lease_ttl_s:
            raise InvalidSetting(
                ("lease_ttl_s", "heartbeat_interval_s"),
                f"must be at least twice heartbeat_interval_s ({self.heartbeat_interval_s:g}) "
                "so that one late heartbeat does not drop a store",
                self.lease_ttl_s,
            )
