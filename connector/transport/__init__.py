"""Data plane transports, by name.

``tcp`` (kvdepot's framed protocol over sockets) and ``shm`` (same-host
shared memory) are always available, ``nixl`` (one-sided RDMA through NVIDIA
NIXL) where the ``kvdepot[rdma]`` extra is installed, and ``auto`` picks one
of them per store: shm on the same host, nixl where RDMA devices exist, tcp
otherwise. A transport is created by name from configuration::

    transport = create_transport("auto", io_timeout_s=10.0)

The layers, each importing only those below it: ``base`` (the interface:
:class:`Transport`, :class:`IndexingTransport`, items and outcomes);
``stream`` (connections to a store's socket, the work items become, the
answers a connection is owed); ``pipeline``, ``stall`` (stores that stopped
answering) and ``pool`` (idle connections); then ``tcp`` (with
``tcp_pool``) beside ``control``, ``arena``, ``shm`` and ``nixl``; ``auto``
on top, routing to them.
"""

from __future__ import annotations

from collections.abc import Callable

from kvdepot.connector.transport.auto import AutoTransport
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
from kvdepot.connector.transport.tcp import TcpTransport
from kvdepot.registry import Registry

TransportFactory = Callable[..., Transport]
"""Builds a transport from keyword arguments (its constructor, typically)."""

TRANSPORTS: Registry[TransportFactory] = Registry("transport")
"""The transports, by name."""
TRANSPORTS.register("tcp", TcpTransport)
TRANSPORTS.register("shm", ShmTransport)
TRANSPORTS.register("auto", AutoTransport)
TRANSPORTS.register("nixl", "kvdepot.connector.transport.nixl:NixlTransport")


def register_transport(name: str, factory: TransportFactory | str) -> None:
    """Make a transport (a factory, or its ``"module:attr"`` path) available under ``name``.

    Raises:
        InvalidArgument: If ``name`` is empty or registered already.
    """
    TRANSPORTS.register(name, factory)


def available_transports() -> list[str]:
    """Names of the registered transports, sorted."""
    return TRANSPORTS.names()


def create_transport(name: str, **kwargs: object) -> Transport:
    """Create the transport registered under ``name``.

    Args:
        name: A registered name, e.g. ``"tcp"``.
        **kwargs: Passed to the transport's factory.

    Raises:
        InvalidArgument: If no transport is registered under ``name``.
        Unavailable: If the transport's module cannot be loaded.
    """
    return TRANSPORTS.get(name)(**kwargs)


__all__ = [
    "TRANSPORTS",
    "AutoTransport",
    "GetItem",
    "GetOutcome",
    "GetStatus",
    "IndexingTransport",
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
