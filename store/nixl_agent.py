"""The store's NIXL agent: the arena registered for one-sided RDMA READ/WRITE.

NVIDIA NIXL (UCX inside: RDMA verbs, NVLink, TCP, shared memory) lets a
client write into and read out of the store's arena without the store's CPU
touching the bytes. The store only registers its arena once and publishes
its agent metadata (over gRPC, ``Store.GetTransferInfo``); reservations,
leases, commits and checksum verification stay on the data-plane control
connection (:mod:`kvdepot.store.session`).

UCX reads its configuration from the environment when it loads, so
:func:`load_nixl` sets safe defaults (only where the operator set nothing)
before importing NIXL:

* ``UCX_MODULES`` excludes the InfiniBand/EFA modules on hosts without RDMA
  devices: the bundled libraries crash at process exit otherwise, and they
  have nothing to drive there;
* on such hosts peer-failure error handling is off (UCX's shared-memory
  transports reject transfers with it on).

One-sided transfers over UCX's TCP transport need the target to progress its
worker: while clients attached as NIXL hold reservations or leases (a
transfer may be in flight), a thread polls the agent.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

from kvdepot.errors import Unavailable
from kvdepot.store.arena import Arena
from kvdepot.store.host import rdma_devices

logger = logging.getLogger(__name__)

NO_RDMA_UCX_MODULES = "^ib,ib_mlx5,ib_efa,rdmacm"
"""UCX modules left out where the host has no RDMA device."""

_POLL_IDLE_S = 0.5
_POLL_BUSY_S = 0.0002


def nixl_available() -> bool:
    """Whether NIXL is installed (checked without loading its libraries)."""
    try:
        return importlib.util.find_spec("nixl") is not None
    except (ImportError, ValueError):
        return False


def load_nixl() -> Any:
    """Import NIXL's API after setting UCX defaults for this host; return its module.

    Raises:
        Unavailable: NIXL is not installed or does not load.
    """
    if not rdma_devices():
        os.environ.setdefault("UCX_MODULES", NO_RDMA_UCX_MODULES)
    try:
        from nixl import _api
    except Exception as exc:  # ImportError, or a bundled library failing to load
        raise Unavailable(f"NIXL is not usable here: {exc}") from exc
    _tame_nixl_logging()
    return _api


def _tame_nixl_logging() -> None:
    # NIXL logs to stdout through a handler of its own: stdout carries a
    # daemon's READY line and a benchmark's JSON. Its records go the way of
    # the process's own logging instead (stderr).
    nixl_logger = logging.getLogger("nixl")
    for handler in list(nixl_logger.handlers):
        nixl_logger.removeHandler(handler)
    nixl_logger.propagate = True


def backend_params() -> dict[str, str]:
    """Parameters of the UCX backend for this host."""
    if rdma_devices():
        return {}
    return {"ucx_error_handling_mode": "none"}


def create_agent(name: str) -> Any:
    """A NIXL agent named ``name`` with the UCX backend.

    Raises:
        Unavailable: NIXL is not usable or its UCX backend does not start.
    """
    api = load_nixl()
    try:
        # No NIXL progress thread: it polls UCX without pause, a whole core
        # even while nothing moves. Initiators progress while they wait for
        # their transfers; the store's own loop progresses while NIXL
        # clients hold reservations or leases (StoreNixlAgent).
        agent = api.nixl_agent(
            name, api.nixl_agent_config(enable_prog_thread=False, backends=[])
        )
        agent.create_backend("UCX", backend_params())
    except Exception as exc:
        raise Unavailable(f"cannot start a NIXL agent with UCX: {exc}") from exc
    return agent


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
