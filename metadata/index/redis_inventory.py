"""Heartbeats and inventory reconciliation of the Redis index (see :mod:`kvdepot.wire.digest`).

Each registration has a digest of the keys it is indexed for: a string
``P:n:{<node>}:dg`` on the node's slot, of int64 cells in Redis's
``BITFIELD`` layout (:data:`~kvdepot.wire.digest.GROUP_CELL`): the whole
count and sum, each group's, each bucket's. The index adds to it what its own
writes changed: the scripts that add or drop replicas answer which replicas
were new or gone (they run on the chunks' slots, the digest is on the node's,
so on a cluster one script cannot do both); the metadata replica adds their
keys' cells to :class:`~kvdepot.metadata.index.redis_client.Counters`, which
flushes them with the replica counts (``NODE_DELTA``, on the node's slot,
dropped once the registration ended). A heartbeat reads the whole cell in its
script and compares it with the node's, as bytes.

A digest written apart from its chunks can drift from them (a replica that
died between a write and its flush, chunks deleted from Redis behind the
index's back). Reconciling a bucket (:meth:`RedisInventory.reconcile_buckets`)
reads the chunks themselves: the registration's replicas in the Redis buckets
that hold the digest bucket (``BUCKET_KEYS``: 1/4096 of the index's chunks,
of every node). It adds the node's keys missing there (their cells added as
any commit's are) and answers the keys indexed besides. Where the chunks
already agree with the node, the bucket's cell is set right if it is not
(``DIGEST_FIX``: only while the cell is still as it was read, so a write
counted meanwhile is not lost; the next comparison catches what is left).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvdepot.keys import KEY_BYTES
from kvdepot.metadata.index import redis_scripts as scripts
from kvdepot.metadata.index.base import Digest, InventoryPage, stale_registration
from kvdepot.metadata.index.redis_client import Connection, Counters, flat, guarded
from kvdepot.metadata.index.redis_layout import (
    SIZE_BYTES,
    Buckets,
    epoch_bytes,
    records,
    registration_reply,
    tag,
    tiers_json,
    transfer_json,
)
from kvdepot.records import TierStats, TransferRate
from kvdepot.types import NodeId
from kvdepot.wire.digest import (
    BUCKET_CELL,
    CELL_BYTES,
    GROUP_BUCKETS,
    GROUP_CELL,
    MASK,
    digest_of,
    key_bucket,
    signed,
    words,
)

_CELL = struct.Struct(">qq")  # a cell pair as Redis keeps it
_NAMES_PER_CALL = 64
"""Redis buckets one BUCKET_KEYS call reads (on a single server)."""
_ITEMS_PER_TRIP = 256  # keys added per round trip, as an inventory page's


class RedisInventory:
    """The Redis index's heartbeats and reconciliation (a part of ``RedisIndex``)."""

    # What the index this is a part of provides.
    _p: str
    _db: Connection
    _counters: Counters
    _lease_ms: int
    _k_nodes: str
    _k_map: str

    async def _layout(self) -> Buckets:
        raise NotImplementedError

    def _keys3(self, node_id: NodeId) -> list[str]:
        """The node's lease, registration record and digest (one slot)."""
        n = f"{self._p}:n:{{{tag(node_id)}}}"
        return [n, n + ":reg", n + ":dg"]

    # -- heartbeats -----------------------------------------------------------
    @guarded
    async def heartbeat(
        self,
        node_id: NodeId,
        tiers: Sequence[TierStats],
        now: float,
        transfer: TransferRate | None = None,
        epoch: int = 0,
    ) -> bool:
        return (await self._beat(node_id, tiers, transfer, epoch, None))[0]

    @guarded
    async def heartbeat_held(
        self,
        node_id: NodeId,
        tiers: Sequence[TierStats],
        now: float,
        transfer: TransferRate | None,
        epoch: int,
        held: Digest,
    ) -> tuple[bool, Digest | None]:
        return await self._beat(node_id, tiers, transfer, epoch, held)

    async def _beat(
        self,
        node_id: NodeId,
        tiers: Sequence[TierStats],
        transfer: TransferRate | None,
        epoch: int,
        held: Digest | None,
    ) -> tuple[bool, Digest | None]:
        # A lease that ran out is not revived even if no reaper ran yet: its
        # registration has ended, so the node registers again with its
        # inventory, exactly as after an index loss.
        lease, _, digest = self._keys3(node_id)
        keys = [lease]
        args: list[Any] = [
            self._lease_ms,
            tiers_json(tiers) if tiers else "",
            transfer_json(transfer) if transfer is not None else "",
            epoch,
        ]
        if held is not None:
            keys.append(digest)
            args += [held[0], _CELL.pack(held[0], signed(held[1]))]
        reply = await self._db.one(scripts.HEARTBEAT.cmd(keys, args))
        cell = None
        if isinstance(reply, list):
            reply, cell = reply
        current = int(reply or 0)
        if current < 0:
            raise stale_registration(node_id, epoch, -current)
        if not current:
            return False, None
        # Re-assert the registry entry and the epoch's node: on a cluster they
        # may sit on shards that lost their data while this node's did not.
        await self._db.exec(
            [
                scripts.NODES_SET.cmd([self._k_nodes], [node_id, current]),
                ("HSETNX", self._k_map, current, node_id),
            ]
        )
        if cell is None:
            return True, None
        count, total = _CELL.unpack(cell)
        return True, (count, total & MASK)

    # -- reconciliation -------------------------------------------------------
    @guarded
    async def reconcile_digests(
        self, node_id: NodeId, epoch: int, groups: bytes
    ) -> tuple[list[int], bytes]:
        lease, _, digest = self._keys3(node_id)
        await self._counters.sync()  # this replica's own writes counted first
        at = [GROUP_CELL * 8, BUCKET_CELL * 8]
        reply = await self._db.one(scripts.DIGEST_DIFF.cmd([lease, digest], [epoch, groups, *at]))
        if int(reply[0]) != 1:
            registration_reply(node_id, epoch, reply)  # raises why
        return [int(g) for g in reply[1]], reply[2]

    @guarded
    async def reconcile_buckets(
        self, node_id: NodeId, epoch: int, buckets: Sequence[tuple[int, InventoryPage]]
    ) -> tuple[bytes, bytes]:
        b = await self._layout()
        # Every key sent is added where it is missing (work in proportion to
        # the keys sent); a bucket whose cells then equal the node's needs
        # nothing more, and no read of other nodes' chunks.
        pages = [page for _, page in buckets]
        every = InventoryPage(
            b"".join(p.keys for p in pages),
            np.concatenate([p.sizes for p in pages]) if pages else np.zeros(0, np.uint64),
            np.concatenate([p.tiers for p in pages]) if pages else np.zeros(0, np.uint8),
        )
        added = await self._add(b, node_id, epoch, every, list(range(len(every))))
        await self._counters.sync()
        cells = await self._cells(node_id, epoch, [bucket for bucket, _ in buckets])
        extra: list[bytes] = []
        for (bucket, page), cell in zip(buckets, cells, strict=True):
            want = digest_of(page.keys)
            if cell == _CELL.pack(want[0], signed(want[1])):
                continue
            # Indexed for keys the node did not send, or cells that drifted.
            have, cell = await self._indexed(b, node_id, epoch, bucket)
            sent = {page.key(j): j for j in range(len(page))}
            gone = [k for k in have if k not in sent]
            extra += gone
            rows = [j for k, j in sent.items() if k not in have]  # removed meanwhile
            if rows:
                added += await self._add(b, node_id, epoch, page, rows)
            elif not gone:
                await self._fix(node_id, epoch, bucket, cell, want)
        return added, b"".join(extra)

    async def _cells(self, node_id: NodeId, epoch: int, buckets: list[int]) -> list[bytes]:
        """The registration's cells of ``buckets`` (one round trip)."""
        lease, record, digest = self._keys3(node_id)
        at = [(BUCKET_CELL + 2 * bucket) * 8 for bucket in buckets]
        out = await self._db.exec(
            [
                scripts.PAGE.cmd([lease, record], [epoch, 0, 0]),
                *(("GETRANGE", digest, a, a + CELL_BYTES - 1) for a in at),
            ]
        )
        registration_reply(node_id, epoch, out[0])
        return [c.ljust(CELL_BYTES, b"\0") for c in out[1:]]

    async def _indexed(
        self, b: Buckets, node_id: NodeId, epoch: int, bucket: int
    ) -> tuple[set[bytes], bytes]:
        """The keys the registration has replicas of in a digest bucket, and
        the bucket's cells as they were before (one round trip)."""
        lease, record, digest = self._keys3(node_id)
        names = b.of_digest_bucket(bucket)
        per = 1 if self._db.cluster else _NAMES_PER_CALL
        reg = epoch_bytes(epoch)
        calls = [
            scripts.BUCKET_KEYS.cmd([n for n, _ in names[i : i + per]], [reg])
            for i in range(0, len(names), per)
        ]
        at = (BUCKET_CELL + 2 * bucket) * 8
        out = await self._db.exec(
            [
                scripts.PAGE.cmd([lease, record], [epoch, 0, 0]),
                ("GETRANGE", digest, at, at + CELL_BYTES - 1),
                *calls,
            ]
        )
        registration_reply(node_id, epoch, out[0])
        per_name = [fields for reply in out[2:] for fields in reply]
        have = {p + f for (_, p), fs in zip(names, per_name, strict=True) for f in fs}
        if len(names) == 1:  # fewer bits than a digest bucket's: others' keys too
            have = {k for k in have if len(k) == KEY_BYTES and key_bucket(k) == bucket}
        return have, out[1].ljust(CELL_BYTES, b"\0")

    async def _add(
        self, b: Buckets, node_id: NodeId, epoch: int, page: InventoryPage, rows: list[int]
    ) -> bytes:
        """Add replicas of the page's ``rows``; count them and their cells;
        return the keys of those that were new."""
        lease, record, _ = self._keys3(node_id)
        keys = b"".join(page.key(j) for j in rows)
        sizes, tiers = page.sizes[rows], page.tiers[rows]
        new: list[int] = []
        for start in range(0, len(rows), _ITEMS_PER_TRIP):
            end = min(len(rows), start + _ITEMS_PER_TRIP)
            names, fields = b.columns(keys[start * KEY_BYTES : end * KEY_BYTES])
            calls = self._db.cols(
                scripts.PAGE_ADD,
                [[n] for n in names],
                [epoch_bytes(epoch), b.width],
                [
                    (fields, b.width),
                    (records(sizes[start:end]), SIZE_BYTES),
                    (tiers[start:end].tobytes(), 1),
                ],
            )
            out = await self._db.exec([scripts.PAGE.cmd([lease, record], [epoch, 0, 0]), *calls])
            registration_reply(node_id, epoch, out[0])
            new += [start + i for i, r in enumerate(flat(out[1:])) if r & 1]
        w = words(keys)[new]
        self._counters.add_node(node_id, epoch, len(new))
        self._counters.add_keys(node_id, epoch, w)
        return np.ascontiguousarray(w, dtype="<u8").tobytes()

    async def _fix(
        self, node_id: NodeId, epoch: int, bucket: int, cell: bytes, want: Digest
    ) -> None:
        """Set a bucket's cells right where they drifted from its chunks."""
        count, total = _CELL.unpack(cell)
        total &= MASK
        if (count, total) == want:
            return
        at = BUCKET_CELL + 2 * bucket
        group = GROUP_CELL + 2 * (bucket // GROUP_BUCKETS)
        deltas = [want[0] - count, signed((want[1] - total) & MASK)]
        await self._db.one(
            scripts.DIGEST_FIX.cmd(self._keys3(node_id), [epoch, at, group, cell, *deltas])
        )
