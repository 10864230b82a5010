"""The stream layer: what every client connection to a store's data-plane
socket shares, whichever transport it serves.

``tcp`` moves chunk bytes over these connections; ``shm`` and ``nixl`` move
only control over them (:mod:`~kvdepot.connector.transport.control`) and
the bytes another way. Both build on this module:

* addresses and connecting, with the token handshake (:func:`connect`);
* the work a call's items become, checked once (:func:`check_put_items`,
  :func:`check_get_items`; :func:`whole_put_work`, :func:`whole_get_work`
  for a caller that validated its keys already), and batches within the
  protocol limits (:func:`split_batches`);
* :class:`Connection`: a socket and the answers it is owed for requests
  sent without waiting for them (:class:`Owed`: late puts, late commits,
  pipelined commits, releases), read in order by whatever next uses it;
  and the requests any connection may send (DELETE, SYNC, PING).
"""

from __future__ import annotations

import abc
import select
import socket
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from kvdepot.connector.transport.base import GetItem, PutItem, PutStatus
from kvdepot.endpoints import parse_endpoint
from kvdepot.errors import InvalidArgument, Unavailable
from kvdepot.keys import ChunkKey, validate_key
from kvdepot.wire.handshake import authenticate
from kvdepot.wire.protocol import (
    INDEX_SETTLED,
    DeleteCode,
    GetEntry,
    Header,
    IndexSettled,
    Opcode,
    ProtocolLimits,
    PutCode,
    PutEntry,
    TimedOut,
    byte_view,
    pack_keys,
    recv_exact,
    recv_reply_header,
    send_all,
    set_io_timeout,
    set_recv_timeout,
    unpack_index_settled,
    unpack_statuses,
)

_T = TypeVar("_T")

PUT_STATUS = {
    PutCode.OK: PutStatus.OK,
    PutCode.EXISTS: PutStatus.EXISTS,
    PutCode.NO_SPACE: PutStatus.NO_SPACE,
    PutCode.CORRUPT: PutStatus.CORRUPT,
    PutCode.INVALID: PutStatus.INVALID,
}
"""Wire status of a put (or a reservation, a commit) to the transport's :class:`PutStatus`."""

PutWork = tuple[int, PutEntry, memoryview, bool]
"""An item to put: its index, entry, bytes, and whether the checksum trails
(is computed by the transport: the entry's checksum is then 0)."""
GetWork = tuple[int, GetEntry, memoryview]
"""An item to get: its index, entry and destination."""


def parse_address(address: str) -> tuple[str, int]:
    """Split ``"host:port"`` (``"[v6]:port"`` for IPv6) into its parts.

    Raises:
        InvalidArgument: If the address is malformed.
    """
    return parse_endpoint(address, "data plane address")


def connect(
    address: str, connect_timeout_s: float, io_timeout_s: float, token: str = ""
) -> socket.socket:
    """A blocking data-plane connection with kernel I/O timeouts and no Nagle delay.

    With a ``token`` the connection first proves it holds it (see
    :mod:`kvdepot.wire.handshake`).

    Raises:
        TimedOut: The store did not accept within ``connect_timeout_s``.
        Unavailable: If the store cannot be reached otherwise.
        AuthRefused: The store refused the token (an ``Unauthenticated``).
        ProtocolError: The store answered the handshake with something else.
    """
    host, port = parse_address(address)
    try:
        sock = socket.create_connection((host, port), timeout=connect_timeout_s)
    except TimeoutError as exc:
        raise TimedOut(f"cannot connect to data plane {address}: timed out") from exc
    except OSError as exc:
        raise Unavailable(f"cannot connect to data plane {address}: {exc}") from exc
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        set_io_timeout(sock, io_timeout_s)
    except OSError as exc:
        sock.close()
        raise Unavailable(f"cannot set up connection to {address}: {exc}") from exc
    if token:
        try:
            authenticate(sock, token)
        except BaseException:
            sock.close()
            raise
    return sock


