"""The store's lines about repeated failures: one at once, then one per interval
with the attempts since the last, per kind; the end of a run with its total."""

from __future__ import annotations

import logging

import pytest

from kvdepot.store.repeat_log import RepeatLog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_one_line_per_interval_per_kind_with_a_count(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    log = RepeatLog(logging.getLogger("test.repeat"), interval_s=10.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="test.repeat"):
        written = []
        for _ in range(40):  # twice a second for 20 s
            written.append(log.failed("a", logging.WARNING, "metadata %s down", "m0"))
            written.append(log.failed("b", logging.ERROR, "refused"))
            clock.now += 0.5
    assert sum(written) == 4  # each kind at 0 s and 10 s
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert lines[:2] == [(logging.WARNING, "metadata m0 down"), (logging.ERROR, "refused")]
    assert (logging.WARNING, "metadata m0 down (20 attempts since the last line; 21 in 10 s)") in (
        lines
    )
    assert log.failing()
    assert log.ended("a") == (40, 20.0)
    assert log.ended("a") is None
    # A new run of that kind starts with a line at once.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="test.repeat"):
        assert log.failed("a", logging.WARNING, "again")
    assert [r.getMessage() for r in caplog.records] == ["again"]
