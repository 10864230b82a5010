"""``KVDepotClient``: publish, look up and pull KV chunks from a user's process.

The client speaks gRPC to the metadata service (synchronously: it lives in
engine processes that are not asyncio) and moves bytes over a data-plane
transport straight from and into caller-owned buffers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvdepot.config import InvalidSetting, Number, Parsed, positive, setting, validate
from kvdepot.connector.fallback import Fallback
from kvdepot.connector.namespace_calls import NamespaceCalls
from kvdepot.connector.put_plan import PutPlan, Route, plan_put
from kvdepot.connector.results import (
    DeferredCommits,
    GetResult,
    Pull,
    PutResult,
    PutTally,
    whole,
)
from kvdepot.connector.transport import create_transport
from kvdepot.connector.transport.base import (
    GetItem,
    IndexingTransport,
    PutStatus,
    Transport,
)
from kvdepot.endpoints import parse_endpoints
from kvdepot.errors import ClientClosed, InvalidArgument, KVDepotError, Unavailable
from kvdepot.keys import ChunkKey, validate_keys
from kvdepot.metadata_client import MetadataClient
from kvdepot.proto.gen import metadata_pb2
from kvdepot.retry import RetryPolicy
from kvdepot.rpc.security_config import NO_SECURITY, SecurityConfig
from kvdepot.types import LookupResult
from kvdepot.wire.lookup import unpack_lookup
from kvdepot.wire.protocol import IndexCode, IndexSettled

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
        fallback_wait_s: Longest a counted ``get_into`` waits for its lookup
            where one store served the last read whole, before reading that
            store (at most ``rpc_timeout_s``; docs/client.md, "Outages").
        connect_timeout_s: Deadline to connect to a store.
        io_timeout_s: Deadline for a stalled data-plane transfer.
        replicate_on_read: After pulling chunks from another node, also store
            them on ``node_id``'s store and register that replica, so the next
            reader on this node reads locally. Without it, only the hot chunks
            the metadata service asks for (read from many nodes, short of
            replicas) are copied, where the client has a ``node_id``.
        defer_index_commit: A put into ``node_id``'s store returns once the
            store committed the chunks (readable there); the store commits
            them into the index right after, batched with other writers'
            (``PutResult.pending``; :meth:`KVDepotClient.sync_index` waits for
            them). Over ``shm`` the put returns once its COMMIT is sent: the
            store commits one put while the writer copies the next, and the
            answer is read by the next exchange. This client's own reads
            and lookups wait for its pending commits first; other
            processes' lookups may miss chunks for that moment.
            Off (the default): the store answers once the index did. The
            vLLM connector turns it on: it publishes from a thread of its
            own, and a decode engine waits for what a prefill announced.
        security: The token this client presents (gRPC and data plane) and
            its TLS settings; by default none.
        metadata_frames: Send lookups and put starts over the metadata
            service's framed socket where it offers one (a fraction of a gRPC
            round trip; see :mod:`kvdepot.wire.frames`); off: gRPC only.
    """

    metadata: str = setting("127.0.0.1:7700", Parsed(parse_endpoints))
    node_id: str = ""
    transport: str = "auto"
    tokens_per_chunk: int = setting(0, Number(low=0))
    rpc_timeout_s: float = setting(10.0, positive())
    fallback_wait_s: float = setting(0.5, positive())
    connect_timeout_s: float = setting(5.0, positive())
    io_timeout_s: float = setting(30.0, positive())
    replicate_on_read: bool = False
    defer_index_commit: bool = False
    security: SecurityConfig = NO_SECURITY
    metadata_frames: bool = True

    def __post_init__(self) -> None:
        validate(self)
        if not isinstance(self.security, SecurityConfig):
            raise InvalidSetting("security", "must be a SecurityConfig", self.security)
        if self.replicate_on_read and not self.node_id:
            raise InvalidSetting(
                ("replicate_on_read", "node_id"), "needs node_id (the store to replicate to)"
            )


