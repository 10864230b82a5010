"""Puts whose answer is read later: the count a transport keeps per store.

A deferring writer (one whose store indexes its chunks after answering) need
not wait for the store's answer either: the ``shm`` transport returns once a
put's COMMIT is sent, the ``tcp`` transport once a put's bytes are handed to
the kernel, and whatever next uses the connection reads the answer. Each such
put takes a ticket of its store's :class:`Pipeline`; whoever reads the answer
settles it. A read of the same client waits for every ticket issued before it
(read-your-writes), and the writer learns what became of its chunks when it
asks the store (``sync_index``): :meth:`Pipeline.take_outcomes`, added to the
store's answer by :func:`with_outcomes`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from kvdepot.wire.protocol import IndexCode, PutCode
from kvdepot.wire.settled import IndexSettled

SETTLE_SLICE_S = 0.005
"""Longest a reader waiting for answers waits on one set of idle connections
before it looks again (a connection checked in meanwhile may hold some);
answers that arrive end the wait at once."""


class Pipeline:
    """The put answers of one store not read yet, and what the read ones said.

    Thread-safe: tickets are taken and settled by any thread, on whichever
    connection carried the put.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._issued = 0
        self._open: dict[int, int] = {}  # ticket -> chunks it carries
        self._skipped = 0
        self._lost = 0
        self._new = 0
        self._elsewhere = 0
        self._not_indexed = 0

    def sent(self, n: int) -> int:
        """A ticket for a put of ``n`` chunks just sent."""
        with self._cond:
            self._issued += 1
            self._open[self._issued] = n
            return self._issued

    def answered(
        self,
        ticket: int,
        statuses: Sequence[PutCode] | None,
        codes: Sequence[IndexCode] = (),
    ) -> None:
        """The answer of ``ticket`` was read: its statuses and index codes
        (``None``: it never will be, the chunks count as lost)."""
        with self._cond:
            n = self._open.pop(ticket, 0)
            if statuses is None:
                self._lost += n
            else:
                for i, st in enumerate(statuses):
                    if st is PutCode.EXISTS:
                        self._skipped += 1
                    elif st is not PutCode.OK:
                        self._lost += 1
                    elif i < len(codes):
                        self._count_index(codes[i])
            self._cond.notify_all()

    def withdraw(self, ticket: int) -> None:
        """Close ``ticket`` uncounted: its put reports its own failure."""
        with self._cond:
            self._open.pop(ticket, None)
            self._cond.notify_all()

    def _count_index(self, code: IndexCode) -> None:
        # Stored: PENDING is the store's to report (its sync); the others
        # mean it committed (or gave up on) them before answering.
        if code is IndexCode.NEW:
            self._new += 1
        elif code is IndexCode.ELSEWHERE:
            self._elsewhere += 1
        elif code is IndexCode.NOT_INDEXED:
            self._not_indexed += 1

    def issued(self) -> int:
        """The last ticket issued (0 when none)."""
        with self._cond:
            return self._issued

    def open_until(self, ticket: int) -> bool:
        """Whether a ticket up to ``ticket`` is still unanswered."""
        with self._cond:
            return any(t <= ticket for t in self._open)

    def wait(self, ticket: int, timeout_s: float) -> bool:
        """Wait until every ticket up to ``ticket`` is answered; whether they are."""
        with self._cond:
            return self._cond.wait_for(lambda: not any(t <= ticket for t in self._open), timeout_s)

    def settle(self, read_idle: Callable[[float], bool], timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until every ticket issued so far is
        answered; whether they all are.

        ``read_idle(wait_s)`` reads the answers idle connections hold, waiting
        up to ``wait_s`` for one to arrive, and says whether any idle
        connection awaits one; answers read by connections in use (another
        thread's exchange) are waited for here. Each wait lasts at most
        :data:`SETTLE_SLICE_S`: a connection may go idle meanwhile."""
        if not self._open:
            # Every put that returned before this call took its ticket before
            # returning: nothing open means nothing to wait for (a dict's
            # truth is read atomically).
            return True
        upto = self.issued()
        if not self.open_until(upto):
            return True
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            # Waiting on the sockets wakes at an answer's arrival; polling
            # them every slice cost a sync after a put 5 ms.
            idle_owe = read_idle(max(0.0, min(left, SETTLE_SLICE_S)))
            if not self.open_until(upto):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if not idle_owe and self.wait(upto, min(left, SETTLE_SLICE_S)):
                return True

    def take_outcomes(self) -> IndexSettled:
        """What the answers read since the last call said: ``skipped`` (the
        store held them already), ``lost`` (refused, or no answer), and of the
        stored ones the store committed before answering, ``new``,
        ``elsewhere`` and ``not_indexed``."""
        with self._cond:
            out = IndexSettled(
                new=self._new,
                elsewhere=self._elsewhere,
                not_indexed=self._not_indexed,
                skipped=self._skipped,
                lost=self._lost,
            )
            self._skipped = self._lost = self._new = self._elsewhere = self._not_indexed = 0
            return out


def with_outcomes(settled: IndexSettled, pipeline: Pipeline) -> IndexSettled:
    """The store's answer to a sync, with what the pipeline's answers said."""
    o = pipeline.take_outcomes()
    # The outcomes add up, the store's pending stays (IndexSettled.__add__).
    return settled if o == IndexSettled() else o + settled
