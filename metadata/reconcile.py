"""The metadata service's side of inventory reconciliation (``Heartbeat``'s
digest check, ``ReconcileDigests``, ``ReconcileBuckets``).

The store daemons are the source of truth for what chunks exist; the index
converges on what they hold. A heartbeat carries the node's count and digest
of its committed chunks (:mod:`kvdepot.wire.digest`); the index compares them
with its own digest of the node, kept up to date by every write, at a
constant cost. Where they differ, the answer says ``reconcile``; the node
then compares its 64 group digests with the index's (``ReconcileDigests``:
the index answers the bucket digests of the groups that differ), and sends,
within a budget of keys per heartbeat, every key it holds in the buckets that
differed twice in a row (``ReconcileBuckets``). The index adds those it lacks
and answers those it names the node for besides; the node reports the ones
it does not hold as removed, through its usual removal reports, after
checking them again. No handler does work in proportion to a node's whole
inventory: a heartbeat compares two numbers, a digest request reads 1 KB and
64 cells per differing group, a bucket request is bounded by the keys sent
and by 1/4096 of the index per bucket.

Every step is idempotent and decided on state read at the time, so a race
with a commit or an eviction in flight (a key committed after the node's
snapshot of a bucket, a key evicted after it) costs at most another round,
never a lookup naming a chunk the node does not hold for longer than a
removal report takes.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

from kvdepot.errors import InvalidArgument
from kvdepot.keys import KEY_BYTES, ChunkKey
from kvdepot.metadata.events import KVEventPublisher
from kvdepot.metadata.index import IndexBackend
from kvdepot.metadata.index.base import MAX_PAGE_CHUNKS, Digest, InventoryPage
from kvdepot.proto.gen import metadata_pb2
from kvdepot.records import TierStats, TransferRate
from kvdepot.types import TIER_BY_CODE
from kvdepot.validation import check_text
from kvdepot.wire.digest import BUCKETS, CELL_BYTES, GROUPS, MASK, buckets_of, words

MAX_RECONCILE_BUCKETS = 256
"""Buckets one ``ReconcileBuckets`` may carry."""


async def heartbeat(
    index: IndexBackend,
    request: metadata_pb2.HeartbeatRequest,
    tiers: Sequence[TierStats],
    transfer: TransferRate | None,
) -> tuple[bool, metadata_pb2.HeartbeatResponse]:
    """Renew the node's lease; with its digest, compare it with the index's.

    Returns:
        Whether the node is known, and the answer (its lease TTL is the caller's).
    """
    node_id, now, epoch = request.node_id, time.monotonic(), request.epoch
    if not request.HasField("held"):
        known = await index.heartbeat(node_id, tiers, now, transfer, epoch)
        return known, metadata_pb2.HeartbeatResponse()
    if request.held.chunks >= 1 << 63:
        raise InvalidArgument(f"a node holding {request.held.chunks} chunks")
    held: Digest = (request.held.chunks, request.held.digest & MASK)
    known, indexed = await index.heartbeat_held(node_id, tiers, now, transfer, epoch, held)
    reply = metadata_pb2.HeartbeatResponse()
    if indexed is not None:
        reply.indexed.chunks, reply.indexed.digest = max(0, indexed[0]), indexed[1]
        reply.reconcile = indexed != held
    return known, reply


_Request = metadata_pb2.ReconcileDigestsRequest | metadata_pb2.ReconcileBucketsRequest


def _node(request: _Request) -> str:
    node_id = check_text(request.node_id, "node_id")
    if not request.epoch:
        raise InvalidArgument("reconciliation needs the epoch RegisterNode answered")
    return node_id


async def reconcile_digests(
    index: IndexBackend, request: metadata_pb2.ReconcileDigestsRequest
) -> metadata_pb2.ReconcileDigestsResponse:
    """The index's bucket digests of the groups that differ from the node's."""
    node_id = _node(request)
    if len(request.groups) != GROUPS * CELL_BYTES:
        raise InvalidArgument(
            f"{len(request.groups)} bytes of group digests; {GROUPS * CELL_BYTES} expected"
        )
    groups, cells = await index.reconcile_digests(node_id, request.epoch, request.groups)
    return metadata_pb2.ReconcileDigestsResponse(groups=groups, buckets=cells)


def bucket_pages(
    request: metadata_pb2.ReconcileBucketsRequest, max_keys: int = MAX_PAGE_CHUNKS
) -> list[tuple[int, InventoryPage]]:
    """The request's buckets, each with its keys as a page, validated.

    Raises:
        InvalidArgument: Buckets not distinct and increasing or out of range,
            counts that do not add up, a key outside its bucket, more than
            ``max_keys`` keys or :data:`MAX_RECONCILE_BUCKETS` buckets.
    """
    buckets, counts = list(request.buckets), list(request.counts)
    if len(buckets) > MAX_RECONCILE_BUCKETS:
        raise InvalidArgument(f"{len(buckets)} buckets; at most {MAX_RECONCILE_BUCKETS} a call")
    if len(counts) != len(buckets):
        raise InvalidArgument(f"{len(buckets)} buckets but {len(counts)} counts")
    if any(b >= BUCKETS for b in buckets) or any(a >= b for a, b in itertools.pairwise(buckets)):
        raise InvalidArgument(f"buckets must be distinct, increasing and below {BUCKETS}")
    n = len(request.keys) // KEY_BYTES
    if len(request.keys) % KEY_BYTES or sum(counts) != n:
        raise InvalidArgument(f"{sum(counts)} keys counted, {len(request.keys)} bytes of keys")
    if n > max_keys:
        raise InvalidArgument(f"{n} keys in one call; the limit is {max_keys}")
    page = InventoryPage.of(request.keys, request.sizes, request.tiers)  # checks the columns
    expected = [b for b, c in zip(buckets, counts, strict=True) for _ in range(c)]
    if n and buckets_of(words(request.keys)).tolist() != expected:
        raise InvalidArgument("a key was sent under a bucket that is not its own")
    out: list[tuple[int, InventoryPage]] = []
    start = 0
    for bucket, count in zip(buckets, counts, strict=True):
        end = start + count
        out.append(
            (
                bucket,
                InventoryPage(
                    page.keys[start * KEY_BYTES : end * KEY_BYTES],
                    page.sizes[start:end],
                    page.tiers[start:end],
                ),
            )
        )
        start = end
    return out


async def reconcile_buckets(
    index: IndexBackend,
    request: metadata_pb2.ReconcileBucketsRequest,
    events: KVEventPublisher | None,
) -> metadata_pb2.ReconcileBucketsResponse:
    """Index the keys the node holds in some buckets; answer the others named."""
    node_id = _node(request)
    pages = bucket_pages(request, MAX_PAGE_CHUNKS)
    added, extra = await index.reconcile_buckets(node_id, request.epoch, pages)
    if events is not None and added:
        tiers = {p.key(i): p.tiers[i] for _, p in pages for i in range(len(p))}
        by_tier: dict[int, list[ChunkKey]] = {}
        for i in range(0, len(added), KEY_BYTES):
            key = ChunkKey(added[i : i + KEY_BYTES])
            by_tier.setdefault(int(tiers.get(key, 1)), []).append(key)
        for code, keys in sorted(by_tier.items()):
            events.stored(node_id, keys, TIER_BY_CODE[code])
    return metadata_pb2.ReconcileBucketsResponse(added=len(added) // KEY_BYTES, extra=extra)
