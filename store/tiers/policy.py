"""Which chunk of a tier goes first, and when chunks move between tiers.

Each tier keeps its committed chunks in an :class:`EvictionPolicy`: the chunk
table tells it about inserts, reads and removals, and asks it for the chunks
to evict or demote, least valuable first. LRU is the default; a policy is a
small class registered by name, so others (FIFO is here as the simplest)
plug in without touching the table.
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvdepot.errors import InvalidArgument
from kvdepot.keys import ChunkKey
from kvdepot.registry import Registry


class EvictionPolicy(abc.ABC):
    """The order in which one tier gives up its chunks.

    Not thread-safe: the chunk table calls it under its lock.
    """

    @abc.abstractmethod
    def insert(self, key: ChunkKey) -> None:
        """A chunk entered the tier (committed, or moved in)."""

    @abc.abstractmethod
    def touch(self, key: ChunkKey) -> None:
        """A chunk of the tier was read."""

    @abc.abstractmethod
    def remove(self, key: ChunkKey) -> None:
        """A chunk left the tier (moved, evicted or deleted)."""

    @abc.abstractmethod
    def coldest(self) -> Iterator[ChunkKey]:
        """The tier's chunks, first to go first.

        The caller stops iterating before it changes the policy.
        """

    @abc.abstractmethod
    def __len__(self) -> int:
        """Chunks in the tier."""


class LruPolicy(EvictionPolicy):
    """Least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[ChunkKey, None] = OrderedDict()

    def insert(self, key: ChunkKey) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: ChunkKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: ChunkKey) -> None:
        self._order.pop(key, None)

    def coldest(self) -> Iterator[ChunkKey]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)


class FifoPolicy(LruPolicy):
    """First in, first out: reads do not change the order."""

    def touch(self, key: ChunkKey) -> None:
        return None


POLICIES: Registry[Callable[[], EvictionPolicy]] = Registry("eviction policy")
"""The eviction policies, by name: each entry makes a new, empty policy."""
POLICIES.register("lru", LruPolicy)
POLICIES.register("fifo", FifoPolicy)


def register_policy(name: str, factory: Callable[[], EvictionPolicy]) -> None:
    """Make a policy available under ``name`` (for :attr:`TieringOptions.policy`).

    Raises:
        InvalidArgument: If ``name`` is registered already.
    """
    POLICIES.register(name, factory)


def create_policy(name: str) -> EvictionPolicy:
    """A new instance of the policy registered as ``name``.

    Raises:
        InvalidArgument: If no policy has that name.
    """
    return POLICIES.get(name)()


def policy_names() -> list[str]:
    """The registered policy names."""
    return POLICIES.names()


@dataclass(frozen=True, slots=True)
class TieringOptions:
    """How the chunk table moves chunks between its tiers.

    Attributes:
        policy: Eviction policy of every tier, by registered name (``lru``).
        promote_hits: A chunk read this many times while on SSD is promoted
            into DRAM on that read; 0 never promotes (SSD chunks are then
            served from their files). Reads by clients that map the DRAM
            arena (``shm``, ``nixl``) always promote: they can only read
            chunks that are in it.
        gpu_promote_hits: A DRAM chunk read this many times is moved up into
            the GPU tier in the background; 0 never (the GPU tier then only
            fills by explicit placement).
        demotion_buffer_bytes: Most bytes of chunks that left DRAM for SSD
            and are still being written (they are served from memory until
            then). A write that needs room beyond this drops its victims
            instead of demoting them, so a burst never blocks on the disk.
        maintenance_interval_s: How often the background thread checks the
            watermarks when nothing wakes it sooner.
        move_wait_s: How long a read that must promote a chunk waits for
            another thread already moving it.

    Raises:
        InvalidArgument: If a value is out of range or the policy unknown.
    """

    policy: str = "lru"
    promote_hits: int = 1
    gpu_promote_hits: int = 2
    demotion_buffer_bytes: int = 256 << 20
    maintenance_interval_s: float = 0.2
    move_wait_s: float = 5.0

    def __post_init__(self) -> None:
        create_policy(self.policy)
        if self.promote_hits < 0 or self.gpu_promote_hits < 0:
            raise InvalidArgument("promotion thresholds must be 0 (never) or positive")
        if self.demotion_buffer_bytes < 0:
            raise InvalidArgument("demotion_buffer_bytes must not be negative")
        if self.maintenance_interval_s <= 0 or self.move_wait_s <= 0:
            raise InvalidArgument("tiering intervals must be positive")
