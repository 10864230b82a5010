"""The packed lookup answer decodes to exactly what the index found."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvdepot.errors import Corrupt
from kvdepot.keys import ChunkKey
from kvdepot.metadata.index.base import IndexConfig
from kvdepot.metadata.index.memory import MemoryIndex
from kvdepot.proto.gen import common_pb2, metadata_pb2
from kvdepot.types import (
    InventoryItem,
    KeyLocation,
    LookupResult,
    NodeId,
    NodeInfo,
    Replica,
)
from kvdepot.wire.lookup import pack_lookup, unpack_lookup


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def wire(result: LookupResult) -> LookupResult:
    data = pack_lookup(result).SerializeToString()
    return unpack_lookup(metadata_pb2.LookupResponse.FromString(data))


def test_mixed_replica_counts_round_trip() -> None:
    a, b, c = (Replica(NodeId(n), f"127.0.0.1:{p}", t) for n, p, t in
               [("a", 1, "cpu"), ("b", 2, "ssd"), ("c", 3, "gpu")])  # fmt: skip
    result = LookupResult(
        4,
        (
            KeyLocation(10, (a,)),
            KeyLocation(20, (b, a, c)),
            KeyLocation(1 << 40, (c,)),
            KeyLocation(5, (a, b)),
        ),
    )
    assert wire(result) == result
    packed = pack_lookup(result)
    assert len(packed.replica_table) == 3  # each distinct replica once
    assert wire(LookupResult(0)) == LookupResult(0)


def test_index_answer_survives_the_wire_with_client_first() -> None:
    async def run() -> tuple[LookupResult, LookupResult]:
        index = MemoryIndex(IndexConfig())
        now = time.monotonic()
        for n in ("n1", "n2"):
            info = NodeInfo(node_id=NodeId(n), address=f"{n}:1")
            inv = [InventoryItem(key(i), 100 + i, "cpu") for i in range(8 if n == "n1" else 4)]
            await index.register_node(info, inv, now)
        keys = [key(i) for i in range(10)]
        return await index.lookup(keys, NodeId("n2"), 0), await index.lookup(keys, "", 0)

    mine, anyone = asyncio.run(run())
    assert mine.hits == anyone.hits == 8
    for r in (mine, anyone):
        assert wire(r) == r
    # The asking node's replica comes first where it holds one.
    assert [loc.replicas[0].node_id for loc in mine.locations] == ["n2"] * 4 + ["n1"] * 4
    assert [loc.size for loc in mine.locations] == [100 + i for i in range(8)]


def test_the_unpacked_form_still_decodes() -> None:
    reply = metadata_pb2.LookupResponse(
        hits=1,
        locations=[
            metadata_pb2.KeyLocation(
                size=7, replicas=[common_pb2.Replica(node_id="a", address="x:1", tier="ssd")]
            )
        ],
    )
    assert unpack_lookup(reply) == LookupResult(
        1, (KeyLocation(7, (Replica(NodeId("a"), "x:1", "ssd"),)),)
    )


@pytest.mark.parametrize(
    "fields",
    [
        {"hits": 2, "sizes": [1], "replica_counts": [1], "replica_refs": [0]},
        {"hits": 1, "sizes": [1], "replica_counts": [2], "replica_refs": [0]},
        {"hits": 1, "sizes": [1], "replica_counts": [1], "replica_refs": [3]},
    ],
)
def test_malformed_packed_answers_are_corrupt(fields: dict[str, object]) -> None:
    reply = metadata_pb2.LookupResponse(
        replica_table=[common_pb2.Replica(node_id="a", address="x:1", tier="cpu")],
        **fields,  # type: ignore[arg-type]
    )
    with pytest.raises(Corrupt):
        unpack_lookup(reply)


def test_equal_replicas_share_one_table_row_whether_or_not_the_same_object() -> None:
    # The redis index builds a Replica per key; the memory index shares them.
    shared = Replica(NodeId("a"), "127.0.0.1:1", "cpu")
    locs = [KeyLocation(10, (shared,)) for _ in range(3)] + [
        KeyLocation(10, (Replica(NodeId("a"), "127.0.0.1:1", "cpu"),)) for _ in range(3)
    ]
    result = LookupResult(6, tuple(locs))
    packed = pack_lookup(result)
    assert len(packed.replica_table) == 1 and list(packed.replica_refs) == [0] * 6
    assert wire(result) == result
