"""A store's side of inventory reconciliation: the index converges on what this store holds.

Every heartbeat carries the count and digest of the store's committed chunks
(:meth:`Reconciler.held`, kept by the chunk table at a constant cost a key:
:mod:`kvdepot.store.inventory`, :mod:`kvdepot.wire.digest`). Where the
index's digest of this node differs, its answer says ``reconcile``, and after
that heartbeat (never in its way, one round at a time) this store:

1. sends its 64 group digests (``ReconcileDigests``, 1 KB); the index
   answers the bucket digests of the groups that differ (1 KB a group);
2. keeps the buckets that differ. A bucket that differed at the round before
   too is *due*: a difference seen once may be a commit or an eviction in
   flight, on its way to the index already;
3. sends every key it holds in due buckets, a budget of ``max_keys`` keys a
   round (``ReconcileBuckets``; a bucket over the budget goes alone): the
   index adds the keys it lacks and answers the keys it names this node for
   besides;
4. checks those, and the keys it sent, against its table again: whatever it
   does not hold now is queued as removed, for its usual removal reports.

So chunks held but not indexed are indexed, and chunks indexed but no longer
held are dropped, within a few heartbeats, at a bounded cost per heartbeat,
whatever the size of the store. Nothing is decided on an old snapshot: a key
committed since the snapshot is added again at worst (it is held), a key
evicted since it is reported removed after the index added it.

A slow scrub (``scrub_s``, one bucket in that many seconds) sends buckets
whose digests agree too: it finds chunks the index lost behind its own back
(a Redis shard that lost data), which its digest, kept by its own writes,
cannot see.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np

from kvdepot.keys import ChunkKey
from kvdepot.proto.gen import metadata_pb2, metadata_pb2_grpc, store_pb2
from kvdepot.repeat_log import RepeatLog
from kvdepot.store.chunks import ChunkStore
from kvdepot.store.lease import PAGE_TIMEOUT_S, MetadataLease
from kvdepot.types import TIER_RANK
from kvdepot.wire.digest import (
    BUCKETS,
    GROUP_BUCKETS,
    I64,
    U64,
    group_cells,
    pack_cells,
    unpack_cells,
)

logger = logging.getLogger(__name__)

MAX_ROUND_BUCKETS = 64
"""Buckets one round sends at most (one ``ReconcileBuckets`` call)."""
MAX_BUCKET_KEYS = 65536
"""Keys one call may carry (the service's limit): a bucket of more (a store
of over 268 M chunks) is never sent, and its drift left to registration."""
_SCRUB_CREDIT_MAX = 64.0
_LOG_S = 10.0  # one line about what reconciliation changed at most this often


@dataclass(slots=True)
class ReconcileStats:
    """What reconciliation did since the store started (see ``store.proto``)."""

    mismatches: int = 0
    rounds: int = 0
    buckets: int = 0
    keys_sent: int = 0
    max_round_keys: int = 0
    added: int = 0
    removed: int = 0
    scrubbed: int = 0


class Reconciler:
    """Reconciles this store's inventory with the index after heartbeats.

    Args:
        node_id: This store's node id.
        chunks: The chunk table (its inventory digest and bucket keys).
        lease: The store's lease: its epoch, whether registered and settled,
            and the replica its calls go to.
        channels: The metadata replicas' channels, as the lease's client has them.
        removed: Queues keys this store no longer holds for its removal
            reports (called on the loop).
        max_keys: Keys a round sends at most.
        scrub_s: Seconds between two buckets scrubbed (0: no scrub).
    """

    def __init__(
        self,
        *,
        node_id: str,
        chunks: ChunkStore,
        lease: MetadataLease,
        channels: list[grpc.aio.Channel],
        removed: Callable[[list[ChunkKey]], None],
        max_keys: int = 4096,
        scrub_s: float = 0.0,
    ) -> None:
        self._node_id = node_id
        self._chunks = chunks
        self._lease = lease
        self._stubs = [metadata_pb2_grpc.MetadataStub(c) for c in channels]
        self._removed = removed
        self._max_keys = max_keys
        self._scrub_s = scrub_s
        self._wake = asyncio.Event()
        self._mismatch = False
        self._differed: set[int] = set()  # buckets that differed at the last round
        self._cursor = 0  # where the next round starts among due buckets
        self._scrub_at = 0  # the next bucket the scrub looks at
        self._scrub_credit = 0.0
        self._scrub_since = time.monotonic()
        self._repeats = RepeatLog(logger)
        self._unlogged = [0, 0]  # added, removed since the last line
        self._logged_at = -_LOG_S
        self.stats = ReconcileStats()

    # -- on heartbeats ------------------------------------------------------------
    def held(self) -> metadata_pb2.InventoryDigest:
        """This store's count and digest of its committed chunks, now."""
        count, total = self._chunks.inventory_digest()
        return metadata_pb2.InventoryDigest(chunks=count, digest=total)

    def observe(self, reply: metadata_pb2.HeartbeatResponse) -> None:
        """A heartbeat's answer: start a round (the lease calls this)."""
        if not reply.HasField("indexed"):
            return  # the index keeps no digests
        self._mismatch = reply.reconcile
        if reply.reconcile:
            self.stats.mismatches += 1
        else:
            self._differed.clear()
        self._wake.set()

    async def run(self) -> None:
        """Run a round after each heartbeat answer, until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._round()
            except (grpc.aio.AioRpcError, TimeoutError) as exc:
                code = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else "timeout"
                self._repeats.failed(
                    "round",
                    logging.INFO,
                    "inventory reconciliation with metadata %s: a round failed (%s); "
                    "the next heartbeat tries again",
                    self._lease.endpoint,
                    code,
                )
            except Exception as exc:  # a round's failure must not end the next ones
                logger.debug("reconciliation round failed", exc_info=True)
                self._repeats.failed(
                    "error", logging.WARNING, "inventory reconciliation: a round failed: %r", exc
                )
            else:
                self._repeats.ended("round")

    # -- a round ----------------------------------------------------------------
    def _stub(self) -> metadata_pb2_grpc.MetadataStub:
        return self._stubs[self._lease.client.replicas.current]

    async def _round(self) -> None:
        lease = self._lease
        if not (lease.holds and lease.settled.is_set()):
            return
        epoch = lease.epoch
        due: list[int] = []
        index_counts: dict[int, int] = {}
        counts: I64 | None = None
        if self._mismatch:
            counts, sums = self._chunks.inventory_cells()
            due, index_counts = await self._compare(epoch, counts, sums)
        picked = self._pick(due, index_counts, counts)
        scrub = self._scrub(picked, counts)
        if picked or scrub:
            await self._send(epoch, sorted(picked + scrub), len(scrub))
        else:
            self._log()  # what the last rounds changed, once its time came

    async def _compare(
        self, epoch: int, counts: I64, sums: U64
    ) -> tuple[list[int], dict[int, int]]:
        """The due buckets (differing now and at the round before), and the
        index's counts of the differing buckets."""
        self.stats.rounds += 1
        reply = await self._stub().ReconcileDigests(
            metadata_pb2.ReconcileDigestsRequest(
                node_id=self._node_id, epoch=epoch, groups=pack_cells(*group_cells(counts, sums))
            ),
            timeout=PAGE_TIMEOUT_S,
        )
        theirs_c, theirs_s = unpack_cells(reply.buckets)
        differ: dict[int, int] = {}
        for i, g in enumerate(reply.groups):
            mine = slice(g * GROUP_BUCKETS, (g + 1) * GROUP_BUCKETS)
            at = slice(i * GROUP_BUCKETS, (i + 1) * GROUP_BUCKETS)
            off = (theirs_c[at] != counts[mine]) | (theirs_s[at] != sums[mine])
            for j in np.flatnonzero(off).tolist():
                differ[g * GROUP_BUCKETS + j] = int(theirs_c[at][j])
        due = sorted(b for b in differ if b in self._differed)
        self._differed = set(differ)
        return due, differ

    def _pick(self, due: list[int], index_counts: dict[int, int], counts: I64 | None) -> list[int]:
        """The due buckets this round sends: from where the last round
        stopped, within the budget (the larger of both sides' counts, the
        service's work too); one bucket at least."""
        if not due or counts is None:
            return []
        start = next((i for i, b in enumerate(due) if b >= self._cursor), 0)
        order = due[start:] + due[:start]
        picked: list[int] = []
        spent = 0
        for b in order:
            if counts[b] > MAX_BUCKET_KEYS:
                continue
            cost = max(int(counts[b]), index_counts.get(b, 0), 1)
            if picked and (spent + cost > self._max_keys or len(picked) >= MAX_ROUND_BUCKETS):
                break
            picked.append(b)
            spent += cost
        if picked:
            self._cursor = (picked[-1] + 1) % BUCKETS
        return picked

    def _scrub(self, picked: list[int], counts: I64 | None) -> list[int]:
        """Buckets the scrub sends this round: one per ``scrub_s`` since the
        last, the next ones this store holds keys in, within what is left of
        the budget."""
        now = time.monotonic()
        if self._scrub_s <= 0:
            return []
        elapsed, self._scrub_since = now - self._scrub_since, now
        self._scrub_credit = min(_SCRUB_CREDIT_MAX, self._scrub_credit + elapsed / self._scrub_s)
        if self._scrub_credit < 1 or len(picked) >= MAX_ROUND_BUCKETS:
            return []
        if counts is None:
            counts, _ = self._chunks.inventory_cells()
        spent = sum(int(counts[b]) for b in picked)
        out: list[int] = []
        seen = 0
        while self._scrub_credit >= 1 and seen < BUCKETS:
            b, seen = self._scrub_at, seen + 1
            self._scrub_at = (b + 1) % BUCKETS
            n = int(counts[b])
            if not n or n > MAX_BUCKET_KEYS or b in picked:
                continue
            if (picked or out) and spent + n > self._max_keys:
                break
            out.append(b)
            spent += n
            self._scrub_credit -= 1
            if len(picked) + len(out) >= MAX_ROUND_BUCKETS:
                break
        return out

    async def _send(self, epoch: int, buckets: list[int], scrubbed: int) -> None:
        """Send the keys of ``buckets``; queue what the index names and this
        store does not hold as removed."""
        holdings = self._chunks.bucket_holdings(buckets)
        keys = [h.key for hs in holdings for h in hs]
        reply = await self._stub().ReconcileBuckets(
            metadata_pb2.ReconcileBucketsRequest(
                node_id=self._node_id,
                epoch=epoch,
                buckets=buckets,
                counts=[len(hs) for hs in holdings],
                keys=b"".join(keys),
                sizes=[h.size for hs in holdings for h in hs],
                tiers=bytes(TIER_RANK[h.tier] for hs in holdings for h in hs),
            ),
            timeout=PAGE_TIMEOUT_S,
        )
        extra = [ChunkKey(reply.extra[i : i + 16]) for i in range(0, len(reply.extra), 16)]
        # Checked now: what left since the snapshot, or was never here.
        check = extra + keys
        held = {h.key for h in self._chunks.holdings_of(check)}
        gone = list(dict.fromkeys(k for k in check if k not in held))
        if gone:
            self._removed(gone)
        s = self.stats
        s.buckets += len(buckets)
        s.scrubbed += scrubbed
        s.keys_sent += len(keys)
        s.max_round_keys = max(s.max_round_keys, len(keys))
        s.added += reply.added
        s.removed += len(gone)
        self._unlogged[0] += reply.added
        self._unlogged[1] += len(gone)
        self._log()

    def _log(self) -> None:
        """One line for what reconciliation changed, at most every ``_LOG_S``."""
        added, removed = self._unlogged
        now = time.monotonic()
        if not (added or removed) or now - self._logged_at < _LOG_S:
            return
        logger.info(
            "inventory reconciled with the index: %d chunks held here indexed, %d no longer "
            "held reported removed (one such line every %.0f s at most)",
            added,
            removed,
            _LOG_S,
            extra={"event": "inventory_reconciled", "node": self._node_id},
        )
        self._unlogged = [0, 0]
        self._logged_at = now

    def stats_proto(self) -> store_pb2.ReconcileStats:
        s = self.stats
        return store_pb2.ReconcileStats(
            chunks=self._chunks.inventory_digest()[0],
            mismatches=s.mismatches,
            rounds=s.rounds,
            buckets=s.buckets,
            keys_sent=s.keys_sent,
            max_round_keys=s.max_round_keys,
            added=s.added,
            removed=s.removed,
            scrubbed=s.scrubbed,
        )
