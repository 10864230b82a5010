"""The metadata clients' failover and retry policy, over stand-in stubs (no network)."""

from __future__ import annotations

import logging
from typing import Any

import grpc
import pytest

from kvdepot.errors import ClientClosed, InvalidArgument, Unavailable
from kvdepot.metadata_client import AsyncMetadataClient, MetadataClient
from kvdepot.proto.gen import metadata_pb2 as pb
from kvdepot.retry import Backoff, RetryPolicy


class _Status(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[()]:
        return ()


class _Replica:
    """A replica's stub: answers GetStats from a script of outcomes."""

    def __init__(self, name: str, outcomes: list[grpc.StatusCode | None]) -> None:
        self.name, self.outcomes, self.calls = name, outcomes, 0

    def GetStats(self, request: Any, timeout: float) -> pb.ClusterStats:
        self.calls += 1
        code = self.outcomes.pop(0) if self.outcomes else None
        if code is not None:
            raise _Status(code, f"{self.name} says {code.name}")
        return pb.ClusterStats(chunks=len(self.name))


def _client(
    replicas: list[_Replica], retry: RetryPolicy | None = None
) -> tuple[MetadataClient, list[float]]:
    slept: list[float] = []
    spec = ",".join(f"127.0.0.1:{7700 + i}" for i in range(len(replicas)))
    client = MetadataClient(spec, 1.0, retry=retry, sleep=slept.append)
    client._stubs = replicas  # type: ignore[assignment]
    return client, slept


def test_an_unreachable_replica_fails_over_and_the_next_calls_stay_there() -> None:
    a, b = _Replica("a", [grpc.StatusCode.UNAVAILABLE]), _Replica("bb", [])
    client, slept = _client([a, b])
    try:
        assert client.get_stats().chunks == 2
        assert client.current == "127.0.0.1:7701"
        assert client.get_stats().chunks == 2
        assert (a.calls, b.calls, slept) == (1, 2, [])
    finally:
        client.close()


def test_by_default_an_outage_is_reported_at_once_without_waiting() -> None:
    down = [grpc.StatusCode.UNAVAILABLE] * 9
    a, b = _Replica("a", list(down)), _Replica("b", list(down))
    client, slept = _client([a, b])
    try:
        with pytest.raises(Unavailable, match=r"127\.0\.0\.1:7700, 127\.0\.0\.1:7701"):
            client.get_stats()
        assert (a.calls, b.calls, slept) == (1, 1, [])
    finally:
        client.close()


def test_a_policy_of_rounds_backs_off_between_them() -> None:
    down = grpc.StatusCode.DEADLINE_EXCEEDED
    a, b = _Replica("a", [down, down, down]), _Replica("bbb", [down, down])
    retry = RetryPolicy(rounds=4, backoff=Backoff(base_s=0.1, cap_s=0.3))
    client, slept = _client([a, b], retry)
    try:
        # Rounds 1 and 2 fail on both, round 3 on a; b answers.
        assert client.get_stats().chunks == 3
        assert slept == pytest.approx([0.1, 0.2])
        assert (a.calls, b.calls) == (3, 3)
    finally:
        client.close()


def test_a_call_timeout_bounds_its_attempts_and_rounds_together() -> None:
    down = grpc.StatusCode.DEADLINE_EXCEEDED
    a, b = _Replica("a", [down] * 9), _Replica("b", [down] * 9)
    timeouts: list[float] = []
    for r in (a, b):
        r.GetStats = _recording(r.GetStats, timeouts)  # type: ignore[method-assign]
    # Rounds back off by 10 s: a call of 0.5 s has time for no second round.
    client, slept = _client([a, b], RetryPolicy(rounds=9, backoff=Backoff(10.0, 10.0)))
    try:
        with pytest.raises(Unavailable, match="no answer within"):
            client.call("GetStats", pb.GetStatsRequest(), timeout_s=0.5)
        assert (a.calls, b.calls, slept) == (1, 1, [])
        # Each attempt's deadline is what is left of the call's, under the client's 1 s.
        assert all(0 < t <= 0.5 for t in timeouts), timeouts
        with pytest.raises(Unavailable, match="no time left"):
            client.call("GetStats", pb.GetStatsRequest(), timeout_s=0.0)
        assert a.calls + b.calls == 2  # nothing sent without time for it
        # Without one, every attempt has the client's own deadline.
        a.outcomes.clear()
        assert client.get_stats().chunks == 1 and timeouts[-1] == 1.0
        assert slept == []
    finally:
        client.close()


def _recording(method: Any, timeouts: list[float]) -> Any:
    def call(request: Any, timeout: float) -> Any:
        timeouts.append(timeout)
        return method(request, timeout)

    return call


def test_failovers_are_logged_once_per_outage_not_per_call(
    caplog: pytest.LogCaptureFixture,
) -> None:
    down = grpc.StatusCode.UNAVAILABLE
    a, b = _Replica("a", [down] * 20), _Replica("b", [down] * 20)
    client, _ = _client([a, b])
    try:
        with caplog.at_level(logging.WARNING, logger="kvdepot.metadata_client"):
            for _ in range(20):  # threads of a store meeting one outage
                with pytest.raises(Unavailable):
                    client.get_stats()
            assert len([r for r in caplog.records if "failing over" in r.message]) == 1
            b.outcomes.clear()
            a.outcomes[:] = [None, down]
            assert client.get_stats().chunks == 1  # back: the outage ended
            assert client.get_stats().chunks == 1  # a fails, b answers: a new one, said at once
        assert len([r for r in caplog.records if "failing over" in r.message]) == 2
    finally:
        client.close()


def test_a_refusal_is_raised_at_once_with_its_class() -> None:
    a, b = _Replica("a", [grpc.StatusCode.INVALID_ARGUMENT]), _Replica("b", [])
    client, slept = _client([a, b], RetryPolicy(rounds=3))
    try:
        with pytest.raises(InvalidArgument, match="a says INVALID_ARGUMENT"):
            client.get_stats()
        assert (a.calls, b.calls, slept) == (1, 0, [])
    finally:
        client.close()


def test_a_closed_client_says_so() -> None:
    client, _ = _client([_Replica("a", [])])
    client.close()
    with pytest.raises(ClientClosed):
        client.get_stats()


def test_the_lease_backoff_grows_per_round_of_replicas_up_to_its_cap() -> None:
    client = AsyncMetadataClient(["a:1", "b:2"], [], Backoff(base_s=0.5, cap_s=2.0))
    # failures in a row -> the wait: a round of two replicas per doubling.
    assert [client.delay(n) for n in range(1, 9)] == [0.5, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 2.0]


@pytest.mark.parametrize(
    "bad",
    [
        lambda: Backoff(base_s=3.0, cap_s=2.0),
        lambda: Backoff(base_s=-1.0),
        lambda: Backoff(factor=0.5),
        lambda: RetryPolicy(rounds=0),
        lambda: RetryPolicy(rounds=True),  # type: ignore[arg-type]
    ],
)
def test_a_bad_policy_is_refused(bad: Any) -> None:
    with pytest.raises(InvalidArgument):
        bad()
