"""The metadata service's clients: synchronous for engines, asynchronous for stores.

Metadata replicas are stateless over a shared index (Redis), so any of them
can answer any call. Both clients keep a channel per replica and send each
call to the one in use; a call that cannot reach it moves on to the next
(failover), the way an injected :class:`~kvdepot.retry.RetryPolicy` (the
synchronous client: an engine's, a store's index committer) or
:class:`~kvdepot.retry.Backoff` (the store's lease) says, never by a loop
written at the call site.

The synchronous client raises kvdepot's errors, with the class the service
raised (see :func:`kvdepot.rpc.errors.from_grpc`) and the replica that
answered. The asynchronous one leaves gRPC's errors to its caller, the store's
lease, which reads their codes and trailing metadata (a held node id's
remaining lease) to decide what a refusal means.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from kvdepot.endpoints import parse_endpoints, split_endpoint
from kvdepot.errors import ClientClosed, Unavailable
from kvdepot.metadata_frames import FrameDown, FrameLink
from kvdepot.proto.gen import metadata_pb2 as pb
from kvdepot.proto.gen import metadata_pb2_grpc
from kvdepot.repeat_log import RepeatLog
from kvdepot.retry import Backoff, RetryPolicy
from kvdepot.rpc.errors import error_type_name, from_grpc
from kvdepot.rpc.security import channel as secure_channel
from kvdepot.rpc.security_config import SecurityConfig
from kvdepot.wire import frames

logger = logging.getLogger(__name__)

# Codes after which another replica (or a later try) may answer. CANCELLED:
# the replica stopped or died with the call in flight.
RETRYABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)
_MAX_MESSAGE = 64 << 20
_FRAME_REPLIES: dict[str, Any] = {"Lookup": pb.LookupResponse, "PutStart": pb.PutStartResponse}


class Replicas:
    """The replicas' addresses and the one calls go to now (thread-safe)."""

    def __init__(self, endpoints: list[str]) -> None:
        self.endpoints = endpoints
        self._current = 0
        self._lock = threading.Lock()

    @property
    def current(self) -> int:
        with self._lock:
            return self._current

    def order(self) -> list[int]:
        """Every replica once, the current one first."""
        start, n = self.current, len(self.endpoints)
        return [(start + i) % n for i in range(n)]

    def use(self, index: int) -> None:
        """Send the next calls to replica ``index`` (it answered)."""
        with self._lock:
            self._current = index

    def fail_over(self) -> None:
        with self._lock:
            self._current = (self._current + 1) % len(self.endpoints)


