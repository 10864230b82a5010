"""A Redis outage under a running metadata service, as its users see it.

Redis (the metadata service's index) is killed. ``kvdepot stats`` prints one
line naming the metadata service and Redis and exits 1; the client's lookups,
puts, loads and stats raise ``Unavailable``. The metadata log gets no
traceback and no line per failed call: over a fixed outage of 8 s with
hundreds of failed calls (and the store's heartbeats), one line per kind of
failure (the next would come 10 s later, with the count since).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvdepot.apps.cluster import LocalCluster
from kvdepot.connector.client import ClientConfig, KVDepotClient
from kvdepot.errors import Unavailable
from kvdepot.keys import Namespace, chunk_keys
from tests.conftest import _redis_binaries, _start_redis, _stop_redis, free_port

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.redis]

NS = Namespace("test/redis-outage", chunk_tokens=16)
CHUNK = 16 << 10
OUTAGE_S = 8.0


def test_redis_outage_is_unavailable_in_one_line_and_logged_with_backoff(tmp_path: Path) -> None:
    binary = _redis_binaries("redis-server")["redis-server"]
    port = free_port()
    redis = _start_redis(binary, tmp_path / "redis", port)
    log = tmp_path / "logs" / "metadata.log"
    calls = 0
    try:
        with LocalCluster(
            nodes=1,
            capacity="32MiB",
            lease_ttl_s=3.0,
            heartbeat_interval_s=0.3,
            log_dir=tmp_path / "logs",
            index=f"redis://127.0.0.1:{port}/0",
        ) as cl:
            address = cl.metadata_address
            keys = chunk_keys(NS, [1] * 16 * 3)
            chunks = [np.full(CHUNK, i, dtype=np.uint8) for i in range(3)]
            with KVDepotClient(ClientConfig(metadata=address, rpc_timeout_s=5)) as client:
                assert client.put(keys, chunks).stored == 3
                assert client.lookup(keys) == 3
                before = len(log.read_text().splitlines())

                redis.kill()
                redis.wait()
                stats = subprocess.run(
                    [sys.executable, "-m", "kvdepot.apps.cli", "stats", "--metadata", address],
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                assert stats.returncode == 1
                lines = stats.stderr.splitlines()
                assert len(lines) == 1, stats.stderr
                assert f"metadata {address} unavailable: redis index unavailable" in lines[0]
                assert "(retry later)" in lines[0]
                assert "Unexpected" not in lines[0] and "class" not in lines[0]

                deadline = time.monotonic() + OUTAGE_S
                while time.monotonic() < deadline:
                    for call in (
                        lambda: client.lookup(keys),
                        lambda: client.put(keys, chunks),
                        lambda: client.get_into(keys, [bytearray(CHUNK) for _ in keys]),
                        client.stats,
                    ):
                        with pytest.raises(Unavailable, match="redis index unavailable"):
                            call()
                        calls += 1
                    time.sleep(0.02)
                outage = log.read_text().splitlines()[before:]
    finally:
        _stop_redis([redis])
    assert calls >= 40, "too few calls to show anything"
    assert not [line for line in outage if "Traceback" in line or "Unexpected" in line], outage
    failing = [line for line in outage if "metadata calls failing" in line]
    assert len(failing) == 1, failing
    assert "redis index unavailable" in failing[0]
    assert len([line for line in outage if "counters not flushed" in line]) <= 1, outage
    # Those two, the health change and the shutdown's few lines.
    assert len(outage) <= 8, outage
