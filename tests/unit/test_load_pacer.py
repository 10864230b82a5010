"""LoadPacer: which loads run inside the engine step, from measured times."""

from __future__ import annotations

import pytest

from kvdepot.connector.vllm.pacing import LoadPacer


def steps(pacer: LoadPacer, start: float, n: int, every_s: float) -> float:
    """``n`` steps ``every_s`` apart from ``start``; the time after the last."""
    t = start
    for _ in range(n):
        pacer.step(t, scheduled_tokens=64)
        t += every_s
    return t


def measured(step_s: float = 0.1) -> tuple[LoadPacer, float]:
    """A pacer that saw 100 ms steps and loads of 2 ms + 10 us per token."""
    pacer = LoadPacer(None, timeout_s=5.0)
    now = steps(pacer, 0.0, 8, step_s)
    for tokens in (128, 1024, 4096):
        pacer.observe(1, 0.002 + 1e-5 * tokens, tokens)
    return pacer, now


def test_a_fixed_threshold_ignores_measurements() -> None:
    never = LoadPacer(0, timeout_s=5.0)
    assert never.in_step(128, 0.0) is None
    fixed = LoadPacer(512, timeout_s=5.0)
    assert fixed.in_step(512, 0.0) == 5.0
    assert fixed.in_step(513, 0.0) is None


def test_auto_loads_asynchronously_until_it_has_measured_steps_and_loads() -> None:
    pacer = LoadPacer(None, timeout_s=5.0)
    assert pacer.in_step(128, 0.0) is None
    now = steps(pacer, 0.0, 8, 0.1)
    assert pacer.in_step(128, now) is None  # no load timed yet
    pacer.observe(2, 0.004, 256)
    pacer.observe(1, 0.002, 128)
    assert pacer.in_step(128, now) == pytest.approx(0.2)


def test_auto_keeps_in_the_step_only_loads_shorter_than_a_step() -> None:
    pacer, now = measured()
    assert pacer.estimate_s(1000) == pytest.approx(0.012, rel=1e-6)
    assert pacer.in_step(1000, now) == pytest.approx(0.2)  # two steps
    # 2 ms + 10 us x 8000 = 82 ms: within a 100 ms step, not with the margin.
    assert pacer.in_step(8000, now) is None


def test_a_steps_in_step_loads_count_together() -> None:
    pacer, now = measured()
    assert pacer.in_step(3000, now) is not None
    assert pacer.in_step(3000, now) is not None
    assert pacer.in_step(3000, now) is None  # 9000 tokens: 92 ms x 1.5 > a step
    pacer.step(now, scheduled_tokens=64)
    assert pacer.in_step(3000, now) is not None


def test_a_failed_load_makes_every_load_asynchronous_for_a_while() -> None:
    pacer, now = measured()
    pacer.failed(now)
    assert pacer.in_step(128, now + 1.0) is None
    assert pacer.in_step(128, now + 31.0) is not None


def test_idle_time_is_not_a_step() -> None:
    pacer = LoadPacer(None, timeout_s=5.0)
    pacer.step(0.0, scheduled_tokens=0)  # nothing scheduled: no step to time
    pacer.step(5.0, scheduled_tokens=64)
    pacer.step(100.0, scheduled_tokens=64)  # idle for 95 s in between
    assert pacer.step_s() is None
    steps(pacer, 100.05, 4, 0.05)
    assert pacer.step_s() == pytest.approx(0.05)


def test_the_in_step_deadline_never_exceeds_the_load_timeout() -> None:
    pacer = LoadPacer(None, timeout_s=0.05)
    now = steps(pacer, 0.0, 8, 0.1)
    pacer.observe(1, 0.001, 128)
    pacer.observe(1, 0.001, 128)
    assert pacer.in_step(128, now) == 0.05
