"""The client side of the metadata service's framed socket (:mod:`kvdepot.wire.frames`).

A :class:`FrameLink` is one replica's socket: a few connections, each used
by one call at a time (a caller takes an idle one or opens one), answering
``Lookup`` and ``PutStart`` with the messages gRPC would carry. A reply's
status is raised as a :class:`FrameError`, a ``grpc.RpcError`` with the code,
details and error class gRPC would give, so the metadata client's failover
and error translation treat both paths alike.

A link learns its port from a gRPC reply's trailing metadata; until then,
and for a while after its socket failed (refused, reset, a broken frame),
calls go over gRPC. A timeout is not such a failure: a service too slow to
answer its socket is as slow over gRPC, and the call's deadline is spent.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import grpc

from kvdepot.errors import Unavailable
from kvdepot.rpc.auth import PROOF_BYTES, dataplane_proof
from kvdepot.rpc.errors import ERROR_TYPE_KEY
from kvdepot.wire import frames
from kvdepot.wire.sockets import TimedOut, recv_exact

MAX_IDLE = 8
"""Idle connections a link keeps (more concurrent callers open and close theirs)."""
DOWN_S = 5.0
"""After its socket failed, a link leaves calls to gRPC this long."""

_CODES = {code.value[0]: code for code in grpc.StatusCode}


class FrameError(grpc.RpcError):
    """A status a framed call ended with, as gRPC would raise it."""

    def __init__(self, code: grpc.StatusCode, details: str, error_type: str = "") -> None:
        super().__init__(details)
        self._code, self._details, self._error_type = code, details, error_type

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Any:  # gRPC's (key, value) pairs
        return ((ERROR_TYPE_KEY, self._error_type),) if self._error_type else ()


class FrameDown(Exception):
    """The socket cannot be used (refused, reset, a protocol error): use gRPC."""


class FrameLink:
    """One replica's framed socket.

    Args:
        host: The replica's host, as its gRPC endpoint names it.
        token: The cluster (or tenant) token to prove; empty: none.
    """

    def __init__(self, host: str, token: str) -> None:
        self.host = host
        self._token = token
        self.port = 0  # not known yet
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._down_until = 0.0
        self.calls = 0
        """Calls answered over the socket (for tests and benchmarks)."""

    def usable(self) -> bool:
        """Whether a call goes over the socket now."""
        return self.port != 0 and time.monotonic() >= self._down_until

    def learn(self, trailing: Any) -> None:
        """Take the port from a gRPC reply's trailing metadata, if it names one."""
        for key, value in trailing or ():
            if key == frames.PORT_KEY and str(value).isdigit():
                self.port = int(value)

    def call(self, method: str, request: Any, reply_type: Any, timeout_s: float) -> Any:
        """``method`` over the socket, within ``timeout_s``.

        Raises:
            FrameError: The service answered a status other than OK, or the
                deadline passed (DEADLINE_EXCEEDED).
            FrameDown: The socket failed; the call was not answered.
        """
        sock = self._checkout(timeout_s)
        ok = False
        try:
            sock.settimeout(max(timeout_s, 0.001))
            payload = request.SerializeToString()
            sock.sendall(frames.pack_request(frames.METHOD_BY_NAME[method], payload))
            status, error_type, body = self._read_reply(sock)
            ok = True
        except (TimeoutError, TimedOut):
            raise FrameError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except (OSError, Unavailable) as exc:
            self._down()
            raise FrameDown(str(exc)) from None
        finally:
            if ok:
                self._checkin(sock)
            else:
                sock.close()
        self.calls += 1
        if status != grpc.StatusCode.OK:
            raise FrameError(status, body.decode("utf-8", "replace"), error_type)
        reply = reply_type()
        reply.ParseFromString(body)
        return reply

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()

    # -- connections ----------------------------------------------------------------
    def _checkout(self, timeout_s: float) -> socket.socket:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        try:
            return self._connect(timeout_s)
        except (TimeoutError, TimedOut):
            raise FrameError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except (OSError, Unavailable, FrameDown) as exc:
            self._down()
            raise FrameDown(str(exc)) from None

    def _checkin(self, sock: socket.socket) -> None:
        with self._lock:
            if len(self._idle) < MAX_IDLE:
                self._idle.append(sock)
                return
        sock.close()

    def _down(self) -> None:
        # Learned again from the next gRPC reply (a restarted service may
        # listen elsewhere), used again once DOWN_S passed.
        self.port = 0
        self._down_until = time.monotonic() + DOWN_S

    def _connect(self, timeout_s: float) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=max(timeout_s, 0.001))
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            magic, version, auth = frames.HELLO.unpack(recv_exact(sock, frames.HELLO.size))
            if magic != frames.MAGIC or version != frames.VERSION:
                raise FrameDown(f"not a kvdepot metadata socket (version {version})")
            if auth:
                nonce = recv_exact(sock, frames.NONCE_BYTES)
                if not self._token:
                    raise FrameDown("the service wants a token")
                proof = dataplane_proof(self._token, nonce)
                assert len(proof) == PROOF_BYTES
                sock.sendall(proof)
                if recv_exact(sock, 1) != frames.ACCEPTED:
                    raise FrameDown("token refused")
        except BaseException:
            sock.close()
            raise
        return sock

    @staticmethod
    def _read_reply(sock: socket.socket) -> tuple[grpc.StatusCode, str, bytes]:
        length, status, name_len = frames.REPLY.unpack(recv_exact(sock, frames.REPLY.size))
        if length > frames.MAX_FRAME or status not in _CODES:
            raise OSError(f"malformed reply frame (status {status}, {length} bytes)")
        name = recv_exact(sock, name_len).decode("ascii", "replace") if name_len else ""
        return _CODES[status], name, recv_exact(sock, length)
