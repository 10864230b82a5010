"""The count of puts whose store answer is read later (no network)."""

from __future__ import annotations

import threading
import time

from kvdepot.connector.transport.pipeline import SETTLE_SLICE_S, Pipeline, with_outcomes
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


class _Recording(Pipeline):
    def __init__(self) -> None:
        super().__init__()
        self.slices: list[float] = []

    def wait(self, ticket: int, timeout_s: float) -> bool:
        self.slices.append(timeout_s)
        return super().wait(ticket, timeout_s)


def test_settle_reads_idle_answers_and_is_bounded() -> None:
    p = _Recording()
    t = p.sent(1)
    waits: list[float] = []

    def read_idle(wait_s: float) -> bool:
        # An idle connection owes the answer: settle waits on it (the socket
        # wakes it at arrival), never on a slice of its own in between.
        waits.append(wait_s)
        if len(waits) == 3:
            p.answered(t, [PutCode.OK], [IndexCode.PENDING])
        return len(waits) < 3

    assert p.settle(read_idle, 5.0)
    assert p.slices == []  # no slice waited on the condition
    assert len(waits) == 3 and all(0 < w <= SETTLE_SLICE_S for w in waits)
    p.sent(1)
    t0 = time.monotonic()
    assert not p.settle(lambda _: False, 0.05)  # never answered: gives up in time
    assert time.monotonic() - t0 < 1.0
    assert p.settle(lambda _: True, 0.0) is False


def test_an_answer_read_by_a_connection_in_use_ends_the_wait() -> None:
    p = Pipeline()
    t = p.sent(1)
    threading.Timer(0.05, p.answered, (t, [PutCode.OK], [])).start()
    t0 = time.monotonic()
    assert p.settle(lambda _: False, 5.0)  # no idle connection owes it
    assert time.monotonic() - t0 < 1.0


def test_a_later_put_is_not_waited_for() -> None:
    p = Pipeline()
    first = p.sent(1)

    def read_idle(wait_s: float) -> bool:
        p.sent(1)  # another thread's put, sent after the wait began
        p.answered(first, [PutCode.OK], [])
        return True

    assert p.settle(read_idle, 1.0)


def test_with_outcomes_adds_the_pipelines_counts_to_a_sync() -> None:
    p = Pipeline()
    p.answered(p.sent(2), [PutCode.EXISTS, PutCode.OK], [IndexCode.NOT_INDEXED, IndexCode.NEW])
    settled = with_outcomes(IndexSettled(new=3, pending=1), p)
    assert settled == IndexSettled(new=4, pending=1, skipped=1)
    assert with_outcomes(settled, p) is settled
