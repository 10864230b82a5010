"""Data plane transports, by name.

``tcp`` (kvdepot's framed protocol over sockets) and ``shm`` (same-host
shared memory) are always available, ``nixl`` (one-sided RDMA through NVIDIA
NIXL) where the ``kvdepot[rdma]`` extra is installed, and ``auto`` picks one
of them per store: shm on the same host, nixl where RDMA devices exist, tcp
otherwise. A transport is created by name from configuration::

    transport = create_transport("auto", io_timeout_s=10.0)
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvdepot.connector.transport.auto import AutoTransport
from kvdepot.connector.transport.base import (
    GetItem,
    GetOutcome,
    PutItem,
    PutStatus,
    Transport,
)
from kvdepot.connector.transport.shm import ShmTransport
from kvdepot.connector.transport.tcp import TcpTransport
from kvdepot.errors import InvalidArgument, Unavailable

TransportFactory = Callable[..., Transport]
"""Builds a transport from keyword arguments (its constructor, typically)."""

_lock = threading.Lock()
_registry: dict[str, TransportFactory] = {}


def register_transport(name: str, factory: TransportFactory) -> None:
    """Make a transport available under ``name``; a later registration replaces it.

    Raises:
        InvalidArgument: If ``name`` is empty.
    """
    if not name:
        raise InvalidArgument("transport name must not be empty")
    with _lock:
        _registry[name] = factory


def available_transports() -> list[str]:
    """Names of the registered transports, sorted."""
    with _lock:
        return sorted(_registry)


def create_transport(name: str, **kwargs: object) -> Transport:
    """Create the transport registered under ``name``.

    Args:
        name: A registered name, e.g. ``"tcp"``.
        **kwargs: Passed to the transport's factory.

    Raises:
        InvalidArgument: If no transport is registered under ``name``.
    """
    with _lock:
        factory = _registry.get(name)
        known = sorted(_registry)
    if factory is None:
        raise InvalidArgument(f"unknown transport {name!r}; known: {', '.join(known)}")
    return factory(**kwargs)


def _create_nixl(**kwargs: object) -> Transport:
    try:
        from kvdepot.connector.transport.nixl import NixlTransport
    except ImportError as exc:  # pragma: no cover - the module itself has no hard deps
        raise Unavailable(f"the nixl transport cannot be loaded: {exc}") from exc
    return NixlTransport(**kwargs)  # type: ignore[arg-type]


register_transport("tcp", TcpTransport)
register_transport("shm", ShmTransport)
register_transport("auto", AutoTransport)
register_transport("nixl", _create_nixl)

__all__ = [
    "AutoTransport",
    "GetItem",
    "GetOutcome",
    "PutItem",
    "PutStatus",
    "ShmTransport",
    "TcpTransport",
    "Transport",
    "TransportFactory",
    "available_transports",
    "create_transport",
    "register_transport",
]
