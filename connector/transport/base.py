"""The data plane transport interface: move chunk bytes to and from a store.

A transport moves bytes only; where a chunk lives is decided by the metadata
service. Implementations (``tcp``, later ``shm`` and ``nixl``) write from and
read into caller-owned memory without intermediate copies.

Failures of the network are per item, never exceptions: a put that could not
be delivered reports :attr:`PutStatus.FAILED`, a read that did not arrive
intact reports ``ok=False``, and the caller treats it as a miss (the engine
recomputes those tokens). Only mistakes of the caller raise:
:class:`~kvdepot.errors.InvalidArgument`, and
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


@dataclass(frozen=True, slots=True)
class GetOutcome:
    """Outcome of reading one chunk.

    Attributes:
        ok: The bytes arrived completely and matched their checksum. Only then
            is ``buffer[:length]`` valid data.
        length: Bytes written into the buffer (the chunk's or the range's size).
        error: Why not ``ok``: a miss, a bad range, a checksum mismatch, a
            buffer too small, a transport failure.
    """

    ok: bool
    length: int
    error: str = ""


class Transport(abc.ABC):
    """Moves chunk bytes between caller memory and store daemons.

    Implementations are thread-safe: several threads may call one transport
    at once. ``address`` is the store's data plane address, ``"host:port"``.
    """

    @abc.abstractmethod
    def put(self, address: str, items: Sequence[PutItem]) -> list[PutStatus]:
        """Write chunks to the store at ``address``.

        Returns:
            One status per item, in order.

        Raises:
            InvalidArgument: A malformed address, key or buffer.
        """

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
            or NOT_INDEXED (the caller commits it itself). By default, and
            from a store or transport that cannot, nothing is indexed.

        Raises:
            InvalidArgument: A malformed address, key or buffer.
        """
        return self.put(address, items), [IndexCode.NOT_INDEXED] * len(items)

    def sync_index(self, address: str, writer: int, wait_s: float) -> IndexSettled | None:
        """What the store's index did with ``writer``'s PENDING chunks since
        the last call, waiting up to ``wait_s`` for those still pending;
        ``None`` where the transport cannot ask (it never deferred)."""
        return None

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
        arguments already: ``keys`` are :data:`ChunkKey` values (see
        :func:`~kvdepot.keys.validate_key`) and ``views`` writable flat byte
        views, one per key. A transport may then skip its own validation of
        every item (``KVDepotClient`` validates each call once).

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

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections and other resources; the transport is unusable after."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
