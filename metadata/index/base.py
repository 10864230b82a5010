"""The interface of an index backend: node registry, chunk index, placement."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

from kvdepot.errors import InvalidArgument
from kvdepot.metadata.keys import ChunkKey
from kvdepot.metadata.types import (
    Allocation,
    IndexStats,
    InventoryItem,
    LookupCounting,
    LookupResult,
    NodeId,
    NodeInfo,
    TierUsage,
    TransferRate,
)


@dataclass(frozen=True, slots=True)
class IndexConfig:
    """Configuration of the index.

    Attributes:
        url: Backend, by scheme: ``memory://`` (embedded) or a later ``redis://…``.
        lease_ttl_s: A node that has not heartbeated for this long is dropped
            with all its replicas.
        allocation_ttl_s: A ``PutStart`` allocation not committed within this
            long is reclaimed.
    """

    url: str = "memory://"
    lease_ttl_s: float = 5.0
    allocation_ttl_s: float = 30.0

    def __post_init__(self) -> None:
        if "://" not in self.url:
            raise InvalidArgument(f"index url {self.url!r} must look like scheme://…")
        if self.lease_ttl_s <= 0 or self.allocation_ttl_s <= 0:
            raise InvalidArgument("lease and allocation TTLs must be positive")


class IndexBackend(abc.ABC):
    """Where the metadata service keeps nodes, chunks and pending allocations.

    Methods are coroutines so that networked backends do not block the
    service's event loop; ``now`` is a monotonic time in seconds, passed in
    so that expiry is testable.
    """

    @abc.abstractmethod
    async def register_node(
        self, node: NodeInfo, inventory: Sequence[InventoryItem], now: float
    ) -> None:
        """Add or replace a node, replacing its replicas with ``inventory``."""

    @abc.abstractmethod
    async def heartbeat(
        self,
        node_id: NodeId,
        tiers: Sequence[TierUsage],
        now: float,
        transfer: TransferRate | None = None,
    ) -> bool:
        """Renew a lease; False if the node is unknown (it must register again).

        ``tiers`` (when not empty) and ``transfer`` (when given) replace what
        the node reported before.
        """

    @abc.abstractmethod
    async def remove_replicas(self, node_id: NodeId, keys: Sequence[ChunkKey]) -> int:
        """Forget that ``node_id`` holds ``keys``; returns how many it held."""

    @abc.abstractmethod
    async def put_start(
        self,
        keys: Sequence[ChunkKey],
        sizes: Sequence[int],
        writer_node_id: NodeId,
        now: float,
        request_id: bytes = b"",
    ) -> list[Allocation]:
        """Phase 1 of a put: skip what exists or is pending, place the rest.

        Args:
            keys: The chunks to publish; a key repeated in ``keys`` is placed
                once and skipped as pending after that.
            sizes: One size in bytes per key.
            writer_node_id: The node to place on first ("" for none).
            now: Monotonic time in seconds.
            request_id: The put's own id, the same on every retry of it
                (:data:`~kvdepot.metadata.validation.MAX_REQUEST_ID` bytes at
                most). A key still pending under this id gets its allocation
                again, on the same node, instead of ``SKIP_PENDING`` (on a new
                node if that one is gone): a retry after a lost reply writes
                what the first attempt was given. Empty: never matches.

        Returns:
            One allocation per key, in order.
        """

    @abc.abstractmethod
    async def put_end(
        self, node_id: NodeId, keys: Sequence[ChunkKey], sizes: Sequence[int]
    ) -> int:
        """Commit chunks written to ``node_id``; returns how many were committed."""

    @abc.abstractmethod
    async def put_revoke(self, node_id: NodeId, keys: Sequence[ChunkKey]) -> int:
        """Drop pending allocations of ``keys`` on ``node_id``."""

    @abc.abstractmethod
    async def lookup(
        self,
        keys: Sequence[ChunkKey],
        client_node_id: NodeId,
        counting: LookupCounting | int = 0,
    ) -> LookupResult:
        """Leading hits of ``keys`` with their replicas, local first."""

    @abc.abstractmethod
    async def expire(self, now: float) -> tuple[int, int]:
        """Drop expired nodes and allocations; returns (nodes, allocations)."""

    @abc.abstractmethod
    async def stats(self, now: float) -> IndexStats:
        """Cluster-wide statistics."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources."""
