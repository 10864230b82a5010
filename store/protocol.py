"""Wire format of the ``tcp`` data plane, and the socket helpers both ends use.

Every message is a fixed 16-byte header, then fixed-size entries, then raw
payloads back to back. Nothing is serialised per chunk: payload bytes go from
the sender's memory to the wire with ``sendmsg`` of a list of buffers and off
the wire straight into their destination with ``recv_into``. All integers are
little-endian.

Header (16 bytes, every message)::

    offset  size  field
    0       4     magic     b"KVDP"
    4       1     version   1
    5       1     opcode    see Opcode
    6       2     flags     reserved: sent as 0, ignored on receipt
    8       4     count     entries that follow (ERROR: message length)
    12      4     aux       opcode-specific (PING/PONG: nonce echoed; else 0)

Requests and replies (n = header.count)::

    PUT           header, n x PutEntry, then the n payloads back to back
      PutEntry    0 key 16B | 16 size u64 | 24 checksum u64            (32 bytes)
    PUT_REPLY     header, n x status u8 (PutCode)
    GET           header, n x GetEntry
      GetEntry    0 key 16B | 16 offset u64 | 24 length u64 (0 = to the end)  (32 bytes)
    GET_REPLY     header, n x GetReplyEntry, then the payloads of the OK
                  entries back to back, in request order
      GetReplyEntry  0 status u8 (GetCode) | 1 pad 7B | 8 length u64 | 16 checksum u64
                                                                        (24 bytes)
    DELETE        header, n x key 16B
    DELETE_REPLY  header, n x status u8 (DeleteCode)
    PING / PONG   header only, count 0
    ERROR         header (count = message length), code u32 (ErrorCode),
                  then the utf-8 message

A GET reply's checksum is the writer's stored checksum for a whole-chunk read
(end to end: the bytes the reader gets are checked against what the writer
hashed), and the xxh3-64 of the served bytes for a ranged read.

A receiver of a malformed frame (bad magic, version or opcode, a count or size
above :class:`ProtocolLimits`, a truncated frame) answers ERROR and closes the
connection: after a framing error the stream cannot be resynchronised.
"""

from __future__ import annotations

import enum
import errno
import os
import socket
import struct
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvdepot.errors import Corrupt, InvalidArgument, Unavailable
from kvdepot.metadata.keys import KEY_BYTES, ChunkKey

MAGIC = b"KVDP"
VERSION = 1

HEADER = struct.Struct("<4sBBHII")
PUT_ENTRY = struct.Struct(f"<{KEY_BYTES}sQQ")
GET_ENTRY = struct.Struct(f"<{KEY_BYTES}sQQ")
GET_REPLY_ENTRY = struct.Struct("<B7xQQ")
ERROR_CODE = struct.Struct("<I")

MAX_ERROR_MESSAGE = 4096
"""Longest ERROR message accepted or sent, in bytes."""

# sendmsg takes at most IOV_MAX buffers per call (1024 on Linux).
try:
    _IOV_MAX = max(16, os.sysconf("SC_IOV_MAX"))
except (AttributeError, ValueError, OSError):
    _IOV_MAX = 1024

_SCRATCH_BYTES = 256 << 10


class Opcode(enum.IntEnum):
    """What a message is."""

    PUT = 1
    PUT_REPLY = 2
    GET = 3
    GET_REPLY = 4
    DELETE = 5
    DELETE_REPLY = 6
    PING = 7
    PONG = 8
    ERROR = 9


REQUEST_OPCODES = frozenset({Opcode.PUT, Opcode.GET, Opcode.DELETE, Opcode.PING})


class PutCode(enum.IntEnum):
    """Per-chunk outcome of a PUT."""

    OK = 0
    EXISTS = 1
    NO_SPACE = 2
    CORRUPT = 3
    INVALID = 4


class GetCode(enum.IntEnum):
    """Per-chunk outcome of a GET."""

    OK = 0
    NOT_FOUND = 1
    INVALID = 2


class DeleteCode(enum.IntEnum):
    """Per-chunk outcome of a DELETE."""

    OK = 0
    NOT_FOUND = 1