def _as_view(buf: Buffer, writable: bool, i: int = 0) -> memoryview:
    try:
        view = memoryview(buf)
    except TypeError:
        raise InvalidArgument(
            f"buffer {i} is a {type(buf).__name__}; buffers are bytes-like "
            "(bytes, bytearray, numpy arrays, memoryview)"
        ) from None
    if not view.c_contiguous:
        raise InvalidArgument("buffers must be C-contiguous")
    if writable and view.readonly:
        raise InvalidArgument("get_into needs writable buffers")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _sequence(items: Any, what: str) -> Sequence[Any]:
    # A str or bytes is a sequence too, of characters: one key is not a list.
    # Anything else indexable with a length will do (a 2-D numpy array of buffers).
    if isinstance(items, str | bytes | bytearray | memoryview) or not (
        hasattr(items, "__len__") and hasattr(items, "__getitem__")
    ):
        raise InvalidArgument(f"{what} must be a list, not {type(items).__name__}")
    return items


def _check_keys(keys: Sequence[bytes]) -> list[ChunkKey]:
    return validate_keys(_sequence(keys, "keys"))


def _views(buffers: Sequence[Buffer], n: int, writable: bool) -> list[memoryview]:
    buffers = _sequence(buffers, "buffers")
    if len(buffers) != n:
        raise InvalidArgument(f"{n} keys but {len(buffers)} buffers")
    return [_as_view(b, writable, i) for i, b in enumerate(buffers)]


