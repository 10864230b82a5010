"""gRPC statuses come back as the kvdepot class the service raised."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import grpc
import pytest

from kvdepot.errors import (
    InvalidArgument,
    KVDepotError,
    NodeIdTaken,
    StaleRegistration,
    Unauthenticated,
    Unavailable,
)
from kvdepot.rpc.errors import ERROR_TYPE_KEY, error_metadata, from_grpc, status_code
from kvdepot.wire.protocol import AuthRefused


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


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (KVDepotError("x"), grpc.StatusCode.UNKNOWN),
        (InvalidArgument("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (NodeIdTaken("x"), grpc.StatusCode.ALREADY_EXISTS),
        (StaleRegistration("x"), grpc.StatusCode.FAILED_PRECONDITION),
        # A Corrupt and an Unauthenticated: answered as the refusal it is.
        (AuthRefused("wrong token"), grpc.StatusCode.UNAUTHENTICATED),
    ],
)
def test_a_service_answers_each_class_with_its_status(
    exc: KVDepotError, code: grpc.StatusCode
) -> None:
    assert status_code(exc) is code
    trailing = error_metadata(exc)
    back = from_grpc(FakeRpcError(code, "why", trailing))
    expected = Unauthenticated if isinstance(exc, AuthRefused) else type(exc)
    assert type(back) is expected


def test_the_error_classes_load_no_grpc() -> None:
    # A fresh interpreter: this one has imported grpc long since.
    probe = (
        "import sys, kvdepot.errors; "
        "print(sorted(m for m in sys.modules if m == 'grpc' or m.startswith(('grpc.', 'grpc_'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]", out.stdout
