"""Lines about repeated failures: one at once, then one per interval and kind with
the attempts since the last line and the total; a flush for the attempts not
logged yet; the total when a run ends; exact counts from several threads."""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from collections.abc import Iterator

import pytest

from kvdepot.repeat_log import RepeatLog

LOGGER = "test.repeat"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def log(clock: Clock) -> RepeatLog:
    return RepeatLog(logging.getLogger(LOGGER), interval_s=10.0, clock=clock)


@pytest.fixture
def logged(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        yield caplog


def test_one_line_per_interval_per_kind_with_a_count_at_each_level(
    log: RepeatLog, clock: Clock, logged: pytest.LogCaptureFixture
) -> None:
    written = []
    for _ in range(40):  # twice a second for 20 s
        written.append(log.failed("a", logging.WARNING, "metadata %s down", "m0"))
        written.append(log.failed("b", logging.ERROR, "refused"))
        clock.now += 0.5
    assert sum(written) == 4  # each kind at 0 s and 10 s
    lines = [(r.levelno, r.getMessage()) for r in logged.records]
    assert lines == [
        (logging.WARNING, "metadata m0 down"),
        (logging.ERROR, "refused"),
        (logging.WARNING, "metadata m0 down (20 attempts since the last line; 21 in 10 s)"),
        (logging.ERROR, "refused (20 attempts since the last line; 21 in 10 s)"),
    ]
    # Structured logs can sum the attempts each line stands for.
    assert [(r.__dict__["kind"], r.__dict__["count"]) for r in logged.records] == [
        ("a", 1), ("b", 1), ("a", 20), ("b", 20)
    ]  # fmt: skip


def test_ended_returns_the_run_and_a_new_run_starts_with_a_line(
    log: RepeatLog, clock: Clock, logged: pytest.LogCaptureFixture
) -> None:
    assert not log.failing()
    assert log.ended("a") is None
    for _ in range(40):
        log.failed("a", logging.WARNING, "down")
        clock.now += 0.5
    log.failed("b", logging.WARNING, "other")
    assert log.failing()
    assert log.ended("a") == (40, 20.0)
    assert log.ended("a") is None
    assert log.failing()  # "b" still is
    assert log.ended("b") == (1, 0.0)
    assert not log.failing()
    logged.clear()
    assert log.failed("a", logging.WARNING, "again")
    assert [r.getMessage() for r in logged.records] == ["again"]


def test_the_latest_message_and_fields_go_into_the_counted_line(
    log: RepeatLog, clock: Clock, logged: pytest.LogCaptureFixture
) -> None:
    log.warn("Unavailable", "calls failing: %s", "redis down", extra={"event": "repeated"})
    clock.now += 5
    assert not log.warn("Unavailable", "calls failing: %s", "redis still down")
    clock.now += 5
    assert log.warn("Unavailable", "calls failing: %s", "redis gone", extra={"event": "again"})
    assert [r.getMessage() for r in logged.records] == [
        "calls failing: redis down",
        "calls failing: redis gone (2 attempts since the last line; 3 in 10 s)",
    ]
    assert [r.levelno for r in logged.records] == [logging.WARNING] * 2
    assert [r.__dict__["event"] for r in logged.records] == ["repeated", "again"]


def test_flush_logs_what_was_not_logged_once_the_interval_is_over(
    log: RepeatLog, clock: Clock, logged: pytest.LogCaptureFixture
) -> None:
    log.warn("a", "down %s", 1)
    log.flush()  # nothing held back
    clock.now += 1
    log.warn("a", "down %s", 2)
    log.failed("b", logging.ERROR, "refused")
    log.failed("b", logging.ERROR, "refused")
    log.failed("a", logging.ERROR, "down %s", 3)
    log.flush()  # within the interval: nothing yet
    assert len(logged.records) == 2
    clock.now += 9
    log.flush()
    log.flush()  # nothing left to log
    # The latest attempt's level and message stand for those held back; "b"'s
    # interval, from its first line at 101 s, is not over.
    assert [(r.levelno, r.getMessage()) for r in logged.records[2:]] == [
        (logging.ERROR, "down 3 (2 attempts since the last line; 3 in 10 s)")
    ]
    clock.now += 1
    log.flush()
    assert [r.getMessage() for r in logged.records[3:]] == [
        "refused (1 attempts since the last line; 2 in 10 s)"
    ]
    # An attempt long after the last line is logged at once.
    clock.now += 60
    assert log.warn("a", "down again")
    assert (
        logged.records[-1].getMessage() == "down again (1 attempts since the last line; 4 in 71 s)"
    )
    # Each line names where it was logged from, not the rate limiter.
    assert {r.filename for r in logged.records} == {"test_repeat_log.py"}


def test_counts_from_several_threads_are_exact(
    log: RepeatLog, clock: Clock, logged: pytest.LogCaptureFixture
) -> None:
    threads, each = 8, 2000
    start = threading.Barrier(threads)
    written: list[bool] = []

    def fail() -> None:
        start.wait()
        mine = [log.warn("k", "store unreachable") for _ in range(each)]
        written.extend(mine)

    # Switch threads as often as possible, to make a lost count likely if
    # counting were not under the lock.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        workers = [threading.Thread(target=fail) for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=60)
    finally:
        sys.setswitchinterval(interval)
    assert sum(written) == 1 and len(written) == threads * each
    assert [r.getMessage() for r in logged.records] == ["store unreachable"]
    clock.now += 10
    log.flush()
    assert logged.records[-1].getMessage() == (
        f"store unreachable ({threads * each - 1} attempts since the last line;"
        f" {threads * each} in 10 s)"
    )
    assert log.ended("k") == (threads * each, 10.0)


def test_a_held_back_exception_is_kept_as_its_text(
    log: RepeatLog, clock: Clock, logged: pytest.LogCaptureFixture
) -> None:
    # A kept exception would keep its traceback's frames, and all they refer
    # to (a load's buffers), alive until the kind's next line.
    class Refused(Exception):  # a subclass can be weakly referenced
        pass

    def failure() -> Refused:
        try:
            raise Refused("store s0 refused")
        except Refused as exc:
            return exc

    log.warn("load", "load failed: %s", failure())
    exc = failure()
    gone = weakref.ref(exc)
    log.warn("load", "load failed: %s", exc)
    del exc
    assert gone() is None
    clock.now += 10
    log.flush()
    assert logged.records[-1].getMessage() == (
        "load failed: store s0 refused (1 attempts since the last line; 2 in 10 s)"
    )
