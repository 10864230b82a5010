"""How the Redis index lays out its state: key names, values, and the sweep.

Chunks live in bucket hashes small enough for Redis to keep in its compact
listpack encoding (``hash-max-listpack-entries``, 128 by default, and
``hash-max-listpack-value``, 64 bytes): 36-44 bytes a chunk at 5-1 M chunks
(Redis's ``used_memory``) instead of a hash of its own. The bucket of a key
is its first ``bucket_bits`` bits; its field is the key's bytes after the
bucket's whole bytes; its value a record (:func:`record`) of the size and,
per replica, the epoch of the registration that holds it and its tier. A
replica counts only while its registration's lease carries that epoch, so
nothing has to be deleted when a registration ends: :class:`Sweeper`
deletes such replicas later, lazily, in bounded steps. This module sets no
Redis configuration: a server whose listpack limits are lower still works,
with bigger buckets in Redis's plain hash encoding.

The layout is documented in :mod:`kvdepot.metadata.index.redis`.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import astuple, dataclass, field
from typing import Any

import numpy as np
from redis.asyncio import RedisCluster

from kvdepot.errors import InvalidArgument, NotFound
from kvdepot.keys import KEY_BYTES, ChunkKey
from kvdepot.metadata.index import redis_scripts as scripts
from kvdepot.metadata.index.base import stale_registration
from kvdepot.metadata.index.redis_client import Connection
from kvdepot.records import TierStats, TransferRate
from kvdepot.types import TIER_BY_CODE, TIER_RANK, Replica
from kvdepot.wire.digest import BUCKET_BITS

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BITS = 17
"""131072 buckets: 38 chunks each at 5 M chunks, 76 at 10 M (under the 128 of
``hash-max-listpack-entries``); ``?bucket_bits=18`` for 10-20 M."""
MIN_BUCKET_BITS, MAX_BUCKET_BITS = 8, 24
SIZE_BYTES = 6  # a record's size
EPOCH_BYTES = 6  # a replica's registration epoch (ms since 1970 fit until year 10889)
REPLICA_BYTES = EPOCH_BYTES + 1  # and its tier code

_NAMES_MAX = 1 << 20  # bucket names kept made
# Sweep: buckets one SCAN step returns about this many of (one SWEEP call of
# about 2500 chunks at 5 M chunks: a few ms of the server's time).
_SCAN_COUNT = 64
# An ended registration is forgotten only after a whole sweep that started
# this long after it ended: a write of it in flight then (a page, a commit,
# each bounded by a round trip's deadline) has landed before that sweep.
SWEEP_GRACE_S = 60.0


def check_bucket_bits(raw: str | int) -> int:
    try:
        bits = int(raw)
    except ValueError:
        bits = -1
    if not MIN_BUCKET_BITS <= bits <= MAX_BUCKET_BITS:
        raise InvalidArgument(
            f"bucket_bits={raw!r}: must be a whole number from {MIN_BUCKET_BITS} to "
            f"{MAX_BUCKET_BITS}"
        )
    return bits


def epoch_bytes(epoch: int) -> bytes:
    return epoch.to_bytes(EPOCH_BYTES, "big")


def record(size: int) -> bytes:
    return size.to_bytes(SIZE_BYTES, "big")


def records(sizes: np.ndarray) -> bytes:
    """The sizes' records, concatenated (6 bytes each, big-endian)."""
    wide = np.ascontiguousarray(sizes, dtype=">u8").view(np.uint8).reshape(-1, 8)
    return wide[:, 8 - SIZE_BYTES :].tobytes()


def replicas(value: bytes) -> list[tuple[int, int]]:
    """(epoch, tier code) of each replica in a record."""
    return [
        (int.from_bytes(value[i : i + EPOCH_BYTES], "big"), value[i + EPOCH_BYTES])
        for i in range(SIZE_BYTES, len(value), REPLICA_BYTES)
    ]


LostListener = Callable[[str, float, list[ChunkKey]], Awaitable[None]]
"""Told the node, the time its registration ended (s) and keys of replicas
of it the sweep deleted."""

Lease = list[bytes | None] | None
"""A node's lease as a lookup reads it: [epoch, address], or None if gone."""


