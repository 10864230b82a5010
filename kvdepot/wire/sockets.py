"""Socket helpers of the data plane: vectored sends, exact receives, timeouts.

Both ends of every data-plane connection use these. Payloads are never
concatenated: buffers go to ``sendmsg`` as an I/O vector and bytes come off
the wire with ``recv_into`` straight into their destination. The hashing
variants checksum each block right after the kernel copied it, so a
checksum costs a pass over cache rather than over memory.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import threading
import time
from collections.abc import Sequence

from kvdepot.errors import InvalidArgument, Unavailable
from kvdepot.wire.xxh3 import BlockHasher, xxh3_64

# sendmsg takes at most IOV_MAX buffers per call (1024 on Linux).
try:
    IOV_MAX = max(16, os.sysconf("SC_IOV_MAX"))
except (AttributeError, ValueError, OSError):
    IOV_MAX = 1024

_SCRATCH_BYTES = 256 << 10

_CHECKSUM = struct.Struct("<Q")
CHECKSUM_SIZE = _CHECKSUM.size
"""Bytes of the checksum that follows each payload of a PUT_TRAILED."""


class PeerClosed(Unavailable):
    """The peer closed or reset the connection."""


class TimedOut(Unavailable):
    """A send or receive made no progress within the socket's timeout."""


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


SEND_PIECE = 1 << 20
"""Most bytes handed to one ``sendmsg`` call.

A single call for a whole large reply lets the kernel fill the socket
buffer before the receiver is woken; pieces of about 1 MiB keep both ends
busy at once. On loopback, two cores, a reply of 8 x 4 MiB went 2.1-2.4 GB/s
as one vector and 3.2-3.6 GB/s in 1 MiB calls (512 KiB: 3.2-3.3, 2 MiB:
3.0-3.3); a vector of up to 1 MiB stays one call.
"""


def send_all(
    sock: socket.socket,
    buffers: Sequence[bytes | bytearray | memoryview],
    short_is_stall: bool = False,
) -> None:
    """Send every buffer in order, in calls of at most ``SEND_PIECE`` bytes.

    Nothing is concatenated: the buffers are handed to the kernel as I/O
    vectors and a partial send resumes from a slice of the first unsent one.
    With ``short_is_stall`` (a client's payloads), a call the socket's send
    timeout ended short is a stall: a frozen peer's kernel takes a little
    more now and then, and resuming would wait a whole timeout for each
    piece. A server leaves slow readers to its own rate deadline instead.

    Raises:
        PeerClosed: The peer closed or reset the connection.
        TimedOut: The peer stopped reading.
        Unavailable: The connection failed otherwise.
    """
    if len(buffers) == 1 and type(buffers[0]) is bytes and len(buffers[0]) <= SEND_PIECE:
        # One small message (a request, most answers): one call, no vector bookkeeping.
        try:
            sock.sendall(buffers[0])
        except OSError as exc:
            raise _translate(exc, "send") from exc
        return
    views = [v for v in (byte_view(b) for b in buffers) if v.nbytes]
    i = 0
    while i < len(views):
        iov = _piece(views, i)
        started = time.monotonic() if short_is_stall else 0.0
        try:
            sent = sock.sendmsg(iov)
        except OSError as exc:
            raise _translate(exc, "send") from exc
        if sent <= 0:
            raise Unavailable("send failed: the socket accepted no bytes")
        if (
            short_is_stall
            and sent < sum(v.nbytes for v in iov)
            and _stalled(sock, time.monotonic() - started)
        ):
            raise TimedOut("send timed out: the peer stopped reading")
        i = _advance(views, i, sent)


def _stalled(sock: socket.socket, waited_s: float) -> bool:
    """Whether a send that came back short after ``waited_s`` ran into the
    socket's send timeout (rather than a signal or a large vector)."""
    whole, micros = struct.unpack("ll", sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, 16))
    timeout_s = whole + micros / 1e6
    return timeout_s > 0 and waited_s >= 0.9 * timeout_s


def _advance(views: list[memoryview], i: int, moved: int) -> int:
    """After ``moved`` more bytes went from (or into) ``views[i:]``: the index
    of the first view not wholly moved, which is trimmed to its rest in place."""
    while moved:
        size = views[i].nbytes
        if moved < size:
            views[i] = views[i][moved:]
            break
        moved -= size
        i += 1
    return i


