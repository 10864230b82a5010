"""Configuration of the metadata service."""

from __future__ import annotations

from dataclasses import dataclass

from kvdepot.errors import InvalidArgument


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
        kv_events: ZeroMQ endpoint to publish KV events on (vLLM's wire
            format), e.g. ``tcp://127.0.0.1:5557``; empty: off.
        kv_events_replay: Endpoint of the replay socket; empty: event port + 1.
        kv_events_block_size: Tokens per chunk, reported in the events.
        route_link_bytes_per_s: Default link speed of the ``Route`` cost model.
        route_prefill_tokens_per_s: Default prefill rate of the ``Route`` cost model.
        route_load_penalty_s: Default seconds per unit of load in ``Route``.
        metrics_port: Port of the Prometheus ``/metrics`` HTTP endpoint, bound
            on ``host``; ``None`` (the default) serves none, 0 picks a free port.
    """

    host: str = "127.0.0.1"
    port: int = 7700
    index: str = "memory://"
    lease_ttl_s: float = 5.0
    heartbeat_interval_s: float = 1.0
    allocation_ttl_s: float = 30.0
    reap_interval_s: float = 0.5
    max_keys_per_request: int = 65536
    kv_events: str = ""
    kv_events_replay: str = ""
    kv_events_block_size: int = 256
    route_link_bytes_per_s: float = 12.5e9
    route_prefill_tokens_per_s: float = 10_000.0
    route_load_penalty_s: float = 0.05
    metrics_port: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise InvalidArgument(f"bad port {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise InvalidArgument(f"bad metrics_port {self.metrics_port}")
        if self.lease_ttl_s <= 0 or self.heartbeat_interval_s <= 0:
            raise InvalidArgument("lease_ttl_s and heartbeat_interval_s must be positive")
        if self.heartbeat_interval_s * 2 > self.lease_ttl_s:
            raise InvalidArgument("lease_ttl_s must be at least twice heartbeat_interval_s")
        if self.allocation_ttl_s <= 0 or self.reap_interval_s <= 0:
            raise InvalidArgument("allocation_ttl_s and reap_interval_s must be positive")
        if self.max_keys_per_request < 1:
            raise InvalidArgument("max_keys_per_request must be positive")
        if self.kv_events_block_size < 1:
            raise InvalidArgument("kv_events_block_size must be positive")
        if min(self.route_link_bytes_per_s, self.route_prefill_tokens_per_s) <= 0:
            raise InvalidArgument("route link speed and prefill rate must be positive")
        if self.route_load_penalty_s < 0:
            raise InvalidArgument("route_load_penalty_s must not be negative")
