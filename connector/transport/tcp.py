"""The ``tcp`` transport: kvdepot's framed binary protocol over plain sockets.

Payloads never pass through an intermediate buffer: a put hands the caller's
buffers to ``sendmsg`` as one I/O vector, a get ``recv_into``\\s each chunk
straight into the caller's destination and then checks its checksum there.

Connections are pooled per peer and reused across calls; a connection that saw
any error is closed, never returned to the pool, because after an error the
position in the byte stream is unknown. A pooled connection the store closed
while idle is detected before use (and, should the race still be lost, the
request is retried once on a fresh connection).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from kvdepot.connector.transport.base import (
    GetItem,
    GetOutcome,
    PutItem,
    PutStatus,
    Transport,
)
from kvdepot.errors import InvalidArgument, KVDepotError, Unavailable
from kvdepot.metadata.keys import KEY_BYTES, ChunkKey
from kvdepot.store.chunks import checksum
from kvdepot.store.protocol import (
    GET_REPLY_ENTRY,
    DeleteCode,
    ErrorCode,
    GetCode,
    GetEntry,
    Header,
    Opcode,
    PeerClosed,
    ProtocolError,
    ProtocolLimits,
    PutCode,
    PutEntry,
    byte_view,
    drain,
    pack_get_entries,
    pack_keys,
    pack_put_entries,
    recv_exact,
    recv_exact_into,
    recv_reply_header,
    send_all,
    set_io_timeout,
    unpack_get_reply_entries,
)

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_A = TypeVar("_A")

_PUT_STATUS = {
    PutCode.OK: PutStatus.OK,
    PutCode.EXISTS: PutStatus.EXISTS,
    PutCode.NO_SPACE: PutStatus.NO_SPACE,
    PutCode.CORRUPT: PutStatus.CORRUPT,
    PutCode.INVALID: PutStatus.INVALID,
}


def parse_address(address: str) -> tuple[str, int]:
    """Split ``"host:port"`` (``"[v6]:port"`` for IPv6) into its parts.

    Raises:
        InvalidArgument: If the address is malformed.
    """
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise InvalidArgument(f"data plane address must be host:port, got {address!r}")
    port = int(port_text)
    if not 0 < port < 65536:
        raise InvalidArgument(f"bad port in data plane address {address!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, port


def _check_key(key: bytes) -> ChunkKey:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise InvalidArgument(f"chunk keys are {KEY_BYTES} bytes")
    return ChunkKey(key)


class _Pool:
    """Idle connections per peer; connections in use belong to their caller."""

    def __init__(self, connect_timeout_s: float, io_timeout_s: float, max_idle: int) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._io_timeout_s = io_timeout_s
        self._max_idle = max_idle
        self._lock = threading.Lock()
        self._idle: dict[str, list[socket.socket]] = {}
        self._closed = False

    def checkout(self, address: str) -> tuple[socket.socket, bool]:
        """A connection to ``address`` and whether it was reused from the pool.

        Raises:
            Unavailable: If a new connection cannot be made.
        """
        while True:
            with self._lock:
                idle = self._idle.get(address)
                sock = idle.pop() if idle else None
            if sock is None:
                return self._connect(address), False
            if _looks_alive(sock):
                return sock, True
            sock.close()

    def checkin(self, address: str, sock: socket.socket) -> None:
        """Return a healthy connection after a complete request and reply."""
        with self._lock:
            idle = self._idle.setdefault(address, [])
            if not self._closed and len(idle) < self._max_idle:
                idle.append(sock)
                return
        sock.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        for socks in idle.values():
            for sock in socks:
                sock.close()

    def _connect(self, address: str) -> socket.socket:
        host, port = parse_address(address)
        try:
            sock = socket.create_connection((host, port), timeout=self._connect_timeout_s)
        except OSError as exc:
            raise Unavailable(f"cannot connect to data plane {address}: {exc}") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            set_io_timeout(sock, self._io_timeout_s)
        except OSError as exc:
            sock.close()
            raise Unavailable(f"cannot set up connection to {address}: {exc}") from exc
        return sock


def _looks_alive(sock: socket.socket) -> bool:
    # An idle connection has nothing to read: EOF means the store closed it
    # (idle timeout, restart), data means the stream is out of sync.
    try:
        return not sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return True
    except OSError:
        return False


def _batches(
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


class TcpTransport(Transport):
    """The ``tcp`` data plane client.

    Args:
        connect_timeout_s: Time allowed to establish a connection.
        io_timeout_s: Time a send or receive may stall before the connection
            is declared dead.
        max_idle_per_peer: Idle connections kept per store for reuse.
        limits: The protocol limits of the stores; requests are split to stay
            within them.

    Raises:
        InvalidArgument: If a timeout is not positive or ``max_idle_per_peer``
            is negative.
    """

    def __init__(
        self,
        connect_timeout_s: float = 5.0,
        io_timeout_s: float = 30.0,
        max_idle_per_peer: int = 4,
        *,
        limits: ProtocolLimits | None = None,
    ) -> None:
        if connect_timeout_s <= 0 or io_timeout_s <= 0:
            raise InvalidArgument("transport timeouts must be positive")
        if max_idle_per_peer < 0:
            raise InvalidArgument("max_idle_per_peer must not be negative")
        self._limits = limits or ProtocolLimits()
        self._pool = _Pool(connect_timeout_s, io_timeout_s, max_idle_per_peer)
        self._closed = False

    def put(self, address: str, items: Sequence[PutItem]) -> list[PutStatus]:
        """Write chunks; see :meth:`Transport.put`."""
        self._check_usable(address)
        limits = self._limits
        statuses = [PutStatus.FAILED] * len(items)
        todo: list[tuple[int, PutEntry, memoryview]] = []
        for i, item in enumerate(items):
            key = _check_key(item.key)
            view = byte_view(item.data)
            if view.nbytes == 0 or view.nbytes > limits.largest_chunk:
                statuses[i] = PutStatus.INVALID
                continue
            todo.append((i, PutEntry(key, view.nbytes, item.checksum), view))
        for batch in _batches(todo, lambda t: t[2].nbytes, limits):
            try:
                codes = self._exchange(address, _put_batch, batch)
            except KVDepotError as exc:
                # This batch and the rest stay FAILED: the store is unreachable or broken.
                logger.warning("put of %d chunks to %s failed: %s", len(todo), address, str(exc))
                break
            for (i, _, _), code in zip(batch, codes, strict=True):
                statuses[i] = _PUT_STATUS[code]
        return statuses

    def get_into(self, address: str, items: Sequence[GetItem]) -> list[GetOutcome]:
        """Read chunks into caller buffers; see :meth:`Transport.get_into`."""
        self._check_usable(address)
        todo: list[tuple[int, GetEntry, memoryview]] = []
        for i, item in enumerate(items):
            key = _check_key(item.key)
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
        outcomes = [GetOutcome(False, 0, "transport: not attempted")] * len(items)
        cap = self._limits.max_chunk_bytes
        batches = list(_batches(todo, lambda t: min(t[1].length or t[2].nbytes, cap), self._limits))
        for k, batch in enumerate(batches):
            try:
                results = self._exchange(address, self._get_batch, batch)
            except KVDepotError as exc:
                # This batch and the rest are misses: the store is unreachable or broken.
                logger.warning("get of %d chunks from %s failed: %s", len(todo), address, str(exc))
                failed = GetOutcome(False, 0, f"transport: {exc}")
                for rest in batches[k:]:
                    for i, _, _ in rest:
                        outcomes[i] = failed
                break
            for (i, _, _), outcome in zip(batch, results, strict=True):
                outcomes[i] = outcome
        return outcomes

    def delete(self, address: str, keys: Sequence[ChunkKey]) -> list[bool]:
        """Delete chunks; see :meth:`Transport.delete`."""
        self._check_usable(address)
        todo = [(i, _check_key(k)) for i, k in enumerate(keys)]
        removed = [False] * len(keys)
        for batch in _batches(todo, lambda _: 0, self._limits):
            try:
                codes = self._exchange(address, _delete_batch, batch)
            except KVDepotError as exc:
                logger.warning("delete of %d chunks at %s failed: %s", len(todo), address, str(exc))
                break
            for (i, _), code in zip(batch, codes, strict=True):
                removed[i] = code == DeleteCode.OK
        return removed

    def close(self) -> None:
        """Close every pooled connection; later calls raise ``InvalidArgument``."""
        self._closed = True
        self._pool.close()

    def _check_usable(self, address: str) -> None:
        if self._closed:
            raise InvalidArgument("transport is closed")
        parse_address(address)

    def _exchange(self, address: str, request: Callable[[socket.socket, _A], _T], batch: _A) -> _T:
        """Run one request/reply on a pooled connection.

        Raises:
            Unavailable: The store is unreachable or the connection failed.
            ProtocolError: The store answered ERROR or something unparsable.
        """
        for attempt in range(2):
            sock, reused = self._pool.checkout(address)
            try:
                result = request(sock, batch)
            except PeerClosed:
                sock.close()
                # A pooled connection the store had just closed: one retry on
                # a fresh connection, which is not a judgement on the store.
                if reused and attempt == 0:
                    continue
                raise
            except BaseException:
                sock.close()
                raise
            self._pool.checkin(address, sock)
            return result
        raise AssertionError("unreachable")

    def _get_batch(
        self, sock: socket.socket, batch: list[tuple[int, GetEntry, memoryview]]
    ) -> list[GetOutcome]:
        n = len(batch)
        send_all(sock, [Header(Opcode.GET, n).pack() + pack_get_entries(e for _, e, _ in batch)])
        recv_reply_header(sock, Opcode.GET_REPLY, n)
        replies = unpack_get_reply_entries(recv_exact(sock, n * GET_REPLY_ENTRY.size))
        max_chunk = self._limits.max_chunk_bytes
        outcomes = []
        for (_, entry, buf), reply in zip(batch, replies, strict=True):
            if reply.status is GetCode.NOT_FOUND:
                outcomes.append(GetOutcome(False, 0, "not found"))
                continue
            if reply.status is GetCode.INVALID:
                outcomes.append(GetOutcome(False, 0, "invalid range"))
                continue
            length = reply.length
            if length > max_chunk:
                raise ProtocolError(ErrorCode.MALFORMED, f"reply of {length} bytes for one chunk")
            if length > buf.nbytes or (entry.length and length != entry.length):
                # Keep the stream in sync, but never hand out these bytes.
                drain(sock, length)
                why = (
                    f"buffer of {buf.nbytes} bytes too small for {length}"
                    if length > buf.nbytes
                    else f"store sent {length} bytes for a range of {entry.length}"
                )
                outcomes.append(GetOutcome(False, 0, why))
                continue
            dest = buf[:length] if length < buf.nbytes else buf
            recv_exact_into(sock, dest)
            if checksum(dest) != reply.checksum:
                outcomes.append(GetOutcome(False, 0, "checksum mismatch"))
                continue
            outcomes.append(GetOutcome(True, length))
        return outcomes


def _put_batch(sock: socket.socket, batch: list[tuple[int, PutEntry, memoryview]]) -> list[PutCode]:
    n = len(batch)
    head = Header(Opcode.PUT, n).pack() + pack_put_entries(e for _, e, _ in batch)
    send_all(sock, [head, *(view for _, _, view in batch)])
    recv_reply_header(sock, Opcode.PUT_REPLY, n)
    try:
        return [PutCode(b) for b in recv_exact(sock, n)]
    except ValueError as exc:
        raise ProtocolError(ErrorCode.MALFORMED, f"unknown PUT status: {exc}") from None


def _delete_batch(sock: socket.socket, batch: list[tuple[int, ChunkKey]]) -> list[DeleteCode]:
    n = len(batch)
    send_all(sock, [Header(Opcode.DELETE, n).pack() + pack_keys(k for _, k in batch)])
    recv_reply_header(sock, Opcode.DELETE_REPLY, n)
    try:
        return [DeleteCode(b) for b in recv_exact(sock, n)]
    except ValueError as exc:
        raise ProtocolError(ErrorCode.MALFORMED, f"unknown DELETE status: {exc}") from None
