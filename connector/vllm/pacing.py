"""Whether a load runs inside the engine step or beside it.

An in-step load is fetched layer by layer while the forward pass runs, so the
request computes in the step it is scheduled; it costs the batch whatever the
fetch takes beyond the layers it overlaps. An asynchronous load costs the
batch nothing, but the request waits at least one step in
``WAITING_FOR_REMOTE_KVS``. So a load belongs inside the step only when it is
expected to take less than a step.

The scheduler sees the steps (the time between its ``build_connector_meta``
calls while tokens are scheduled); the workers time their fetches and report
them in the connector's stats (``load_timed*``). From those, :class:`LoadPacer`
fits the time of a load as ``fixed + per_token * tokens`` and gives an in-step
load a deadline of two steps: a store that stalls costs the batch at most that,
once, and then every load is asynchronous for a while.

A hit is loaded only when that pays (:meth:`LoadPacer.pays`): the steps'
times against the tokens they computed give the engine's cost of a token
(``fixed + per_token * tokens`` again), the recent loads *from the same
source* a fetch's time (robust to a lucky or unlucky one), and a load
expected to take longer than a step and longer than computing its tokens is
declined: the engine recomputes them, as it would without kvdepot. A source
is a store's node and tier as the lookup names them (the scheduler labels
each load with the one holding most of its tokens, and the workers report
its time under that label), so while one store or tier is slow, loads from
the others go ahead. The scheduler judges a hit whose chunks live on several
sources run by run, and loads it up to the first run that does not pay. A
load that fits in a step is never declined (it costs the request at most the
step it waits), nor is one before both costs are measured. A load given up at its
deadline took at least that long: after ``_LATE_IN_ROW`` such loads in a row
(one stalled store's single timeout does not close the gate), each counts as
a timed load of the deadline. After ``_PROBE_S`` of declines the scheduler
sends a **probe**: a declined request's load, fetched by the workers into
staging of their own and timed, while the request computes as if it had
missed (no request waits for it); the next requests wait for its figure,
which joins the others. After a fast answer the next probe comes
``_PROBE_S`` later, after a slow one half as often each time, up to
``_PROBE_MAX_S``: a store that recovered is loaded from again once most of
the recent figures are fast. Probes too are per source.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict, deque

_STEPS = 16  # recent steps whose median is the step time
_SAMPLES = 32  # recent reports of timed loads
_MIN_STEPS = 4
_MIN_SAMPLES = 2
_IDLE_S = 30.0  # longer gaps between steps are idle time, not a step
_MARGIN = 1.5  # an estimate within this factor of a step stays asynchronous
_DEADLINE_STEPS = 2.0
_COOLDOWN_S = 30.0  # after a failed or late load, every load is asynchronous
_GATE_MARGIN = 1.0  # a load declined is expected to take this many times its compute
_PROBE_S = 10.0  # a declining gate probes the store after this long,
_PROBE_MAX_S = 80.0  # then half as often each time, down to once in this long
_GATE_SAMPLES = 8  # recent timed loads the gate reads
_LATE_IN_ROW = 2  # loads given up in a row before the deadline counts as a time
_MIN_COMPUTE = 8  # steps timed before the engine's cost of a token is trusted
_SOURCES = 64  # sources whose figures are kept (the least recently used go)


class _Gate:
    """One source's side of the cost gate: its recent loads' times and its
    probes. A source is where a load's objects are read from (a store's
    node and tier, as the scheduler's lookup names them); the engine reaches
    a node over one transport (shared memory on its host, TCP or NIXL
    otherwise), so a source also stands for the transport."""

    __slots__ = (
        "declining_since",
        "late_in_row",
        "probe_answered",
        "probe_at",
        "probe_every",
        "probe_wanted",
        "samples",
        "unanswered",
    )

    def __init__(self) -> None:
        self.samples: deque[tuple[float, float, int]] = deque(maxlen=_GATE_SAMPLES)
        self.declining_since: float | None = None
        self.probe_every = _PROBE_S
        self.probe_at: float | None = None  # a probe measuring the source is under way
        self.probe_wanted = False  # the scheduler is to send one
        self.unanswered = False  # the last probe sent no figure in time
        self.probe_answered = False  # a figure came since the probe was sent
        self.late_in_row = 0

    def fetch_s(self, tokens: int) -> float | None:
        """Fetch time of ``tokens`` from this source: the fit of its recent
        loads, scaled by the median of their times over the fit's, so that
        neither one lucky fast load of a source that is mostly slow nor one
        slow load of a fast source decides."""
        recent = list(self.samples)
        if not recent:
            return None
        fixed, per_token = _fit(recent)
        ratios = [s / (fixed + per_token * t) for t, s, _ in recent if fixed + per_token * t > 0]
        return (fixed + per_token * tokens) * (statistics.median(ratios) if ratios else 1.0)

    def waiting(self, now: float, timeout_s: float) -> bool:
        """Whether loads wait for a probe's figure (or for twice the load
        deadline, if it never comes)."""
        if self.probe_at is not None and not self.probe_answered:
            if now - self.probe_at < 2 * timeout_s:
                return True
            if not self.unanswered:
                # Its figure may wait for a step of an engine that went idle
                # (workers report with steps): probe once more first.
                self.unanswered = True
                self.probe_at, self.probe_wanted = now, True
                return True
        self.probe_at, self.probe_answered, self.unanswered = None, False, False
        return False

    def decline(self, now: float) -> None:
        """A load was declined: after ``probe_every`` of declines, measure
        the source again with a probe of this load (the request computes)."""
        if self.declining_since is None:
            self.declining_since = now
        elif now - self.declining_since >= self.probe_every:
            self.declining_since, self.probe_at = now, now
            self.probe_wanted = True

    def answer(self, fast: bool) -> None:
        """A figure came: while a probe was under way, its pace sets the next
        (soon again after a fast answer, less often after each slow one)."""
        if self.probe_at is None:
            return
        self.probe_answered = True
        self.probe_every = _PROBE_S if fast else min(2 * self.probe_every, _PROBE_MAX_S)


class LoadPacer:
    """Chooses in-step or asynchronous loads, their deadline, and which loads pay.

    Args:
        max_tokens: ``None``: decide from the measured step and load times
            (``sync_load_max_tokens`` ``"auto"``). Otherwise loads of at most
            this many tokens run inside the step (0: none do).
        timeout_s: Deadline of a load; an in-step load never gets more.
    """

    def __init__(self, max_tokens: int | None, timeout_s: float) -> None:
        self._max_tokens = max_tokens
        self._timeout_s = timeout_s
        self._steps: deque[float] = deque(maxlen=_STEPS)
        # Every source's loads, for in-step loads (a step's may come from several).
        self._samples: deque[tuple[float, float, int]] = deque(maxlen=_SAMPLES)
        self._gates: OrderedDict[str, _Gate] = OrderedDict()
        self._last_step: float | None = None
        self._failed_at = -1e18
        self._granted = 0  # tokens loaded inside the coming step so far
        # Recent steps' (tokens computed, seconds), by the tokens' power of two:
        # the engine's cost of a token is the slope of their fastest steps.
        self._computed: dict[int, deque[tuple[float, float]]] = {}
        self._last_tokens = 0

    def step(self, now: float, scheduled_tokens: int) -> None:
        """An engine step started; ``scheduled_tokens`` is what it computes."""
        last, self._last_step = self._last_step, now if scheduled_tokens > 0 else None
        tokens, self._last_tokens = self._last_tokens, scheduled_tokens
        self._granted = 0
        if last is not None and 0 < now - last <= _IDLE_S:
            self._steps.append(now - last)
            if tokens > 0:
                recent = self._computed.setdefault(tokens.bit_length(), deque(maxlen=_STEPS))
                recent.append((float(tokens), now - last))

    def compute_s(self, tokens: int) -> float | None:
        """Expected seconds the engine adds to compute ``tokens`` more prompt
        tokens (the per-token part of its step time), or None if unknown.

        Fitted to the fastest recent step of each size (by powers of two of
        its tokens): what else a step waited for (a first run's warm-up, a
        busy host, its own loads) only ever lengthens it.
        """
        if sum(len(r) for r in self._computed.values()) < _MIN_COMPUTE:
            return None
        fastest = [min(r, key=lambda x: x[1]) for r in self._computed.values() if r]
        if len(fastest) < 2:
            return None  # steps of one size do not tell a token's cost
        _, per_token = _fit([(t, s, 1) for t, s in fastest])
        return per_token * tokens

    def _gate(self, source: str) -> _Gate:
        gate = self._gates.get(source)
        if gate is None:
            gate = self._gates[source] = _Gate()
            if len(self._gates) > _SOURCES:
                self._gates.popitem(last=False)
        self._gates.move_to_end(source)
        return gate

    def pays(self, tokens: int, now: float, source: str = "") -> bool:
        """Whether loading ``tokens`` from ``source`` is expected to beat
        computing them. A source never timed is loaded from (and so timed)."""
        gate = self._gate(source)
        if gate.waiting(now, self._timeout_s):
            return False
        fetch, step, compute = gate.fetch_s(tokens), self.step_s(), self.compute_s(tokens)
        if step is None or fetch is None or compute is None:
            return True
        if fetch <= step or fetch <= _GATE_MARGIN * compute:
            gate.declining_since, gate.probe_every = None, _PROBE_S
            return True
        gate.decline(now)
        return False

    def take_probe(self, source: str = "") -> bool:
        """Whether the load from ``source`` just declined is to be sent as a
        probe (once)."""
        gate = self._gates.get(source)
        if gate is None:
            return False
        wanted, gate.probe_wanted = gate.probe_wanted, False
        return wanted

    def _answer(self, gate: _Gate, tokens: float, seconds: float) -> None:
        compute = self.compute_s(int(tokens))
        gate.answer(compute is not None and seconds <= _GATE_MARGIN * compute)

    def observe(self, loads: int, seconds: float, tokens: int, source: str = "") -> None:
        """Workers fetched ``loads`` whole loads of ``tokens`` from ``source``
        in ``seconds``."""
        if loads > 0 and seconds >= 0 and tokens > 0:
            sample = (tokens / loads, seconds / loads, loads)
            self._samples.append(sample)
            gate = self._gate(source)
            gate.samples.append(sample)
            gate.late_in_row = 0
            self._answer(gate, sample[0], sample[1])

    def late(self, loads: int, seconds: float, tokens: int, source: str = "") -> None:
        """Workers gave up ``loads`` loads of ``tokens`` from ``source`` at
        their deadlines, ``seconds`` in all."""
        if loads <= 0 or tokens <= 0 or seconds <= 0:
            return
        gate = self._gate(source)
        gate.late_in_row += loads
        if gate.late_in_row >= _LATE_IN_ROW or gate.probe_at is not None:
            # As a time, the deadline: a lower bound of the load's.
            sample = (tokens / loads, seconds / loads, loads)
            self._samples.append(sample)
            gate.samples.append(sample)
            self._answer(gate, sample[0], sample[1])

    def failed(self, now: float) -> None:
        """A load failed or ran late: the store may be stalled."""
        self._failed_at = now

    def step_s(self) -> float | None:
        """The median of the recent steps, or None before enough were seen."""
        if len(self._steps) < _MIN_STEPS:
            return None
        return statistics.median(self._steps)

    def estimate_s(self, tokens: int) -> float | None:
        """Expected seconds to fetch a load of ``tokens``, or None if unknown."""
        if len(self._samples) < _MIN_SAMPLES:
            return None
        fixed, per_token = _fit(list(self._samples))
        return fixed + per_token * tokens

    def in_step(self, tokens: int, now: float) -> float | None:
        """The deadline in seconds of an in-step load of ``tokens``, or None
        when the load should be asynchronous."""
        if self._max_tokens is not None:
            if 0 < tokens <= self._max_tokens:
                return self._timeout_s
            return None
        if now - self._failed_at < _COOLDOWN_S:
            return None
        # The step's in-step loads are fetched together: their sum counts.
        step, estimate = self.step_s(), self.estimate_s(self._granted + tokens)
        if step is None or estimate is None or estimate * _MARGIN > step:
            return None
        self._granted += tokens
        return min(self._timeout_s, _DEADLINE_STEPS * step)


def _fit(samples: list[tuple[float, float, int]]) -> tuple[float, float]:
    """``(fixed, per_token)`` seconds from ``(tokens, seconds, weight)`` samples:
    weighted least squares, both terms non-negative; proportional when the
    samples' sizes do not spread enough to tell the terms apart."""
    w = sum(n for _, _, n in samples)
    mt = sum(t * n for t, _, n in samples) / w
    ms = sum(s * n for _, s, n in samples) / w
    var = sum(n * (t - mt) ** 2 for t, _, n in samples) / w
    if var <= (0.05 * mt) ** 2:
        return 0.0, ms / mt
    cov = sum(n * (t - mt) * (s - ms) for t, s, n in samples) / w
    per_token = cov / var
    fixed = ms - per_token * mt
    if per_token < 0:
        return ms, 0.0
    if fixed < 0:
        return 0.0, ms / mt
    return fixed, per_token
