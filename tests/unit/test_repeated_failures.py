"""Failures repeated on every call are logged once per interval, with a count;
gRPC statuses come back as the kvdepot class the service raised."""

from __future__ import annotations

import logging
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
from kvdepot.metadata.failures import RepeatedFailures


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records]


def test_first_failure_at_once_then_one_line_per_interval_with_the_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    log = RepeatedFailures(logging.getLogger("t.failures"), "calls failing", 10.0, clock)
    with caplog.at_level(logging.WARNING, "t.failures"):
        for _ in range(40):  # 5 s of failures, eight a second
            log.failed("Unavailable", "redis down")
            clock.now += 0.125
        assert lines(caplog) == ["calls failing: redis down"]
        for _ in range(41):  # the last one 10 s after the first line
            log.failed("Unavailable", "redis still down")
            clock.now += 0.125
        assert lines(caplog)[1:] == [
            "calls failing: redis still down (80 failures in the last 10 s)"
        ]
        # Another kind has its own line; the first kind stays quiet.
        log.failed("KVDepotError", "redis index error: WRONGTYPE")
        log.failed("Unavailable", "redis still down")
        assert len(caplog.records) == 3
        assert caplog.records[1].__dict__["count"] == 80


def test_flush_reports_what_was_not_reported_once_the_interval_is_over(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    log = RepeatedFailures(logging.getLogger("t.failures"), "calls failing", 10.0, clock)
    with caplog.at_level(logging.WARNING, "t.failures"):
        log.failed("Unavailable", "down")
        clock.now += 1
        log.failed("Unavailable", "down")
        log.failed("Unavailable", "down")
        log.flush()  # within the interval: nothing yet
        assert len(caplog.records) == 1
        clock.now += 9
        log.flush()
        log.flush()  # nothing left to report
        assert lines(caplog)[1:] == ["calls failing: down (2 failures in the last 10 s)"]
        # A failure long after the last line is logged at once.
        clock.now += 60
        log.failed("Unavailable", "down again")
        assert lines(caplog)[2:] == ["calls failing: down again (1 failure in the last 60 s)"]


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
