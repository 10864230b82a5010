"""The DRAM tier: one preallocated arena and a best-fit allocator over it.

Every chunk is written into this tier first (the data plane receives
straight into it, same-host clients write through their mapping of it), and
it is the only tier transports send from. Its allocator is best fit with
coalescing of free neighbours (:mod:`kvdepot.store.allocator`): under the
churn of a cache (10^5 chunks of nine sizes from 4 KiB to 2 MiB coming and
going in LRU order, in ``tests/unit/test_tier_cpu.py``) an allocation only
fails when the arena is about 90% full on average, a few evictions then make
room, and the arena is one free extent again once emptied; without the
internal waste of size classes (up to 2x for sizes between classes).

Where the node has CUDA and a GPU tier, the arena is registered with CUDA
(page-locked), so copies between it and the GPU run at DMA speed. That is
opt-in (``pin``): only then is torch imported.
"""

from __future__ import annotations

import contextlib
import logging

from kvdepot.errors import Unavailable
from kvdepot.keys import ChunkKey
from kvdepot.store.allocator import Allocator
from kvdepot.store.arena import Arena
from kvdepot.store.tiers.base import AllocatorSpace, Tier, TierLimits

logger = logging.getLogger(__name__)


class CpuTier(AllocatorSpace, Tier):
    """Chunks in the DRAM arena.

    Args:
        capacity: Bytes of the arena.
        arena_path: Back the arena with a shared file here (see :class:`Arena`).
        limits: The tier's watermarks.
        pin: Page-lock the arena with CUDA when CUDA is available (imports
            torch); a failure to pin is logged, not raised.
        alignment: Granularity of allocations (a power of two).

    Raises:
        InvalidArgument: If ``capacity`` or ``alignment`` is invalid.
        CapacityExceeded: If the arena's backing file cannot be reserved.
        Unavailable: If the arena cannot be created or mapped.
    """

    name = "cpu"
    host_memory = True

    def __init__(
        self,
        capacity: int,
        *,
        arena_path: str | None = None,
        limits: TierLimits = TierLimits(),  # noqa: B008 - frozen, immutable default
        pin: bool = False,
        alignment: int = 4096,
    ) -> None:
        super().__init__(limits)
        self._allocator = Allocator(capacity, alignment)
        self._arena = Arena(capacity, path=arena_path)
        self._pinned = False
        if pin:
            from kvdepot.store.tiers.gpu import pin_host_memory

            self._pinned = pin_host_memory(self._arena.address, self._arena.capacity)

    @property
    def arena(self) -> Arena:
        """The arena (for transports that map it)."""
        return self._arena

    @property
    def pinned(self) -> bool:
        """Whether the arena is page-locked with CUDA."""
        return self._pinned

    @property
    def largest_free(self) -> int:
        """The largest allocation that can succeed now."""
        return self._allocator.largest_free

    @property
    def free_extents(self) -> int:
        """Free extents of the arena (1 when empty: no fragmentation)."""
        return self._allocator.free_extents

    def view(self, handle: int, size: int) -> memoryview:
        return self._arena.view(handle, size)

    def write(self, handle: int, data: memoryview, *, key: ChunkKey, checksum: int) -> None:
        self._arena.view(handle, len(data))[:] = data

    def read_into(self, handle: int, dest: memoryview) -> None:
        dest[:] = self._arena.view(handle, len(dest))

    def close(self) -> None:
        if self._pinned:
            from kvdepot.store.tiers.gpu import unpin_host_memory

            with contextlib.suppress(Unavailable):
                unpin_host_memory(self._arena.address)
            self._pinned = False
        self._arena.close()