def live_replicas(
    tail: bytes, leases: dict[str, Lease], owners: dict[int, str], client: str
) -> tuple[Replica, ...]:
    """The live replicas of a record (its bytes after the size), the client's first."""
    found: list[Replica] = []
    for i in range(0, len(tail), REPLICA_BYTES):
        epoch = int.from_bytes(tail[i : i + EPOCH_BYTES], "big")
        nid = owners.get(epoch)
        lease = leases.get(nid) if nid is not None else None
        # Not live: the node is dead, or an ended registration wrote it.
        if nid is not None and lease is not None and int(lease[0] or 0) == epoch:
            tier = TIER_BY_CODE[tail[i + EPOCH_BYTES]]
            found.append(Replica(nid, (lease[1] or b"").decode(), tier))
    if len(found) > 1:
        found.sort(key=lambda r: (r.node_id != client, TIER_RANK.get(r.tier, 9)))
    return tuple(found)


class LeaseCache:
    """Leases that lookups read lately, used again for ``ttl_s``.

    A lookup has to know each named node's live epoch and address; with many
    nodes, reading every lease in every lookup's round trip cost more than the
    chunks themselves (128 nodes: p50 2.2x that of 2 nodes). A lease read less
    than ``ttl_s`` ago is taken as it was: a registration that ended within
    that time may still be named, and its read is a miss, as a read of a node
    that died within its lease already is. This process's own registrations
    and reaps drop the entries they change at once.
    """

    def __init__(self, ttl_s: float, limit: int = 4096) -> None:
        self.ttl_s = ttl_s
        self._limit = limit
        self._at: dict[str, tuple[float, Lease]] = {}

    def split(self, node_ids: Sequence[str]) -> tuple[dict[str, Lease], list[str]]:
        """The fresh leases among ``node_ids``, and the ids to read again."""
        now = time.monotonic()
        fresh: dict[str, Lease] = {}
        stale: list[str] = []
        for n in node_ids:
            hit = self._at.get(n)
            if hit is not None and now - hit[0] < self.ttl_s:
                fresh[n] = hit[1]
            else:
                stale.append(n)
        return fresh, stale

    def put(self, leases: dict[str, Lease]) -> None:
        if len(self._at) + len(leases) > self._limit:
            self._at.clear()
        now = time.monotonic()
        self._at.update((n, (now, lease)) for n, lease in leases.items())

    def drop(self, node_id: str) -> None:
        self._at.pop(node_id, None)


def tag(node_id: str) -> str:
    """A node id as a hash tag: braces in it would change which part of the
    key Redis Cluster hashes; escaping keeps a node's keys on one slot and
    stays injective."""
    return node_id.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")


def tier_code(tier: str) -> bytes:
    code = TIER_RANK.get(tier)
    if code is None:
        raise InvalidArgument(f"unknown tier {tier!r}")
    return bytes((code,))


# -- lease fields -----------------------------------------------------------------
def tiers_json(tiers: Sequence[TierStats]) -> str:
    return json.dumps([list(astuple(t)) for t in tiers], separators=(",", ":"))


def tiers_parse(raw: bytes | None) -> tuple[TierStats, ...]:
    if not raw:
        return ()
    return tuple(TierStats(*row) for row in json.loads(raw))


def transfer_json(transfer: TransferRate) -> str:
    return json.dumps(list(astuple(transfer)), separators=(",", ":"))


def transfer_parse(raw: bytes | None) -> TransferRate:
    if not raw:
        return TransferRate()
    return TransferRate(*json.loads(raw))


# -- pending allocations: "<batch>:<deadline ms>:<node>" --------------------------
def pending_live(value: bytes | None, now_ms: int) -> bool:
    if value is None:
        return False
    parts = value.split(b":", 2)
    return len(parts) == 3 and int(parts[1]) > now_ms


def batch_id(request_id: bytes) -> str:
    """A new allocation batch, naming the put's request id when it sent one."""
    batch = uuid.uuid4().hex
    return f"{batch}-{request_id.hex()}" if request_id else batch


