"""``KVDepotClient``: publish, look up and pull KV chunks from a user's process.

The client speaks gRPC to the metadata service (synchronously: it lives in
engine processes that are not asyncio) and moves bytes over a data-plane
transport straight from and into caller-owned buffers.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvdepot.connector.metadata import MetadataConnection, parse_endpoints
from kvdepot.connector.transport import create_transport
from kvdepot.connector.transport.base import GetItem, PutItem, PutStatus, Transport
from kvdepot.errors import InvalidArgument
from kvdepot.metadata.keys import KEY_BYTES, ChunkKey
from kvdepot.metadata.lookup_wire import unpack_lookup
from kvdepot.metadata.types import LookupResult
from kvdepot.proto.gen import metadata_pb2
from kvdepot.security import NO_SECURITY, SecurityConfig

logger = logging.getLogger(__name__)

LookupCount = Literal["all", "hits", "none"]
"""What a lookup adds to the cluster's statistics (see ``KVDepotClient.lookup``)."""

Buffer = Any  # anything exporting the buffer protocol: bytes, bytearray, numpy, memoryview


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """Configuration of a :class:`KVDepotClient`.

    Attributes:
        metadata: Metadata service address ``host:port``, or several replicas
            ``host:port,host:port`` to fail over between.
        node_id: The store node on this host, if any: puts go there first
            and lookups list its replicas first.
        transport: Data-plane transport name: ``auto`` (per store: ``shm`` on
            this host, ``nixl`` where RDMA devices exist, ``tcp`` otherwise),
            or one of ``tcp``, ``shm``, ``nixl`` for every store.
        tokens_per_chunk: Tokens a chunk covers, for hit-rate statistics.
        rpc_timeout_s: Deadline of each metadata call.
        connect_timeout_s: Deadline to connect to a store.
        io_timeout_s: Deadline for a stalled data-plane transfer.
        replicate_on_read: After pulling chunks from another node, also store
            them on ``node_id``'s store and register that replica, so the next
            reader on this node reads locally.
        security: The token this client presents (gRPC and data plane) and
            its TLS settings; by default none.
    """

    metadata: str = "127.0.0.1:7700"
    node_id: str = ""
    transport: str = "auto"
    tokens_per_chunk: int = 0
    rpc_timeout_s: float = 10.0
    connect_timeout_s: float = 5.0
    io_timeout_s: float = 30.0
    replicate_on_read: bool = False
    security: SecurityConfig = NO_SECURITY

    def __post_init__(self) -> None:
        parse_endpoints(self.metadata)
        if self.replicate_on_read and not self.node_id:
            raise InvalidArgument("replicate_on_read needs node_id (the store to replicate to)")
        if min(self.rpc_timeout_s, self.connect_timeout_s, self.io_timeout_s) <= 0:
            raise InvalidArgument("timeouts must be positive")
        if self.tokens_per_chunk < 0:
            raise InvalidArgument("tokens_per_chunk must not be negative")


@dataclass(frozen=True, slots=True)
class PutResult:
    """What a put did, key by key summed up."""

    stored: int
    skipped: int
    failed: int
    bytes_sent: int
    bytes_skipped: int


@dataclass(frozen=True, slots=True)
class GetResult:
    """Which keys were loaded into their buffers (verified) and which missed.

    Attributes:
        loaded: Per key, whether its chunk is in its buffer.
        bytes_received: Bytes of all loaded chunks.
        sizes: Per key, the size of the chunk loaded (0 for a miss).
    """

    loaded: tuple[bool, ...]
    bytes_received: int
    sizes: tuple[int, ...] = ()

    @property
    def leading(self) -> int:
        """Number of leading keys loaded: the usable prefix."""
        n = 0
        for ok in self.loaded:
            if not ok:
                break
            n += 1
        return n


def _as_view(buf: Buffer, writable: bool) -> memoryview:
    view = memoryview(buf)
    if not view.c_contiguous:
        raise InvalidArgument("buffers must be C-contiguous")
    if writable and view.readonly:
        raise InvalidArgument("get_into needs writable buffers")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _check_keys(keys: Sequence[bytes]) -> list[ChunkKey]:
    for i, k in enumerate(keys):
        if len(k) != KEY_BYTES:
            raise InvalidArgument(f"key {i} is {len(k)} bytes; chunk keys are {KEY_BYTES}")
    return [ChunkKey(bytes(k)) for k in keys]


