"""A store's lease with the metadata service: registration, heartbeats, failover.

The store registers (with its inventory) and then heartbeats; the metadata
service lists it, and clients find it, while its lease lasts. A refusal that
retrying cannot change ends the lease (and the store); a service that does
not answer is retried with backoff, over every replica, for as long as the
store runs, each kind of failure logged once and then with a count.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from kvdepot.errors import (
    InvalidArgument,
    KVDepotError,
    NodeIdTaken,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from kvdepot.metadata_client import AsyncMetadataClient
from kvdepot.proto.gen import common_pb2, metadata_pb2
from kvdepot.repeat_log import RepeatLog
from kvdepot.retry import Backoff
from kvdepot.rpc.errors import error_type_name
from kvdepot.rpc.health import HealthState
from kvdepot.types import LEASE_REMAINING_KEY, TIER_BY_CODE

logger = logging.getLogger(__name__)

# A node id held by an instance that no longer heartbeats (a store restarted
# without its SSD directory) is waited for, until its lease runs out; a lease
# whose end moved later by more than this was renewed: the holder is alive.
RENEWED_SLACK_S = 0.5
# Attempts to reach an unanswering metadata service back off up to this
# (or the retry delay, if longer): well inside a lease.
RETRY_CAP_S = 2.0

# One inventory page may take this long to be indexed (the service renews
# the lease with every page, so a slow page does not expire the node).
PAGE_TIMEOUT_S = 10.0

InventoryColumns = tuple[bytes, list[int], bytes]
"""One page of chunks as RegisterInventory carries them: keys, sizes, tiers."""

_UNPAGED_STEP = 65536  # chunks taken from the inventory at a time for an unpaged registration

_TOKEN_HINT = "; give it the cluster token (--auth-token-file / KVDEPOT_AUTH_TOKEN)"
# Refusals of a registration that retrying cannot change, and what they raise.
_REFUSALS: dict[grpc.StatusCode, tuple[type[KVDepotError], str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (InvalidArgument, ""),
    grpc.StatusCode.UNAUTHENTICATED: (Unauthenticated, _TOKEN_HINT),
    grpc.StatusCode.PERMISSION_DENIED: (PermissionDenied, ""),
    grpc.StatusCode.UNIMPLEMENTED: (
        Unavailable,
        " (is that address a kvdepot metadata service?)",
    ),
}


def _chunk_refs(columns: list[InventoryColumns]) -> list[common_pb2.ChunkRef]:
    """Pages of columns as the ChunkRef messages of an unpaged RegisterNode."""
    refs = []
    for keys, sizes, tiers in columns:
        for j, size in enumerate(sizes):
            tier = TIER_BY_CODE[tiers[j]] if tiers else "cpu"
            refs.append(common_pb2.ChunkRef(key=keys[16 * j : 16 * (j + 1)], size=size, tier=tier))
    return refs


def _lease_remaining(exc: grpc.aio.AioRpcError) -> float | None:
    """Seconds left of the holder's lease, from a refused RegisterNode."""
    # grpc.aio's Metadata iterates (key, value) pairs, whatever the stubs say.
    trailing: Any = exc.trailing_metadata() or ()
    for key, value in trailing:
        if key == LEASE_REMAINING_KEY:
            with contextlib.suppress(ValueError):
                return max(0.0, int(value) / 1000)
    return None