def retried(value: bytes | None, request_hex: bytes, now_ms: int) -> str | None:
    """The node of ``value`` if it is a live allocation made by the put whose
    request id is ``request_hex`` (hex, ``b""`` for none), else None."""
    if value is None or not request_hex or not pending_live(value, now_ms):
        return None
    batch, _, rest = value.partition(b":")
    if batch.partition(b"-")[2] != request_hex:
        return None
    return rest.partition(b":")[2].decode()


def ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def wall_ms() -> int:
    return int(time.time() * 1000)


def registration_reply(node_id: str, epoch: int, reply: Sequence[Any]) -> int:
    """The node's count from a PAGE reply, or the refusal it means."""
    code = int(reply[0])
    if code == 0:
        raise NotFound(f"node {node_id!r} is not registered (its lease ran out): register again")
    if code < 0:
        raise stale_registration(node_id, epoch, int(reply[1]))
    return int(reply[1])


class Buckets:
    """Names of the buckets and where a key lives in them.

    Args:
        prefix: The index's key prefix.
        bits: Bits of a key that pick its bucket.
    """

    def __init__(self, prefix: str, bits: int) -> None:
        self.bits = bits
        self._shift = 24 - bits
        self._digits = (bits + 3) // 4
        self.skip = bits // 8  # bytes of a key the bucket determines
        self.width = KEY_BYTES - self.skip  # of a field
        self._name = f"{prefix}:b:{{{{{{:0{self._digits}x}}}}}}".format
        self._pending = f"{prefix}:p:{{{{{{:0{self._digits}x}}}}}}{{}}".format
        glob = "".join("\\" + c if c in "\\*?[]^" else c for c in prefix)
        self.pattern = f"{glob}:b:{{*"  # for SCAN
        self._names: dict[int, str] = {}

    def bucket(self, key: bytes) -> str:
        return self._cached(int.from_bytes(key[:3], "big") >> self._shift)

    def _cached(self, i: int) -> str:
        name = self._names.get(i)
        if name is None:
            name = self._name(i)
            if len(self._names) < _NAMES_MAX:
                self._names[i] = name
        return name

    def field(self, key: bytes) -> bytes:
        return key[self.skip :]

    def key_of(self, bucket: bytes, field: bytes) -> bytes:
        """The key whose ``field`` is in the bucket named ``bucket``."""
        i = int(bucket[bucket.rindex(b"{") + 1 : bucket.rindex(b"}")], 16)
        return (i << (24 - self.bits)).to_bytes(3, "big")[: self.skip] + field

    def of_digest_bucket(self, bucket: int) -> list[tuple[str, bytes]]:
        """The buckets holding the keys of a digest bucket (a key's first 12
        bits: :mod:`kvdepot.wire.digest`), each with the bytes its keys start
        with before their field. With fewer than 12 bits, one bucket holds
        other digest buckets' keys too."""
        shift = self.bits - BUCKET_BITS
        ids = range(bucket << shift, (bucket + 1) << shift) if shift >= 0 else [bucket >> -shift]
        return [
            (self._cached(i), (i << (24 - self.bits)).to_bytes(3, "big")[: self.skip]) for i in ids
        ]

    def columns(self, keys: bytes) -> tuple[list[str], bytes]:
        """The buckets of ``keys`` (16 bytes each, concatenated) and their
        fields, concatenated: without a Python object per key but the name."""
        rows = np.frombuffer(keys, dtype=np.uint8).reshape(-1, KEY_BYTES)
        ids = (rows[:, :3].astype(np.uint32) << np.array([16, 8, 0], np.uint32)).sum(axis=1)
        names = [self._cached(i) for i in (ids >> self._shift).tolist()]
        return names, rows[:, self.skip :].tobytes()

    def pending(self, key: bytes) -> str:
        """The key's pending allocation: on its bucket's slot, so that one
        script commits both."""
        return self._pending(int.from_bytes(key[:3], "big") >> self._shift, key.hex())


@dataclass(slots=True)
class _Pass:
    """One sweep over every bucket, as this process runs it."""

    started_ms: int
    ended: dict[int, str]  # the registrations known to have ended at its start
    cursors: dict[str, int]  # per server (one on a single server)
    dropped: Counter[int] = field(default_factory=Counter)
    told: Counter[int] = field(default_factory=Counter)  # replicas told of, per epoch
    swept_before: dict[int, int] = field(default_factory=dict)  # by earlier passes