def _piece(views: list[memoryview], i: int) -> list[memoryview]:
    """The next I/O vector from ``views[i]``: at most ``SEND_PIECE`` bytes."""
    iov: list[memoryview] = []
    room = SEND_PIECE
    for view in views[i : i + IOV_MAX]:
        if view.nbytes >= room:
            iov.append(view[:room] if view.nbytes > room else view)
            break
        iov.append(view)
        room -= view.nbytes
    return iov


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


def recv_exact_into_many(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Fill each of ``views`` completely, in order, with as few calls as the
    kernel allows (``recvmsg_into`` with ``MSG_WAITALL``).

    For several small payloads of one reply: one system call instead of one
    per payload. At most :data:`IOV_MAX` views; each must be a flat byte view.

    Raises:
        PeerClosed: The peer closed the connection before every view was full.
        TimedOut: No bytes arrived within the socket's timeout.
        Unavailable: The connection failed otherwise.
    """
    left = [v for v in views if v.nbytes]
    if len(left) > IOV_MAX:
        raise InvalidArgument(f"{len(left)} views exceed the {IOV_MAX} one receive takes")
    total = sum(v.nbytes for v in left)
    got = 0
    i = 0
    while i < len(left):
        try:
            n = sock.recvmsg_into(left[i:] if i else left, 0, socket.MSG_WAITALL)[0]
        except OSError as exc:
            raise _translate(exc, "receive") from exc
        if n == 0:
            raise PeerClosed(f"peer closed the connection after {got} of {total} bytes")
        got += n
        # A signal or the receive timeout cut the call short: resume after the filled part.
        i = _advance(left, i, n)


HASH_BLOCK = 512 << 10
"""Bytes moved between two hash updates when hashing while sending or receiving.

Small enough that a block is still in the core's L2 cache when it is
hashed right after the kernel copied it, so the checksum costs a pass over
cache instead of a second pass over memory; large enough that the system
calls stay few.
"""


def recv_hashed_into(sock: socket.socket, view: memoryview, block: int = HASH_BLOCK) -> int:
    """Fill ``view`` from the socket and return the xxh3-64 of its bytes.

    Each block is hashed right after it arrived, while it is in cache; the
    kernel keeps receiving into the socket buffer meanwhile.

    Raises:
        PeerClosed: The peer closed the connection before ``view`` was full.
        TimedOut: No bytes arrived within the socket's timeout.
        Unavailable: The connection failed otherwise.
    """
    view = byte_view(view)
    total = view.nbytes
    if total <= block:
        recv_exact_into(sock, view)
        return xxh3_64(view)
    hasher = BlockHasher(view)
    for start in range(0, total, block):
        end = min(start + block, total)
        recv_exact_into(sock, view[start:end])
        hasher.update(start, end)
    return hasher.digest()


def send_hashed(
    sock: socket.socket,
    head: Sequence[bytes | bytearray | memoryview],
    payloads: Sequence[memoryview],
    block: int = HASH_BLOCK,
    short_is_stall: bool = False,
) -> list[int]:
    """Send ``head``, then each payload followed by its xxh3-64 (8 bytes).

    The framing of a PUT_TRAILED: each block of a payload is hashed right
    after ``sendmsg`` handed it to the kernel, so the payload is read from
    memory once. Returns the checksums sent.

    Raises:
        PeerClosed: The peer closed or reset the connection.
        TimedOut: The peer stopped reading.
        Unavailable: The connection failed otherwise.
    """
    pending: list[bytes | bytearray | memoryview] = list(head)
    sums: list[int] = []
    for payload in payloads:
        view = byte_view(payload)
        hasher = BlockHasher(view)
        for start in range(0, view.nbytes, block):
            end = min(start + block, view.nbytes)
            pending.append(view[start:end])
            send_all(sock, pending, short_is_stall)
            pending = []
            hasher.update(start, end)
        digest = hasher.digest()
        sums.append(digest)
        pending.append(_CHECKSUM.pack(digest))
    send_all(sock, pending, short_is_stall)
    return sums


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
