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
        register_retry_s: Delay between attempts to reach the metadata service.
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
    register_retry_s: float = 0.5

    def __post_init__(self) -> None:
        for name in ("port", "grpc_port"):
            value = getattr(self, name)
            if not 0 <= value < 65536:
                raise InvalidArgument(f"bad {name} {value}")
        if self.capacity_bytes < 4096:
            raise InvalidArgument("capacity_bytes must be at least 4 KiB")
        if self.max_chunk_bytes < 0 or self.max_chunk_bytes > self.capacity_bytes:
            raise InvalidArgument("max_chunk_bytes must be between 0 and capacity_bytes")
        if self.nixl not in ("auto", "on", "off"):
            raise InvalidArgument(f"nixl must be auto, on or off, got {self.nixl!r}")
        if self.idle_timeout_s <= 0 or self.io_timeout_s <= 0 or self.register_retry_s <= 0:
            raise InvalidArgument("timeouts must be positive")
        from kvdepot.connector.metadata import parse_endpoints

        parse_endpoints(self.metadata)
