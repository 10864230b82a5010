"""Records a store reports and the metadata service keeps: one of each, shared.

A store node measures its tiers and its data-plane throughput; the metadata
service stores what the node reported (in the index, Redis included) and
serves it back in ``ClusterStats``. Both ends use these records, so a field
is added once; :mod:`kvdepot.wire.records` converts them to and from protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TierStats:
    """A snapshot of one tier's usage and counters.

    Moves are counted on the tier a chunk leaves: ``promotions`` of the
    ``ssd`` tier are chunks it handed up to DRAM, ``demotions`` of ``cpu``
    are chunks it handed down to SSD. ``evictions`` are chunks the tier
    dropped from the store for room (the lowest tier, or when the tier
    below could not take them).

    Attributes:
        name: ``gpu``, ``cpu`` or ``ssd``.
        capacity_bytes: Bytes the tier may use.
        used_bytes: Bytes it uses now (allocation rounding, and for ``ssd``
            the segment files on disk, dead records included).
        chunks: Committed chunks it holds.
        hits: Reads served from this tier.
        misses: Reads that reached this tier and did not find the chunk in
            it (it was in a slower tier, or nowhere).
        evictions: Chunks dropped from the store to make room in this tier.
        promotions: Chunks moved from this tier to a faster one.
        demotions: Chunks moved from this tier to a slower one.
    """

    name: str
    capacity_bytes: int = 0
    used_bytes: int = 0
    chunks: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    promotions: int = 0
    demotions: int = 0


@dataclass(frozen=True, slots=True)
class TransferRate:
    """A node's data-plane bytes per second in each direction over the last ``window_s`` seconds.

    ``window_s`` is shorter than the meter's window while the meter is young,
    and 0 before it has two samples (then both rates are 0).

    Attributes:
        bytes_in_per_s: Chunk payload received (puts).
        bytes_out_per_s: Chunk payload sent (gets).
        window_s: The span the rates cover.
    """

    bytes_in_per_s: float = 0.0
    bytes_out_per_s: float = 0.0
    window_s: float = 0.0


__all__ = ["TierStats", "TransferRate"]
