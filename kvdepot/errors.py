"""The one error hierarchy of kvdepot.

Every error raised to a caller is a :class:`KVDepotError`; the subclass says
what the caller should do about it. Third-party errors (gRPC, sockets) are
translated at the boundary with :func:`from_grpc` and the transport code.

An error keeps its class across gRPC: a service answers with the class's
status code and names the class in the trailing metadata
(:data:`ERROR_TYPE_KEY`, see :func:`kvdepot.request_guard.abort_with`), so
that :func:`from_grpc` raises the same subclass where two share a code.
"""

from __future__ import annotations

import grpc


class KVDepotError(Exception):
    """Root of every error kvdepot raises."""

    grpc_code: grpc.StatusCode = grpc.StatusCode.UNKNOWN


class InvalidArgument(KVDepotError):
    """The request itself is wrong; retrying it unchanged will fail again."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(KVDepotError):
    """The chunk or node does not exist (a cache miss)."""

    grpc_code = grpc.StatusCode.NOT_FOUND


class CapacityExceeded(KVDepotError):
    """The store cannot fit the data even after evicting everything it may."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(KVDepotError):
    """A peer could not be reached or went away; retry elsewhere or later."""

    grpc_code = grpc.StatusCode.UNAVAILABLE


class Corrupt(KVDepotError):
    """Bytes failed their checksum or a frame was malformed; treat as a miss."""

    grpc_code = grpc.StatusCode.DATA_LOSS


class Unauthenticated(KVDepotError):
    """The peer refused us: no credentials, or wrong ones (token, certificate)."""

    grpc_code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(KVDepotError):
    """Authenticated, but these credentials may not do this (a tenant token)."""

    grpc_code = grpc.StatusCode.PERMISSION_DENIED


class NodeIdTaken(KVDepotError):
    """Another live store instance holds this node id: a duplicate ``--node-id``.

    Retrying does not help while that instance heartbeats; stop it, wait for
    its lease to run out, or take the id over on purpose (``--force-node-id``).
    """

    grpc_code = grpc.StatusCode.ALREADY_EXISTS

    def __init__(self, message: str, lease_remaining_s: float = 0.0) -> None:
        super().__init__(message)
        self.lease_remaining_s = lease_remaining_s
        """How long the holder's lease lasts unless it heartbeats again."""


class ClientClosed(InvalidArgument):
    """The client was closed; calls on it fail until a new client is made."""


class StaleRegistration(KVDepotError):
    """A heartbeat of a registration that has been replaced (its epoch is not the
    node's any more): another instance of the node id registered since."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION


ERROR_TYPE_KEY = "kvdepot-error"
"""Trailing metadata key of a kvdepot service's error status: the class name."""

_BY_NAME: dict[str, type[KVDepotError]] = {
    cls.__name__: cls
    for cls in (
        KVDepotError,
        InvalidArgument,
        NotFound,
        CapacityExceeded,
        Unavailable,
        Corrupt,
        Unauthenticated,
        PermissionDenied,
        NodeIdTaken,
        StaleRegistration,
    )
}

# For a status without the class's name: a peer that is not a kvdepot
# service, or gRPC's own (a dead connection, a deadline, a shutdown).
_BY_CODE: dict[grpc.StatusCode, type[KVDepotError]] = {
    cls.grpc_code: cls for cls in _BY_NAME.values() if cls is not KVDepotError
}
_BY_CODE[grpc.StatusCode.DEADLINE_EXCEEDED] = Unavailable
# A server that stops (or dies) with calls in flight cancels them.
_BY_CODE[grpc.StatusCode.CANCELLED] = Unavailable
_BY_CODE[grpc.StatusCode.FAILED_PRECONDITION] = InvalidArgument


def error_type_name(exc: grpc.RpcError) -> str | None:
    """The kvdepot class a service named in ``exc``'s trailing metadata, if any."""
    trailing_metadata = getattr(exc, "trailing_metadata", None)
    if trailing_metadata is None:
        return None
    try:
        trailing = trailing_metadata() or ()
    except Exception:  # a call object that never got a status
        return None
    for key, value in trailing:
        if key == ERROR_TYPE_KEY:
            return value if isinstance(value, str) else value.decode("ascii", "replace")
    return None


def from_grpc(exc: grpc.RpcError, what: str = "") -> KVDepotError:
    """Translate a gRPC error into the matching :class:`KVDepotError`.

    The class the service named, where it did and kvdepot knows it; else the
    one of the status code.
    """
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    cls = _BY_NAME.get(error_type_name(exc) or "") or _BY_CODE.get(code, KVDepotError)
    prefix = f"{what}: " if what else ""
    return cls(f"{prefix}{details or code.name}")
