"""The plan of a put, decided once (connector/put_plan.py), and the client's
one record of deferred commits."""

from __future__ import annotations

import pytest

from kvdepot.connector.put_plan import (
    LOCAL_FIRST_STREAM_BYTES,
    REFERENCE,
    Answer,
    PutPlan,
    Route,
    plan_put,
)
from kvdepot.connector.results import DeferredCommits
from kvdepot.wire.settled import IndexSettled

STREAM = lambda address: False  # noqa: E731 - tcp: bytes move before the store can refuse them
RESERVES = lambda address: True  # noqa: E731 - shm, nixl


def test_a_client_that_does_not_know_its_store_takes_the_reference_route() -> None:
    assert plan_put(None, 1, RESERVES, True, 7) is REFERENCE


def test_the_local_route_waits_or_defers_as_configured() -> None:
    assert plan_put("h:1", 4096, STREAM, False, 7) == PutPlan(Route.LOCAL, Answer.WAIT, "h:1")
    assert plan_put("h:1", 4096, STREAM, True, 7) == PutPlan(Route.LOCAL, Answer.DEFER, "h:1", 7)


def test_a_large_put_over_a_stream_goes_by_reference_but_not_over_a_reserving_transport() -> None:
    big = LOCAL_FIRST_STREAM_BYTES + 1
    assert plan_put("h:1", LOCAL_FIRST_STREAM_BYTES, STREAM, False, 7).route is Route.LOCAL
    assert plan_put("h:1", big, STREAM, False, 7) is REFERENCE
    assert plan_put("h:1", big, RESERVES, False, 7).route is Route.LOCAL


def test_a_plan_is_consistent_or_refused() -> None:
    with pytest.raises(ValueError):
        PutPlan(Route.REFERENCE, address="h:1")
    with pytest.raises(ValueError):
        PutPlan(Route.LOCAL)
    with pytest.raises(ValueError):
        PutPlan(Route.LOCAL, Answer.DEFER, "h:1")  # no writer token
    with pytest.raises(ValueError):
        PutPlan(Route.LOCAL, Answer.WAIT, "h:1", 7)


def test_a_sync_settles_the_puts_made_before_it_asked_not_those_made_meanwhile() -> None:
    d = DeferredCommits()
    assert not d.open()
    d.made()
    mark = d.mark()
    d.made()  # a put that raced the question
    d.answered(mark, IndexSettled(new=1))
    assert d.open()
    mark = d.mark()
    d.answered(mark, IndexSettled(new=1))
    assert not d.open()


def test_a_sync_that_finds_commits_pending_settles_nothing() -> None:
    d = DeferredCommits()
    d.made()
    d.answered(d.mark(), IndexSettled(new=1, pending=2))
    assert d.open()
