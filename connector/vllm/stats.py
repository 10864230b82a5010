"""The connector's counters, their Prometheus series, and its logging inside vLLM.

Two figures are kept apart: what the cluster *held* when a request was
looked up (``lookup_hit_tokens``, counted once per request) and what the
engine was *served* (``tokens_hit``: tokens whose KV a load put into the
engine). They differ by what vLLM's own prefix cache already had, by loads
that failed or were declined, and by the tail an in-step load leaves to the
engine; only the served figure equals vLLM's
``vllm:prompt_tokens_by_source{source="external_kv_transfer"}``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

STAT_KEYS = (
    # Lookups: what the cluster held when asked.
    "lookups",  # requests looked up in the metadata service (once each)
    "lookups_repeated",  # ... looked up again (a waiting request's lookup went stale)
    "lookup_hit_tokens",  # tokens the cluster held at a request's first lookup
    "lookup_errors",  # lookups that failed or missed their deadline
    "lookup_timeouts",  # ... of those, that missed their deadline
    "lookups_skipped",  # new requests not looked up: the breaker was open
    # Loads: what the engine was served.
    "tokens_hit",  # tokens whose KV a load put into the engine (rank 0 counts them)
    "chunks_loaded",  # objects loaded: whole chunks and tail blocks
    "bytes_loaded",
    "load_errors",  # objects planned for a load that did not arrive verified
    "loads_async",  # requests loaded while the batch kept running
    "loads_sync",  # requests loaded inside the step (small loads)
    "loads_timed_out",  # loads given up at their deadline
    "loads_declined_failed",  # requests asked again after a failed load: recomputed
    "loads_declined_cost",  # hits not loaded: loading was expected to be slower
    "tokens_declined_cost",  # ... their tokens, and those of loads cut short (computed instead)
    "loads_cut_cost",  # hits loaded in part: the rest was expected slower to load than compute
    "load_timed",  # loads fetched whole: how long fetching took, for the
    "load_timed_us",  # scheduler's choice of in-step or asynchronous loads
    "load_timed_tokens",
    "load_late",  # loads given up at their deadline (probes too): their
    "load_late_us",  # deadlines and tokens, a lower bound of what fetching takes
    "load_late_tokens",
    "loads_probed",  # loads fetched beside a declined request to time the store
    # Saves.
    "chunks_saved",  # objects published
    "bytes_saved",
    "chunks_skipped",  # objects not sent: the cluster had them
    "save_errors",
    "saves_dropped",  # objects not saved: staging full, or a block left its window
    "bytes_loaded_rank0",  # bytes_loaded by tensor-parallel rank 0 alone (its heads)
)

# Timed and late loads by source (a store's node and tier, as the scheduler
# labelled the load): {source: [SOURCE_FIELDS...]}, for the cost gate. Kept
# apart from the counters: vLLM's log line and Prometheus show the totals.
SOURCES_KEY = "load_sources"
SOURCE_FIELDS = ("timed", "timed_us", "timed_tokens", "late", "late_us", "late_tokens")

# Cumulative counters of this process (tests and operators read them; vLLM's
# own stats interface gets per-interval deltas).
PROCESS_STATS: dict[str, int] = dict.fromkeys(STAT_KEYS, 0)
# The engine's totals as its scheduler sees them: its own counts and those the
# workers report with each step, whichever process they run in (with tensor
# parallelism each rank counts its own shard objects, and they add up).
ENGINE_STATS: dict[str, int] = dict.fromkeys(STAT_KEYS, 0)
_lock = threading.Lock()


@dataclass
class KVDepotConnectorStats(KVConnectorStats):
    """Counters for vLLM's stats logger, summed across workers and intervals."""

    def __post_init__(self) -> None:
        for k in STAT_KEYS:
            self.data.setdefault(k, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(STAT_KEYS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        data: dict[str, Any] = self.data
        for k, v in other.data.items():
            if k == SOURCES_KEY:
                # A copy: the dict may be shared with the report it came from.
                mine = {src: list(f) for src, f in data.get(SOURCES_KEY, {}).items()}
                merge_sources(mine, v)
                data[SOURCES_KEY] = mine
            else:
                data[k] = data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in self.data.items() if k != SOURCES_KEY}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class Counters:
    """One side's counters: the process totals and vLLM's current interval."""

    def __init__(self, scheduler: bool = False) -> None:
        self._interval = KVDepotConnectorStats()
        self._scheduler = scheduler

    def add(self, **deltas: int) -> None:
        with _lock:
            for k, v in deltas.items():
                PROCESS_STATS[k] += v
                self._interval.data[k] += v
                if self._scheduler:
                    ENGINE_STATS[k] += v

    def add_source(self, source: str, **deltas: int) -> None:
        """Count a load's time under its ``source`` (``SOURCE_FIELDS``)."""
        data: dict[str, Any] = self._interval.data
        with _lock:
            merge_sources(
                data.setdefault(SOURCES_KEY, {}),
                {source: [deltas.get(f, 0) for f in SOURCE_FIELDS]},
            )

    @staticmethod
    def add_workers(data: dict[str, int]) -> None:
        """Count what the workers reported for a step into ``ENGINE_STATS``."""
        with _lock:
            for k in STAT_KEYS:
                v = data.get(k, 0)
                if isinstance(v, int) and not isinstance(v, bool):
                    ENGINE_STATS[k] += v

    def take(self) -> KVDepotConnectorStats | None:
        """The counts since the last call, or None when nothing happened."""
        with _lock:
            if self._interval.is_empty():
                return None
            out, self._interval = self._interval, KVDepotConnectorStats()
            return out


def merge_sources(into: dict[str, list[int]], more: Mapping[str, Any]) -> None:
    """Add one report's figures by source to another's."""
    for source, values in more.items():
        have = into.setdefault(str(source), [0] * len(SOURCE_FIELDS))
        for i, v in enumerate(list(values)[: len(SOURCE_FIELDS)]):
            have[i] += int(v)


def attach_to_vllm_logging() -> None:
    """Send ``kvdepot.*`` records through vLLM's handlers (its format, time
    and level), so the connector's and the client's lines land in vLLM's log."""
    ours = logging.getLogger("kvdepot")
    if ours.handlers:
        return
    theirs = logging.getLogger("vllm")
    if not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level or logging.INFO)
    ours.propagate = False


