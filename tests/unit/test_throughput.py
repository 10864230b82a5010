"""Transfer rates over a sliding window of counter samples."""

from __future__ import annotations

import pytest

from kvdepot.errors import InvalidArgument
from kvdepot.records import TransferRate
from kvdepot.store.throughput import ThroughputMeter


def test_no_rate_before_two_samples() -> None:
    m = ThroughputMeter(10.0)
    assert m.rate() == TransferRate()
    m.sample(100.0, 5, 5)
    assert m.rate() == TransferRate()


def test_rate_spans_the_window_and_forgets_older_traffic() -> None:
    m = ThroughputMeter(10.0)
    for t in range(11):
        m.sample(float(t), bytes_in=t * 1000, bytes_out=t * 3000)
    r = m.rate()
    assert r.window_s == pytest.approx(10.0)
    assert r.bytes_in_per_s == pytest.approx(1000.0)
    assert r.bytes_out_per_s == pytest.approx(3000.0)
    # Traffic stops: ten quiet seconds later the window holds none of it.
    for t in range(11, 22):
        m.sample(float(t), bytes_in=10_000, bytes_out=30_000)
    assert m.rate().bytes_in_per_s == pytest.approx(0.0)
    assert m.rate().bytes_out_per_s == pytest.approx(0.0)
    assert m.rate().window_s <= 11.0


def test_young_meter_uses_the_span_it_has() -> None:
    m = ThroughputMeter(10.0)
    m.sample(0.0, 0, 0)
    m.sample(2.0, 4000, 0)
    r = m.rate()
    assert r.window_s == pytest.approx(2.0) and r.bytes_in_per_s == pytest.approx(2000.0)


def test_a_counter_that_went_backwards_reads_as_no_traffic() -> None:
    m = ThroughputMeter(10.0)
    m.sample(0.0, 1000, 1000)
    m.sample(1.0, 10, 10)
    assert m.rate().bytes_in_per_s == 0.0
    m.sample(1.0, 99, 99)  # same instant: ignored
    assert m.rate().bytes_in_per_s == 0.0


def test_window_must_be_positive() -> None:
    with pytest.raises(InvalidArgument):
        ThroughputMeter(0)
