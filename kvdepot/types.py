"""Boundary data of the metadata service, independent of protobuf."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvdepot.keys import ChunkKey
from kvdepot.records import TierStats, TransferRate

NodeId = str

LEASE_REMAINING_KEY = "kvdepot-lease-remaining-ms"
"""Trailing metadata of a RegisterNode refused for a node id another live
instance holds: the milliseconds left of that instance's lease."""

TIER_BY_CODE = ("gpu", "cpu", "ssd")
"""The tiers, fastest first: the one place that says their order. A tier's
position is its rank and its one-byte code in a paged inventory."""
TIER_RANK = {name: rank for rank, name in enumerate(TIER_BY_CODE)}
"""Tier name -> rank, lower is faster: a store orders its tiers by it, and
lookups order replicas by it after locality."""


_NO_TRANSFER = TransferRate()  # frozen: one instance serves as every default


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """A registered store node."""

    node_id: NodeId
    address: str
    grpc_address: str = ""
    tiers: tuple[TierStats, ...] = ()
    transfer: TransferRate = _NO_TRANSFER

    @property
    def capacity_bytes(self) -> int:
        return sum(t.capacity_bytes for t in self.tiers)

    @property
    def free_bytes(self) -> int:
        return sum(max(0, t.capacity_bytes - t.used_bytes) for t in self.tiers)


@dataclass(frozen=True, slots=True)
class Replica:
    """One copy of a chunk."""

    node_id: NodeId
    address: str
    tier: str = "cpu"


@dataclass(frozen=True, slots=True)
class InventoryItem:
    """A chunk a node holds, as announced at registration."""

    key: ChunkKey
    size: int
    tier: str = "cpu"


class Action(enum.Enum):
    """What a writer should do with one key of a put."""

    WRITE = 1
    SKIP_EXISTS = 2
    SKIP_PENDING = 3


@dataclass(frozen=True, slots=True)
class Allocation:
    """The answer of ``PutStart`` for one key."""

    action: Action
    node: Replica | None = None


@dataclass(frozen=True, slots=True)
class KeyLocation:
    """Where one hit key lives."""

    size: int
    replicas: tuple[Replica, ...]


@dataclass(frozen=True, slots=True)
class LookupResult:
    """The number of leading hits and where each hit lives.

    ``replicate``: indexes of hit keys a reader with a store of its own should
    copy there after reading them (hot chunks short of replicas).
    """

    hits: int
    locations: tuple[KeyLocation, ...] = ()
    replicate: tuple[int, ...] = ()


COUNT_ALL, COUNT_HITS, COUNT_NONE = 0, 1, 2


@dataclass(frozen=True, slots=True)
class LookupCounting:
    """What one lookup adds to the cluster's statistics.

    Attributes:
        tokens_per_key: Tokens each key covers, for hit rates in tokens.
        key_tokens: Per key, where keys cover different token counts (a
            prompt's chunks, then its tail blocks); overrides tokens_per_key.
        mode: ``COUNT_ALL`` (a prompt's lookup), ``COUNT_HITS`` (the rest of
            a prompt's lookup: its hits only) or ``COUNT_NONE`` (a load's
            lookup of a prompt counted already).
    """

    tokens_per_key: int = 0
    key_tokens: tuple[int, ...] = ()
    mode: int = COUNT_ALL

    def deltas(self, keys: int, hits: int) -> dict[str, int]:
        """The counters' increments for ``hits`` leading hits of ``keys`` keys."""
        if self.mode == COUNT_NONE:
            return {}
        if self.key_tokens and len(self.key_tokens) == keys:
            hit_tokens = sum(self.key_tokens[:hits])
            miss_tokens = sum(self.key_tokens[hits:])
        else:
            hit_tokens = hits * self.tokens_per_key
            miss_tokens = (keys - hits) * self.tokens_per_key
        if self.mode == COUNT_HITS:
            return {"hit_keys": hits, "hit_tokens": hit_tokens}
        return {
            "lookups": 1,
            "hit_keys": hits,
            "miss_keys": keys - hits,
            "hit_tokens": hit_tokens,
            "miss_tokens": miss_tokens,
        }


@dataclass(frozen=True, slots=True)
class NodeStatus:
    """A node as the index sees it, for statistics."""

    info: NodeInfo
    chunks_indexed: int
    lease_remaining_s: float
    # What the node reported at its last heartbeat (None: no digest), and
    # whether the index's digest of it was equal then.
    chunks_held: int | None = None
    in_sync: bool = False


@dataclass(frozen=True, slots=True)
class IndexStats:
    """Cluster-wide counters kept by the index."""

    nodes: tuple[NodeStatus, ...] = ()
    chunks: int = 0
    lookups: int = 0
    hit_keys: int = 0
    miss_keys: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    puts_committed: int = 0
    chunks_deduplicated: int = 0
    bytes_saved: int = 0
    bytes_committed: int = 0
    nodes_expired: int = 0
    allocations_expired: int = 0
    extra: dict[str, int] = field(default_factory=dict)
