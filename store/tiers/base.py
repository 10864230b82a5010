"""The interface of a storage tier, and the registry of tier kinds.

A store node keeps chunks in up to three tiers, fastest first (the order of
:data:`kvdepot.types.TIER_RANK`, which the metadata service ranks replicas by):

* ``gpu``: a device tensor arena (only where the ``gpu`` tier is configured);
* ``cpu``: the DRAM arena every chunk is written into and that same-host
  clients map;
* ``ssd``: append-only segment files under a directory, kept across restarts.

A :class:`Tier` is only storage: it hands out *handles* to room for one
chunk, moves bytes in and out of that room, and frees it. Which chunk lives
where, leases, and the policy that moves chunks between tiers belong to the
chunk table (:class:`kvdepot.store.chunks.ChunkStore`), which serialises
``allocate``/``free`` under its lock. ``write``/``read_into`` may run on any
thread without that lock, on handles the table keeps alive meanwhile.
"""

from __future__ import annotations

import abc
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from kvdepot.errors import InvalidArgument
from kvdepot.keys import ChunkKey
from kvdepot.registry import Registry


@dataclass(frozen=True, slots=True)
class TierLimits:
    """When a tier starts and stops moving its coldest chunks down.

    A background thread starts demoting (or, from the lowest tier, dropping)
    the tier's least valuable chunks once its usage goes above
    ``high_watermark`` of its capacity, and stops once usage is at or below
    ``low_watermark``. A write that finds the tier full meanwhile makes room
    at once; the watermarks keep that off the hot path.

    Attributes:
        high_watermark: Fraction of capacity that starts background demotion.
        low_watermark: Fraction of capacity it stops at.

    Raises:
        InvalidArgument: Unless ``0 < low_watermark <= high_watermark <= 1``.
    """

    high_watermark: float = 0.95
    low_watermark: float = 0.85

    def __post_init__(self) -> None:
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise InvalidArgument(
                "watermarks must satisfy 0 < low <= high <= 1, got "
                f"low {self.low_watermark}, high {self.high_watermark}"
            )

    @classmethod
    def parse(cls, text: str) -> TierLimits:
        """``"0.9:0.8"`` (high:low) as limits.

        Raises:
            InvalidArgument: If ``text`` is not two fractions.
        """
        high, sep, low = text.partition(":")
        try:
            if not sep:
                raise ValueError(text)
            return cls(float(high), float(low))
        except ValueError:
            raise InvalidArgument(
                f"bad watermarks {text!r}: use HIGH:LOW, e.g. 0.95:0.85"
            ) from None


@dataclass(frozen=True, slots=True)
class RecoveredChunk:
    """A chunk a persistent tier found (and verified) when it was opened.

    Attributes:
        key: The chunk's key.
        size: Its size in bytes.
        checksum: Its checksum (verified against its bytes where the tier
            was asked to verify on open, and on every read regardless).
        handle: Where it is, for the tier's ``read_into`` and ``free``.
    """

    key: ChunkKey
    size: int
    checksum: int
    handle: int


