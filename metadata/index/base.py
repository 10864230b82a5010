"""The interface of an index backend: node registry, chunk index, placement."""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvdepot.errors import InvalidArgument, NodeIdTaken, StaleRegistration
from kvdepot.keys import KEY_BYTES, ChunkKey
from kvdepot.metadata.index.departures import DepartureConfig, DepartureLog, MemoryDepartures
from kvdepot.metadata.index.namespaces import MemoryNamespaces, NamespaceStore
from kvdepot.metadata.placement import PlacementConfig
from kvdepot.records import TierStats, TransferRate
from kvdepot.types import (
    COUNT_NONE,
    TIER_BY_CODE,
    TIER_RANK,
    Allocation,
    IndexStats,
    InventoryItem,
    KeyLocation,
    LookupCounting,
    LookupResult,
    NodeId,
    NodeInfo,
)
from kvdepot.validation import MAX_SIZE


@dataclass(frozen=True, slots=True)
class IndexConfig:
    """Configuration of the index.

    Attributes:
        url: Backend, by scheme: ``memory://`` (embedded) or a later ``redis://…``.
        lease_ttl_s: A node that has not heartbeated for this long is dropped
            with all its replicas.
        allocation_ttl_s: A ``PutStart`` allocation not committed within this
            long is reclaimed.
        placement: How new chunks are spread over nodes (warm-up, backoff).
        departures: How much history of chunk departures is kept.
        max_namespaces: Namespaces kept (the most recently seen).
    """

    url: str = "memory://"
    lease_ttl_s: float = 5.0
    allocation_ttl_s: float = 30.0
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    departures: DepartureConfig = field(default_factory=DepartureConfig)
    max_namespaces: int = 1024

    def __post_init__(self) -> None:
        if self.max_namespaces < 1:
            raise InvalidArgument("max_namespaces must be positive")
        if "://" not in self.url:
            raise InvalidArgument(f"index url {self.url!r} must look like scheme://…")
        if self.lease_ttl_s <= 0 or self.allocation_ttl_s <= 0:
            raise InvalidArgument("lease and allocation TTLs must be positive")


Digest = tuple[int, int]
"""The count of a set of chunk keys and the sum of their hashes (:mod:`kvdepot.wire.digest`)."""

MAX_PAGE_CHUNKS = 65536
"""Chunks in one inventory page at most: about 1.5 MB on the wire, and a
bounded amount of index work per call."""
DEFAULT_PAGE_CHUNKS = 4096
"""The page size a metadata service asks for unless configured otherwise: a
page's decoding (on the service's loop, in one go) stays near a quarter of a
millisecond, so lookups meanwhile wait little behind it."""


@dataclass(frozen=True, slots=True)
class InventoryPage:
    """One page of a node's inventory, in columns (no object per chunk).

    Attributes:
        keys: ``n`` chunk keys of 16 bytes, concatenated.
        sizes: One size in bytes per key (``uint64``).
        tiers: One tier code per key (``uint8``, index into ``TIER_BY_CODE``).
    """

    keys: bytes
    sizes: np.ndarray
    tiers: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.keys) // KEY_BYTES
        if len(self.keys) % KEY_BYTES:
            raise InvalidArgument(f"inventory keys of {len(self.keys)} bytes: not 16 bytes each")
        if len(self.sizes) != n:
            raise InvalidArgument(f"{n} inventory keys but {len(self.sizes)} sizes")
        if len(self.tiers) != n:
            raise InvalidArgument(f"{n} inventory keys but {len(self.tiers)} tiers")
        if n and int(self.tiers.max()) >= len(TIER_BY_CODE):
            raise InvalidArgument(f"unknown tier code {int(self.tiers.max())} in an inventory")
        if n and not 0 < int(self.sizes.min()) <= int(self.sizes.max()) <= MAX_SIZE:
            raise InvalidArgument(f"chunk sizes must be between 1 and {MAX_SIZE} in an inventory")

    def __len__(self) -> int:
        return len(self.keys) // KEY_BYTES

    @classmethod
    def of(
        cls, keys: bytes, sizes: Sequence[int] | np.ndarray, tiers: bytes = b""
    ) -> InventoryPage:
        """A page from wire columns; ``tiers`` empty: every chunk on cpu."""
        n = len(keys) // KEY_BYTES
        size_col = np.asarray(sizes, dtype=np.uint64)
        if tiers:
            tier_col = np.frombuffer(tiers, dtype=np.uint8)
        else:
            tier_col = np.full(n, TIER_RANK["cpu"], dtype=np.uint8)
        return cls(keys, size_col, tier_col)

    @classmethod
    def from_items(cls, items: Sequence[InventoryItem]) -> InventoryPage:
        return cls(
            b"".join(i.key for i in items),
            np.fromiter((i.size for i in items), dtype=np.uint64, count=len(items)),
            np.fromiter((TIER_RANK[i.tier] for i in items), dtype=np.uint8, count=len(items)),
        )

    def key(self, i: int) -> ChunkKey:
        return ChunkKey(self.keys[i * KEY_BYTES : (i + 1) * KEY_BYTES])

    def items(self) -> Iterator[InventoryItem]:
        """The page's chunks as items (an object each: for small pages)."""
        for i, (size, tier) in enumerate(
            zip(self.sizes.tolist(), self.tiers.tolist(), strict=True)
        ):
            yield InventoryItem(self.key(i), size, TIER_BY_CODE[tier])


