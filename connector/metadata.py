"""A synchronous connection to one of several metadata replicas, with failover.

Metadata replicas are stateless over a shared index (Redis), so any of them
can answer any call: a call that cannot reach the current replica is retried
once on each of the others before the caller sees ``Unavailable``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import grpc

from kvdepot.errors import InvalidArgument, from_grpc
from kvdepot.proto.gen import metadata_pb2_grpc
from kvdepot.security import SecurityConfig
from kvdepot.security import channel as secure_channel

logger = logging.getLogger(__name__)

_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def parse_endpoints(spec: str) -> list[str]:
    """Split ``"host:port[,host:port…]"`` into addresses, validating each."""
    endpoints = [e.strip() for e in spec.split(",") if e.strip()]
    if not endpoints:
        raise InvalidArgument("no metadata address given")
    for e in endpoints:
        host, sep, port = e.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidArgument(f"metadata address {e!r} must be host:port")
    return endpoints


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
        for attempt in range(n):
            idx = (start + attempt) % n
            try:
                reply = getattr(self._stubs[idx], method)(request, timeout=self._timeout_s)
            except grpc.RpcError as exc:
                if exc.code() not in _RETRYABLE:
                    raise from_grpc(exc, f"metadata {method}") from None
                last = exc
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
        raise from_grpc(last, f"metadata {method} ({', '.join(self.endpoints)})") from None

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
        for channel in self._channels:
            channel.close()