def _key(name: str) -> Callable[[Mapping[str, Any]], int]:
    return lambda d: int(d.get(name, 0))


def _lookup_errors(d: Mapping[str, Any]) -> int:
    # A timed-out lookup is counted in both keys: here it is a deadline miss.
    return max(0, int(d.get("lookup_errors", 0)) - int(d.get("lookup_timeouts", 0)))


# (series, help, label, {label value: value of an interval's counts}); the
# label is "" for a series without one. Names carry vLLM's prefix, so vLLM
# drops and recreates them with its own series (a new engine, a new logger).
PROM_SERIES: tuple[tuple[str, str, str, dict[str, Callable[[Mapping[str, Any]], int]]], ...] = (
    (
        "vllm:kvdepot_lookups",
        "Requests the connector looked up in kvdepot (once per request).",
        "",
        {"": _key("lookups")},
    ),
    (
        "vllm:kvdepot_lookups_repeated",
        "Further lookups of a request already looked up (it waited for KV blocks).",
        "",
        {"": _key("lookups_repeated")},
    ),
    (
        "vllm:kvdepot_lookup_failures",
        "Lookups that got no answer, by reason (deadline: missed the lookup deadline).",
        "reason",
        {"deadline": _key("lookup_timeouts"), "error": _lookup_errors},
    ),
    (
        "vllm:kvdepot_lookup_hit_tokens",
        "Prompt tokens kvdepot held when a request was first looked up (held, not served).",
        "",
        {"": _key("lookup_hit_tokens")},
    ),
    (
        "vllm:kvdepot_loaded_tokens",
        "Prompt tokens whose KV a load from kvdepot put into the engine (served).",
        "",
        {"": _key("tokens_hit")},
    ),
    (
        "vllm:kvdepot_loaded_objects",
        "Objects (chunks and tail blocks) loaded into the engine.",
        "",
        {"": _key("chunks_loaded")},
    ),
    ("vllm:kvdepot_loaded_bytes", "Bytes loaded into the engine.", "", {"": _key("bytes_loaded")}),
    (
        "vllm:kvdepot_loads",
        "Requests' loads started, by mode (async: the batch kept running; in_step: in the step).",
        "mode",
        {"async": _key("loads_async"), "in_step": _key("loads_sync")},
    ),
    (
        "vllm:kvdepot_loads_failed",
        "Loads given up, by reason (deadline: not done within load_timeout_s).",
        "reason",
        {"deadline": _key("loads_timed_out")},
    ),
    (
        "vllm:kvdepot_load_failed_objects",
        "Objects of a load that did not arrive verified (missing, corrupt or late): recomputed.",
        "",
        {"": _key("load_errors")},
    ),
    (
        "vllm:kvdepot_loads_declined",
        "Requests the connector did not load for, by reason (breaker_open: not looked up, "
        "lookups kept failing; after_failed_load: recomputed after their load failed; "
        "slower_than_compute: loading was expected to take longer than computing; "
        "partly_slower_than_compute: only a leading part was loaded, the rest lives where "
        "loading it was expected to take longer).",
        "reason",
        {
            "breaker_open": _key("lookups_skipped"),
            "after_failed_load": _key("loads_declined_failed"),
            "slower_than_compute": _key("loads_declined_cost"),
            "partly_slower_than_compute": _key("loads_cut_cost"),
        },
    ),
    (
        "vllm:kvdepot_declined_tokens",
        "Prompt tokens held but computed: their load was expected to be slower.",
        "",
        {"": _key("tokens_declined_cost")},
    ),
    (
        "vllm:kvdepot_probed_loads",
        "Declined loads fetched in the background to time the store (the request computed).",
        "",
        {"": _key("loads_probed")},
    ),
    (
        "vllm:kvdepot_saved_objects",
        "Objects published to kvdepot.",
        "",
        {"": _key("chunks_saved")},
    ),
    ("vllm:kvdepot_saved_bytes", "Bytes published to kvdepot.", "", {"": _key("bytes_saved")}),
    (
        "vllm:kvdepot_save_skipped_objects",
        "Objects not sent: kvdepot had them already.",
        "",
        {"": _key("chunks_skipped")},
    ),
    (
        "vllm:kvdepot_save_failed_objects",
        "Objects whose publishing failed.",
        "",
        {"": _key("save_errors")},
    ),
    (
        "vllm:kvdepot_saves_dropped_objects",
        "Objects not saved: the staging buffer was full (or a block had left a sliding window).",
        "",
        {"": _key("saves_dropped")},
    ),
)


class KVDepotPromMetrics(KVConnectorPromMetrics):
    """The connector's counters as Prometheus counters on the engine's ``/metrics``.

    vLLM hands each step's summed counts (workers and scheduler, see
    :class:`KVDepotConnectorStats`) to :meth:`observe`, whether or not its
    log line for the interval is printed.
    """

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # (engine, counter child, value of an interval's counts)
        self._series: list[tuple[int, Any, Callable[[Mapping[str, Any]], int]]] = []
        for name, doc, label, values in PROM_SERIES:
            names = [*labelnames, label] if label else list(labelnames)
            counter = self._counter_cls(name=name, documentation=doc, labelnames=names)
            for value, fn in values.items():
                engines = {
                    i: [*lv, value] if label else list(lv)
                    for i, lv in per_engine_labelvalues.items()
                }
                for i, child in create_metric_per_engine(counter, engines).items():
                    self._series.append((i, child, fn))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for i, child, fn in self._series:
            if i == engine_idx and (n := fn(transfer_stats_data)) > 0:
                child.inc(n)
