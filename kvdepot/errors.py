"""The one error hierarchy of kvdepot.

Every error raised to a caller is a :class:`KVDepotError`; the subclass says
what the caller should do about it. Third-party errors (gRPC, sockets) are
translated at the boundary (:func:`kvdepot.rpc.errors.from_grpc`, the
transport code).

This module imports nothing but the standard library, so every process (a
vLLM worker, a tool reading a config) can raise and catch these without
loading gRPC. Each class names its canonical RPC status (``rpc_status``, a
``google.rpc.Code`` name); :mod:`kvdepot.rpc.errors` maps it to gRPC's codes
and carries the class across gRPC, so that a client raises the class the
service raised.
"""

from __future__ import annotations

from typing import ClassVar


class KVDepotError(Exception):
    """Root of every error kvdepot raises."""

    rpc_status: ClassVar[str] = "UNKNOWN"
    """The RPC status a service answers this error with (a ``google.rpc.Code`` name)."""


class InvalidArgument(KVDepotError):
    """The request itself is wrong; retrying it unchanged will fail again."""

    rpc_status = "INVALID_ARGUMENT"


class NotFound(KVDepotError):
    """The chunk or node does not exist (a cache miss)."""

    rpc_status = "NOT_FOUND"


class CapacityExceeded(KVDepotError):
    """The store cannot fit the data even after evicting everything it may."""

    rpc_status = "RESOURCE_EXHAUSTED"


class Unavailable(KVDepotError):
    """A peer could not be reached or went away; retry elsewhere or later."""

    rpc_status = "UNAVAILABLE"


class Corrupt(KVDepotError):
    """Bytes failed their checksum or a frame was malformed; treat as a miss."""

    rpc_status = "DATA_LOSS"


class Unauthenticated(KVDepotError):
    """The peer refused us: no credentials, or wrong ones (token, certificate)."""

    rpc_status = "UNAUTHENTICATED"


class PermissionDenied(KVDepotError):
    """Authenticated, but these credentials may not do this (a tenant token)."""

    rpc_status = "PERMISSION_DENIED"


class NodeIdTaken(KVDepotError):
    """Another live store instance holds this node id: a duplicate ``--node-id``.

    Retrying does not help while that instance heartbeats; stop it, wait for
    its lease to run out, or take the id over on purpose (``--force-node-id``).
    """

    rpc_status = "ALREADY_EXISTS"

    def __init__(self, message: str, lease_remaining_s: float = 0.0) -> None:
        super().__init__(message)
        self.lease_remaining_s = lease_remaining_s
        """How long the holder's lease lasts unless it heartbeats again."""


class ClientClosed(InvalidArgument):
    """The client was closed; calls on it fail until a new client is made."""


class StaleRegistration(KVDepotError):
    """A heartbeat of a registration that has been replaced (its epoch is not the
    node's any more): another instance of the node id registered since."""

    rpc_status = "FAILED_PRECONDITION"
