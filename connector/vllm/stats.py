"""The connector's counters and its logging inside vLLM."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

STAT_KEYS = (
    "lookups",  # scheduler lookups sent to the metadata service
    "lookup_errors",  # ... that failed or missed their deadline
    "lookup_timeouts",  # ... of those, that missed their deadline
    "lookups_skipped",  # new requests not looked up: the breaker was open
    "tokens_hit",  # tokens whose KV a load put into the engine
    "chunks_loaded",  # objects loaded: whole chunks and tail blocks
    "bytes_loaded",
    "load_errors",  # objects planned for a load that did not arrive verified
    "loads_async",  # requests loaded while the batch kept running
    "loads_sync",  # requests loaded inside the step (small loads)
    "loads_timed_out",  # loads given up at their deadline
    "load_timed",  # loads fetched whole: how long fetching took, for the
    "load_timed_us",  # scheduler's choice of in-step or asynchronous loads
    "load_timed_tokens",
    "chunks_saved",  # objects published
    "bytes_saved",
    "chunks_skipped",  # objects not sent: the cluster had them
    "save_errors",
    "saves_dropped",  # objects not staged: the staging buffer was full
)

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
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

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
