"""The vLLM connector's counters as Prometheus series (vLLM's KV-connector metrics hook)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the connector's package imports vLLM")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvdepot.connector.vllm import KVDepotConnector
from kvdepot.connector.vllm.stats import PROM_SERIES, STAT_KEYS, KVDepotConnectorStats

# Read by the scheduler's load pacing and by tests, not an operator's figures.
_INTERNAL = {
    "load_timed",
    "load_timed_us",
    "load_timed_tokens",
    "load_late",
    "load_late_us",
    "load_late_tokens",
    "bytes_loaded_rank0",
}


def _metrics(registry: CollectorRegistry) -> Any:
    """The connector's metrics object, built the way vLLM's Prometheus logger builds it."""

    def bound(cls: type) -> type:
        return type(cls.__name__, (cls,), {"__init__": _with_registry(cls, registry)})

    types = {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)}
    return KVDepotConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None),
        types,  # type: ignore[arg-type]
        ["model_name", "engine"],
        {0: ["m", "0"], 1: ["m", "1"]},
    )


def _with_registry(cls: type, registry: CollectorRegistry) -> Any:
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        cls.__init__(self, *args, registry=registry, **kwargs)

    return init


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            if s.name.endswith("_total"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_every_counter_an_operator_reads_is_exported() -> None:
    exported = set()
    for _, _, _, values in PROM_SERIES:
        for fn in values.values():
            for key in STAT_KEYS:
                if fn({key: 1}):
                    exported.add(key)
    assert exported == set(STAT_KEYS) - _INTERNAL


def test_intervals_add_up_per_engine_with_reasons_as_labels() -> None:
    registry = CollectorRegistry()
    prom = _metrics(registry)
    # A step's stats: the workers' and the scheduler's summed, as vLLM sends them.
    worker = KVDepotConnectorStats(data={"tokens_hit": 512, "chunks_loaded": 2, "saves_dropped": 1})
    sched = KVDepotConnectorStats(
        data={"lookups": 3, "lookup_errors": 2, "lookup_timeouts": 1, "loads_sync": 1}
    )
    prom.observe(worker.aggregate(sched).to_dict(), engine_idx=0)
    prom.observe({"tokens_hit": 128, "lookups_skipped": 4, "loads_async": 1}, engine_idx=0)
    prom.observe({"tokens_hit": 7}, engine_idx=1)
    got = _samples(registry)

    def value(name: str, **labels: str) -> float:
        key = tuple(sorted({"model_name": "m", "engine": "0", **labels}.items()))
        return got[(f"vllm:kvdepot_{name}_total", key)]

    assert value("loaded_tokens") == 640
    assert value("loaded_tokens", engine="1") == 7
    assert value("lookups") == 3
    assert value("lookup_failures", reason="deadline") == 1
    assert value("lookup_failures", reason="error") == 1
    assert value("loads", mode="in_step") == 1 and value("loads", mode="async") == 1
    assert value("loads_declined", reason="breaker_open") == 4
    assert value("saves_dropped_objects") == 1
    # Held and served are separate series; nothing was reported held here.
    assert value("lookup_hit_tokens") == 0
