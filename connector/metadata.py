"""A synchronous connection to one of several metadata replicas, with failover.

Metadata replicas are stateless over a shared index (Redis), so any of them
can answer any call: a call that cannot reach the current replica is retried
once on each of the others before the caller sees ``Unavailable``.

Errors keep the class the service raised (see :func:`kvdepot.grpc_errors.from_grpc`)
and name the replica that answered.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import grpc

from kvdepot.endpoints import parse_endpoints
from kvdepot.errors import ClientClosed, Unavailable
from kvdepot.grpc_errors import error_type_name, from_grpc
from kvdepot.proto.gen import metadata_pb2_grpc
from kvdepot.security import SecurityConfig
from kvdepot.security import channel as secure_channel

logger = logging.getLogger(__name__)

# CANCELLED: the replica stopped or died with the call in flight.
_RETRYABLE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
)


class MetadataConnection:
    """gRPC stubs for every replica; calls go to the current one.

    Args:
        spec: ``host:port[,host:port…]`` of the replicas.
        timeout_s: Deadline of each call.
        security: Token and TLS settings of the channels.
    """

    def __init__(self, spec: str, timeout_s: float, security: SecurityConfig | None = None) -> None:
        self.endpoints = parse_endpoints(spec)
        self._timeout_s = timeout_s
        options = [("grpc.max_receive_message_length", 64 << 20)]
        self._channels = [secure_channel(e, security, options) for e in self.endpoints]
        self._stubs = [metadata_pb2_grpc.MetadataStub(c) for c in self._channels]
        self._current = 0
        self._lock = threading.Lock()
        self._closed = False

    @property
    def current(self) -> str:
        """The replica calls go to now."""
        return self.endpoints[self._current]

    def call(self, method: str, request: Any) -> Any:
        """Call ``method`` on the current replica, failing over on UNAVAILABLE.

        Raises:
            KVDepotError: the translated status of the last attempt.
        """
        with self._lock:
            start = self._current
        n = len(self._stubs)
        last: grpc.RpcError | None = None
        last_idx = start
        for attempt in range(n):
            idx = (start + attempt) % n
            if self._closed:
                raise ClientClosed("the client is closed")
            try:
                reply = getattr(self._stubs[idx], method)(request, timeout=self._timeout_s)
            except ValueError:
                # grpc's "Cannot invoke RPC on closed channel!"
                if self._closed:
                    raise ClientClosed("the client is closed") from None
                raise
            except grpc.RpcError as exc:
                if exc.code() not in _RETRYABLE:
                    raise from_grpc(exc, f"metadata {self.endpoints[idx]} {method}") from None
                last, last_idx = exc, idx
                if n > 1:
                    logger.warning(
                        "metadata %s unreachable (%s); failing over",
                        self.endpoints[idx],
                        exc.code().name,
                    )
                continue
            if idx != start:
                with self._lock:
                    self._current = idx
            return reply
        assert last is not None
        raise self._unavailable(method, last, last_idx) from None

    def _unavailable(self, method: str, exc: grpc.RpcError, idx: int) -> Exception:
        if self._closed:
            return ClientClosed("the client is closed")
        error = from_grpc(exc)
        if error_type_name(exc) is not None:
            # The replica answered: its own service (the index) failed.
            where = f"metadata {self.endpoints[idx]}"
        else:
            where = f"metadata {', '.join(self.endpoints)}"
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            # gRPC says only "Deadline Exceeded".
            return Unavailable(f"{where}: no answer within {self._timeout_s:g} s (retry later)")
        if isinstance(error, Unavailable):
            return Unavailable(f"{where} unavailable: {error} (retry later)")
        return from_grpc(exc, f"{where} {method}")

    def wait_ready(self, timeout_s: float) -> bool:
        """Connect the current replica's channel now, waiting up to ``timeout_s``,
        so the first calls of a short deadline do not pay for the connection."""
        with self._lock:
            channel = self._channels[self._current]
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            return False
        return True

    def close(self) -> None:
        self._closed = True
        for channel in self._channels:
            channel.close()
