"""The ``auto`` transport: the fastest data plane each store can be reached by.

Per store address, decided once and remembered:

1. ``shm`` when the store runs on this host (same kernel boot id) and its
   arena file is the store's and this process may map it;
2. ``nixl`` where this host has RDMA devices (``/sys/class/infiniband`` is
   not empty), NIXL is importable and the store runs a NIXL agent;
3. ``tcp`` otherwise.

A store that restarts is handled by the chosen transport (``shm`` maps the new
arena generation). Should the chosen transport fail outright for an address
(the store came back without a shared arena, say), the choice is forgotten,
made again, and the failed items are retried once with the new choice: puts
are idempotent (a chunk already stored is EXISTS) and reads have no effects.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence

from kvdepot.connector.transport.base import GetItem, GetOutcome, PutItem, PutStatus, Transport
from kvdepot.connector.transport.shm import ShmTransport
from kvdepot.connector.transport.tcp import TcpTransport
from kvdepot.errors import InvalidArgument, KVDepotError
from kvdepot.keys import ChunkKey
from kvdepot.rpc.security_config import SecurityConfig
from kvdepot.wire.host import rdma_devices
from kvdepot.wire.protocol import IndexCode, IndexSettled, ProtocolLimits

logger = logging.getLogger(__name__)

NixlFactory = Callable[[], Transport | None]
"""Creates the NIXL transport, or ``None`` where it cannot run."""


def _default_nixl(security: SecurityConfig | None = None) -> Transport | None:
    if not rdma_devices():
        return None
    try:
        from kvdepot.connector.transport.nixl import NixlTransport, nixl_available
    except ImportError:
        return None
    if not nixl_available():
        return None
    try:
        return NixlTransport(security=security)
    except KVDepotError as exc:
        logger.warning("NIXL is installed but its agent cannot start: %s", str(exc))
        return None


class AutoTransport(Transport):
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
        self._tcp = TcpTransport(
            connect_timeout_s, io_timeout_s, max_idle_per_peer, limits=limits, security=security
        )
        self._shm = (
            ShmTransport(
                connect_timeout_s, io_timeout_s, max_idle_per_peer, limits=limits, security=security
            )
            if shm
            else None
        )
        if nixl is _default_nixl:
            nixl = functools.partial(_default_nixl, security)
        self._nixl_factory = nixl
        self._nixl: Transport | None = None
        self._nixl_tried = False
        self._lock = threading.Lock()
        self._choice: dict[str, Transport] = {}
        self._closed = False

    def choice(self, address: str) -> str:
        """The name of the transport used for ``address`` (deciding it if needed)."""
        t = self._pick(address)
        if t is self._shm:
            return "shm"
        if t is self._tcp:
            return "tcp"
        return "nixl"

    def _pick(self, address: str) -> Transport:
        if self._closed:
            raise InvalidArgument("transport is closed")
        with self._lock:
            chosen = self._choice.get(address)
        if chosen is not None:
            return chosen
        chosen = self._decide(address)
        with self._lock:
            self._choice[address] = chosen
        return chosen

    def _decide(self, address: str) -> Transport:
        if self._shm is not None and self._shm.usable(address):
            logger.info("data plane to %s: shm", address)
            return self._shm
        nixl = self._nixl_transport()
        usable = getattr(nixl, "usable", None)
        if nixl is not None and callable(usable) and usable(address):
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

    def _forget(self, address: str, failed: Transport) -> Transport:
        with self._lock:
            if self._choice.get(address) is failed:
                del self._choice[address]
        again = self._pick(address)
        if again is not failed:
            logger.warning("data plane to %s failed; now using %s", address, self.choice(address))
        return again

    def put(self, address: str, items: Sequence[PutItem]) -> list[PutStatus]:
        """Write chunks with the transport chosen for ``address``; see :meth:`Transport.put`."""
        t = self._pick(address)
        statuses = t.put(address, items)
        if t is self._tcp or PutStatus.FAILED not in statuses:
            return statuses
        again = self._forget(address, t)
        retry = [i for i, s in enumerate(statuses) if s is PutStatus.FAILED]
        for i, s in zip(retry, again.put(address, [items[i] for i in retry]), strict=True):
            statuses[i] = s
        return statuses

    def put_indexed(
        self, address: str, items: Sequence[PutItem], writer: int = 0
    ) -> tuple[list[PutStatus], list[IndexCode]]:
        """Write chunks with the transport chosen for ``address``, the store
        indexing them; see :meth:`Transport.put_indexed`."""
        t = self._pick(address)
        statuses, indexed = t.put_indexed(address, items, writer)
        if t is self._tcp or PutStatus.FAILED not in statuses:
            return statuses, indexed
        again = self._forget(address, t)
        retry = [i for i, s in enumerate(statuses) if s is PutStatus.FAILED]
        st, ix = again.put_indexed(address, [items[i] for i in retry], writer)
        for i, s, x in zip(retry, st, ix, strict=True):
            statuses[i], indexed[i] = s, x
        return statuses, indexed

    def sync_index(self, address: str, writer: int, wait_s: float) -> IndexSettled | None:
        """Ask over the store's socket (any transport's deferred chunks are
        counted per writer), through the chosen transport where it pipelines
        commits; see :meth:`Transport.sync_index`."""
        t = self._pick(address)
        if t is self._shm:
            return t.sync_index(address, writer, wait_s)
        return self._tcp.sync_index(address, writer, wait_s)

    def get_into(self, address: str, items: Sequence[GetItem]) -> list[GetOutcome]:
        """Read chunks with the transport chosen for ``address``; see :meth:`Transport.get_into`."""
        t = self._pick(address)
        outcomes = t.get_into(address, items)
        failed = [i for i, o in enumerate(outcomes) if o.error.startswith("transport")]
        if t is self._tcp or not failed:
            return outcomes
        again = self._forget(address, t)
        for i, o in zip(failed, again.get_into(address, [items[i] for i in failed]), strict=True):
            outcomes[i] = o
        return outcomes

    def get_whole(
        self, address: str, keys: Sequence[ChunkKey], views: Sequence[memoryview]
    ) -> list[GetOutcome]:
        """Read whole chunks with the transport chosen for ``address``; see
        :meth:`Transport.get_whole`."""
        t = self._pick(address)
        outcomes = t.get_whole(address, keys, views)
        failed = [i for i, o in enumerate(outcomes) if o.error.startswith("transport")]
        if t is self._tcp or not failed:
            return outcomes
        again = self._forget(address, t)
        retried = again.get_whole(address, [keys[i] for i in failed], [views[i] for i in failed])
        for i, o in zip(failed, retried, strict=True):
            outcomes[i] = o
        return outcomes

    def delete(self, address: str, keys: Sequence[ChunkKey]) -> list[bool]:
        """Delete chunks (over the store's socket); see :meth:`Transport.delete`."""
        return self._tcp.delete(address, keys)

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