class ErrorCode(enum.IntEnum):
    """Why a connection is being closed (the code of an ERROR message)."""

    BAD_MAGIC = 1
    BAD_VERSION = 2
    BAD_OPCODE = 3
    LIMIT_EXCEEDED = 4
    MALFORMED = 5
    INTERNAL = 6


class ProtocolError(Corrupt):
    """A malformed frame, or an ERROR message from the peer.

    Attributes:
        code: What was wrong.
    """

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.detail = message


class PeerClosed(Unavailable):
    """The peer closed or reset the connection."""


class TimedOut(Unavailable):
    """A send or receive made no progress within the socket's timeout."""


@dataclass(frozen=True, slots=True)
class ProtocolLimits:
    """Bounds a receiver enforces before it reserves memory for a request.

    Attributes:
        max_batch: Most entries in one message.
        max_chunk_bytes: Largest single payload.
        max_request_bytes: Largest sum of the payloads of one PUT; senders
            also split GETs so their replies stay under it.
    """

    max_batch: int = 4096
    max_chunk_bytes: int = 1 << 30
    max_request_bytes: int = 8 << 30

    def __post_init__(self) -> None:
        if self.max_batch <= 0 or self.max_chunk_bytes <= 0 or self.max_request_bytes <= 0:
            raise InvalidArgument(f"protocol limits must be positive: {self}")
        if self.max_batch > 0xFFFFFFFF:
            raise InvalidArgument("max_batch must fit in the u32 count field")

    @property
    def largest_chunk(self) -> int:
        """The largest chunk one PUT can carry: both limits apply."""
        return min(self.max_chunk_bytes, self.max_request_bytes)


@dataclass(frozen=True, slots=True)
class Header:
    """The 16-byte header of every message."""

    opcode: Opcode
    count: int = 0
    aux: int = 0
    flags: int = 0

    def pack(self) -> bytes:
        """The header's wire bytes."""
        return HEADER.pack(MAGIC, VERSION, self.opcode, self.flags, self.count, self.aux)


