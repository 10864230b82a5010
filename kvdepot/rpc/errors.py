"""kvdepot errors across gRPC: status codes, and the class carried in trailing metadata.

A service answers a :class:`~kvdepot.errors.KVDepotError` with the status its
class names (:func:`status_code`) and the class's name in the trailing
metadata under :data:`ERROR_TYPE_KEY` (:func:`error_metadata`, sent by
:func:`kvdepot.rpc.request_guard.abort_with`); :func:`from_grpc` raises the same
subclass on the client, also where two classes share a code. This is the only
place that ties the error classes to gRPC, so that :mod:`kvdepot.errors`
imports no gRPC.
"""

from __future__ import annotations

import grpc

from kvdepot.errors import (
    CapacityExceeded,
    Corrupt,
    InvalidArgument,
    KVDepotError,
    NodeIdTaken,
    NotFound,
    PermissionDenied,
    StaleRegistration,
    Unauthenticated,
    Unavailable,
)

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
    grpc.StatusCode[cls.rpc_status]: cls for cls in _BY_NAME.values() if cls is not KVDepotError
}
_BY_CODE[grpc.StatusCode.DEADLINE_EXCEEDED] = Unavailable
# A server that stops (or dies) with calls in flight cancels them.
_BY_CODE[grpc.StatusCode.CANCELLED] = Unavailable
_BY_CODE[grpc.StatusCode.FAILED_PRECONDITION] = InvalidArgument


def status_code(exc: KVDepotError) -> grpc.StatusCode:
    """The gRPC status a service answers ``exc`` with."""
    return grpc.StatusCode[type(exc).rpc_status]


def error_metadata(exc: KVDepotError) -> tuple[tuple[str, str], ...]:
    """The trailing metadata that names ``exc``'s class to the client."""
    return ((ERROR_TYPE_KEY, type(exc).__name__),)


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


__all__ = ["ERROR_TYPE_KEY", "error_metadata", "error_type_name", "from_grpc", "status_code"]
