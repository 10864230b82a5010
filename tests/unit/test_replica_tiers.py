"""Tier moves reported by stores: recorded where the index can keep them."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from kvdepot.errors import InvalidArgument
from kvdepot.keys import ChunkKey
from kvdepot.metadata.replica_tiers import ReplicaTierIndex, record_moves


class TierKeeping(ReplicaTierIndex):
    def __init__(self) -> None:
        self.tiers: dict[tuple[str, ChunkKey], str] = {}

    async def set_replica_tier(self, node_id: str, keys: Sequence[ChunkKey], tier: str) -> int:
        for k in keys:
            self.tiers[(node_id, k)] = tier
        return len(keys)


def test_moves_are_recorded_by_an_index_that_keeps_tiers() -> None:
    index = TierKeeping()
    keys = [ChunkKey(bytes([i]) * 16) for i in range(3)]
    assert asyncio.run(record_moves(index, "n1", keys, "ssd")) == (3, True)
    assert set(index.tiers.values()) == {"ssd"}


def test_other_indexes_say_they_do_not_keep_moves() -> None:
    assert asyncio.run(record_moves(object(), "n1", [], "cpu")) == (0, False)
    with pytest.raises(InvalidArgument, match="unknown tier"):
        asyncio.run(record_moves(TierKeeping(), "n1", [], "tape"))