def unpack_header(data: bytes | bytearray | memoryview) -> Header:
    """Parse a header, rejecting anything that is not this protocol.

    Raises:
        ProtocolError: Bad magic, version or opcode.
    """
    magic, version, opcode, flags, count, aux = HEADER.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(ErrorCode.BAD_MAGIC, f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise ProtocolError(ErrorCode.BAD_VERSION, f"unsupported version {version}")
    try:
        op = Opcode(opcode)
    except ValueError:
        raise ProtocolError(ErrorCode.BAD_OPCODE, f"unknown opcode {opcode}") from None
    return Header(op, count, aux, flags)


@dataclass(frozen=True, slots=True)
class PutEntry:
    """One chunk announced in a PUT; its payload follows the entries."""

    key: ChunkKey
    size: int
    checksum: int


@dataclass(frozen=True, slots=True)
class GetEntry:
    """One ranged read in a GET (``length`` 0: to the end of the chunk)."""

    key: ChunkKey
    offset: int = 0
    length: int = 0


@dataclass(frozen=True, slots=True)
class GetReplyEntry:
    """One answer in a GET_REPLY; ``length`` payload bytes follow if OK."""

    status: GetCode
    length: int = 0
    checksum: int = 0


def pack_put_entries(entries: Iterable[PutEntry]) -> bytes:
    """Wire bytes of the entries of a PUT."""
    return b"".join(PUT_ENTRY.pack(e.key, e.size, e.checksum) for e in entries)


def unpack_put_entries(data: bytes | bytearray | memoryview) -> list[PutEntry]:
    """Parse the entries of a PUT (``len(data)`` a multiple of 32)."""
    return [PutEntry(ChunkKey(bytes(k)), size, ck) for k, size, ck in PUT_ENTRY.iter_unpack(data)]


def pack_get_entries(entries: Iterable[GetEntry]) -> bytes:
    """Wire bytes of the entries of a GET."""
    return b"".join(GET_ENTRY.pack(e.key, e.offset, e.length) for e in entries)


def unpack_get_entries(data: bytes | bytearray | memoryview) -> list[GetEntry]:
    """Parse the entries of a GET (``len(data)`` a multiple of 32)."""
    return [GetEntry(ChunkKey(bytes(k)), off, n) for k, off, n in GET_ENTRY.iter_unpack(data)]


def pack_get_reply_entries(entries: Iterable[GetReplyEntry]) -> bytes:
    """Wire bytes of the entries of a GET_REPLY."""
    return b"".join(GET_REPLY_ENTRY.pack(e.status, e.length, e.checksum) for e in entries)


def unpack_get_reply_entries(data: bytes | bytearray | memoryview) -> list[GetReplyEntry]:
    """Parse the entries of a GET_REPLY.

    Raises:
        ProtocolError: An unknown status.
    """
    out = []
    for status, length, ck in GET_REPLY_ENTRY.iter_unpack(data):
        try:
            code = GetCode(status)
        except ValueError:
            raise ProtocolError(ErrorCode.MALFORMED, f"unknown GET status {status}") from None
        out.append(GetReplyEntry(code, length, ck))
    return out


def pack_keys(keys: Iterable[bytes]) -> bytes:
    """Wire bytes of the keys of a DELETE."""
    return b"".join(keys)


def unpack_keys(data: bytes | bytearray | memoryview) -> list[ChunkKey]:
    """Parse the keys of a DELETE (``len(data)`` a multiple of 16)."""
    raw = bytes(data)
    return [ChunkKey(raw[i : i + KEY_BYTES]) for i in range(0, len(raw), KEY_BYTES)]


def encode_error(code: ErrorCode, message: str) -> bytes:
    """A complete ERROR message."""
    text = message.encode("utf-8", "replace")[:MAX_ERROR_MESSAGE]
    return Header(Opcode.ERROR, len(text)).pack() + ERROR_CODE.pack(code) + text


def read_error(sock: socket.socket, header: Header) -> ProtocolError:
    """Read the body of an ERROR message whose header was read; return it as an error.

    Raises:
        ProtocolError: The message is longer than :data:`MAX_ERROR_MESSAGE`.
        Unavailable: The connection failed.
    """
    if header.count > MAX_ERROR_MESSAGE:
        return ProtocolError(ErrorCode.MALFORMED, f"ERROR message of {header.count} bytes")
    body = recv_exact(sock, ERROR_CODE.size + header.count)
    (raw_code,) = ERROR_CODE.unpack_from(body)
    try:
        code = ErrorCode(raw_code)
    except ValueError:
        code = ErrorCode.INTERNAL
    text = body[ERROR_CODE.size :].decode("utf-8", "replace")
    return ProtocolError(code, f"peer closed the connection: {text}")


def recv_reply_header(sock: socket.socket, opcode: Opcode, count: int) -> Header:
    """Read the header of the reply to a request, checking it is the one expected.

    Raises:
        ProtocolError: The peer sent ERROR, or a reply of the wrong kind or size.
        Unavailable: The connection failed.
    """
    header = unpack_header(recv_exact(sock, HEADER.size))
    if header.opcode is Opcode.ERROR:
        raise read_error(sock, header)
    if header.opcode is not opcode or header.count != count:
        raise ProtocolError(
            ErrorCode.MALFORMED,
            f"expected {opcode.name} of {count}, got {header.opcode.name} of {header.count}",
        )
    return header


def byte_view(buf: bytes | bytearray | memoryview) -> memoryview:
    """A flat unsigned-byte view of ``buf`` without copying.

    Views with another format or shape (float16 tensors, say) are cast, so
    lengths are always in bytes.

    Raises:
        InvalidArgument: If ``buf`` is not contiguous.
    """
    view = buf if isinstance(buf, memoryview) else memoryview(buf)
    if not view.c_contiguous:
        raise InvalidArgument("buffers must be contiguous")
    if view.format == "B" and view.ndim == 1:
        return view
    return view.cast("B")


def _translate(exc: OSError, what: str) -> Unavailable:
    if isinstance(exc, TimeoutError | BlockingIOError):
        return TimedOut(f"{what} timed out")
    if isinstance(exc, ConnectionError) or exc.errno in (errno.EPIPE, errno.ECONNRESET):
        return PeerClosed(f"{what} failed: peer closed the connection ({exc})")
    return Unavailable(f"{what} failed: {exc}")


def send_all(sock: socket.socket, buffers: Sequence[bytes | bytearray | memoryview]) -> None:
    """Send every buffer in order, with as few ``sendmsg`` calls as possible.

    Nothing is concatenated: the buffers are handed to the kernel as an I/O
    vector and a partial send resumes from a slice of the first unsent one.

    Raises:
        PeerClosed: The peer closed or reset the connection.
        TimedOut: The peer stopped reading.
        Unavailable: The connection failed otherwise.
    """
    views = [v for v in (byte_view(b) for b in buffers) if v.nbytes]
    i = 0
    while i < len(views):
        try:
            sent = sock.sendmsg(views[i : i + _IOV_MAX])
        except OSError as exc:
            raise _translate(exc, "send") from exc
        if sent <= 0:
            raise Unavailable("send failed: the socket accepted no bytes")
        while sent:
            n = views[i].nbytes
            if sent >= n:
                sent -= n
                i += 1
            else:
                views[i] = views[i][sent:]
                sent = 0


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` completely from the socket.

    Raises:
        PeerClosed: The peer closed the connection before ``view`` was full.
        TimedOut: No bytes arrived within the socket's timeout.
        Unavailable: The connection failed otherwise.
    """
    view = byte_view(view)
    total = view.nbytes
    got = 0
    while got < total:
        try:
            # MSG_WAITALL lets the kernel fill the whole view in one call on a
            # blocking socket instead of one call per arriving segment.
            n = sock.recv_into(view[got:] if got else view, total - got, socket.MSG_WAITALL)
        except OSError as exc:
            raise _translate(exc, "receive") from exc
        if n == 0:
            raise PeerClosed(f"peer closed the connection after {got} of {total} bytes")
        got += n


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Receive exactly ``n`` bytes (for headers and entries, not payloads).

    Raises:
        PeerClosed: The peer closed the connection first.
        Unavailable: The connection failed or timed out.
    """
    buf = bytearray(n)
    recv_exact_into(sock, memoryview(buf))
    return bytes(buf)


_scratch = threading.local()


def _thread_scratch() -> memoryview:
    view: memoryview | None = getattr(_scratch, "view", None)
    if view is None:
        view = memoryview(bytearray(_SCRATCH_BYTES))
        _scratch.view = view
    return view


def drain(sock: socket.socket, n: int, scratch: memoryview | None = None) -> None:
    """Read and discard ``n`` bytes (a payload that will not be stored).

    Args:
        sock: The socket to read from.
        n: Bytes to discard.
        scratch: Reusable buffer to read into; a per-thread one by default.

    Raises:
        PeerClosed: The peer closed the connection first.
        Unavailable: The connection failed or timed out.
    """
    buf = byte_view(scratch) if scratch is not None else _thread_scratch()
    size = buf.nbytes
    while n > 0:
        step = min(n, size)
        recv_exact_into(sock, buf[:step] if step < size else buf)
        n -= step


def set_io_timeout(sock: socket.socket, seconds: float) -> None:
    """Make ``sock`` blocking with kernel send and receive timeouts.

    Kernel timeouts (``SO_RCVTIMEO``/``SO_SNDTIMEO``) instead of Python's
    socket timeouts keep large transfers at one system call each: Python's
    timeout mode polls before every call and cannot use ``MSG_WAITALL``.
    A timeout surfaces from the helpers above as :class:`Unavailable`.
    """
    if sock.gettimeout() is not None:
        sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(seconds))
    set_recv_timeout(sock, seconds)


def set_send_timeout(sock: socket.socket, seconds: float) -> None:
    """Change only the kernel send timeout of a socket set up by :func:`set_io_timeout`."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(seconds))


def set_recv_timeout(sock: socket.socket, seconds: float) -> None:
    """Change only the kernel receive timeout of a socket set up by :func:`set_io_timeout`."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))


def _timeval(seconds: float) -> bytes:
    if seconds <= 0:
        # A zero timeval means "wait forever" to the kernel; never what a caller meant.
        raise InvalidArgument(f"socket timeouts must be positive, got {seconds}")
    whole = int(seconds)
    micros = max(int((seconds - whole) * 1_000_000), 0 if whole else 1)
    return struct.pack("ll", whole, micros)