class Sweeper:
    """Deletes the replicas of ended registrations from the buckets, in steps.

    A sweep is a pass of SCAN over the bucket keys (on every primary of a
    cluster), each step one SCAN and one SWEEP round trip of about
    ``_SCAN_COUNT`` buckets; :meth:`run` takes steps until its time budget is
    spent. It runs while some registration that ended is not yet forgotten.
    A lock in Redis keeps two metadata replicas from sweeping at once (each
    keeps its own place: a pass is one process's), and every deletion is one
    script call that checks again, so overlapping sweeps are safe anyway.

    Args:
        db: The connection.
        buckets: The bucket layout.
        keys: The registrations' keys: last epoch, map, ended, swept, lock.
    """

    def __init__(
        self,
        db: Connection,
        buckets: Buckets,
        keys: Sequence[str],
        on_lost: LostListener | None = None,
        lost_per_step: int = 0,
        lost_per_pass: int = 0,
    ) -> None:
        # Told (node, ended at in s, keys) of replicas of ended registrations
        # before they are deleted: up to lost_per_step a step's script call,
        # while the pass has told of fewer than lost_per_pass of some one.
        self._on_lost = on_lost
        self._lost_per_step = lost_per_step if on_lost is not None else 0
        self._lost_per_pass = max(lost_per_pass, self._lost_per_step)
        self._db = db
        self._buckets = buckets
        self._last, self._map, self._ended, self._swept, self._lock = keys
        self._pass: _Pass | None = None
        self._covered: set[int] = set()  # ended registrations a pass of ours has swept
        self._token = uuid.uuid4().hex
        self.grace_s = SWEEP_GRACE_S

    async def run(self, budget_s: float) -> int:
        """Sweep for about ``budget_s`` seconds at most (a step more); returns
        the replicas deleted."""
        deadline = time.monotonic() + budget_s
        last, now_ms, mapped, raw = await self._db.one(
            scripts.SNAPSHOT.cmd([self._last, self._map, self._ended], [])
        )
        ended = {int(e): v.decode() for e, v in zip(raw[::2], raw[1::2], strict=True)}
        self._covered.intersection_update(ended)  # forgotten since, by another replica
        if self._pass is None and not self._due(ended, int(now_ms)):
            return 0
        lock_ms = int(budget_s * 1000) + 10_000  # released at the end; expires if we die
        if not await self._db.one(("SET", self._lock, self._token, "NX", "PX", lock_ms)):
            return 0
        try:
            if self._pass is None:
                self._pass = _Pass(int(now_ms), ended, await self._start())
                raw = await self._db.one(("HGETALL", self._swept))
                self._pass.swept_before = {int(e): int(n) for e, n in raw.items()}
            keep = b"".join(epoch_bytes(int(e)) for e in mapped if int(e) not in ended)
            deleted = 0
            while self._pass.cursors:  # a step at least
                deleted += await self._step(self._pass, int(last), keep)
                if time.monotonic() >= deadline:
                    break
            if not self._pass.cursors:
                await self._finish(self._pass)
                self._pass = None
            return deleted
        finally:
            await self._db.one(("DEL", self._lock))

    def _due(self, ended: dict[int, str], now_ms: int) -> bool:
        """Whether a pass would delete or forget something: an ended
        registration no pass of ours swept yet, or one it may now forget."""
        grace_ms = self.grace_s * 1000
        return any(
            e not in self._covered or int(v.split(" ", 1)[0]) + grace_ms <= now_ms
            for e, v in ended.items()
        )

    async def _start(self) -> dict[str, int]:
        client = self._db.client
        if isinstance(client, RedisCluster):
            return {n.name: 0 for n in client.get_primaries()}
        return {"": 0}

    async def _scan(self, server: str, cursor: int) -> tuple[int, list[bytes]]:
        client = self._db.client
        pattern = self._buckets.pattern
        if isinstance(client, RedisCluster):
            node = client.get_node(node_name=server)
            if node is None:  # the cluster changed: this server's part is done
                return 0, []
            out: Any = await client.scan(
                cursor=cursor, match=pattern, count=_SCAN_COUNT, target_nodes=node
            )
            return int(out[0][server]), list(out[1])
        out = await client.scan(cursor=cursor, match=pattern, count=_SCAN_COUNT)
        return int(out[0]), list(out[1])

    async def _step(self, sweep: _Pass, last: int, keep: bytes) -> int:
        server, cursor = next(iter(sweep.cursors.items()))
        cursor, keys = await self._scan(server, cursor)
        if cursor == 0:
            del sweep.cursors[server]
        else:
            sweep.cursors[server] = cursor
        if not keys:
            return 0
        if self._telling(sweep):
            want = [last, keep, self._lost_per_step]
            for lost in await self._db.exec(self._calls(keys, want)):
                await self._tell_lost(sweep, lost)
        dropped: Counter[int] = Counter()
        for reply in await self._db.exec(self._calls(keys, [last, keep])):
            for epoch, n in zip(reply[1::2], reply[2::2], strict=True):
                dropped[int.from_bytes(epoch, "big")] += int(n)
        if dropped:
            await self._db.exec([("HINCRBY", self._swept, e, n) for e, n in dropped.items()])
        sweep.dropped.update(dropped)
        return sum(dropped.values())

    def _telling(self, sweep: _Pass) -> bool:
        """Whether a step reads the replicas it will delete first, to tell of
        them: while some ended registration has replicas left and fewer than
        ``lost_per_pass`` told of."""
        if not self._lost_per_step:
            return False
        for epoch, ended in sweep.ended.items():
            parts = ended.split(" ", 2)
            count = int(parts[1]) if len(parts) > 1 else -1  # -1: unknown
            gone = sweep.swept_before.get(epoch, 0) + sweep.dropped[epoch]
            if sweep.told[epoch] < self._lost_per_pass and (count < 0 or gone < count):
                return True
        return False

    def _calls(self, keys: Sequence[bytes], argv: list[Any]) -> list[scripts.Cmd]:
        if self._db.cluster:  # a script's keys on one slot
            return [scripts.SWEEP.cmd([k], argv) for k in keys]
        return [scripts.SWEEP.cmd(keys, argv)]

    async def _tell_lost(self, sweep: _Pass, lost: Sequence[bytes]) -> None:
        assert self._on_lost is not None
        by_epoch: dict[int, list[ChunkKey]] = {}
        for bucket, fld, raw in zip(lost[::3], lost[1::3], lost[2::3], strict=True):
            key = ChunkKey(self._buckets.key_of(bucket, fld))
            by_epoch.setdefault(int.from_bytes(raw, "big"), []).append(key)
        for number, keys in by_epoch.items():
            sweep.told[number] += len(keys)
            parts = sweep.ended.get(number, "").split(" ", 2)
            if len(parts) == 3:  # else replaced, not ended with its node
                await self._on_lost(parts[2], int(parts[0]) / 1000, keys)

    async def _finish(self, sweep: _Pass) -> None:
        """A pass is complete: forget the registrations it may forget, and say
        how many replicas of each the sweeps deleted."""
        self._covered.update(sweep.ended)
        grace_ms = self.grace_s * 1000
        for epoch, ended in sweep.ended.items():
            if int(ended.split(" ", 1)[0]) + grace_ms > sweep.started_ms:
                continue
            out = await self._db.one(
                scripts.RETIRE.cmd([self._map, self._ended, self._swept], [epoch])
            )
            self._covered.discard(epoch)
            if out:
                _, count, node = out[0].decode().split(" ", 2)
                logger.info(
                    "node %s: registration %d cleaned up, %d replicas deleted (%s indexed at "
                    "its end)",
                    node,
                    epoch,
                    int(out[1]),
                    count if count != "-1" else "unknown",
                    extra={"event": "registration_swept", "node": node, "replicas": int(out[1])},
                )
        others = sum(n for e, n in sweep.dropped.items() if e not in sweep.ended)
        if others:
            logger.info("sweep deleted %d replicas of registrations ended meanwhile", others)
