"""The ``auto`` transport: the fastest data plane each store can be reached by.

Per store address, decided once and remembered:

1. ``shm`` when the store runs on this host (same kernel boot id) and its
   arena file is the store's and this process may map it;
2. ``nixl`` where this host has RDMA devices (``/sys/class/infiniband`` is
   not empty), NIXL is importable and the store runs a NIXL agent;
3. ``tcp`` otherwise.

Deciding asks the store (its ATTACH says where its arena is): while a store
cannot be reached nothing is decided, the call fails, and a later one
decides. One transport of each kind serves every store, and all share one
record of stores that stopped answering
(:class:`~kvdepot.connector.transport.stall.Stalls`): a store that timed out
over one is tried over none until it answers again, and a timeout never
changes the choice, so once it answers it is reached the way it was (``shm``
on the same host), not over ``tcp`` from then on.

A store that restarts is handled by the chosen transport (``shm`` maps the new
arena generation). Should the chosen transport fail otherwise for an address
(the store came back without a shared arena, say), the choice is made again
and the failed items are retried once with it (:meth:`AutoTransport._route`,
the one fallback of every call): puts are idempotent (a chunk already stored
is EXISTS) and reads have no effects.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvdepot.connector.transport.base import (
    GetItem,
    GetOutcome,
    GetStatus,
    IndexingTransport,
    PutItem,
    PutStatus,
    Transport,
)
from kvdepot.connector.transport.shm import ShmTransport
from kvdepot.connector.transport.stall import PROBE_TIMEOUT_S, Stalls, log_failure
from kvdepot.connector.transport.tcp import TcpTransport
from kvdepot.errors import InvalidArgument, KVDepotError, Unavailable
from kvdepot.keys import ChunkKey
from kvdepot.rpc.security_config import SecurityConfig
from kvdepot.wire.host import rdma_devices
from kvdepot.wire.protocol import IndexCode, IndexSettled, ProtocolLimits

logger = logging.getLogger(__name__)

_R = TypeVar("_R")
_S = TypeVar("_S")

NixlFactory = Callable[[], Transport | None]
"""Creates the NIXL transport, or ``None`` where it cannot run."""

Attempt = Callable[[Transport, list[int] | None], list[_R]]
"""Runs a call's items (those at the indices; ``None``: all) with a transport."""


def _default_nixl(
    security: SecurityConfig | None = None,
    connect_timeout_s: float = 5.0,
    io_timeout_s: float = 30.0,
    max_idle_per_peer: int = 4,
    limits: ProtocolLimits | None = None,
    stalls: Stalls | None = None,
) -> Transport | None:
    if not rdma_devices():
        return None
    try:
        from kvdepot.connector.transport.nixl import NixlTransport, nixl_available
    except ImportError:
        return None
    if not nixl_available():
        return None
    try:
        return NixlTransport(
            connect_timeout_s,
            io_timeout_s,
            max_idle_per_peer,
            limits=limits,
            security=security,
            stalls=stalls,
        )
    except KVDepotError as exc:
        logger.warning("NIXL is installed but its agent cannot start: %s", str(exc))
        return None


def _sub(seq: Sequence[_S], idx: list[int] | None) -> Sequence[_S]:
    return seq if idx is None else [seq[i] for i in idx]


def _put_failed(status: PutStatus) -> bool:
    return status is PutStatus.FAILED


def _get_failed(outcome: GetOutcome) -> bool:
    return outcome.status is GetStatus.FAILED


def _failed_get(exc: BaseException) -> GetOutcome:
    return GetOutcome(GetStatus.FAILED, 0, f"transport: {exc}")


