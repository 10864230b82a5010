"""The scheduler's lookups on a busy host: one slow call is a miss of that
request, never kvdepot skipped for the next ones; the deadline follows the
lookups' measured latency; the breaker opens on failures in a row. A real
metadata service and store; slowness by SIGSTOP of the service."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvdepot[vllm]')")

from kvdepot.apps.cluster import LocalCluster
from kvdepot.connector.client import ClientConfig, KVDepotClient
from kvdepot.connector.vllm.lookups import LookupBreaker, LookupDeadline
from kvdepot.connector.vllm.plan import PrefixKeys
from kvdepot.connector.vllm.stats import Counters
from kvdepot.keys import Namespace, chunk_keys
from kvdepot.repeat_log import RepeatLog
from kvdepot.types import LookupResult
from tests.procs import freeze

pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.faults]

NS = Namespace("test/lookup-deadline", chunk_tokens=16)


def _pause(pid: int, seconds: float) -> threading.Thread:
    """SIGSTOP ``pid`` now and SIGCONT it after ``seconds``, on a thread."""
    freeze(pid)

    def resume() -> None:
        time.sleep(seconds)
        os.kill(pid, signal.SIGCONT)

    t = threading.Thread(target=resume)
    t.start()
    return t


def test_one_slow_lookup_does_not_skip_the_next_requests(tmp_path: Path) -> None:
    with LocalCluster(nodes=1, capacity="32MiB", log_dir=tmp_path) as cluster:
        assert cluster.metadata is not None
        config = ClientConfig(metadata=cluster.metadata_address, rpc_timeout_s=0.5)
        with KVDepotClient(config) as client:
            keys = chunk_keys(NS, list(range(16 * 4)))
            client.put(keys, [np.full(4096, i, dtype=np.uint8) for i in range(len(keys))])
            prefix = PrefixKeys(tuple(keys), (), 16, 16)
            counters = Counters(True)
            breaker = LookupBreaker(
                client,
                LookupDeadline(0.05, 0.5),
                1.0,
                3,
                RepeatLog(logging.getLogger(__name__)),
            )
            assert hits(breaker.lookup(prefix, counters)) == len(keys)

            resumed = _pause(cluster.metadata.proc.pid, 0.3)
            assert breaker.lookup(prefix, counters) is None  # this one request misses
            resumed.join()
            # The next request is looked up again, and hits.
            assert hits(breaker.lookup(prefix, counters)) == len(keys)
            assert counters._interval.data["lookups_skipped"] == 0
            assert counters._interval.data["lookup_timeouts"] == 1

            # Failures in a row open it; then requests are skipped and counted.
            stopped = _pause(cluster.metadata.proc.pid, 3.0)
            try:
                for _ in range(3):
                    assert breaker.lookup(prefix, counters) is None
                assert breaker.lookup(prefix, counters) is None
                assert counters._interval.data["lookups_skipped"] == 1
            finally:
                stopped.join()


def test_the_deadline_follows_the_measured_latency() -> None:
    d = LookupDeadline(0.05, 0.5)
    assert d.seconds == 0.05
    for _ in range(20):
        d.answered(0.004)  # a quiet host: the floor
    assert d.seconds == 0.05
    for _ in range(20):
        d.answered(0.04)  # a busy one: three times its 90th percentile
    assert d.seconds == pytest.approx(0.12)
    for _ in range(64):
        d.missed()  # however slow, never beyond the ceiling
    assert d.seconds == 0.5
    for _ in range(64):
        d.answered(0.004)  # and back once the host is quiet again
    assert d.seconds == 0.05


def hits(found: LookupResult | None) -> int | None:
    """The hits of a lookup's answer (None: none came)."""
    return None if found is None else found.hits
