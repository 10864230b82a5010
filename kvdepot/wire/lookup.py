"""The packed wire form of a lookup answer.

A 128-key lookup answered as one ``KeyLocation`` message per key, each with
its ``Replica`` messages, costs hundreds of small protobuf objects to build
on the service and to parse on the client, more than the index lookup
itself. The packed form sends each distinct replica once and everything else
as packed integer arrays, which protobuf builds and parses in bulk; in a
cluster the same few (node, tier) pairs answer for every key.
"""

from __future__ import annotations

from kvdepot.errors import Corrupt
from kvdepot.proto.gen import common_pb2, metadata_pb2
from kvdepot.types import KeyLocation, LookupResult, NodeId, Replica


def pack_lookup(result: LookupResult) -> metadata_pb2.LookupResponse:
    """The packed ``LookupResponse`` of ``result``."""
    # First by identity (the memory index shares one Replica object per node
    # and tier, and hashing the dataclass per key cost more than the rest of
    # packing), then by value.
    by_id: dict[int, int] = {}
    by_value: dict[Replica, int] = {}
    rows: list[Replica] = []
    sizes: list[int] = []
    counts: list[int] = []
    refs: list[int] = []
    for loc in result.locations:
        sizes.append(loc.size)
        counts.append(len(loc.replicas))
        for r in loc.replicas:
            ref = by_id.get(id(r))
            if ref is None:
                ref = by_value.get(r)
                if ref is None:
                    ref = by_value[r] = len(rows)
                    rows.append(r)
                by_id[id(r)] = ref
            refs.append(ref)
    return metadata_pb2.LookupResponse(
        hits=result.hits,
        replica_table=[
            common_pb2.Replica(node_id=r.node_id, address=r.address, tier=r.tier) for r in rows
        ],
        sizes=sizes,
        replica_counts=counts,
        replica_refs=refs,
        replicate=result.replicate,
    )


def unpack_lookup(reply: metadata_pb2.LookupResponse) -> LookupResult:
    """A lookup answer in either form, checked for consistency.

    Raises:
        Corrupt: If the packed arrays do not fit together (a broken service).
    """
    hits = reply.hits
    replicate = tuple(reply.replicate)
    if replicate and max(replicate) >= hits:
        raise Corrupt(f"malformed lookup answer: a key to replicate beyond {hits} hits")
    if not reply.sizes and not reply.replica_table and len(reply.locations) == hits:
        return LookupResult(
            hits,
            tuple(
                KeyLocation(
                    loc.size,
                    tuple(Replica(NodeId(r.node_id), r.address, r.tier) for r in loc.replicas),
                )
                for loc in reply.locations
            ),
            replicate,
        )
    table = [Replica(NodeId(r.node_id), r.address, r.tier) for r in reply.replica_table]
    sizes = list(reply.sizes)
    counts = list(reply.replica_counts)
    refs = list(reply.replica_refs)
    if len(sizes) != hits or len(counts) != hits or sum(counts) != len(refs):
        raise Corrupt(
            f"malformed lookup answer: {hits} hits, {len(sizes)} sizes, "
            f"{len(counts)} replica counts, {len(refs)} replica refs"
        )
    if refs and not 0 <= min(refs) <= max(refs) < len(table):
        raise Corrupt(f"malformed lookup answer: a replica ref outside a table of {len(table)}")
    if counts.count(1) == hits:  # one replica each, the common case: no slicing
        singles = [(r,) for r in table]
        return LookupResult(
            hits,
            tuple(KeyLocation(size, singles[i]) for size, i in zip(sizes, refs, strict=True)),
            replicate,
        )
    locations: list[KeyLocation] = []
    at = 0
    for size, count in zip(sizes, counts, strict=True):
        locations.append(KeyLocation(size, tuple(table[i] for i in refs[at : at + count])))
        at += count
    return LookupResult(hits, tuple(locations), replicate)