def check_put_items(
    items: Sequence[PutItem], limits: ProtocolLimits
) -> tuple[list[PutStatus], list[PutWork]]:
    """Validate put items: statuses preset to FAILED (INVALID for empty or
    oversized chunks) and the work left to do.

    Raises:
        InvalidArgument: A malformed key or buffer.
    """
    statuses = [PutStatus.FAILED] * len(items)
    todo: list[PutWork] = []
    for i, item in enumerate(items):
        key = validate_key(item.key)
        view = byte_view(item.data)
        if view.nbytes == 0 or view.nbytes > limits.largest_chunk:
            statuses[i] = PutStatus.INVALID
            continue
        trailed = item.checksum is None
        todo.append((i, PutEntry(key, view.nbytes, item.checksum or 0), view, trailed))
    return statuses, todo


def whole_put_work(
    keys: Sequence[ChunkKey], views: Sequence[memoryview], limits: ProtocolLimits
) -> tuple[list[PutStatus], list[PutWork]]:
    """:func:`check_put_items` of keys and flat byte views its caller
    validated already; every checksum is the transport's to compute.

    Raises:
        InvalidArgument: A number of views other than of keys.
    """
    if len(keys) != len(views):
        raise InvalidArgument(f"{len(keys)} keys but {len(views)} buffers")
    statuses = [PutStatus.FAILED] * len(keys)
    todo: list[PutWork] = []
    largest = limits.largest_chunk
    for i, (key, view) in enumerate(zip(keys, views, strict=True)):
        n = view.nbytes
        if n == 0 or n > largest:
            statuses[i] = PutStatus.INVALID
            continue
        todo.append((i, PutEntry(key, n, 0), view, True))
    return statuses, todo


def check_get_items(items: Sequence[GetItem]) -> list[GetWork]:
    """Validate get items and return the work to do.

    Raises:
        InvalidArgument: A malformed key, range, or a read-only or too small buffer.
    """
    todo: list[GetWork] = []
    for i, item in enumerate(items):
        key = validate_key(item.key)
        buf = byte_view(item.buffer)
        if buf.readonly:
            raise InvalidArgument("get buffers must be writable")
        if buf.nbytes == 0:
            raise InvalidArgument("get buffers must not be empty")
        if item.offset < 0 or item.length < 0:
            raise InvalidArgument(f"bad range offset={item.offset} length={item.length}")
        if item.length > buf.nbytes:
            raise InvalidArgument(
                f"buffer of {buf.nbytes} bytes cannot hold a read of {item.length} bytes"
            )
        todo.append((i, GetEntry(key, item.offset, item.length), buf))
    return todo


def whole_get_work(keys: Sequence[ChunkKey], views: Sequence[memoryview]) -> list[GetWork]:
    """The work of reading whole chunks into writable flat byte views, for a
    caller that validated its keys and views already.

    Raises:
        InvalidArgument: A number of views other than of keys, or an empty view.
    """
    if len(keys) != len(views):
        raise InvalidArgument(f"{len(keys)} keys but {len(views)} buffers")
    todo = [(i, GetEntry(k), v) for i, (k, v) in enumerate(zip(keys, views, strict=True))]
    if any(v.nbytes == 0 for v in views):
        raise InvalidArgument("get buffers must not be empty")
    return todo


def split_batches(
    items: list[_T], size: Callable[[_T], int], limits: ProtocolLimits
) -> Iterator[list[_T]]:
    """Split ``items`` into requests within the batch and request-size limits."""
    batch: list[_T] = []
    total = 0
    for item in items:
        n = size(item)
        if batch and (len(batch) >= limits.max_batch or total + n > limits.max_request_bytes):
            yield batch
            batch, total = [], 0
        batch.append(item)
        total += n
    if batch:
        yield batch


class Owed(abc.ABC):
    """An answer a connection is owed for a request it sent without waiting."""

    __slots__ = ()

    @abc.abstractmethod
    def read(self, sock: socket.socket) -> None:
        """Read this answer, the next one on ``sock``, and account for it.

        Raises:
            ProtocolError: The store answered ERROR or something unparsable.
            Unavailable: The connection failed.
        """

    def lost(self) -> None:  # noqa: B027 -- most answers leave nothing to account for
        """The answer never comes: the connection closed first."""

    def withdrawn(self) -> None:  # noqa: B027 -- as lost, for most answers
        """Its sender reports the request failed itself: nothing to account for."""


