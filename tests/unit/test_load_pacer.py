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


def computing(pacer: LoadPacer, start: float, per_token_s: float, base_s: float = 0.005) -> float:
    """Steps of 64 and 512 tokens taking ``base_s + per_token_s`` a token."""
    t = start
    for i in range(16):
        tokens = 64 if i % 2 else 512
        pacer.step(t, scheduled_tokens=tokens)
        t += base_s + per_token_s * tokens
    pacer.step(t, scheduled_tokens=64)
    return t


def test_a_load_is_declined_only_when_computing_its_tokens_is_clearly_faster() -> None:
    pacer = LoadPacer(None, timeout_s=5.0)
    assert pacer.pays(4096, 0.0)  # nothing measured: load
    now = computing(pacer, 0.0, per_token_s=1e-4)  # 0.1 ms a token
    assert pacer.compute_s(1000) == pytest.approx(0.1, rel=0.01)
    assert pacer.pays(4096, now)  # no load timed yet
    # A slow store: 50 ms + 1 ms a token, ten times the compute.
    for tokens in (256, 1024):
        pacer.observe(1, 0.05 + 1e-3 * tokens, tokens)
    assert not pacer.pays(4096, now)
    assert not pacer.pays(16, now)  # its fixed 50 ms alone is 30 times the compute


def test_a_load_that_fits_in_a_step_is_never_declined() -> None:
    pacer = LoadPacer(None, timeout_s=5.0)
    now = computing(pacer, 0.0, per_token_s=1e-4)  # steps of 11-56 ms
    for tokens in (256, 1024):
        pacer.observe(1, 1e-3 * tokens, tokens)  # ten times the compute of its tokens
    step = pacer.step_s()
    assert step is not None and pacer.estimate_s(16) == pytest.approx(0.016)
    assert step > 0.016
    assert pacer.pays(16, now)  # it costs the request at most the step it waits
    assert not pacer.pays(1024, now)


def test_a_declining_gate_measures_the_store_again_less_often_while_it_stays_slow() -> None:
    pacer = LoadPacer(None, timeout_s=5.0)
    now = computing(pacer, 0.0, per_token_s=1e-4)

    def slow() -> None:
        pacer.observe(1, 0.05 + 1e-3 * 1024, 1024)

    slow()
    assert not pacer.pays(4096, now) and not pacer.take_probe()  # declining from now on
    assert not pacer.pays(4096, now + 9.9) and not pacer.take_probe()
    # After 10 s a declined load is sent as a probe (its request computes);
    # the others wait for its figure.
    assert not pacer.pays(4096, now + 10.0)
    assert pacer.take_probe() and not pacer.take_probe()
    assert not pacer.pays(4096, now + 10.1) and not pacer.take_probe()
    slow()  # still slow: declined, and the next probe comes after 20 s
    assert not pacer.pays(4096, now + 11.0)
    assert not pacer.pays(4096, now + 29.9) and not pacer.take_probe()
    assert not pacer.pays(4096, now + 30.0) and pacer.take_probe()

    def fast() -> None:
        pacer.observe(1, 0.001 + 1e-6 * 1024, 1024)

    # This time the store answers fast: one fast figure among slow ones
    # (a lucky load) does not open the gate, but the next probe comes 10 s on.
    fast()
    assert not pacer.pays(4096, now + 30.1)
    assert not pacer.pays(4096, now + 39.9) and not pacer.take_probe()
    assert not pacer.pays(4096, now + 40.1) and pacer.take_probe()
    fast()
    assert not pacer.pays(4096, now + 40.2)  # 2 fast, 2 slow
    assert not pacer.pays(4096, now + 50.2) and pacer.take_probe()
    fast()  # most recent figures fast: loads go ahead again
    assert pacer.pays(4096, now + 50.3)
    assert pacer.pays(65536, now + 50.4)