class KVDepotClient:
    """Publish chunks, look up prefixes and pull chunks into caller buffers.

    Thread-safe: one client may be shared by the threads of an engine.
    """

    def __init__(self, config: ClientConfig, transport: Transport | None = None) -> None:
        """Connect to the metadata service; data-plane connections open on use.

        Args:
            config: The client's configuration.
            transport: Moves the bytes to and from every store; by default the
                one ``config.transport`` names (``auto`` picks per store).
        """
        self.config = config
        self._metadata = MetadataConnection(config.metadata, config.rpc_timeout_s, config.security)
        self._transport = transport or create_transport(
            config.transport,
            connect_timeout_s=config.connect_timeout_s,
            io_timeout_s=config.io_timeout_s,
            security=config.security,
        )
        self._closed = False
        self._lock = threading.Lock()
        # This node's store, once a reply named it (see get_into).
        self._local_address: str | None = None

    def __enter__(self) -> KVDepotClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the metadata channel and the data-plane connections."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._transport.close()
        self._metadata.close()

    def connect(self, timeout_s: float) -> bool:
        """Open the metadata channel now (up to ``timeout_s``); whether it is up."""
        return self._metadata.wait_ready(timeout_s)

    def _call(self, method: str, request: Any) -> Any:
        return self._metadata.call(method, request)

    def _learn_local(self, nodes: Iterable[Any]) -> None:
        # Replicas and allocations name nodes with their data-plane address.
        if not self.config.node_id:
            return
        for node in nodes:
            if node.node_id == self.config.node_id and node.address:
                self._local_address = node.address
                return

    # -- publish ----------------------------------------------------------------
    def put(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> PutResult:
        """Publish chunks; keys already stored (or being stored) are not sent.

        Args:
            keys: Chunk keys, e.g. from :func:`kvdepot.metadata.keys.chunk_keys`.
            buffers: One buffer per key with the chunk's bytes.

        Returns:
            Counts of chunks stored, skipped as already present, and failed.

        Raises:
            InvalidArgument: mismatched keys and buffers, or bad keys.
            Unavailable: the metadata service cannot be reached.
        """
        if len(keys) != len(buffers):
            raise InvalidArgument(f"{len(keys)} keys but {len(buffers)} buffers")
        ckeys = _check_keys(keys)
        views = [_as_view(b, writable=False) for b in buffers]
        if any(v.nbytes == 0 for v in views):
            raise InvalidArgument("chunks must not be empty")
        if not ckeys:
            return PutResult(0, 0, 0, 0, 0)
        # One id per put, sent again on each failover retry of this request
        # (the connection resends the same message): if a replica allocated
        # the keys and died before answering, the next one hands the same
        # allocations back instead of reporting them pending until they expire.
        reply = self._call(
            "PutStart",
            metadata_pb2.PutStartRequest(
                keys=ckeys,
                sizes=[v.nbytes for v in views],
                writer_node_id=self.config.node_id,
                request_id=os.urandom(16),
            ),
        )
        groups: dict[tuple[str, str], list[int]] = defaultdict(list)
        skipped = bytes_skipped = 0
        self._learn_local(a.node for a in reply.allocations)
        for i, alloc in enumerate(reply.allocations):
            if alloc.action == metadata_pb2.Allocation.WRITE:
                groups[(alloc.node.node_id, alloc.node.address)].append(i)
            else:
                skipped += 1
                bytes_skipped += views[i].nbytes
        stored = failed = bytes_sent = 0
        for (node_id, address), idx in groups.items():
            # The checksum is left to the transport, which computes it while
            # it reads the bytes anyway (sending or copying them): one pass
            # over memory instead of two. The store verifies it either way.
            items = [PutItem(ckeys[i], views[i]) for i in idx]
            statuses = self._transport.put(address, items)
            done = [i for i, s in zip(idx, statuses, strict=True) if s in _WRITTEN]
            lost = [i for i, s in zip(idx, statuses, strict=True) if s not in _WRITTEN]
            if done:
                self._call(
                    "PutEnd",
                    metadata_pb2.PutEndRequest(
                        keys=[ckeys[i] for i in done],
                        node_id=node_id,
                        sizes=[views[i].nbytes for i in done],
                    ),
                )
            if lost:
                logger.warning(
                    "put of %d chunks to %s failed: %s",
                    len(lost),
                    address,
                    sorted({s.name for s in statuses if s not in _WRITTEN}),
                )
                self._call(
                    "PutRevoke",
                    metadata_pb2.PutRevokeRequest(keys=[ckeys[i] for i in lost], node_id=node_id),
                )
            stored += len(done)
            failed += len(lost)
            bytes_sent += sum(
                views[i].nbytes for i, s in zip(idx, statuses, strict=True) if s is PutStatus.OK
            )
        return PutResult(stored, skipped, failed, bytes_sent, bytes_skipped)

    # -- lookup -----------------------------------------------------------------
    def _lookup(
        self,
        keys: Sequence[bytes],
        key_tokens: Sequence[int] = (),
        count: LookupCount = "all",
    ) -> metadata_pb2.LookupResponse:
        if key_tokens and len(key_tokens) != len(keys):
            raise InvalidArgument(f"{len(key_tokens)} key_tokens for {len(keys)} keys")
        return self._call(
            "Lookup",
            metadata_pb2.LookupRequest(
                keys=_check_keys(keys),
                client_node_id=self.config.node_id,
                tokens_per_key=self.config.tokens_per_chunk,
                packed=True,
                key_tokens=list(key_tokens),
                count=_COUNT[count],
            ),
        )

    def lookup_locations(
        self, keys: Sequence[bytes], *, count: LookupCount = "all"
    ) -> LookupResult:
        """The lookup answer: leading hits and the replicas of each, this node's first.

        Args:
            keys: Chunk keys in prompt order.
            count: What the lookup adds to the cluster's statistics: ``all``,
                ``hits`` (the rest of a prompt's lookup) or ``none`` (a load
                of a prompt whose lookup was counted).

        Raises:
            Unavailable: The metadata service cannot be reached.
            Corrupt: The answer is malformed.
        """
        return unpack_lookup(self._lookup(keys, count=count))

    def lookup(
        self,
        keys: Sequence[bytes],
        *,
        key_tokens: Sequence[int] = (),
        count: LookupCount = "all",
    ) -> int:
        """Number of leading keys that are stored somewhere in the cluster.

        Args:
            keys: Chunk keys in prompt order.
            key_tokens: Tokens each key covers, where they differ (for the
                cluster's hit rate in tokens).
            count: As for :meth:`lookup_locations`.
        """
        if not keys:
            return 0
        return int(self._lookup(keys, key_tokens, count).hits)

    # -- pull ---------------------------------------------------------------------
    def get_into(
        self, keys: Sequence[bytes], buffers: Sequence[Buffer], *, count: LookupCount = "all"
    ) -> GetResult:
        """Pull the leading cached chunks of ``keys`` into ``buffers``.

        Each loaded chunk has been verified against its checksum. A chunk that
        is missing, evicted meanwhile, corrupt, or on a store that died is a
        miss (``loaded[i]`` is False) and its buffer content is undefined.
        This node's store is read first: when it holds every chunk, the
        metadata service is not asked at all. ``count`` is passed to the
        lookup it makes (``none`` when the caller counted the prompt already).

        Raises:
            InvalidArgument: mismatched keys and buffers, or bad keys.
            Unavailable: the metadata service cannot be reached.
        """
        if len(keys) != len(buffers):
            raise InvalidArgument(f"{len(keys)} keys but {len(buffers)} buffers")
        views = [_as_view(b, writable=True) for b in buffers]
        if not keys:
            return GetResult((), 0, ())
        ckeys = _check_keys(keys)
        local = self._local_address
        early = None
        if local is not None:
            # This node's store usually holds what this node reads: read it
            # from there first. When it has every chunk (each read verified
            # against its checksum) no metadata round trip is needed at all:
            # a key names its bytes, wherever they are found.
            early = self._transport.get_into(
                local, [GetItem(k, v) for k, v in zip(ckeys, views, strict=True)]
            )
            if all(o.ok for o in early):
                sizes = tuple(o.length for o in early)
                return GetResult((True,) * len(keys), sum(sizes), sizes)
        reply = self.lookup_locations(keys, count=count)
        self._learn_local(r for loc in reply.locations for r in loc.replicas)
        loaded = [False] * len(keys)
        remote: list[int] = []
        received = 0
        if early is not None:
            for i in range(reply.hits):
                size = reply.locations[i].size
                if early[i].ok and early[i].length == size:
                    loaded[i] = True
                    received += size
        # Each round tries the next replica of every key that is still missing.
        attempt = 0
        todo = [
            i
            for i in range(reply.hits)
            if not loaded[i] and views[i].nbytes >= reply.locations[i].size
        ]
        while todo:
            groups: dict[str, list[int]] = defaultdict(list)
            for i in todo:
                reps = reply.locations[i].replicas
                if attempt < len(reps):
                    groups[reps[attempt].address].append(i)
            if not groups:
                break
            for address, idx in groups.items():
                items = [GetItem(ckeys[i], views[i][: reply.locations[i].size]) for i in idx]
                outcomes = self._transport.get_into(address, items)
                for i, out in zip(idx, outcomes, strict=True):
                    if out.ok and out.length == reply.locations[i].size:
                        loaded[i] = True
                        received += out.length
                        if address != self._local_address:
                            remote.append(i)
            todo = [i for i in todo if not loaded[i]]
            attempt += 1
        if remote and self.config.replicate_on_read:
            self._replicate(
                [ckeys[i] for i in remote], [views[i][: reply.locations[i].size] for i in remote]
            )
        sizes = tuple(reply.locations[i].size if ok else 0 for i, ok in enumerate(loaded))
        return GetResult(tuple(loaded), received, sizes)

    def _replicate(self, keys: list[ChunkKey], views: list[memoryview]) -> None:
        """Store pulled chunks on this node too and register the replicas."""
        if self._local_address is None:
            self._learn_local(self.stats().nodes)
        local = self._local_address
        if local is None:
            return
        items = [PutItem(k, v) for k, v in zip(keys, views, strict=True)]
        statuses = self._transport.put(local, items)
        done = [i for i, st in enumerate(statuses) if st in _WRITTEN]
        if done:
            self._call(
                "PutEnd",
                metadata_pb2.PutEndRequest(
                    keys=[keys[i] for i in done],
                    node_id=self.config.node_id,
                    sizes=[views[i].nbytes for i in done],
                ),
            )

    def get_ranges_into(
        self,
        keys: Sequence[bytes],
        ranges: Sequence[tuple[int, int]],
        buffers: Sequence[Buffer],
        replicas: Sequence[Sequence[str]],
    ) -> list[bool]:
        """Read byte ranges of chunks whose replicas a lookup already found.

        For pipelined loads: one lookup, then several batches of ranged reads
        (e.g. one layer of every chunk at a time). Item ``i`` reads
        ``ranges[i] = (offset, length)`` of chunk ``keys[i]`` into ``buffers[i]``,
        trying ``replicas[i]`` (data-plane addresses) in order. The store
        checksums what it serves; callers that need end-to-end verification of
        a range keep their own checksums inside the chunk.

        Returns:
            Per item, whether its range arrived complete and verified.
        """
        n = len(keys)
        if not n == len(ranges) == len(buffers) == len(replicas):
            raise InvalidArgument("keys, ranges, buffers and replicas must have equal lengths")
        ckeys = _check_keys(keys)
        views = [_as_view(b, writable=True) for b in buffers]
        for (offset, length), view in zip(ranges, views, strict=True):
            if offset < 0 or length <= 0 or view.nbytes < length:
                raise InvalidArgument("each range needs a positive length that fits its buffer")
        done = [False] * n
        attempt = 0
        todo = list(range(n))
        while todo:
            groups: dict[str, list[int]] = defaultdict(list)
            for i in todo:
                if attempt < len(replicas[i]):
                    groups[replicas[i][attempt]].append(i)
            if not groups:
                break
            for address, idx in groups.items():
                items = [
                    GetItem(ckeys[i], views[i][: ranges[i][1]], ranges[i][0], ranges[i][1])
                    for i in idx
                ]
                for i, out in zip(idx, self._transport.get_into(address, items), strict=True):
                    done[i] = out.ok and out.length == ranges[i][1]
            todo = [i for i in todo if not done[i]]
            attempt += 1
        return done

    def stats(self) -> metadata_pb2.ClusterStats:
        """Cluster-wide statistics from the metadata service."""
        return self._call("GetStats", metadata_pb2.GetStatsRequest())


_WRITTEN = (PutStatus.OK, PutStatus.EXISTS)
_COUNT = {
    "all": metadata_pb2.LookupRequest.COUNT_ALL,
    "hits": metadata_pb2.LookupRequest.COUNT_HITS,
    "none": metadata_pb2.LookupRequest.COUNT_NONE,
}