def node_id_taken(node_id: NodeId, address: str, remaining_s: float) -> NodeIdTaken:
    """The refusal of a registration of a node id another live instance holds."""
    return NodeIdTaken(
        f"node id {node_id!r} is held by another live store instance at {address} "
        f"(its lease runs out in {remaining_s:.1f} s unless it heartbeats); stop that "
        "store or pick another --node-id, or take the id over with --force-node-id",
        remaining_s,
    )


def stale_registration(node_id: NodeId, epoch: int, current: int | None) -> StaleRegistration:
    """The refusal of a heartbeat of a replaced registration."""
    now = f"epoch {current}" if current else "another epoch"
    return StaleRegistration(
        f"node {node_id!r} was registered again by another store instance ({now}); "
        f"heartbeats of epoch {epoch} no longer renew its lease"
    )


def next_epoch(last: int, now_ms: int) -> int:
    """An epoch above ``last`` and the wall clock in ms, so that one never repeats
    even across a restart of the index."""
    return max(last + 1, now_ms)


class IndexBackend(abc.ABC):
    """Where the metadata service keeps nodes, chunks and pending allocations.

    Methods are coroutines so that networked backends do not block the
    service's event loop; ``now`` is a monotonic time in seconds, passed in
    so that expiry is testable.

    ``namespaces`` and ``departures`` keep the namespaces in use and the
    history of chunk departures; a backend that keeps its state elsewhere
    (Redis) replaces the in-process ones.
    """

    _namespaces: NamespaceStore | None = None
    _departures: DepartureLog | None = None

    @property
    def namespaces(self) -> NamespaceStore:
        if self._namespaces is None:
            self._namespaces = MemoryNamespaces()
        return self._namespaces

    @property
    def departures(self) -> DepartureLog:
        if self._departures is None:
            self._departures = MemoryDepartures()
        return self._departures

    async def probe(
        self, keys: Sequence[ChunkKey], client_node_id: NodeId = ""
    ) -> list[KeyLocation | None]:
        """Per key, where it is stored (None: nowhere), whatever precedes it;
        counts nothing. For ``Explain``: a lookup a key at a time."""
        out: list[KeyLocation | None] = []
        for key in keys:
            found = await self.lookup([key], client_node_id, LookupCounting(mode=COUNT_NONE))
            out.append(found.locations[0] if found.hits else None)
        return out

    async def lost_with_node(self, keys: Sequence[ChunkKey]) -> dict[ChunkKey, tuple[str, float]]:
        """Keys whose only replicas belonged to registrations that ended
        (node, wall time it ended), where the backend still knows them
        (the Redis index until its sweep; the embedded one records them as
        departures instead)."""
        return {}

    @abc.abstractmethod
    async def register_begin(
        self,
        node: NodeInfo,
        now: float,
        instance: str = "",
        force: bool = False,
    ) -> int:
        """Add or replace a node with no chunks yet: its inventory follows in
        :meth:`register_page` calls under the returned epoch.

        The replicas of the node's earlier registration stop counting at once
        (a lookup never names them again); what they leave in the index is
        cleaned up later, in bounded steps.

        Args:
            node: The node; its id is owned by the store instance that holds
                a live lease on it.
            now: Monotonic time in seconds.
            instance: The registering store instance's identity. A node id
                whose lease is live under another instance is refused; the
                same instance (a store restarted on its own SSD directory)
                takes it back at once.
            force: Take the id over from a live instance anyway.

        Returns:
            The registration's epoch (positive, never reused for the node id),
            which its heartbeats and pages carry.

        Raises:
            NodeIdTaken: Another instance holds a live lease on the node id.
        """

    @abc.abstractmethod
    async def register_page(
        self, node_id: NodeId, epoch: int, page: InventoryPage, now: float, last: bool = False
    ) -> tuple[int, int]:
        """Index one page of a registering node's inventory and renew its lease.

        The work is bounded by the page (at most :data:`MAX_PAGE_CHUNKS`) and
        done in steps that let other requests through. A page sent again (a
        retry) changes nothing more.

        Returns:
            (replicas the page added: none for a page sent again, chunks the node has in
            the index now).

        Raises:
            NotFound: The node is not registered (its lease ran out, or the
                index was lost): register again.
            StaleRegistration: The node was registered again under another epoch.
        """

    async def register_node(
        self,
        node: NodeInfo,
        inventory: Sequence[InventoryItem],
        now: float,
        instance: str = "",
        force: bool = False,
    ) -> int:
        """Add or replace a node with its whole inventory: :meth:`register_begin`
        and the inventory in pages. Returns the epoch (see there)."""
        epoch = await self.register_begin(node, now, instance, force)
        pages = range(0, len(inventory), DEFAULT_PAGE_CHUNKS)
        for start in pages:
            page = InventoryPage.from_items(inventory[start : start + DEFAULT_PAGE_CHUNKS])
            await self.register_page(node.node_id, epoch, page, now, last=False)
        await self.register_page(node.node_id, epoch, InventoryPage.of(b"", ()), now, last=True)
        return epoch

    @abc.abstractmethod
    async def heartbeat(
        self,
        node_id: NodeId,
        tiers: Sequence[TierStats],
        now: float,
        transfer: TransferRate | None = None,
        epoch: int = 0,
    ) -> bool:
        """Renew a lease; False if the node is unknown (it must register again).

        ``tiers`` (when not empty) and ``transfer`` (when given) replace what
        the node reported before. ``epoch`` (0: not checked) is the one
        :meth:`register_node` answered the heartbeating instance.

        Raises:
            StaleRegistration: The node is registered under another epoch (its
                id was registered again since): the lease is not renewed.
        """

    async def heartbeat_held(
        self,
        node_id: NodeId,
        tiers: Sequence[TierStats],
        now: float,
        transfer: TransferRate | None,
        epoch: int,
        held: Digest,
    ) -> tuple[bool, Digest | None]:
        """:meth:`heartbeat` of a node that reports its inventory digest
        ``held`` (count, sum: :mod:`kvdepot.wire.digest`), kept for statistics.

        Returns:
            Whether the node is known, and the index's digest of the node's
            replicas (None: this index keeps no digests; the node does not
            reconcile).
        """
        return await self.heartbeat(node_id, tiers, now, transfer, epoch), None

    async def reconcile_digests(
        self, node_id: NodeId, epoch: int, groups: bytes
    ) -> tuple[list[int], bytes]:
        """The groups whose cells differ from the node's ``groups`` (64
        packed cells), and the index's cells of their buckets, packed.

        Raises:
            NotFound, StaleRegistration: As :meth:`register_page`.
        """
        raise InvalidArgument("this index backend keeps no inventory digests")

    async def reconcile_buckets(
        self, node_id: NodeId, epoch: int, buckets: Sequence[tuple[int, InventoryPage]]
    ) -> tuple[bytes, bytes]:
        """Per bucket, every key the node holds in it: index those it is not
        indexed for; return the keys whose replicas were added, and the keys
        it is indexed for in these buckets besides (each concatenated), which
        the node checks and reports removed. Work bounded by the keys given
        and by 1/4096 of the index per bucket, with pauses between buckets.

        Raises:
            NotFound, StaleRegistration: As :meth:`register_page`.
        """
        raise InvalidArgument("this index backend keeps no inventory digests")

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
                (:data:`~kvdepot.validation.MAX_REQUEST_ID` bytes at
                most). A key still pending under this id gets its allocation
                again, on the same node, instead of ``SKIP_PENDING`` (on a new
                node if that one is gone): a retry after a lost reply writes
                what the first attempt was given. Empty: never matches.

        Returns:
            One allocation per key, in order.
        """

    @abc.abstractmethod
    async def put_end(self, node_id: NodeId, keys: Sequence[ChunkKey], sizes: Sequence[int]) -> int:
        """Commit chunks written to ``node_id``; returns how many were committed."""

    async def commit_written(
        self,
        node_id: NodeId,
        keys: Sequence[ChunkKey],
        sizes: Sequence[int],
        now: float,
        request_id: bytes = b"",
    ) -> tuple[list[Allocation], int]:
        """A put whose every chunk ``node_id``'s store holds already.

        The allocations :meth:`put_start` answers for them (a new chunk is
        ``WRITE``), then committed on ``node_id`` as :meth:`put_end` does;
        returns both answers. A backend may do it in one step, with the same
        answers and effects (a store's index commits take this path on every
        put).
        """
        allocations = await self.put_start(keys, sizes, node_id, now, request_id)
        return allocations, await self.put_end(node_id, keys, sizes)

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
