"""The data plane transport interface: move chunk bytes to and from a store.

A transport moves bytes only; where a chunk lives is decided by the metadata
service. Implementations (``tcp``, ``shm``, ``nixl``, and ``auto`` routing
among them) write from and read into caller-owned memory without
intermediate copies. Those whose stores index what they store implement
:class:`IndexingTransport` too.

Failures of the network are per item, never exceptions: a put that could not
be delivered reports :attr:`PutStatus.FAILED`, a read that did not arrive
intact a :class:`GetStatus` other than OK (``ok`` is False), and the caller
treats it as a miss (the engine recomputes those tokens). A store that
stopped answering costs one call its I/O timeout; later calls to it fail at
once until it answers again (:meth:`Transport.stalled`). Only mistakes of
the caller raise: :class:`~kvdepot.errors.InvalidArgument`, and
:class:`~kvdepot.errors.Unauthenticated` when a store refuses the
transport's token (every call would fail the same way until it is fixed).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Sequence
from dataclasses import dataclass

from kvdepot.errors import InvalidArgument
from kvdepot.keys import ChunkKey
from kvdepot.wire.protocol import IndexCode, IndexSettled


@dataclass(frozen=True, slots=True)
class PutItem:
    """One chunk to write.

    Attributes:
        key: The chunk's key.
        data: The chunk's bytes (any contiguous buffer; sent without copying).
        checksum: xxh3-64 of ``data``, see :func:`kvdepot.wire.xxh3.checksum`;
            ``None`` lets the transport compute it while it reads ``data`` for
            sending or copying (one pass over memory instead of two). Either
            way, bytes that do not match it are not stored (``CORRUPT``).
    """

    key: ChunkKey
    data: memoryview | bytes
    checksum: int | None = None


@dataclass(frozen=True, slots=True)
class GetItem:
    """One (ranged) read of a chunk into caller memory.

    Attributes:
        key: The chunk's key.
        buffer: Writable, caller-owned destination; the bytes land at its start.
        offset: First byte of the chunk to read.
        length: Bytes to read; 0 reads to the end of the chunk. Must fit
            ``buffer``.
    """

    key: ChunkKey
    buffer: memoryview
    offset: int = 0
    length: int = 0


class PutStatus(enum.Enum):
    """Outcome of writing one chunk."""

    OK = "ok"
    """Stored and committed on the store."""
    EXISTS = "exists"
    """The store already holds (or is receiving) the chunk; nothing written."""
    NO_SPACE = "no_space"
    """The store is full of chunks it may not evict, or the chunk is larger than it."""
    CORRUPT = "corrupt"
    """The bytes did not match the checksum on arrival; nothing stored."""
    INVALID = "invalid"
    """The store refused the item (empty, or above a size limit)."""
    FAILED = "failed"
    """The transport failed (unreachable store, connection lost, timeout)."""


class GetStatus(enum.Enum):
    """Outcome of reading one chunk (or range)."""

    OK = "ok"
    """Arrived completely and matched its checksum."""
    NOT_FOUND = "not_found"
    """The store does not hold the chunk."""
    INVALID = "invalid"
    """The range lies outside the chunk."""
    MISFIT = "misfit"
    """The chunk is larger than the buffer, or the store had another length
    than the range asked for: nothing handed out."""
    CORRUPT = "corrupt"
    """The bytes did not match their checksum."""
    FAILED = "failed"
    """The transport failed (unreachable or stalled store, connection lost,
    timeout), or the item was not attempted after an earlier one failed."""


@dataclass(frozen=True, slots=True)
class GetOutcome:
    """Outcome of reading one chunk.

    Attributes:
        status: What happened; only :attr:`GetStatus.OK` makes
            ``buffer[:length]`` valid data.
        length: Bytes written into the buffer (the chunk's or the range's size).
        error: Why not OK, for people: the status is what code decides by.
    """

    status: GetStatus
    length: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        """The bytes arrived completely and matched their checksum."""
        return self.status is GetStatus.OK


class Transport(abc.ABC):
    """Moves chunk bytes between caller memory and store daemons.

    Implementations are thread-safe: several threads may call one transport
    at once. ``address`` is the store's data plane address, ``"host:port"``.
    """

    name = "transport"
    """The name it is registered under (``tcp``, ``shm``, ...)."""

    @abc.abstractmethod
    def put(self, address: str, items: Sequence[PutItem]) -> list[PutStatus]:
        """Write chunks to the store at ``address``.

        Returns:
            One status per item, in order.

        Raises:
            InvalidArgument: A malformed address, key or buffer.
        """

    def put_whole(
        self, address: str, keys: Sequence[ChunkKey], views: Sequence[memoryview]
    ) -> list[PutStatus]:
        """:meth:`put` for a caller that validated its arguments already:
        ``keys`` are :data:`ChunkKey` values (see
        :func:`~kvdepot.keys.validate_key`) and ``views`` flat byte views, one
        per key, whose checksums the transport computes. A transport may then
        skip its own validation of every item (``KVDepotClient`` validates
        each call once).

        Raises:
            InvalidArgument: A malformed address, or a number of views other
                than of keys.
        """
        if len(keys) != len(views):
            raise InvalidArgument(f"{len(keys)} keys but {len(views)} buffers")
        return self.put(address, [PutItem(k, v) for k, v in zip(keys, views, strict=True)])

    @abc.abstractmethod
    def get_into(self, address: str, items: Sequence[GetItem]) -> list[GetOutcome]:
        """Read chunks (or ranges of them) into the items' buffers.

        Returns:
            One outcome per item, in order.

        Raises:
            InvalidArgument: A malformed address, key, range, or a read-only or
                too small buffer for an explicit ``length``.
        """

    def get_whole(
        self, address: str, keys: Sequence[ChunkKey], views: Sequence[memoryview]
    ) -> list[GetOutcome]:
        """:meth:`get_into` of whole chunks, for a caller that validated its
        arguments already: ``keys`` are :data:`ChunkKey` values and ``views``
        writable flat byte views, one per key. A transport may then skip its
        own validation of every item.

        Raises:
            InvalidArgument: A malformed address, a number of views other
                than of keys, or an empty view.
        """
        if len(keys) != len(views):
            raise InvalidArgument(f"{len(keys)} keys but {len(views)} buffers")
        return self.get_into(address, [GetItem(k, v) for k, v in zip(keys, views, strict=True)])

    @abc.abstractmethod
    def delete(self, address: str, keys: Sequence[ChunkKey]) -> list[bool]:
        """Delete chunks from the store at ``address``.

        Returns:
            Per key, whether the store held and removed it (``False`` also
            when the store could not be reached).

        Raises:
            InvalidArgument: A malformed address or key.
        """

    def usable(self, address: str) -> bool:
        """Whether this transport can serve the store at ``address`` (``shm``:
        the store runs on this host with an arena this process may map).

        Raises:
            Unavailable: The store cannot be reached now, so nothing can be
                said (a transport that must ask the store).
            Unauthenticated: The store refused this client's token.
        """
        return True

    def reserves_first(self, address: str) -> bool:
        """Whether a put to ``address`` learns what the store holds before it
        moves any byte (``shm``, ``nixl``: RESERVE, then copy); a stream
        (``tcp``) sends the bytes of chunks the store may hold already."""
        return False

    def stalled(self, address: str) -> bool:
        """Whether the store at ``address`` stopped answering within the I/O
        timeout: calls to it fail at once (FAILED) until it answers a probe."""
        return False

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections and other resources; the transport is unusable after."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class IndexingTransport(Transport):
    """A transport to stores that commit what they store into the cluster's
    index themselves: a writer publishing into its own node's store then
    needs no metadata call of its own (the ``index`` protocol: see
    :mod:`kvdepot.wire.protocol`, ``HeaderFlags.INDEX``)."""

    @abc.abstractmethod
    def put_indexed(
        self, address: str, items: Sequence[PutItem], writer: int = 0
    ) -> tuple[list[PutStatus], list[IndexCode]]:
        """Write chunks to the writer's own node's store, which commits what it
        stored (OK) into the cluster's index too, before it answers, or with
        ``writer`` (a nonzero u32 token) right after it answered.

        Returns:
            Per item its status, and whether the index committed it: NEW,
            ELSEWHERE (another node had stored it; this one is a replica now),
            PENDING (``writer``: queued for the index, see :meth:`sync_index`)
            or NOT_INDEXED (the caller commits it itself; also from a store
            that cannot index).

        Raises:
            InvalidArgument: A malformed address, key or buffer.
        """

    def put_whole_indexed(
        self,
        address: str,
        keys: Sequence[ChunkKey],
        views: Sequence[memoryview],
        writer: int = 0,
    ) -> tuple[list[PutStatus], list[IndexCode]]:
        """:meth:`put_indexed` for a caller that validated its arguments
        already, as :meth:`Transport.put_whole`.

        Raises:
            InvalidArgument: A malformed address, or a number of views other
                than of keys.
        """
        if len(keys) != len(views):
            raise InvalidArgument(f"{len(keys)} keys but {len(views)} buffers")
        items = [PutItem(k, v) for k, v in zip(keys, views, strict=True)]
        return self.put_indexed(address, items, writer)

    @abc.abstractmethod
    def sync_index(self, address: str, writer: int, wait_s: float) -> IndexSettled:
        """What the store's index did with ``writer``'s PENDING chunks since
        the last call, waiting up to ``wait_s`` for those still pending.

        Raises:
            Unavailable: The store cannot be reached or stalled.
        """