class Connection:
    """One data-plane connection and the answers it is owed, oldest first.

    Answers come in request order, so whatever next uses the connection reads
    the owed ones first (:meth:`settle`). Not thread-safe: used by one caller
    at a time (checked out of a pool).
    """

    __slots__ = ("_arrival", "_owed", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._owed: deque[Owed] = deque()
        # poll, not select: an engine's process may hold more than 1024 fds.
        # One poller for the connection's life: each reuse checks it.
        self._arrival = select.poll()
        self._arrival.register(sock, select.POLLIN)

    @property
    def awaits(self) -> int:
        """Answers owed, not read yet."""
        return len(self._owed)

    def owe(self, answer: Owed) -> None:
        """A request was just sent whose ``answer`` is read later."""
        self._owed.append(answer)

    def owed(self) -> list[Owed]:
        """The answers owed, oldest first."""
        return list(self._owed)

    def settle(self, keep: int = 0) -> None:
        """Read the answers owed, all but the newest ``keep``.

        Raises:
            ProtocolError: The store answered ERROR or something unparsable.
            Unavailable: The connection failed (``TimedOut``: the store did
                not answer within the I/O timeout).
        """
        while len(self._owed) > keep:
            self._read_oldest()

    def settle_arrived(self, keep: int = 0) -> None:
        """:meth:`settle`, reading only answers that have arrived: never waits
        for one the store has not sent yet."""
        while len(self._owed) > keep and self.readable():
            self._read_oldest()

    def _read_oldest(self) -> None:
        # The store sends an answer in one piece: once its first byte is
        # here, the rest is (or is about to be).
        self._owed[0].read(self.sock)
        self._owed.popleft()

    def withdraw_last(self, k: int) -> None:
        """Forget the last ``k`` answers owed: their sender reports the failure."""
        for _ in range(k):
            self._owed.pop().withdrawn()

    def readable(self) -> bool:
        """Whether bytes, EOF or an error are here to read, without waiting.

        A connection owed nothing has nothing to read: EOF means the store
        closed it (idle timeout, restart), data means the stream is out of sync.
        """
        try:
            return bool(self._arrival.poll(0))
        except OSError:
            return True  # let the read report what is wrong

    def close(self) -> None:
        """Close the socket; the answers it was owed never come."""
        self.sock.close()
        owed, self._owed = self._owed, deque()
        for answer in owed:
            answer.lost()

    def delete(self, keys: Sequence[ChunkKey]) -> list[DeleteCode]:
        """Delete chunks (one request within the batch limit)."""
        self.settle()
        n = len(keys)
        send_all(self.sock, [Header(Opcode.DELETE, n).pack() + pack_keys(keys)])
        recv_reply_header(self.sock, Opcode.DELETE_REPLY, n)
        return unpack_statuses(recv_exact(self.sock, n), DeleteCode)

    def sync(self, writer: int, wait_s: float, io_timeout_s: float) -> IndexSettled:
        """What the store's index did with ``writer``'s deferred chunks, the
        store waiting up to ``wait_s`` for those still pending."""
        self.settle()
        wait_ms = min(max(int(wait_s * 1000), 0), 0xFFFFFFFF)
        send_all(self.sock, [Header(Opcode.SYNC, wait_ms, writer).pack()])
        # The store may take the wait it was given: that is no stall.
        set_recv_timeout(self.sock, io_timeout_s + wait_ms / 1000)
        try:
            header = recv_reply_header(self.sock, Opcode.SYNC_REPLY, INDEX_SETTLED.size)
            return unpack_index_settled(recv_exact(self.sock, header.count))
        finally:
            set_recv_timeout(self.sock, io_timeout_s)

    def ping(self) -> None:
        """One PING answered by PONG."""
        self.settle()
        send_all(self.sock, [Header(Opcode.PING, 0, 1).pack()])
        recv_reply_header(self.sock, Opcode.PONG, 0)