class MetadataLease:
    """This store's registration with the metadata service(s), kept alive.

    Args:
        node_id: The store's node id.
        endpoints: The metadata replicas' addresses, one channel each.
        channels: Their channels (the caller closes them).
        health: Set SERVING while the lease holds.
        registration: The RegisterNode request of this moment; ``force``,
            ``paged`` and nothing else is set here.
        inventory: The store's chunks of this moment, in pages of at most
            the given number (checked again as each page is built, so a
            page never names a chunk the store no longer holds).
        heartbeat: The Heartbeat request of this moment; ``epoch`` is set here.
        retry_s: Base delay between attempts that found no service; it
            doubles with each round of replicas that all failed, up to
            ``RETRY_CAP_S`` (or ``retry_s`` if longer).
        force: Take the node id over at the first registration.
        answered: Called (on the loop) each time the service answered a
            registration or heartbeat: what waited for it to answer again
            (the index commits the store owes) goes on. Must not block.
        heartbeat_answered: Called (on the loop) with each heartbeat's answer
            (its inventory digest check: :mod:`kvdepot.store.reconcile`).
            Must not block.
    """

    def __init__(
        self,
        *,
        node_id: str,
        endpoints: list[str],
        channels: list[grpc.aio.Channel],
        health: HealthState,
        registration: Callable[[], metadata_pb2.RegisterNodeRequest],
        inventory: Callable[[int], Iterator[InventoryColumns]],
        heartbeat: Callable[[], metadata_pb2.HeartbeatRequest],
        retry_s: float,
        force: bool = False,
        answered: Callable[[], None] | None = None,
        heartbeat_answered: Callable[[metadata_pb2.HeartbeatResponse], None] | None = None,
    ) -> None:
        self.node_id = node_id
        self.client = AsyncMetadataClient(
            endpoints, channels, Backoff(retry_s, max(retry_s, RETRY_CAP_S))
        )
        self._health = health
        self._registration = registration
        self._inventory = inventory
        self._heartbeat = heartbeat
        self._retry_s = retry_s
        # Taking the node id over from a live instance is asked at start only:
        # never again once registered, so two forcing stores cannot flap.
        self._force = force
        self._on_answered = answered
        self._on_heartbeat = heartbeat_answered
        # The epoch of this instance's registration (0 before the first);
        # heartbeats carry it, so that a replaced registration is never renewed.
        self.epoch = 0
        self.heartbeat_s = 1.0
        self.lease_s = 5.0  # until the metadata service tells its lease
        self.registered = asyncio.Event()  # set at the first registration
        # Set while the index holds this store's whole inventory; cleared while
        # a registration's pages are still going (removal reports wait for it,
        # so that no page names a chunk again after its removal was reported).
        self.settled = asyncio.Event()
        # The pages still to send of a registration under way, and the one in
        # flight (sent again after a failure, to any replica).
        self._pages: Iterator[InventoryColumns] | None = None
        self._page: metadata_pb2.RegisterInventoryRequest | None = None
        self._sent_chunks = 0
        self._repeats = RepeatLog(logger)
        # Where this store stands now.
        self._holds = False  # registered and not told otherwise since
        self._failures = 0  # attempts in a row that found no service
        self._last_ok = time.monotonic()
        # The end of another instance's lease on our node id, while we wait for it.
        self._held_until: float | None = None
        self._waited_from = 0.0

    @property
    def endpoint(self) -> str:
        return self.client.endpoint

    @property
    def holds(self) -> bool:
        """Whether this store is registered now (and was not told otherwise since)."""
        return self._holds

    async def run(self) -> None:
        """Hold the lease until cancelled; raise why this store cannot.

        Raises:
            KVDepotError: A refusal that retrying cannot change (see
                :meth:`StoreDaemon.wait`).
        """
        while True:
            try:
                await self._renew()
            except grpc.aio.AioRpcError as exc:
                delay = self._refused(exc)
                if delay is None:
                    delay = self._outage(exc)
                    lost_s = time.monotonic() - self._last_ok
                    if lost_s > self.lease_s:
                        # Our lease has run out: the cluster no longer sees this node.
                        await self._health.set(
                            False, f"no metadata service for {lost_s:.1f} s: {exc.code().name}"
                        )
                if delay:
                    await asyncio.sleep(delay)
                continue
            self._answered()
            await self._health.set(True, "holds a metadata lease")
            await asyncio.sleep(self.heartbeat_s)

    async def _renew(self) -> None:
        """Register (when not registered), send the next inventory pages, or
        heartbeat, once."""
        if self._holds:
            request = self._heartbeat()
            request.epoch = self.epoch
            reply = await self.client.heartbeat(request, max(1.0, self.heartbeat_s * 2))
            if reply.lease_ttl_ms:
                self.lease_s = reply.lease_ttl_ms / 1000
            if self._on_heartbeat is not None:
                self._on_heartbeat(reply)
            return
        if self._pages is None:
            await self._begin()
        if self._pages is not None:
            await self._send_pages()
        self._holds = True
        logger.info(
            "registered with metadata %s (%d chunks, epoch %d)",
            self.endpoint,
            self._sent_chunks,
            self.epoch,
            extra={
                "event": "registered",
                "node": self.node_id,
                "chunks": self._sent_chunks,
                "epoch": self.epoch,
            },
        )
        self.settled.set()
        self.registered.set()

    async def _begin(self) -> None:
        """RegisterNode; leaves the pages to send in ``_pages`` (None: none)."""
        self.settled.clear()
        registration = self._registration()
        registration.force = self._force
        registration.paged = True
        answer = await self.client.register_node(registration, PAGE_TIMEOUT_S)
        self._force = False
        self._held_until = None
        self.epoch = answer.epoch
        self.heartbeat_s = max(0.05, answer.heartbeat_interval_ms / 1000)
        if answer.lease_ttl_ms:
            self.lease_s = answer.lease_ttl_ms / 1000
        self._page = None
        self._sent_chunks = 0
        if answer.max_page_chunks:
            self._pages = self._inventory(answer.max_page_chunks)
            return
        # A service that predates paging ignored `paged` (and knows no
        # RegisterInventory): the inventory goes in the message, as before.
        columns = list(self._inventory(_UNPAGED_STEP))
        registration.paged = False
        registration.inventory.extend(_chunk_refs(columns))
        answer = await self.client.register_node(registration, PAGE_TIMEOUT_S)
        self.epoch = answer.epoch
        self._sent_chunks = len(registration.inventory)
        self._pages = None  # nothing more to send

    async def _send_pages(self) -> None:
        """Send the registration's pages in turn; a failed one is sent again
        at the next attempt (the service takes a page twice as once)."""
        assert self._pages is not None
        while True:
            if self._page is None:
                columns = next(self._pages, None)
                keys, sizes, tiers = columns if columns is not None else (b"", [], b"")
                self._page = metadata_pb2.RegisterInventoryRequest(
                    node_id=self.node_id,
                    epoch=self.epoch,
                    keys=keys,
                    sizes=sizes,
                    tiers=tiers,
                    last=columns is None,
                )
            reply = await self.client.register_inventory(self._page, PAGE_TIMEOUT_S)
            if reply.lease_ttl_ms:
                self.lease_s = reply.lease_ttl_ms / 1000
            self._last_ok = time.monotonic()
            self._sent_chunks = reply.chunks
            if self._page.last:
                self._pages = self._page = None
                return
            self._page = None

    def _restart_registration(self) -> None:
        self._holds = False
        self._pages = self._page = None

    def _fail_over(self) -> None:
        # Replicas share the index: any of them can take our heartbeats.
        if self.client.fail_over():
            self._repeats.failed(
                "failover", logging.WARNING, "failing over to metadata %s", self.endpoint
            )

    def _refused(self, exc: grpc.aio.AioRpcError) -> float | None:
        """What a refusal of the service means: the delay before the next
        attempt, or ``None`` for a failure to retry with backoff.

        Raises:
            KVDepotError: A refusal that retrying cannot change.
        """
        code = exc.code()
        if code == grpc.StatusCode.NOT_FOUND:
            # Our lease expired or the index was lost: re-announce.
            self._repeats.failed(
                "forgotten", logging.WARNING, "metadata forgot this node; registering again"
            )
            self._restart_registration()
            return 0.0
        if code == grpc.StatusCode.ALREADY_EXISTS and not self._holds:
            return self._node_id_held(exc)
        if code == grpc.StatusCode.FAILED_PRECONDITION and (self._holds or self._pages):
            # Our registration was replaced (the id was taken over): this
            # instance no longer owns it. Registering again is refused while
            # the other instance lives, which stops us.
            logger.error(
                "metadata %s refused this store's heartbeat: %s",
                self.endpoint,
                exc.details(),
                extra={"event": "heartbeat_refused", "node": self.node_id},
            )
            self._restart_registration()
            return 0.0
        fatal = _REFUSALS.get(code)
        if fatal is not None and not self._holds:
            # The request is ours and will not change: retrying it is
            # refused forever (INVALID_ARGUMENT); a token, or the service at
            # that address, is fixed until a restart. Once this store has
            # served, it keeps its chunks for the clients that reach it.
            cls, hint = fatal
            if code == grpc.StatusCode.INVALID_ARGUMENT or not self.registered.is_set():
                raise cls(
                    f"metadata {self.endpoint} refused store {self.node_id!r}: "
                    f"{exc.details() or code.name}{hint}"
                ) from None
        return None

    def _node_id_held(self, exc: grpc.aio.AioRpcError) -> float:
        # Another instance holds the node id. Serving under it would corrupt
        # the index: fatal (see wait()), unless its lease is running out
        # unrenewed (it crashed or stopped).
        now = time.monotonic()
        remaining = _lease_remaining(exc)
        if remaining is not None and self._held_until is None:
            self._held_until, self._waited_from = now + remaining, now
            logger.info(
                "node id %s is held by another instance; waiting up to %.1f s "
                "for its lease to run out",
                self.node_id,
                remaining,
            )
        if (
            remaining is None
            or self._held_until is None
            or now + remaining > self._held_until + RENEWED_SLACK_S
            or now - self._waited_from > remaining + self.lease_s + 10
        ):
            raise NodeIdTaken(
                f"metadata {self.endpoint} refused store {self.node_id}: {exc.details()}"
            ) from None
        return min(self._retry_s, remaining + 0.05)

    def _outage(self, exc: grpc.aio.AioRpcError) -> float:
        """Log a failed attempt (at most one line per kind and interval, with
        a count) and fail over; returns the delay before the next attempt."""
        code = exc.code()
        extra = {"event": "metadata_unreachable", "node": self.node_id, "code": code.name}
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            self._repeats.failed(
                "refused",
                logging.ERROR,
                "metadata %s refused this store (%s: %s)%s",
                self.endpoint,
                code.name,
                exc.details(),
                _TOKEN_HINT,
                extra=extra,
            )
        else:
            self._repeats.failed(
                "unreachable",
                logging.WARNING,
                "metadata %s unreachable (%s: %s)",
                self.endpoint,
                code.name,
                exc.details(),
                extra=extra,
            )
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            self._fail_over()
        self._failures += 1
        delay = self.client.delay(self._failures)
        if code == grpc.StatusCode.UNAVAILABLE and error_type_name(exc) == "Unavailable":
            # The service answered: its index is down. Asked again at the
            # heartbeats' pace (no more calls than a lease makes anyway), not
            # backed off: an index back empty learns of this store within a
            # heartbeat, not up to RETRY_CAP_S later, when puts fail for want
            # of a registered store.
            delay = min(delay, self.heartbeat_s)
        return delay

    def _answered(self) -> None:
        self._last_ok = time.monotonic()
        self._failures = 0
        if self._on_answered is not None:
            self._on_answered()
        for kind in ("failover", "forgotten"):
            self._repeats.ended(kind)
        for kind in ("unreachable", "refused"):
            ended = self._repeats.ended(kind)
            if ended is not None:
                logger.info(
                    "metadata %s answers again, after %d failed attempts in %.1f s",
                    self.endpoint,
                    ended[0],
                    ended[1],
                    extra={"event": "metadata_reachable", "node": self.node_id},
                )
