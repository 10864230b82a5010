"""The metadata service's framed socket (:mod:`kvdepot.wire.frames`), served on its loop.

Each connection is one task of the service's event loop: the same loop, the
same servicer and index as the gRPC calls, so a call answered here is exactly
the gRPC call's answer (the servicer's handler runs with a context whose
``abort`` ends the call with a status frame). A tenant's keys are moved into
its key space first, as the gRPC interceptor does. Anything malformed (a bad
proof, an unknown method, an oversized or unparsable frame) closes the
connection; the client then uses gRPC, which says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

import grpc

from kvdepot.proto.gen import metadata_pb2
from kvdepot.rpc.auth import (
    CLUSTER,
    PROOF_BYTES,
    Authenticator,
    Principal,
    RefusalLog,
    tenant_key,
)
from kvdepot.rpc.errors import ERROR_TYPE_KEY
from kvdepot.shutdown import cancel_and_wait
from kvdepot.wire import frames
from kvdepot.wire.frames import Method

logger = logging.getLogger(__name__)

MAX_CONNECTIONS = 4096
"""Connections served at once; more are closed at accept."""
HANDSHAKE_TIMEOUT_S = 5.0
"""A connection that has not proven its token within this is closed."""

Handler = Callable[[Any, Any], Awaitable[Any]]


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, error_type: str) -> None:
        super().__init__(details)
        self.code, self.details, self.error_type = code, details, error_type


class _Context:
    """What the servicer's handlers use of a gRPC context: ``abort``."""

    async def abort(
        self,
        code: grpc.StatusCode,
        details: str = "",
        trailing_metadata: tuple[tuple[str, str], ...] = (),
    ) -> NoReturn:
        error_type = next((v for k, v in trailing_metadata if k == ERROR_TYPE_KEY), "")
        raise _Aborted(code, details, error_type)

    def set_trailing_metadata(self, _: Any) -> None:
        return None


class FrameServer:
    """Serves ``Lookup`` and ``PutStart`` of ``servicer`` on a TCP listener.

    Args:
        servicer: The gRPC servicer whose handlers answer.
        auth: Checks proofs; ``None`` (or one without tokens) requires none.
    """

    def __init__(self, servicer: Any, auth: Authenticator | None) -> None:
        self._handlers: dict[Method, tuple[type[Any], Handler]] = {
            Method.LOOKUP: (metadata_pb2.LookupRequest, servicer.Lookup),
            Method.PUT_START: (metadata_pb2.PutStartRequest, servicer.PutStart),
        }
        self._auth = auth if auth is not None and auth.required else None
        self._refusals = RefusalLog("metadata frames")
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: a free port); returns the bound port."""
        self._server = await asyncio.start_server(self._accept, host, port, limit=1 << 16)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        await cancel_and_wait(list(self._tasks), "metadata frames connections")

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is None or len(self._tasks) >= MAX_CONNECTIONS:
            writer.close()
            return
        self._tasks.add(task)
        try:
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # Not asyncio.wait_for: in Python 3.11 it swallows a cancellation
            # that lands as the handshake completes, and a closed server served on.
            async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
                principal = await self._handshake(reader, writer)
            if principal is not None:
                await self._serve(reader, writer, principal)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass  # the client went away (or never proved itself): nothing to answer
        except asyncio.CancelledError:
            # The service is stopping. Ended quietly: asyncio's stream callback
            # logs a connection task that ends cancelled as an ERROR with its
            # traceback (Python 3.11), one per open connection.
            writer.close()
            return
        finally:
            self._tasks.discard(task)
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()

    async def _handshake(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> Principal | None:
        if self._auth is None:
            writer.write(frames.pack_hello(None))
            await writer.drain()
            return CLUSTER
        nonce = secrets.token_bytes(frames.NONCE_BYTES)
        writer.write(frames.pack_hello(nonce))
        await writer.drain()
        proof = await reader.readexactly(PROOF_BYTES)
        principal = self._auth.verify_proof(nonce, proof)
        if principal is None:
            peer = writer.get_extra_info("peername")
            self._refusals.refuse(str(peer[0]) if peer else "unknown", "wrong token")
            return None
        writer.write(frames.ACCEPTED)
        await writer.drain()
        return principal

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, principal: Principal
    ) -> None:
        context = _Context()
        while True:
            length, method_code = frames.REQUEST.unpack(
                await reader.readexactly(frames.REQUEST.size)
            )
            if length > frames.MAX_FRAME or method_code not in self._handlers:
                return  # not a client of this protocol: close
            request_type, handler = self._handlers[Method(method_code)]
            request = request_type()
            try:
                request.ParseFromString(await reader.readexactly(length))
            except Exception:  # protobuf's DecodeError, or worse: not a client of ours
                return
            if principal.tenant:
                mapped = [tenant_key(principal.tenant, k) for k in request.keys]
                del request.keys[:]
                request.keys.extend(mapped)
            writer.write(await self._call(handler, request, context))
            await writer.drain()

    @staticmethod
    async def _call(handler: Handler, request: Any, context: _Context) -> bytes:
        try:
            reply = await handler(request, context)
        except _Aborted as exc:
            return frames.pack_reply(exc.code.value[0], exc.details.encode(), exc.error_type)
        except Exception as exc:  # as gRPC would: the caller gets UNKNOWN, the log the cause
            logger.exception("metadata frames call failed")
            return frames.pack_reply(grpc.StatusCode.UNKNOWN.value[0], str(exc).encode())
        return frames.pack_reply(grpc.StatusCode.OK.value[0], reply.SerializeToString())
