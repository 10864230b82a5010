"""Offset allocator for the DRAM arena.

The arena is one preallocated buffer; this module only hands out offsets into
it. Free space is kept as extents (offset, size) in two sorted lists:

* by offset, so that :meth:`Allocator.free` finds the neighbours of an extent
  with one bisect and coalesces them (free space never stays split into
  adjacent pieces), and
* by (size, offset), so that :meth:`Allocator.alloc` finds the smallest
  extent that fits with one bisect (best fit, lowest offset among equals).

Best fit keeps large extents intact for large chunks, which is what keeps the
arena from fragmenting under the churn of a cache: many chunks of a few sizes
come and go. Every size is rounded up to ``alignment`` so extents stay
page-aligned (which DMA engines and ``O_DIRECT`` writers want anyway).

Lookups are O(log n); inserting into and removing from the Python lists is a
``memmove`` of pointers, cheap for the tens of thousands of extents an arena
holds. Not thread-safe: the chunk store serialises calls under its own lock.
"""

from __future__ import annotations

import bisect

from kvdepot.errors import InvalidArgument


class Allocator:
    """Best-fit allocator of aligned extents over ``[0, capacity)``.

    Args:
        capacity: Bytes to manage. Rounded down to a multiple of ``alignment``.
        alignment: Granularity of every allocation; a power of two.

    Raises:
        InvalidArgument: If ``alignment`` is not a power of two or
            ``capacity`` is smaller than one ``alignment``.
    """

    def __init__(self, capacity: int, alignment: int = 4096) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise InvalidArgument(f"alignment must be a power of two, got {alignment}")
        usable = capacity - capacity % alignment
        if usable <= 0:
            raise InvalidArgument(
                f"capacity {capacity} is smaller than one alignment unit ({alignment})"
            )
        self._alignment = alignment
        self._capacity = usable
        self._used = 0
        # Free extents: offsets sorted, their sizes, and (size, offset) sorted.
        self._free_offsets: list[int] = [0]
        self._free_size: dict[int, int] = {0: usable}
        self._by_size: list[tuple[int, int]] = [(usable, 0)]
        # Allocated extents: offset -> rounded size.
        self._allocated: dict[int, int] = {}

    @property
    def capacity(self) -> int:
        """Bytes managed (the constructor's capacity rounded down to alignment)."""
        return self._capacity

    @property
    def alignment(self) -> int:
        """Granularity of every allocation."""
        return self._alignment

    @property
    def used_bytes(self) -> int:
        """Bytes currently allocated, counting the rounding of each extent."""
        return self._used

    @property
    def free_bytes(self) -> int:
        """Bytes not allocated, whether or not they are contiguous."""
        return self._capacity - self._used

    @property
    def largest_free(self) -> int:
        """Size of the largest free extent: the largest allocation that can succeed."""
        return self._by_size[-1][0] if self._by_size else 0

    @property
    def free_extents(self) -> int:
        """Number of free extents (1 when nothing is allocated: no fragmentation)."""
        return len(self._free_offsets)

    def rounded(self, size: int) -> int:
        """The number of bytes an allocation of ``size`` actually takes."""
        return -(-size // self._alignment) * self._alignment

    def alloc(self, size: int) -> int | None:
        """Allocate an extent of at least ``size`` bytes.

        Args:
            size: Bytes wanted; positive.

        Returns:
            The offset of the extent, or ``None`` if no free extent fits.

        Raises:
            InvalidArgument: If ``size`` is not positive.
        """
        if size <= 0:
            raise InvalidArgument(f"allocation size must be positive, got {size}")
        need = self.rounded(size)
        i = bisect.bisect_left(self._by_size, (need, -1))
        if i == len(self._by_size):
            return None
        ext_size, offset = self._by_size[i]
        self._remove_free(offset, ext_size, size_index=i)
        rest = ext_size - need
        if rest:
            self._insert_free(offset + need, rest)
        self._allocated[offset] = need
        self._used += need
        return offset

    def size_of(self, offset: int) -> int:
        """The rounded size of the allocated extent at ``offset``.

        Raises:
            InvalidArgument: If nothing is allocated at ``offset``.
        """
        try:
            return self._allocated[offset]
        except KeyError:
            raise InvalidArgument(f"no allocation at offset {offset}") from None

    def free(self, offset: int) -> None:
        """Free the extent allocated at ``offset``, merging it with free neighbours.

        Raises:
            InvalidArgument: If nothing is allocated at ``offset`` (a double
                free or a wild offset: a bug in the caller).
        """
        size = self._allocated.pop(offset, None)
        if size is None:
            raise InvalidArgument(f"free of offset {offset} that is not allocated")
        self._used -= size
        start, end = offset, offset + size
        i = bisect.bisect_left(self._free_offsets, offset)
        # The successor is the free extent starting exactly where this one ends.
        if i < len(self._free_offsets) and self._free_offsets[i] == end:
            succ_size = self._free_size[end]
            self._remove_free(end, succ_size, offset_index=i)
            end += succ_size
        # The predecessor is the free extent ending exactly where this one starts.
        if i > 0:
            pred = self._free_offsets[i - 1]
            pred_size = self._free_size[pred]
            if pred + pred_size == start:
                self._remove_free(pred, pred_size, offset_index=i - 1)
                start = pred
        self._insert_free(start, end - start)

    def _insert_free(self, offset: int, size: int) -> None:
        bisect.insort(self._free_offsets, offset)
        self._free_size[offset] = size
        bisect.insort(self._by_size, (size, offset))

    def _remove_free(
        self,
        offset: int,
        size: int,
        *,
        offset_index: int | None = None,
        size_index: int | None = None,
    ) -> None:
        if offset_index is None:
            offset_index = bisect.bisect_left(self._free_offsets, offset)
        if size_index is None:
            size_index = bisect.bisect_left(self._by_size, (size, offset))
        del self._free_offsets[offset_index]
        del self._free_size[offset]
        del self._by_size[size_index]
