"""gRPC statuses come back as the kvdepot class the service raised."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from kvdepot.errors import (
    ERROR_TYPE_KEY,
    InvalidArgument,
    KVDepotError,
    StaleRegistration,
    Unavailable,
    from_grpc,
)


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str, trailing: Any = ()) -> None:
        self._code, self._details, self._trailing = code, details, trailing

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Any:
        return self._trailing


@pytest.mark.parametrize(
    ("code", "name", "expected"),
    [
        # Two classes share FAILED_PRECONDITION: the name tells them apart.
        (grpc.StatusCode.FAILED_PRECONDITION, "StaleRegistration", StaleRegistration),
        (grpc.StatusCode.FAILED_PRECONDITION, None, InvalidArgument),
        (grpc.StatusCode.UNKNOWN, "KVDepotError", KVDepotError),
        (grpc.StatusCode.UNAVAILABLE, "Unavailable", Unavailable),
        # gRPC's own statuses of a server that went away mid-call.
        (grpc.StatusCode.CANCELLED, None, Unavailable),
        (grpc.StatusCode.DEADLINE_EXCEEDED, None, Unavailable),
        # A name kvdepot does not know falls back to the code.
        (grpc.StatusCode.UNAVAILABLE, "NoSuchError", Unavailable),
    ],
)
def test_from_grpc_restores_the_class_the_service_named(
    code: grpc.StatusCode, name: str | None, expected: type[KVDepotError]
) -> None:
    trailing = ((ERROR_TYPE_KEY, name),) if name else ()
    exc = from_grpc(FakeRpcError(code, "why", trailing), "metadata x")
    assert type(exc) is expected
    assert str(exc) == "metadata x: why"