class KVDepotClient(NamespaceCalls):
    """Publish chunks, look up prefixes and pull chunks into caller buffers.

    Thread-safe: one client may be shared by the threads of an engine.
    """

    def __init__(
        self,
        config: ClientConfig,
        transport: Transport | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        """Connect to the metadata service; data-plane connections open on use.

        Args:
            config: The client's configuration.
            transport: Moves the bytes to and from every store; by default the
                one ``config.transport`` names (``auto`` picks per store).
            retry: How a metadata call retries the replicas; by default each
                once, without waiting (an engine must not stall on an outage).
        """
        self.config = config
        self._metadata = MetadataClient(
            config.metadata,
            config.rpc_timeout_s,
            config.security,
            retry=retry,
            frames=config.metadata_frames,
        )
        self._transport = transport or create_transport(
            config.transport,
            connect_timeout_s=config.connect_timeout_s,
            io_timeout_s=config.io_timeout_s,
            security=config.security,
        )
        # Stores reached through it commit into the index themselves (the
        # local route); without that every put takes the reference route.
        self._indexing = self._transport if isinstance(self._transport, IndexingTransport) else None
        self._closed = False
        self._lock = threading.Lock()
        # This node's store, once a reply named it (see get_into).
        self._local_address: str | None = None
        # What get_into reads first (see there): another store that served
        # the whole of the last read, else this node's store unless the last
        # read came from several stores or none.
        self._sticky: str | None = None
        self._lookup_first = False
        # A buffer smaller than its chunk is logged once, then only counted
        # in the GetResult's reasons: an engine repeats the mistake each load.
        self._warned_small = False
        # Deferred index commits (defer_index_commit): the token the store
        # counts this client's by, and whether any may still be pending.
        self._writer = int.from_bytes(os.urandom(4), "little") or 1
        self._deferred = DeferredCommits()
        # Answers from the stores it knows, without the metadata service.
        self._fallback = Fallback(self._transport)
        self._init_namespaces()

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
        with contextlib.suppress(KVDepotError):
            self.flush_usage()
        self._transport.close()
        self._metadata.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosed("the client is closed; make a new KVDepotClient")

    def connect(self, timeout_s: float) -> bool:
        """Open the metadata channel now (up to ``timeout_s``); whether it is up."""
        self._check_open()
        return self._metadata.wait_ready(timeout_s)

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
        """Publish chunks; keys already stored (or being stored) are not sent over the network.

        The put's plan is decided once (:func:`~kvdepot.connector.put_plan.plan_put`,
        docs/write-path.md). Once a reply named this node's store (``node_id``),
        chunks go there first and the store commits them into the index
        before it answers (or right after, ``defer_index_commit``): no
        metadata call of this client's own. Over ``tcp`` only a batch of at
        most 8 MiB does, since a stream sends the bytes of chunks the store
        holds already. Chunks the store did not take or could not index go
        where ``PutStart`` places them (the ones it wrote committed by that
        call), and ``PutEnd`` commits what was sent elsewhere.

        Args:
            keys: Chunk keys, e.g. from :func:`kvdepot.keys.chunk_keys`.
            buffers: One buffer per key with the chunk's bytes.

        Returns:
            Counts of chunks stored, skipped as already present, pending
            (deferred; or, ``PutStart`` failing, owed to the index by this
            node's store: connector/fallback.py), and failed.

        Raises:
            InvalidArgument: mismatched keys and buffers, or bad keys.
            ClientClosed: the client was closed.
            Unavailable: the metadata service cannot be reached, and this
                client has no node's store that took the chunks.
        """
        self._check_open()
        ckeys = _check_keys(keys)
        views = _views(buffers, len(ckeys), writable=False)
        if any(v.nbytes == 0 for v in views):
            raise InvalidArgument("chunks must not be empty")
        if not ckeys:
            return PutResult(0, 0, 0, 0, 0)
        plan = plan_put(
            self._local_address if self._indexing is not None else None,
            sum(v.nbytes for v in views),
            self._transport.reserves_first,
            self.config.defer_index_commit,
            self._writer,
        )
        tally = PutTally()
        rest: list[int] = list(range(len(ckeys)))
        written: list[bool] = []
        if plan.route is Route.LOCAL:
            rest, written = self._write_local(plan, ckeys, views, tally)
        if rest:
            self._place([ckeys[i] for i in rest], [views[i] for i in rest], written, tally)
        if tally.pending:
            self._deferred.made()
        result = tally.result()
        self.add_usage(stored_chunks=result.stored + result.pending)
        return result

    def _place(
        self, ckeys: list[ChunkKey], views: list[memoryview], written: list[bool], tally: PutTally
    ) -> None:
        """The reference path: ``PutStart`` commits what this node's store took
        (``written``) and places the rest, which goes there and ``PutEnd`` commits."""
        sizes = [v.nbytes for v in views]
        if not any(written):
            written = []
        # One id per put, sent again on each failover retry of this request
        # (the connection resends the same message): if a replica allocated
        # the keys and died before answering, the next one hands the same
        # allocations back instead of reporting them pending until they expire.
        request = metadata_pb2.PutStartRequest(
            keys=ckeys,
            sizes=sizes,
            writer_node_id=self.config.node_id,
            request_id=os.urandom(16),
            written=written,
        )
        try:
            reply = self._metadata.put_start(request)
        except Unavailable as exc:
            # This node's store takes them and owes their index commits.
            local = self._local_address
            self._fallback.put(exc, self._indexing, local, ckeys, views, written, tally)
            return
        self._fallback.answered()
        self._learn_local(a.node for a in reply.allocations)
        if written and not reply.written_committed:
            # This node is no live node of the index: its store's copies are
            # not indexed. Send them where the allocations say instead.
            logger.warning("put: node %s is not registered; placing elsewhere", self.config.node_id)
            written = []
        groups: dict[tuple[str, str], list[int]] = defaultdict(list)
        for i, alloc in enumerate(reply.allocations):
            if written and written[i]:
                # Written and committed by PutStart itself: new (WRITE) or
                # already stored elsewhere (now with this node as a replica).
                tally.add(sizes[i], alloc.action == metadata_pb2.Allocation.WRITE)
            elif alloc.action == metadata_pb2.Allocation.WRITE:
                groups[(alloc.node.node_id, alloc.node.address)].append(i)
            else:
                tally.skipped += 1
                tally.bytes_skipped += sizes[i]
        for (node_id, address), idx in groups.items():
            self._put_to(node_id, address, [ckeys[i] for i in idx], [views[i] for i in idx], tally)

    def _write_local(
        self, plan: PutPlan, keys: list[ChunkKey], views: list[memoryview], tally: PutTally
    ) -> tuple[list[int], list[bool]]:
        """The local route: write the chunks into this node's store, which
        commits them into the index too (before or after it answers, as
        planned). Tallies what it settled; returns the indices left to the
        reference route and, per one of those, whether the store holds it
        (its ``PutStart`` then commits it there rather than sending it)."""
        assert self._indexing is not None  # plan_put plans no local route without it
        statuses, indexed = self._indexing.put_whole_indexed(plan.address, keys, views, plan.writer)
        rest: list[int] = []
        written: list[bool] = []
        for i, (status, code) in enumerate(zip(statuses, indexed, strict=True)):
            size = views[i].nbytes
            if status is PutStatus.OK and code is IndexCode.PENDING:
                tally.add_pending(size)
            elif status is PutStatus.OK and code is not IndexCode.NOT_INDEXED:
                # Committed by the store into the index: new, or stored
                # elsewhere already (now with this node as a replica).
                tally.add(size, code is IndexCode.NEW)
            else:
                rest.append(i)
                written.append(status is PutStatus.OK)
        return rest, written if any(written) else []

    def _put_to(
        self,
        node_id: str,
        address: str,
        keys: list[ChunkKey],
        views: list[memoryview],
        tally: PutTally,
    ) -> None:
        """Send chunks allocated to one store, then commit (PutEnd) or revoke them."""
        # The checksum is left to the transport, which computes it while
        # it reads the bytes anyway (sending or copying them): one pass
        # over memory instead of two. The store verifies it either way.
        statuses = self._transport.put_whole(address, keys, views)
        done = [i for i, s in enumerate(statuses) if s in _WRITTEN]
        lost = [i for i, s in enumerate(statuses) if s not in _WRITTEN]
        if done:
            self._metadata.put_end(
                metadata_pb2.PutEndRequest(
                    keys=[keys[i] for i in done],
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
            self._metadata.put_revoke(
                metadata_pb2.PutRevokeRequest(keys=[keys[i] for i in lost], node_id=node_id),
            )
        tally.stored += len(done)
        tally.failed += len(lost)
        tally.bytes_sent += sum(
            v.nbytes for v, s in zip(views, statuses, strict=True) if s is PutStatus.OK
        )

    def sync_index(self, timeout_s: float | None = None) -> IndexSettled:
        """Wait until this client's deferred index commits are done (at most
        ``timeout_s``, by default ``rpc_timeout_s``, and the store's own bound).

        Returns:
            What the index did with them since the last call: ``new``,
            ``elsewhere`` (stored by another node first), ``not_indexed``
            (readable in this node's store, named by no lookup until the
            store registers again), ``pending`` (still on their way), and of
            those a put handed over without waiting for the store's answer
            (``shm``), ``skipped`` (the store held them already) and
            ``lost`` (not stored: the store refused them or failed).

        Raises:
            ClientClosed: the client was closed.
            Unavailable: this node's store cannot be reached.
        """
        self._check_open()
        local = self._local_address
        if local is None or not self._deferred.open():
            return IndexSettled()
        mark = self._deferred.mark()
        wait = self.config.rpc_timeout_s if timeout_s is None else timeout_s
        if self._indexing is None:
            raise Unavailable(f"the {self.config.transport} transport cannot ask what was indexed")
        settled = self._indexing.sync_index(local, self._writer, wait)
        self._deferred.answered(mark, settled)
        return settled

    def _read_own_writes(self) -> None:
        """Before a lookup: this client's deferred commits, in the index."""
        if not self._deferred.open():
            return
        try:
            self.sync_index()
        except KVDepotError as exc:  # the lookup goes ahead: at worst a miss
            logger.debug("sync before lookup failed: %s", exc)

    # -- lookup -----------------------------------------------------------------
    def _lookup(
        self,
        keys: Sequence[bytes],
        key_tokens: Sequence[int] = (),
        count: LookupCount = "all",
        timeout_s: float | None = None,
    ) -> metadata_pb2.LookupResponse:
        self._check_open()
        ckeys = _check_keys(keys)
        key_tokens = _sequence(key_tokens or (), "key_tokens")
        if key_tokens and len(key_tokens) != len(ckeys):
            raise InvalidArgument(f"{len(key_tokens)} key_tokens for {len(ckeys)} keys")
        if not isinstance(count, str) or count not in _COUNT:
            raise InvalidArgument(f"count must be one of {', '.join(_COUNT)}, not {count!r}")
        self._read_own_writes()
        try:
            tokens = [int(t) for t in key_tokens]
        except (TypeError, ValueError):
            raise InvalidArgument("key_tokens must be integers") from None
        if any(not 0 <= t < 2**32 for t in tokens):
            raise InvalidArgument("key_tokens must be in [0, 2**32)")
        reply: metadata_pb2.LookupResponse = self._metadata.lookup(
            metadata_pb2.LookupRequest(
                keys=ckeys,
                client_node_id=self.config.node_id,
                tokens_per_key=self.config.tokens_per_chunk,
                packed=True,
                key_tokens=tokens,
                count=_COUNT[count],
                namespace=self.namespace,
            ),
            timeout_s=timeout_s,
        )
        self._fallback.answered()
        return reply

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
        self._check_open()
        return unpack_lookup(self._lookup(keys, count=count))

    def lookup(
        self,
        keys: Sequence[bytes],
        *,
        key_tokens: Sequence[int] = (),
        count: LookupCount = "all",
        timeout_s: float | None = None,
    ) -> int:
        """Number of leading keys that are stored somewhere in the cluster.

        Without the metadata service, those this node's store holds
        (connector/fallback.py).

        Args:
            keys: Chunk keys in prompt order.
            key_tokens: Tokens each key covers, where they differ (for the
                cluster's hit rate in tokens).
            count: As for :meth:`lookup_locations`.
            timeout_s: This call's deadline, failover included, if shorter
                than ``rpc_timeout_s``.
        """
        self._check_open()
        if not len(_sequence(keys, "keys")):
            return 0
        try:
            return int(self._lookup(keys, key_tokens, count, timeout_s).hits)
        except Unavailable as exc:
            return self._fallback.lookup(exc, self._local_address, _check_keys(keys))

    def lookup_where(
        self,
        keys: Sequence[bytes],
        *,
        key_tokens: Sequence[int] = (),
        count: LookupCount = "all",
        timeout_s: float | None = None,
    ) -> LookupResult:
        """As :meth:`lookup`, with each hit's replicas (this node's first);
        without the metadata service, this node's store's hits, no replicas."""
        self._check_open()
        if not len(_sequence(keys, "keys")):
            return LookupResult(0)
        try:
            return unpack_lookup(self._lookup(keys, key_tokens, count, timeout_s))
        except Unavailable as exc:
            return LookupResult(self._fallback.lookup(exc, self._local_address, _check_keys(keys)))

    # -- pull ---------------------------------------------------------------------
    def get_into(
        self,
        keys: Sequence[bytes],
        buffers: Sequence[Buffer],
        *,
        count: LookupCount = "all",
        prefer: str | None = None,
    ) -> GetResult:
        """Pull the leading cached chunks of ``keys`` into ``buffers``.

        Each loaded chunk has been verified against its checksum. A chunk that
        is missing, evicted meanwhile, corrupt, on a store that died, or bigger
        than its buffer is a miss (``loaded[i]`` is False, ``reasons[i]`` says
        why) and its buffer content is undefined.
        One store is read first, before any lookup: this node's store, or,
        with ``count="none"``, the store at ``prefer`` (one a lookup named) or
        else the one other store that served the last read (a decode node
        reading what one prefill node published). When it holds every chunk,
        the metadata service is not asked at all. After a read that no single
        store served, the next one asks the metadata service first (its
        answer lists this node's replicas first). ``count`` is passed to the
        lookup (``none`` when the caller counted the prompt already). A
        counted read waits for its lookup ``fallback_wait_s`` at most where a
        store served the last read whole, then reads that store; without the
        metadata service, this node's store serves what it holds.

        Raises:
            InvalidArgument: mismatched keys and buffers, or bad keys.
            ClientClosed: the client was closed.
            Unavailable: the metadata service cannot be reached (nor the stores above).
        """
        self._check_open()
        ckeys = _check_keys(keys)
        views = _views(buffers, len(ckeys), writable=True)
        if not ckeys:
            return GetResult((), 0, (), ())
        local = self._local_address
        # Another store is read first only for a caller that counted the
        # prompt already: a counted read always reaches the index, so the
        # cluster's hits agree with what was read (and hot chunks' readers
        # spread over their replicas).
        sticky = (prefer or self._sticky) if count == "none" else None
        first = sticky or (None if self._lookup_first else local)
        early = None
        if first is not None:
            # A key names its bytes wherever they are, and reads are verified:
            # a store that holds every chunk saves the metadata round trip.
            early = self._transport.get_whole(first, ckeys, views)
            if all(o.ok for o in early):
                if first != local and self.config.replicate_on_read:
                    self._replicate(
                        ckeys, [v[: o.length] for v, o in zip(views, early, strict=True)]
                    )
                return whole(early)
        try:
            reply = self._read_lookup(ckeys, views, count, first)
        except Unavailable as exc:
            return self._fallback.read(exc, ckeys, views, local, first, early)
        if isinstance(reply, GetResult):
            return reply  # the store that served the last read, without the index
        self._learn_local(r for loc in reply.locations for r in loc.replicas)
        pull = Pull(len(ckeys), reply)
        if early is not None and first is not None:
            for i in range(reply.hits):
                if early[i].ok and early[i].length == reply.locations[i].size:
                    pull.loaded_from(i, first)
        todo = [i for i in range(reply.hits) if not pull.loaded[i] and self._fits(pull, i, views)]
        self._read_replicas(ckeys, views, pull, todo)
        if local is not None and first != local:
            self._read_unindexed(local, ckeys, views, pull)
        self._remember(pull.sources)
        remote = [i for i, a in enumerate(pull.sources) if a and a != self._local_address]
        if not self.config.replicate_on_read:
            # Only the hot chunks the service asks this node to hold a copy of.
            hinted = set(reply.replicate) if self.config.node_id else set()
            remote = [i for i in remote if i in hinted]
        if remote:
            self._replicate([ckeys[i] for i in remote], [views[i][: pull.sizes[i]] for i in remote])
        return pull.result()

    def _read_lookup(
        self, keys: list[ChunkKey], views: list[memoryview], count: LookupCount, first: str | None
    ) -> LookupResult | GetResult:
        """A read's lookup. Where no store was read first but one served the
        last read whole, it is not waited for long: that store is read then."""
        last = self._sticky if first is None else None
        if last is None:
            return unpack_lookup(self._lookup(keys, count=count))
        return self._fallback.lookup_or_read(
            lambda t: unpack_lookup(self._lookup(keys, count=count, timeout_s=t)),
            (last, keys, views),
            self.config.fallback_wait_s,
            self.config.rpc_timeout_s,
        )

    def _remember(self, sources: list[str]) -> None:
        """Which store the next read tries first, from where this one's chunks came."""
        served = {a for a in sources if a}
        local = self._local_address
        if local is not None and local in served:
            self._sticky, self._lookup_first = None, False
        elif len(served) == 1:
            (self._sticky,) = served
        else:
            # No chunk, or chunks from several stores: no one store would
            # have served this read whole, so the next one asks the index first.
            self._sticky, self._lookup_first = None, True

    def _read_unindexed(
        self, local: str, keys: list[ChunkKey], views: list[memoryview], pull: Pull
    ) -> None:
        """After a read that did not try this node's store first: read the keys
        the lookup did not name from it where the lookup named only this
        node's. A chunk the store holds without an index entry (its put's
        PutStart failed) is found, as when this store is read first."""
        hits = pull.reply.hits
        if hits == len(keys) or any(pull.sources[i] != local for i in range(hits)):
            return
        tail = list(range(hits, len(keys)))
        outcomes = self._transport.get_whole(
            local, [keys[i] for i in tail], [views[i] for i in tail]
        )
        if all(o.ok for o in outcomes):
            pull.extend(tail, outcomes, local)

    def _read_replicas(
        self, keys: list[ChunkKey], views: list[memoryview], pull: Pull, todo: list[int]
    ) -> None:
        """Read each chunk of ``todo`` from its replicas in the lookup's order;
        each round tries the next replica of every chunk still missing."""
        locations = pull.reply.locations
        attempt = 0
        while todo:
            groups: dict[str, list[int]] = defaultdict(list)
            for i in todo:
                reps = locations[i].replicas
                if attempt < len(reps):
                    groups[reps[attempt].address].append(i)
            if not groups:
                break
            for address, idx in groups.items():
                sub = [views[i][: locations[i].size] for i in idx]
                got = self._transport.get_whole(address, [keys[i] for i in idx], sub)
                for i, out in zip(idx, got, strict=True):
                    if out.ok and out.length == locations[i].size:
                        pull.loaded_from(i, address)
                    else:
                        pull.reasons[i] = f"{address}: {out.error or 'incomplete read'}"
            todo = [i for i in todo if not pull.loaded[i]]
            attempt += 1

    def _fits(self, pull: Pull, i: int, views: Sequence[memoryview]) -> bool:
        """Whether chunk ``i`` fits its buffer; a miss with its reason if not."""
        if pull.fits(i, views[i]):
            return True
        if not self._warned_small:
            self._warned_small = True
            logger.warning("get_into: key %d: %s: a miss (buffers must hold a whole chunk; "
                           "logged once per client)", i, pull.reasons[i])  # fmt: skip
        return False

    def _replicate(self, keys: list[ChunkKey], views: list[memoryview]) -> None:
        """Store pulled chunks on this node too and register the replicas."""
        if self._local_address is None:
            self._learn_local(self.stats().nodes)
        local = self._local_address
        if local is None:
            return
        statuses = self._transport.put_whole(local, keys, views)
        done = [i for i, st in enumerate(statuses) if st in _WRITTEN]
        if done:
            self._metadata.put_end(
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
        self._check_open()
        ckeys = _check_keys(keys)
        n = len(ckeys)
        if not n == len(_sequence(ranges, "ranges")) == len(_sequence(replicas, "replicas")):
            raise InvalidArgument("keys, ranges, buffers and replicas must have equal lengths")
        views = _views(buffers, n, writable=True)
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
        self._check_open()
        return self._metadata.get_stats()


_WRITTEN = (PutStatus.OK, PutStatus.EXISTS)
_COUNT = {
    "all": metadata_pb2.LookupRequest.COUNT_ALL,
    "hits": metadata_pb2.LookupRequest.COUNT_HITS,
    "none": metadata_pb2.LookupRequest.COUNT_NONE,
}