class MetadataClient:
    """The synchronous metadata client: typed calls with replica failover.

    Engines call through it, and so do a store's data-plane threads when
    they commit what they stored into the index.

    Args:
        spec: ``host:port[,host:port…]`` of the replicas.
        timeout_s: Deadline of each attempt (a call's own ``timeout_s``,
            where given, bounds all of its attempts together).
        security: Token and TLS settings of the channels (the token the
            calls present, the CA that verifies the replicas).
        retry: How often a call tries the replicas before it raises
            ``Unavailable``; by default each once, without waiting.
        sleep: Waits between rounds (tests give a recorder).
        frames: Send ``Lookup`` and ``PutStart`` over the replicas' framed
            sockets (:mod:`kvdepot.metadata_frames`) where they offer one;
            never with TLS.
    """

    def __init__(
        self,
        spec: str,
        timeout_s: float,
        security: SecurityConfig | None = None,
        *,
        retry: RetryPolicy | None = None,
        sleep: Callable[[float], None] = time.sleep,
        frames: bool = True,
    ) -> None:
        self.replicas = Replicas(parse_endpoints(spec))
        self.endpoints = self.replicas.endpoints
        self.retry = retry or RetryPolicy()
        self._timeout_s = timeout_s
        self._sleep = sleep
        options = [("grpc.max_receive_message_length", _MAX_MESSAGE)]
        self._channels = [secure_channel(e, security, options) for e in self.endpoints]
        self._stubs = [metadata_pb2_grpc.MetadataStub(c) for c in self._channels]
        self.links: list[FrameLink] = []
        if frames and not (security is not None and security.tls_enabled):
            token = security.tokens().token if security is not None else ""
            self.links = [FrameLink(split_endpoint(e)[0], token) for e in self.endpoints]
        self._closed = False
        # Callers on many threads meet one outage at once: a line per
        # failover would bury the log.
        self._repeats = RepeatLog(logger)
        self._failed_over = False  # a failover was logged since the last answer

    @property
    def current(self) -> str:
        """The replica calls go to now."""
        return self.endpoints[self.replicas.current]

    # -- the calls an engine makes ----------------------------------------------
    def put_start(
        self, request: pb.PutStartRequest, *, timeout_s: float | None = None
    ) -> pb.PutStartResponse:
        reply: pb.PutStartResponse = self.call("PutStart", request, timeout_s=timeout_s)
        return reply

    def put_end(self, request: pb.PutEndRequest) -> pb.PutEndResponse:
        reply: pb.PutEndResponse = self.call("PutEnd", request)
        return reply

    def put_revoke(self, request: pb.PutRevokeRequest) -> pb.PutRevokeResponse:
        reply: pb.PutRevokeResponse = self.call("PutRevoke", request)
        return reply

    def lookup(
        self, request: pb.LookupRequest, *, timeout_s: float | None = None
    ) -> pb.LookupResponse:
        reply: pb.LookupResponse = self.call("Lookup", request, timeout_s=timeout_s)
        return reply

    def get_stats(self) -> pb.ClusterStats:
        reply: pb.ClusterStats = self.call("GetStats", pb.GetStatsRequest())
        return reply

    # -- failover -----------------------------------------------------------------
    def call(self, method: str, request: Any, *, timeout_s: float | None = None) -> Any:
        """Call ``method``, failing over across replicas as the policy says.

        The same request message goes to every attempt (a PutStart's
        ``request_id`` lets the replica that answers hand back what one that
        died allocated for it).

        Args:
            method: The Metadata service's method.
            request: Its request message.
            timeout_s: Longest the whole call may take, every attempt and
                wait between rounds included; each attempt's deadline is the
                client's or what is left of this, whichever is shorter. No
                limit beyond the policy's rounds by default.

        Raises:
            KVDepotError: the translated status of the last attempt.
        """
        until = None if timeout_s is None else time.monotonic() + timeout_s
        last: tuple[grpc.RpcError, int, float] | None = None
        for rounds in range(self.retry.rounds):
            if rounds:
                delay = self.retry.backoff.delay(rounds)
                if until is not None and time.monotonic() + delay >= until:
                    break  # no time for another round
                self._sleep(delay)
            for idx in self.replicas.order():
                attempt_s = self._timeout_s
                if until is not None:
                    attempt_s = min(attempt_s, until - time.monotonic())
                    if attempt_s <= 0:
                        break
                try:
                    reply = self._attempt(idx, method, request, attempt_s)
                except grpc.RpcError as exc:
                    if exc.code() not in RETRYABLE:
                        raise from_grpc(exc, f"metadata {self.endpoints[idx]} {method}") from None
                    last = (exc, idx, attempt_s)
                    self._failing_over(idx, exc)
                    continue
                self.replicas.use(idx)
                if self._failed_over:
                    self._failed_over = False
                    self._repeats.ended("failover")
                return reply
        if last is None:
            raise Unavailable(
                f"metadata {', '.join(self.endpoints)}: no time left for {method} (retry later)"
            )
        raise self._unavailable(method, *last) from None

    def _failing_over(self, idx: int, exc: grpc.RpcError) -> None:
        if len(self.endpoints) > 1:
            self._failed_over = True
            self._repeats.failed(
                "failover",
                logging.WARNING,
                "metadata %s unreachable (%s); failing over",
                self.endpoints[idx],
                exc.code().name,
            )

    def _attempt(self, idx: int, method: str, request: Any, timeout_s: float) -> Any:
        if self._closed:
            raise ClientClosed("the client is closed")
        link = self.links[idx] if self.links and method in frames.METHOD_BY_NAME else None
        try:
            if link is not None:
                if link.usable():
                    with contextlib.suppress(FrameDown):  # gRPC answers this one
                        return link.call(method, request, _FRAME_REPLIES[method], timeout_s)
                elif link.port == 0:
                    stub = getattr(self._stubs[idx], method)
                    reply, call = stub.with_call(request, timeout=timeout_s)
                    link.learn(call.trailing_metadata())
                    return reply
            return getattr(self._stubs[idx], method)(request, timeout=timeout_s)
        except ValueError:
            # grpc's "Cannot invoke RPC on closed channel!"
            if self._closed:
                raise ClientClosed("the client is closed") from None
            raise

    def _unavailable(
        self, method: str, exc: grpc.RpcError, idx: int, timeout_s: float
    ) -> Exception:
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
            return Unavailable(f"{where}: no answer within {timeout_s:.3g} s (retry later)")
        if isinstance(error, Unavailable):
            return Unavailable(f"{where} unavailable: {error} (retry later)")
        return from_grpc(exc, f"{where} {method}")

    def wait_ready(self, timeout_s: float) -> bool:
        """Connect the current replica's channel now, waiting up to ``timeout_s``,
        so the first calls of a short deadline do not pay for the connection."""
        channel = self._channels[self.replicas.current]
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            return False
        return True

    def close(self) -> None:
        self._closed = True
        for link in self.links:
            link.close()
        for channel in self._channels:
            channel.close()


