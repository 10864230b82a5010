"""The ``tcp`` data plane server: chunk bytes in and out of the DRAM arena.

One thread per connection, each looping over requests (see
:mod:`kvdepot.wire.protocol` for the wire format): this module listens,
admits connections, authenticates them and reads each request's header under
the connection's deadlines; :mod:`kvdepot.store.handlers` answers the
requests. The threads spend their time in ``recv_into``/``sendmsg``, which
release the GIL, so connections proceed in parallel.

Zero copy on both paths:

* PUT: each chunk is reserved in the arena first and its payload is received
  straight into the reservation's view; it is checksummed there and committed
  only once every payload of the request arrived, so a client that dies
  mid-request leaves nothing visible and nothing reserved.
* GET: every chunk of the request is leased (pinned against eviction), and the
  reply header, entries and arena views go out in one ``sendmsg`` vector; the
  leases are released whatever happens. A chunk in another tier (SSD, GPU)
  is promoted into the arena or copied out for the reply, checked against
  its checksum when it comes off SSD (see :class:`ChunkStore`).

Clients that move bytes themselves (``shm``, ``nixl``) use the same
connections for their control messages: ATTACH tells them where the arena is,
and the reservations and leases they take belong to the connection's
:class:`~kvdepot.store.session.Session`, dropped when it closes.

A malformed frame is answered with ERROR and the connection is closed;
nothing a client sends can take down the server or leak arena memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import select
import socket
import struct
import threading
import time

from kvdepot.errors import InvalidArgument, Unavailable
from kvdepot.rpc.auth import Authenticator, RefusalLog, peer_host
from kvdepot.store.chunks import ChunkStore
from kvdepot.store.handlers import ReplyFailed, RequestHandlers
from kvdepot.store.indexer import Indexer
from kvdepot.store.session import GrantBudget, HeldListener, Session
from kvdepot.store.watchdog import RequestWatchdog
from kvdepot.wire.handshake import ServerHandshake
from kvdepot.wire.host import host_identity
from kvdepot.wire.protocol import (
    HEADER,
    AttachFlags,
    AttachInfo,
    AuthRefused,
    ErrorCode,
    PeerClosed,
    ProtocolError,
    ProtocolLimits,
    TimedOut,
    encode_error,
    recv_exact_into,
    set_io_timeout,
    set_recv_timeout,
    set_send_timeout,
    unpack_header,
)

logger = logging.getLogger(__name__)

_ERROR_SEND_TIMEOUT_S = 1.0
# After an ERROR, what the peer still sends is read and dropped for this long
# (and at most this many reads), so that the close does not reset the ERROR away.
_ERROR_LINGER_S = 0.5
_ERROR_LINGER_READS = 16
_JOIN_TIMEOUT_S = 5.0
_LINGER_RESET = struct.pack("ii", 1, 0)
_NO_IDLE_CUT_S = 365 * 86400.0
"""The idle wait of a connection holding grants: none in practice."""


@dataclasses.dataclass(frozen=True, slots=True)
class DataPlaneStats:
    """Counters of a data plane server since it started.

    Attributes:
        connections_total: Connections accepted.
        connections_open: Connections open now.
        puts: Chunks stored (committed) by PUTs.
        gets: Chunk reads served.
        get_misses: Chunk reads that found nothing.
        bytes_in: Payload bytes received (stored or not).
        bytes_out: Payload bytes sent.
        protocol_errors: Connections closed for a malformed or truncated
            request, or for stalling inside one.
        corrupt_puts: Chunks whose payload failed its checksum.
        put_rejected: Chunks refused for lack of space or as invalid
            (already-present chunks are not rejections).
    """

    connections_total: int = 0
    connections_open: int = 0
    puts: int = 0
    gets: int = 0
    get_misses: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    protocol_errors: int = 0
    corrupt_puts: int = 0
    put_rejected: int = 0


_COUNTERS = tuple(f.name for f in dataclasses.fields(DataPlaneStats))


class DataPlaneServer:
    """Serves one :class:`ChunkStore` over the ``tcp`` data plane protocol.

    Args:
        chunks: The chunk table to serve.
        host: Address to listen on.
        port: Port to listen on; 0 picks a free one (see :attr:`address`).
        limits: Bounds checked on every request before anything is reserved.
        idle_timeout_s: A connection idle this long between requests is closed.
        io_timeout_s: A connection that stalls this long inside a request is
            closed (and its reservations revoked).
        on_nixl_held: Told the change in reservations and leases held by
            connections that attached as NIXL clients.
        min_rate: Bytes per second a client must at least move within a
            request: one that takes longer than twice ``io_timeout_s`` plus
            its payload at this rate is closed, however steadily it trickles.
        hold_timeout_s: A connection that holds reservations or leases
            (``shm``, ``nixl`` clients) without a break for this long is
            closed, and what it held is freed.
        max_connections: Connections served at once; more are answered
            ERROR and closed.
        auth: When it holds tokens, every connection must prove it holds
            one before anything else (see :mod:`kvdepot.wire.handshake`).
        verify_shm_commits: Hash again what ``shm`` clients copied into the
            arena before committing it (see :class:`~kvdepot.store.session.Session`).
        index: Commits what a PUT or COMMIT with ``HeaderFlags.INDEX`` stored
            into the cluster's index (see :mod:`kvdepot.store.indexer`);
            ``None`` indexes nothing (such requests are answered NOT_INDEXED).

    Raises:
        InvalidArgument: If a timeout, the rate or the connection limit is not positive.
    """

    def __init__(
        self,
        chunks: ChunkStore,
        host: str = "127.0.0.1",
        port: int = 0,
        limits: ProtocolLimits = ProtocolLimits(),  # noqa: B008 - frozen, immutable default
        idle_timeout_s: float = 60.0,
        io_timeout_s: float = 30.0,
        on_nixl_held: HeldListener | None = None,
        *,
        min_rate: int = 1 << 20,
        hold_timeout_s: float = 60.0,
        max_connections: int = 1024,
        auth: Authenticator | None = None,
        verify_shm_commits: bool = False,
        index: Indexer | None = None,
    ) -> None:
        if min(idle_timeout_s, io_timeout_s, hold_timeout_s) <= 0:
            raise InvalidArgument("data plane timeouts must be positive")
        if max_connections <= 0:
            raise InvalidArgument("max_connections must be positive")
        self._chunks = chunks
        self._on_nixl_held = on_nixl_held
        self._auth = auth
        self._verify_shm_commits = verify_shm_commits
        self._grants = GrantBudget(chunks.capacity)
        self._refusals = RefusalLog("data plane")
        arena = chunks.arena
        dev, ino = arena.file_id or (0, 0)
        self._attach_info = AttachInfo(
            generation=arena.generation,
            arena_size=arena.capacity,
            file_dev=dev,
            file_ino=ino,
            flags=(AttachFlags.SHM | AttachFlags.GRANTS if arena.path else AttachFlags.NONE)
            | (AttachFlags.VERIFIES_SHM if verify_shm_commits else AttachFlags.NONE),
            arena_path=arena.path or "",
            host_id=host_identity(),
        )
        self._host = host
        self._port = port
        self._limits = limits
        self._idle_timeout_s = idle_timeout_s
        self._io_timeout_s = io_timeout_s
        self._hold_timeout_s = hold_timeout_s
        self._max_connections = max_connections
        self._at_limit = False
        # Twice the I/O timeout: a request that merely stalls is the kernel
        # timeout's to end (with a clearer error); this is for the trickles.
        self._watchdog = RequestWatchdog(2 * io_timeout_s, min_rate)
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._handlers = RequestHandlers(
            chunks, limits, self._watchdog, self._count, lambda: self._attach_info, index
        )

    @property
    def address(self) -> tuple[str, int]:
        """The address actually listened on (the chosen port when 0 was asked).

        Raises:
            Unavailable: If the server is not started.
        """
        if self._listener is None:
            raise Unavailable("data plane server is not started")
        name = self._listener.getsockname()
        return str(name[0]), int(name[1])

    def start(self) -> None:
        """Bind, listen, and start accepting connections in a background thread.

        Raises:
            InvalidArgument: If already started.
            Unavailable: If the address cannot be bound.
        """
        if self._listener is not None:
            raise InvalidArgument("data plane server already started")
        try:
            infos = socket.getaddrinfo(
                self._host, self._port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
            family, kind, proto, _, addr = infos[0]
            listener = socket.socket(family, kind, proto)
        except OSError as exc:
            raise Unavailable(f"cannot listen on {self._host}:{self._port}: {exc}") from exc
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(addr)
            listener.listen(512)
        except OSError as exc:
            listener.close()
            raise Unavailable(f"cannot listen on {self._host}:{self._port}: {exc}") from exc
        self._listener = listener
        self._stopping.clear()
        self._watchdog.start()
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name="kvdepot-dataplane-accept", daemon=True
        )
        self._accept_thread.start()
        logger.info("data plane listening on %s:%d", *self.address)

    def stop(self) -> None:
        """Stop accepting, close every connection, and wait for their threads."""
        self._stopping.set()
        listener, self._listener = self._listener, None
        if listener is not None:
            # shutdown wakes the thread blocked in accept(); close alone may not.
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        if self._accept_thread is not None:
            self._accept_thread.join(_JOIN_TIMEOUT_S)
            self._accept_thread = None
        with self._lock:
            connections = list(self._connections.items())
        for conn, _ in connections:
            # Wakes threads blocked in recv/send; each closes its own socket.
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for _, thread in connections:
            thread.join(_JOIN_TIMEOUT_S)
            if thread.is_alive():
                logger.warning("data plane connection thread %s did not stop", thread.name)
        self._watchdog.stop()

    def __enter__(self) -> DataPlaneServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def attach_info(self) -> AttachInfo:
        """What ATTACH answers: the arena's identity and what else is offered."""
        return self._attach_info

    @attach_info.setter
    def attach_info(self, info: AttachInfo) -> None:
        self._attach_info = info

    def stats(self) -> DataPlaneStats:
        """A consistent snapshot of the counters."""
        with self._lock:
            return DataPlaneStats(**self._counters)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counters[name] += delta

    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        while not self._stopping.is_set():
            try:
                conn, peer = listener.accept()
            except OSError as exc:
                if self._stopping.is_set():
                    return
                # Out of file descriptors and the like: keep serving the rest.
                logger.warning("data plane accept failed: %s", exc)
                self._stopping.wait(0.1)
                continue
            if self._stopping.is_set():
                conn.close()
                return
            if not self._admit(conn, peer):
                continue
            thread = threading.Thread(
                target=self._serve,
                args=(conn, _peer_name(peer)),
                name=f"kvdepot-dataplane-{_peer_name(peer)}",
                daemon=True,
            )
            with self._lock:
                self._connections[conn] = thread
            self._count(connections_total=1, connections_open=1)
            thread.start()

    def _admit(self, conn: socket.socket, peer: object) -> bool:
        # Beyond the limit a connection is refused at once: a flood of idle
        # connections costs threads and file descriptors, not the server.
        with self._lock:
            room = len(self._connections) < self._max_connections
            warn = not room and not self._at_limit
            self._at_limit = not room
        if room:
            return True
        if warn:
            logger.warning(
                "data plane at its limit of %d connections: refusing new ones",
                self._max_connections,
            )
        logger.debug("refused a data plane connection from %s", _peer_name(peer))
        with contextlib.suppress(OSError):
            conn.setblocking(False)  # never wait on a peer from the accept thread
            conn.send(
                encode_error(
                    ErrorCode.LIMIT_EXCEEDED,
                    f"the store serves at most {self._max_connections} connections",
                )
            )
        conn.close()
        self._count(connections_total=1, protocol_errors=1)
        return False

    def _serve(self, conn: socket.socket, peer: str) -> None:
        session = Session(
            self._chunks,
            self._limits.max_held,
            self._on_nixl_held,
            verify_shm_commits=self._verify_shm_commits,
            grants=self._grants,
        )
        gate = ServerHandshake(self._auth)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            set_io_timeout(conn, self._io_timeout_s)
            header = memoryview(bytearray(HEADER.size))
            # poll, not select: a store may serve more than 1024 fds.
            arrival = select.poll()
            arrival.register(conn, select.POLLIN)
            while not self._stopping.is_set():
                if not self._next_request(conn, header, session, arrival):
                    return
                try:
                    request = unpack_header(header)
                    if gate.admit(conn, request):
                        self._handlers.dispatch(conn, request, session)
                    elif gate.principal is not None:
                        session.tenant = gate.principal.tenant
                except ReplyFailed as exc:
                    if self._watchdog.expired(conn):
                        raise self._too_slow() from exc
                    logger.debug("data plane peer %s left during a reply: %s", peer, str(exc))
                    return
                except PeerClosed as exc:
                    raise ProtocolError(ErrorCode.MALFORMED, f"truncated request: {exc}") from exc
                except TimedOut as exc:
                    raise ProtocolError(ErrorCode.MALFORMED, f"stalled request: {exc}") from exc
                finally:
                    self._watchdog.disarm(conn)
                self._check_hold(session)
        except AuthRefused as exc:
            # Once per peer and minute: a misconfigured client retries forever.
            self._refusals.refuse(peer_host(peer), exc.detail)
            self._send_error(conn, exc.code, exc.detail)
        except ProtocolError as exc:
            # Logged as text: a record that kept the exception would keep its
            # traceback's frames alive, and with them views of the arena.
            self._count(protocol_errors=1)
            err = self._too_slow() if self._watchdog.expired(conn) else exc
            logger.warning("data plane peer %s: %s; closing the connection", peer, str(err))
            self._send_error(conn, err.code, err.detail)
        except Unavailable as exc:
            if self._watchdog.expired(conn):
                self._count(protocol_errors=1)
                logger.warning("data plane peer %s: %s", peer, str(self._too_slow()))
            else:
                logger.debug("data plane peer %s: %s", peer, str(exc))
        except Exception as exc:
            logger.exception("data plane connection from %s failed", peer)
            self._send_error(conn, ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}")
        finally:
            # Whatever ended the connection, nothing it reserved or leased outlives it.
            session.close()
            if self._watchdog.expired(conn):
                # Reset: what is queued for a too slow reader is dropped, not
                # trickled out of the kernel's buffers at its pace.
                with contextlib.suppress(OSError):
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
            self._watchdog.forget(conn)
            conn.close()
            with self._lock:
                self._connections.pop(conn, None)
            self._count(connections_open=-1)

    def _too_slow(self) -> ProtocolError:
        w = self._watchdog
        return ProtocolError(
            ErrorCode.LIMIT_EXCEEDED,
            f"request slower than {w.grace_s:g} s plus its payload at {w.min_rate} bytes/s",
        )

    def _hold_left(self, session: Session) -> float | None:
        if session.held_since is None:
            return None
        return session.held_since + self._hold_timeout_s - time.monotonic()

    def _hold_error(self, session: Session) -> ProtocolError:
        return ProtocolError(
            ErrorCode.LIMIT_EXCEEDED,
            f"held {session.held} reservations and leases for more than {self._hold_timeout_s:g} s",
        )

    def _check_hold(self, session: Session) -> None:
        left = self._hold_left(session)
        if left is not None and left <= 0:
            raise self._hold_error(session)

    def _next_request(
        self, conn: socket.socket, header: memoryview, session: Session, arrival: select.poll
    ) -> bool:
        # Wait for the first byte under the idle timeout (shorter while the
        # connection holds reservations or leases), then read the rest of
        # the request under the I/O timeout and the request's deadline. A
        # connection holding grants is not cut for idleness: its client may
        # be copying into them (it is on this host: its death closes the socket).
        # The wait is a poll: the socket's receive timeout stays the I/O
        # timeout, with no system calls per request to switch it.
        left = self._hold_left(session)
        idle = _NO_IDLE_CUT_S if session.granted else self._idle_timeout_s
        wait = idle if left is None else max(min(left, idle), 1e-3)
        try:
            ready = arrival.poll(None if wait >= _NO_IDLE_CUT_S else math.ceil(wait * 1000))
            n = conn.recv_into(header, HEADER.size) if ready else -1
        except OSError as exc:
            logger.debug("data plane connection reset: %s", str(exc))
            return False
        if n < 0:
            if left is not None and left <= wait:
                raise self._hold_error(session)
            logger.debug("data plane connection idle for %.0f s", wait)
            return False
        if n == 0:
            return False
        self._watchdog.arm(conn)
        if n < HEADER.size:
            try:
                recv_exact_into(conn, header[n:])
            except PeerClosed as exc:
                raise ProtocolError(ErrorCode.MALFORMED, f"truncated header: {exc}") from exc
            except TimedOut as exc:
                raise ProtocolError(ErrorCode.MALFORMED, f"stalled header: {exc}") from exc
        return True

    def _send_error(self, conn: socket.socket, code: ErrorCode, message: str) -> None:
        # Best effort: the peer may be gone or not reading.
        try:
            set_send_timeout(conn, _ERROR_SEND_TIMEOUT_S)
            conn.sendall(encode_error(code, message))
            # Closing with unread input would reset the connection, and the
            # reset discards the ERROR before the peer reads it: half-close,
            # then read what the peer still sends, for a moment at most.
            conn.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + _ERROR_LINGER_S
            scratch = bytearray(64 << 10)
            for _ in range(_ERROR_LINGER_READS):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                set_recv_timeout(conn, left)
                if not conn.recv_into(scratch):
                    break
        except OSError:
            pass


def _peer_name(peer: object) -> str:
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer)
