"""The workers' load times by source, as they travel to the scheduler."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

from kvdepot.connector.vllm.stats import (
    SOURCES_KEY,
    Counters,
    KVDepotConnectorStats,
)


def test_figures_by_source_add_up_across_workers_and_stay_out_of_the_log_line() -> None:
    ranks = [Counters(), Counters()]
    for counters in ranks:
        counters.add(load_timed=1, load_timed_us=2000, load_timed_tokens=512)
        counters.add_source("a/cpu", timed=1, timed_us=2000, timed_tokens=512)
    ranks[1].add_source("b/disk", late=1, late_us=5_000_000, late_tokens=256)
    first, second = (c.take() for c in ranks)
    assert first is not None and second is not None
    shared = second.data[SOURCES_KEY]
    total = KVDepotConnectorStats(data=dict(first.data)).aggregate(second)
    assert total.data[SOURCES_KEY] == {
        "a/cpu": [2, 4000, 1024, 0, 0, 0],
        "b/disk": [0, 0, 0, 1, 5_000_000, 256],
    }
    assert total.data["load_timed"] == 2
    assert second.data[SOURCES_KEY] is shared and shared["a/cpu"] == [1, 2000, 512, 0, 0, 0]
    assert SOURCES_KEY not in total.reduce()  # vLLM's log line shows the totals
    # What vLLM rebuilds from a report (the engine's logger) aggregates too.
    rebuilt = KVDepotConnectorStats(data={}).aggregate(total)
    assert rebuilt.data[SOURCES_KEY] == total.data[SOURCES_KEY]
