"""Tier moves of replicas: which tier of its node a chunk's copy is in now.

A store node moves chunks between its tiers (DRAM to SSD when it fills, SSD
back to DRAM when read) and reports each move with ``ReportMoved``, so that
lookups can order replicas by tier (:data:`~kvdepot.types.TIER_RANK`).
Recording a move is an optional capability of an index backend: one that
implements :class:`ReplicaTierIndex` keeps tiers current; with one that does
not, a replica keeps the tier it was announced with (at registration or
commit) until the node registers again, which changes nothing but the order
of replicas in lookups.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Sequence

from kvdepot.errors import InvalidArgument
from kvdepot.keys import ChunkKey
from kvdepot.types import TIER_RANK, NodeId

logger = logging.getLogger(__name__)


class ReplicaTierIndex(abc.ABC):
    """An index backend that can change the tier of replicas in place."""

    @abc.abstractmethod
    async def set_replica_tier(self, node_id: NodeId, keys: Sequence[ChunkKey], tier: str) -> int:
        """Record that ``node_id``'s replicas of ``keys`` are now in ``tier``.

        Keys the node does not hold are ignored. Returns how many replicas changed.
        """


_warned: set[str] = set()


async def record_moves(
    index: object, node_id: NodeId, keys: Sequence[ChunkKey], tier: str
) -> tuple[int, bool]:
    """Record a tier move in ``index`` if it can keep them.

    Returns:
        The replicas updated, and whether the index records moves at all.

    Raises:
        InvalidArgument: If ``tier`` is not a known tier.
    """
    if tier not in TIER_RANK:
        raise InvalidArgument(f"unknown tier {tier!r}; known: {', '.join(TIER_RANK)}")
    if isinstance(index, ReplicaTierIndex):
        return await index.set_replica_tier(node_id, keys, tier), True
    name = type(index).__name__
    if name not in _warned:
        _warned.add(name)
        logger.info(
            "index %s does not record tier moves: replicas keep the tier they were announced with",
            name,
        )
    return 0, False