class AutoTransport(IndexingTransport):
    """Routes each store address to ``shm``, ``nixl`` or ``tcp``.

    Args:
        connect_timeout_s: Time allowed to connect to a store.
        io_timeout_s: Time a transfer may stall.
        max_idle_per_peer: Idle connections kept per store and transport.
        limits: The stores' protocol limits.
        shm: Whether same-host stores may be reached through shared memory.
        nixl: Creates the NIXL transport (called at most once, on the first
            address that is not on this host); ``None`` never uses NIXL. The
            default uses it where RDMA devices exist and NIXL is importable.
        security: The token every data-plane connection proves it holds,
            and the gRPC settings of NIXL's ``GetTransferInfo``.

    Raises:
        InvalidArgument: If a timeout is not positive.
    """

    name = "auto"

    def __init__(
        self,
        connect_timeout_s: float = 5.0,
        io_timeout_s: float = 30.0,
        max_idle_per_peer: int = 4,
        *,
        limits: ProtocolLimits | None = None,
        shm: bool = True,
        nixl: NixlFactory | None = _default_nixl,
        security: SecurityConfig | None = None,
    ) -> None:
        if connect_timeout_s <= 0 or io_timeout_s <= 0:
            raise InvalidArgument("transport timeouts must be positive")
        token = security.tokens().token if security is not None else ""
        self._stalls = Stalls(min(io_timeout_s, PROBE_TIMEOUT_S), token)
        timeouts = (connect_timeout_s, io_timeout_s, max_idle_per_peer)
        self._tcp = TcpTransport(*timeouts, limits=limits, security=security, stalls=self._stalls)
        self._shm = (
            ShmTransport(*timeouts, limits=limits, security=security, stalls=self._stalls)
            if shm
            else None
        )
        if nixl is _default_nixl:
            nixl = functools.partial(_default_nixl, security, *timeouts, limits, self._stalls)
        self._nixl_factory = nixl
        self._nixl: Transport | None = None
        self._nixl_tried = False
        self._lock = threading.Lock()
        self._choice: dict[str, Transport] = {}
        self._closed = False

    def choice(self, address: str) -> str:
        """The name of the transport used for ``address`` (deciding it if needed).

        Raises:
            Unavailable: Nothing is decided and the store cannot be reached.
        """
        return self._pick(address).name

    def stalled(self, address: str) -> bool:
        """Whether the store stopped answering; see :meth:`Transport.stalled`."""
        if self._stalls.stalled(address):
            return True
        with self._lock:
            nixl = self._nixl  # one a factory made with its own record
        return nixl is not None and nixl.stalled(address)

    def reserves_first(self, address: str) -> bool:
        """As the transport chosen for ``address`` (``False`` while nothing can
        be decided); see :meth:`Transport.reserves_first`."""
        try:
            return self._pick(address).reserves_first(address)
        except Unavailable:
            return False

    def _pick(self, address: str) -> Transport:
        if self._closed:
            raise InvalidArgument("transport is closed")
        with self._lock:
            chosen = self._choice.get(address)
        if chosen is not None:
            return chosen
        chosen = self._decide(address)
        with self._lock:
            return self._choice.setdefault(address, chosen)

    def _decide(self, address: str) -> Transport:
        # usable() raises where the store cannot say (unreachable, stalled):
        # nothing is remembered then.
        if self._shm is not None and self._shm.usable(address):
            logger.info("data plane to %s: shm", address)
            return self._shm
        nixl = self._nixl_transport()
        if nixl is not None and nixl.usable(address):
            logger.info("data plane to %s: nixl", address)
            return nixl
        logger.info("data plane to %s: tcp", address)
        return self._tcp

    def _nixl_transport(self) -> Transport | None:
        with self._lock:
            if self._nixl_tried:
                return self._nixl
            self._nixl_tried = True
        created = self._nixl_factory() if self._nixl_factory is not None else None
        with self._lock:
            self._nixl = created
        return created

    def _route(
        self,
        address: str,
        n: int,
        attempt: Attempt[_R],
        failed: Callable[[_R], bool],
        failure: Callable[[BaseException], _R],
    ) -> list[_R]:
        """The one way every call goes: ``attempt`` of the call's ``n`` items
        with the transport chosen for ``address``; those ``failed`` are
        retried once with the transport chosen again, unless the store
        stalled (it is tried no more in this call, and keeps its choice) or
        ``tcp`` failed (there is nothing to fall back to)."""
        try:
            t = self._pick(address)
        except Unavailable as exc:
            log_failure(logger, "choosing a data plane", address, exc)
            return [failure(exc)] * n
        results = attempt(t, None)
        retry = [i for i, r in enumerate(results) if failed(r)]
        if not retry or t is self._tcp or t.stalled(address):
            return results
        with self._lock:
            if self._choice.get(address) is t:
                del self._choice[address]
        try:
            again = self._pick(address)
        except Unavailable as exc:
            log_failure(logger, "choosing a data plane again", address, exc)
            return results  # a later call decides, once the store answers
        if again is not t:
            logger.warning("data plane to %s failed over %s; now %s", address, t.name, again.name)
        for i, r in zip(retry, attempt(again, retry), strict=True):
            results[i] = r
        return results

    def put(self, address: str, items: Sequence[PutItem]) -> list[PutStatus]:
        """Write chunks with the transport chosen for ``address``; see :meth:`Transport.put`."""

        def attempt(t: Transport, idx: list[int] | None) -> list[PutStatus]:
            return t.put(address, _sub(items, idx))

        return self._route(address, len(items), attempt, _put_failed, lambda _: PutStatus.FAILED)

    def put_whole(
        self, address: str, keys: Sequence[ChunkKey], views: Sequence[memoryview]
    ) -> list[PutStatus]:
        """Write whole chunks validated by the caller; see :meth:`Transport.put_whole`."""
        if len(keys) != len(views):
            raise InvalidArgument(f"{len(keys)} keys but {len(views)} buffers")

        def attempt(t: Transport, idx: list[int] | None) -> list[PutStatus]:
            return t.put_whole(address, _sub(keys, idx), _sub(views, idx))

        return self._route(address, len(keys), attempt, _put_failed, lambda _: PutStatus.FAILED)

    def put_indexed(
        self, address: str, items: Sequence[PutItem], writer: int = 0
    ) -> tuple[list[PutStatus], list[IndexCode]]:
        """Write chunks with the transport chosen for ``address``, the store
        indexing them; see :meth:`IndexingTransport.put_indexed`."""

        def attempt(t: Transport, idx: list[int] | None) -> list[tuple[PutStatus, IndexCode]]:
            sub = _sub(items, idx)
            if isinstance(t, IndexingTransport):
                return list(zip(*t.put_indexed(address, sub, writer), strict=True))
            return [(s, IndexCode.NOT_INDEXED) for s in t.put(address, sub)]

        return self._indexed(address, len(items), attempt)

    def put_whole_indexed(
        self,
        address: str,
        keys: Sequence[ChunkKey],
        views: Sequence[memoryview],
        writer: int = 0,
    ) -> tuple[list[PutStatus], list[IndexCode]]:
        """:meth:`put_indexed` of whole chunks validated by the caller."""
        if len(keys) != len(views):
            raise InvalidArgument(f"{len(keys)} keys but {len(views)} buffers")

        def attempt(t: Transport, idx: list[int] | None) -> list[tuple[PutStatus, IndexCode]]:
            k, v = _sub(keys, idx), _sub(views, idx)
            if isinstance(t, IndexingTransport):
                return list(zip(*t.put_whole_indexed(address, k, v, writer), strict=True))
            return [(s, IndexCode.NOT_INDEXED) for s in t.put_whole(address, k, v)]

        return self._indexed(address, len(keys), attempt)

    def _indexed(
        self, address: str, n: int, attempt: Attempt[tuple[PutStatus, IndexCode]]
    ) -> tuple[list[PutStatus], list[IndexCode]]:
        pairs = self._route(
            address,
            n,
            attempt,
            lambda r: r[0] is PutStatus.FAILED,
            lambda _: (PutStatus.FAILED, IndexCode.NOT_INDEXED),
        )
        return [s for s, _ in pairs], [x for _, x in pairs]

    def sync_index(self, address: str, writer: int, wait_s: float) -> IndexSettled:
        """Ask the store through the chosen transport (each counts the
        commits it pipelined; the store counts per writer whatever carried
        them), ``tcp`` where that one cannot; see
        :meth:`IndexingTransport.sync_index`."""
        t = self._pick(address)
        if not isinstance(t, IndexingTransport):
            t = self._tcp
        return t.sync_index(address, writer, wait_s)

    def get_into(self, address: str, items: Sequence[GetItem]) -> list[GetOutcome]:
        """Read chunks with the transport chosen for ``address``; see :meth:`Transport.get_into`."""

        def attempt(t: Transport, idx: list[int] | None) -> list[GetOutcome]:
            return t.get_into(address, _sub(items, idx))

        return self._route(address, len(items), attempt, _get_failed, _failed_get)

    def get_whole(
        self, address: str, keys: Sequence[ChunkKey], views: Sequence[memoryview]
    ) -> list[GetOutcome]:
        """Read whole chunks with the transport chosen for ``address``; see
        :meth:`Transport.get_whole`."""
        if len(keys) != len(views):
            raise InvalidArgument(f"{len(keys)} keys but {len(views)} buffers")

        def attempt(t: Transport, idx: list[int] | None) -> list[GetOutcome]:
            return t.get_whole(address, _sub(keys, idx), _sub(views, idx))

        return self._route(address, len(keys), attempt, _get_failed, _failed_get)

    def delete(self, address: str, keys: Sequence[ChunkKey]) -> list[bool]:
        """Delete chunks with the chosen transport (``tcp`` while nothing is
        decided); see :meth:`Transport.delete`."""
        try:
            t = self._pick(address)
        except Unavailable:
            t = self._tcp  # fails as fast, saying nothing was removed
        return t.delete(address, keys)

    def close(self) -> None:
        """Close every transport this one created."""
        self._closed = True
        self._tcp.close()
        if self._shm is not None:
            self._shm.close()
        with self._lock:
            nixl = self._nixl
        if nixl is not None:
            nixl.close()
        self._stalls.close()
