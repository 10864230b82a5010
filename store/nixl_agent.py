"""The store's NIXL agent: the arena registered for one-sided RDMA READ/WRITE.

NVIDIA NIXL (UCX inside: RDMA verbs, NVLink, TCP, shared memory) lets a
client write into and read out of the store's arena without the store's CPU
touching the bytes. The store only registers its arena once and publishes
its agent metadata (over gRPC, ``Store.GetTransferInfo``); reservations,
leases, commits and checksum verification stay on the data-plane control
connection (:mod:`kvdepot.store.session`).

NIXL is loaded and agents are started by :mod:`kvdepot.wire.nixl`.

One-sided transfers over UCX's TCP transport need the target to progress its
worker: while clients attached as NIXL hold reservations or leases (a
transfer may be in flight), a thread polls the agent.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from kvdepot.errors import Unavailable
from kvdepot.store.arena import Arena
from kvdepot.wire.nixl import create_agent

logger = logging.getLogger(__name__)

_POLL_IDLE_S = 0.5
_POLL_BUSY_S = 0.0002


@dataclass(frozen=True, slots=True)
class NixlArenaInfo:
    """What a client needs to address the arena through NIXL.

    Attributes:
        agent_name: The store agent's name.
        agent_metadata: Its metadata, for the client's ``add_remote_agent``.
        arena_address: Virtual address of the arena in the store's process.
        arena_size: Bytes of the arena.
    """

    agent_name: str
    agent_metadata: bytes
    arena_address: int
    arena_size: int


class StoreNixlAgent:
    """The store's agent with the arena registered as DRAM.

    Args:
        arena: The arena to register.
        name: Agent name, unique in the cluster (the node id and generation).

    Raises:
        Unavailable: NIXL is not usable here.
    """

    def __init__(self, arena: Arena, name: str) -> None:
        self._agent = create_agent(name)
        self._name = name
        address = arena.address
        try:
            self._registration = self._agent.register_memory(
                [(address, arena.capacity, 0, "")], "DRAM"
            )
            metadata = bytes(self._agent.get_agent_metadata())
        except Exception as exc:
            raise Unavailable(f"cannot register the arena with NIXL: {exc}") from exc
        self.info = NixlArenaInfo(name, metadata, address, arena.capacity)
        self._held = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(
            target=self._progress_loop, name="kvdepot-nixl-progress", daemon=True
        )
        self._thread.start()
        logger.info("NIXL agent %s registered the arena (%d bytes)", name, arena.capacity)

    def on_held(self, delta: int) -> None:
        """Told how many more (or fewer) items NIXL clients hold (see Session)."""
        with self._cond:
            self._held += delta
            if self._held > 0:
                self._cond.notify_all()

    def _progress_loop(self) -> None:
        while True:
            with self._cond:
                if self._stopping:
                    return
                if self._held <= 0:
                    self._cond.wait(_POLL_IDLE_S)
                    continue
            try:
                # Drives UCX's worker: one-sided ops over TCP need the target to.
                self._agent.get_new_notifs()
            except Exception:
                logger.exception("NIXL progress failed")
            with self._cond:
                self._cond.wait(_POLL_BUSY_S)

    def close(self) -> None:
        """Stop progressing and deregister the arena (before it is unmapped)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(5.0)
        try:
            self._agent.deregister_memory(self._registration)
        except Exception as exc:
            logger.warning("NIXL deregistration failed: %s", exc)
