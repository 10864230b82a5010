"""Loading NIXL and starting an agent, for both ends of the NIXL data plane.

UCX takes its configuration (``UCX_NET_DEVICES``, ``UCX_TLS``, ...) from the
environment the operator starts the process with; this module sets none of
it. What it decides for the host goes in the backend's parameters instead:
on hosts without RDMA devices peer-failure error handling is off (UCX's
shared-memory transports reject transfers with it on).
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

from kvdepot.errors import Unavailable
from kvdepot.wire.host import rdma_devices


def nixl_available() -> bool:
    """Whether NIXL is installed (checked without loading its libraries)."""
    try:
        return importlib.util.find_spec("nixl") is not None
    except (ImportError, ValueError):
        return False


def load_nixl() -> Any:
    """Import NIXL's API; return its module.

    Raises:
        Unavailable: NIXL is not installed or does not load.
    """
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
