"""The count of puts whose store answer is read later (no network)."""

from __future__ import annotations

import time

from kvdepot.connector.transport.pipeline import Pipeline, with_outcomes
from kvdepot.wire.protocol import IndexCode, IndexSettled, PutCode


def test_answers_are_counted_by_what_the_store_said() -> None:
    p = Pipeline()
    a, b, c = p.sent(4), p.sent(2), p.sent(3)
    p.answered(
        a,
        [PutCode.OK, PutCode.OK, PutCode.EXISTS, PutCode.CORRUPT],
        [IndexCode.PENDING, IndexCode.NEW, IndexCode.NOT_INDEXED, IndexCode.NOT_INDEXED],
    )
    p.answered(b, [PutCode.OK, PutCode.NO_SPACE], [IndexCode.ELSEWHERE, IndexCode.NOT_INDEXED])
    p.answered(c, None)  # the connection failed: every chunk of it is lost
    assert p.take_outcomes() == IndexSettled(new=1, elsewhere=1, skipped=1, lost=5)
    assert p.take_outcomes() == IndexSettled()  # told once


def test_a_withdrawn_put_is_neither_open_nor_counted() -> None:
    p = Pipeline()
    t = p.sent(8)
    assert p.open_until(p.issued())
    p.withdraw(t)
    assert not p.open_until(p.issued())
    assert p.take_outcomes() == IndexSettled()


def test_settle_reads_idle_answers_and_is_bounded() -> None:
    p = Pipeline()
    t = p.sent(1)
    calls: list[int] = []

    def read_idle() -> None:
        calls.append(1)
        if len(calls) == 3:
            p.answered(t, [PutCode.OK], [IndexCode.PENDING])

    assert p.settle(read_idle, 5.0)
    assert len(calls) == 3  # read again until the answer came
    p.sent(1)
    t0 = time.monotonic()
    assert not p.settle(lambda: None, 0.05)  # never answered: gives up in time
    assert time.monotonic() - t0 < 1.0
    assert p.settle(lambda: None, 0.0) is False


def test_a_later_put_is_not_waited_for() -> None:
    p = Pipeline()
    first = p.sent(1)

    def read_idle() -> None:
        p.sent(1)  # another thread's put, sent after the wait began
        p.answered(first, [PutCode.OK], [])

    assert p.settle(read_idle, 1.0)


def test_with_outcomes_adds_the_pipelines_counts_to_a_sync() -> None:
    p = Pipeline()
    p.answered(p.sent(2), [PutCode.EXISTS, PutCode.OK], [IndexCode.NOT_INDEXED, IndexCode.NEW])
    settled = with_outcomes(IndexSettled(new=3, pending=1), p)
    assert settled == IndexSettled(new=4, pending=1, skipped=1)
    assert with_outcomes(settled, p) is settled