class Tier(abc.ABC):
    """Room for chunks in one kind of memory or storage.

    Handles are small integers meaningful only to the tier that issued them.
    ``allocate``, ``free`` and the accounting properties are called under the
    chunk table's lock and must not block on I/O; ``write`` and ``read_into``
    are called without it, possibly from several threads at once (on
    different handles, or reads of the same handle).

    Args:
        limits: The tier's watermarks.
    """

    name: str = ""
    """The tier's kind, one of :data:`kvdepot.types.TIER_RANK`'s."""

    host_memory: bool = False
    """Whether :meth:`view` gives host memory that transports may send from
    (and same-host clients map): true only for the DRAM arena."""

    persistent: bool = False
    """Whether chunks survive a restart (:meth:`recover` finds them again)."""

    config_type: ClassVar[type[Any] | None] = None
    """The tier's own settings (a frozen dataclass), for :meth:`from_config`:
    the store's settings named after the tier (``<name>_<field>``)."""

    def __init__(self, limits: TierLimits) -> None:
        self._limits = limits

    @classmethod
    def from_config(cls, config: Any) -> Tier:
        """The tier its settings (a :attr:`config_type`) describe.

        Raises:
            InvalidArgument: If this kind of tier is not built from settings.
        """
        raise InvalidArgument(f"the {cls.name} tier is not configured on its own")

    @property
    def limits(self) -> TierLimits:
        """The tier's watermarks."""
        return self._limits

    @property
    @abc.abstractmethod
    def capacity(self) -> int:
        """Bytes the tier may use."""

    @property
    @abc.abstractmethod
    def used_bytes(self) -> int:
        """Bytes in use now, counting allocation rounding and overheads."""

    @property
    def free_bytes(self) -> int:
        """Bytes not in use (not necessarily contiguous)."""
        return max(0, self.capacity - self.used_bytes)

    @property
    def failure(self) -> str | None:
        """Why the tier is out of service (its device failed), or ``None``
        while it works; see :mod:`kvdepot.store.tiers.faults`."""
        return None

    @property
    def executor(self) -> Executor | None:
        """Threads that run this tier's slow I/O off the serving path.

        ``None`` for memory tiers, whose copies the caller makes itself.
        """
        return None

    @abc.abstractmethod
    def rounded(self, size: int) -> int:
        """The bytes an allocation of ``size`` takes in this tier."""

    @abc.abstractmethod
    def allocate(self, size: int) -> int | None:
        """Room for a chunk of ``size`` bytes, or ``None`` if none is free."""

    @abc.abstractmethod
    def size_of(self, handle: int) -> int:
        """The bytes the allocation behind ``handle`` takes (see :meth:`rounded`)."""

    @abc.abstractmethod
    def free(self, handle: int) -> None:
        """Give the room back; the handle is invalid afterwards."""

    def can_make_room(self, size: int, evictable_bytes: int) -> bool:
        """Whether evicting ``evictable_bytes`` could let ``size`` fit.

        Used to refuse a write at once, before evicting anything, when even
        emptying the tier of everything evictable would not be enough.
        """
        return self.free_bytes + evictable_bytes >= self.rounded(size)

    @abc.abstractmethod
    def write(self, handle: int, data: memoryview, *, key: ChunkKey, checksum: int) -> None:
        """Store a chunk's bytes at ``handle``.

        Raises:
            CapacityExceeded: The device is full (for example ``ENOSPC``).
            TierIOError: Any other I/O failure (``TierFailed``: the tier is
                out of service).
        """

    @abc.abstractmethod
    def read_into(self, handle: int, dest: memoryview) -> None:
        """Copy the chunk at ``handle`` into ``dest`` (exactly its size).

        Raises:
            Corrupt: The bytes failed their checksum or are truncated
                (tiers that keep bytes outside process memory check it).
            TierIOError: The device failed the read (``TierFailed``: the
                tier is out of service).
            Unavailable: Any other failure.
        """

    def view(self, handle: int, size: int) -> memoryview:
        """A writable view of the room at ``handle``, for host-memory tiers.

        Raises:
            InvalidArgument: If the tier is not host memory.
        """
        raise InvalidArgument(f"the {self.name} tier is not host memory")

    def recover(self) -> list[RecoveredChunk]:
        """Chunks found when opening a persistent tier, oldest first."""
        return []

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the tier's memory, files and threads."""


# -- registry ---------------------------------------------------------------------

TIERS: Registry[type[Tier]] = Registry("tier", base=Tier)
"""The tier kinds, by name. Modules are imported only when their tier is asked
for, so a store without a ``gpu`` tier never imports the GPU tier's dependencies."""
TIERS.register("gpu", "kvdepot.store.tiers.gpu:GpuTier")
TIERS.register("cpu", "kvdepot.store.tiers.cpu:CpuTier")
TIERS.register("ssd", "kvdepot.store.tiers.ssd:SsdTier")


def register_tier(name: str, target: str | type[Tier]) -> None:
    """Register a tier class, or its ``"module:Class"`` path (imported on first use).

    Raises:
        InvalidArgument: If ``name`` is registered already.
    """
    TIERS.register(name, target)


def tier_class(name: str) -> type[Tier]:
    """The class registered for ``name``, importing its module if needed.

    Raises:
        InvalidArgument: If no tier is registered under ``name``, or its
            target is not a :class:`Tier`.
    """
    return TIERS.get(name)


class AllocatorSpace:
    """Space accounting of a tier whose bytes live in one preallocated arena
    carved up by an :class:`~kvdepot.store.allocator.Allocator` (``cpu``, ``gpu``).

    Mixed into such tiers ahead of :class:`Tier`; they set ``self._allocator``.
    """

    if TYPE_CHECKING:
        from kvdepot.store.allocator import Allocator

        _allocator: Allocator

    @property
    def capacity(self) -> int:
        return self._allocator.capacity

    @property
    def used_bytes(self) -> int:
        return self._allocator.used_bytes

    @property
    def free_bytes(self) -> int:
        return self._allocator.free_bytes

    def rounded(self, size: int) -> int:
        return self._allocator.rounded(size)

    def allocate(self, size: int) -> int | None:
        return self._allocator.alloc(size)

    def size_of(self, handle: int) -> int:
        return self._allocator.size_of(handle)

    def free(self, handle: int) -> None:
        self._allocator.free(handle)