class AsyncMetadataClient:
    """The store daemon's metadata client: typed calls to the replica in use.

    One attempt per call: the caller (the lease, which retries for as long
    as the store runs) decides what a failure means, moves on with
    :meth:`fail_over` and waits :meth:`delay` between attempts.

    Args:
        endpoints: The replicas' addresses.
        channels: One channel per replica (the caller closes them).
        backoff: The wait after each round of attempts that found no replica.
    """

    def __init__(
        self, endpoints: list[str], channels: list[grpc.aio.Channel], backoff: Backoff
    ) -> None:
        self.replicas = Replicas(endpoints)
        self.backoff = backoff
        self._stubs = [metadata_pb2_grpc.MetadataStub(c) for c in channels]

    @property
    def endpoint(self) -> str:
        """The replica calls go to now."""
        return self.replicas.endpoints[self.replicas.current]

    def fail_over(self) -> bool:
        """Send the next calls to the next replica; whether there is another."""
        if len(self.replicas.endpoints) < 2:
            return False
        self.replicas.fail_over()
        return True

    def delay(self, failures: int) -> float:
        """The wait after ``failures`` attempts in a row found no replica:
        each replica is tried at the base delay, each round that all of them
        failed backs off further."""
        return self.backoff.delay(failures // len(self.replicas.endpoints) + 1)

    def _stub(self) -> Any:
        return self._stubs[self.replicas.current]

    async def register_node(
        self, request: pb.RegisterNodeRequest, timeout_s: float
    ) -> pb.RegisterNodeResponse:
        reply: pb.RegisterNodeResponse = await self._stub().RegisterNode(request, timeout=timeout_s)
        return reply

    async def register_inventory(
        self, request: pb.RegisterInventoryRequest, timeout_s: float
    ) -> pb.RegisterInventoryResponse:
        reply: pb.RegisterInventoryResponse = await self._stub().RegisterInventory(
            request, timeout=timeout_s
        )
        return reply

    async def heartbeat(
        self, request: pb.HeartbeatRequest, timeout_s: float
    ) -> pb.HeartbeatResponse:
        reply: pb.HeartbeatResponse = await self._stub().Heartbeat(request, timeout=timeout_s)
        return reply

    async def report_removed(
        self, request: pb.ReportRemovedRequest, timeout_s: float
    ) -> pb.ReportRemovedResponse:
        reply: pb.ReportRemovedResponse = await self._stub().ReportRemoved(
            request, timeout=timeout_s
        )
        return reply

    async def report_moved(
        self, request: pb.ReportMovedRequest, timeout_s: float
    ) -> pb.ReportMovedResponse:
        reply: pb.ReportMovedResponse = await self._stub().ReportMoved(request, timeout=timeout_s)
        return reply


__all__ = ["RETRYABLE", "AsyncMetadataClient", "MetadataClient", "Replicas"]