def test_loads_given_up_in_a_row_count_as_their_deadline() -> None:
    pacer = LoadPacer(None, timeout_s=5.0)
    now = computing(pacer, 0.0, per_token_s=1e-4)
    # One stalled store's single timeout does not close the gate ...
    pacer.late(1, 5.0, 1024)
    assert pacer.pays(1024, now)
    # ... a store that keeps missing the deadline does: at least 5 s a load.
    pacer.late(1, 5.0, 1024)
    assert not pacer.pays(1024, now)
    # A load fetched whole in between starts the count again.
    fresh = LoadPacer(None, timeout_s=5.0)
    now = computing(fresh, 0.0, per_token_s=1e-4)
    fresh.late(1, 5.0, 1024)
    fresh.observe(1, 0.01, 1024)
    fresh.late(1, 5.0, 1024)
    assert fresh.pays(1024, now)
    # A probe given up at its deadline counts at once: still slow.
    pacer.pays(1024, now + 10.0)
    assert pacer.take_probe()
    pacer.late(1, 5.0, 1024)
    assert not pacer.pays(1024, now + 15.1) and not pacer.take_probe()


def test_a_probe_that_never_reports_is_sent_again() -> None:
    pacer = LoadPacer(None, timeout_s=5.0)
    now = computing(pacer, 0.0, per_token_s=1e-4)
    pacer.observe(1, 1.0, 1024)
    assert not pacer.pays(4096, now)
    assert not pacer.pays(4096, now + 10.0) and pacer.take_probe()  # it never reports
    assert not pacer.pays(4096, now + 19.9)  # waiting for it, 2 x the load deadline
    # Its report may wait for an idle engine's next step: one more probe ...
    assert not pacer.pays(4096, now + 20.0) and pacer.take_probe()
    assert not pacer.pays(4096, now + 29.9) and not pacer.take_probe()
    # ... then the figures it had decide, and probes go on.
    assert not pacer.pays(4096, now + 30.0) and pacer.take_probe()
    pacer.observe(1, 0.001, 1024)  # this one answers
    assert not pacer.pays(4096, now + 30.1) and not pacer.take_probe()


def test_a_fast_store_is_always_loaded() -> None:
    pacer = LoadPacer(None, timeout_s=5.0)
    now = computing(pacer, 0.0, per_token_s=1e-4)
    for tokens in (256, 1024, 4096):
        pacer.observe(1, 0.002 + 1e-5 * tokens, tokens)  # 10x cheaper than compute
    assert all(pacer.pays(t, now) for t in (16, 256, 4096, 65536))


def test_a_slow_first_step_does_not_make_computing_look_expensive() -> None:
    """A first prefill pays for warm-up (2.6 s for 88 tokens in one engine
    run); the cost of a token is read from the fastest steps of each size."""
    pacer = LoadPacer(None, timeout_s=5.0)
    t = 0.0
    for tokens, seconds in [(88, 2.6)] + [(1, 0.004)] * 7 + [(88, 0.019)] + [(1, 0.004)] * 7:
        pacer.step(t, scheduled_tokens=tokens)
        t += seconds
    pacer.step(t, scheduled_tokens=1)
    assert pacer.compute_s(512) == pytest.approx(512 * 0.015 / 87, rel=0.01)
    pacer.observe(1, 0.3, 512)
    pacer.observe(1, 0.32, 512)
    assert not pacer.pays(512, t)  # 300 ms to fetch what computes in 90


def test_each_source_is_judged_by_its_own_loads() -> None:
    """While one store is slow, loads from another (or from a tier of it
    never timed) go ahead; probes measure the slow one alone."""
    pacer = LoadPacer(None, timeout_s=5.0)
    now = computing(pacer, 0.0, per_token_s=1e-4)
    for tokens in (256, 1024):
        pacer.observe(1, 0.05 + 1e-3 * tokens, tokens, source="node-a/cpu")
        pacer.observe(1, 0.002 + 1e-6 * tokens, tokens, source="node-b/cpu")
    assert not pacer.pays(4096, now, "node-a/cpu")
    assert pacer.pays(4096, now, "node-b/cpu")
    assert pacer.pays(4096, now, "node-a/disk")  # never timed: loaded, so timed
    assert not pacer.pays(4096, now + 10.0, "node-a/cpu")
    assert not pacer.take_probe("node-b/cpu") and pacer.take_probe("node-a/cpu")
    # While node-a's probe is under way, node-b's loads do not wait for it.
    assert pacer.pays(4096, now + 10.1, "node-b/cpu")
    # Loads given up at their deadline count against their own source only.
    pacer.late(1, 5.0, 1024, source="node-c/cpu")
    pacer.late(1, 5.0, 1024, source="node-c/cpu")
    assert not pacer.pays(1024, now + 10.2, "node-c/cpu")
    assert pacer.pays(1024, now + 10.2, "node-b/cpu")
