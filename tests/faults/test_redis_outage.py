"""A Redis outage under a running metadata service, as its users see it.

Redis (the metadata service's index) is killed. ``kvdepot stats`` prints one
line naming the metadata service and Redis and exits 1; a client with no
store of its own on its node gets ``Unavailable`` from its lookups, puts,
loads and stats; a client whose node has a store is answered by that store
(see kvdepot.connector.fallback). The metadata log gets no
traceback and no line per failed call: over a fixed outage of 8 s with
hundreds of failed calls (and the store's heartbeats), one line per kind of
failure (the next would come 10 s later, with the count since).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kvdepot.apps.cluster import LocalCluster
from kvdepot.connector.client import ClientConfig, KVDepotClient
from kvdepot.errors import Unavailable
from kvdepot.keys import Namespace, chunk_keys
from tests.conftest import _redis_binaries, _start_redis, _stop_redis, free_port
from tests.faults.support import ReadTally, payload, sentinel_buffers

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.redis]

NS = Namespace("test/redis-outage", chunk_tokens=16)
CHUNK = 16 << 10
OUTAGE_S = 8.0
HEARTBEAT_S = 0.3


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


RESTART_AFTER_S = 3.8
"""Redis's outage in the test below: a store's heartbeats backed off
(1 s, then 2 s) would have tried last about 0.5 s before the restart and
would try next about 1.2 s after it."""


class NodeClient:
    """A client of the cluster's one node putting, looking up and loading
    fresh chunks in a loop on a thread of its own; what goes wrong is kept."""

    def __init__(self, client: KVDepotClient) -> None:
        self.client = client
        self.tally = ReadTally()
        self.published: list[list[bytes]] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def cycle(self, n: int, index_up: bool) -> None:
        keys = chunk_keys(NS, [n] * 16 * 3)
        result = self.client.put(keys, [payload(k, CHUNK) for k in keys])
        assert result.failed == 0 and result.stored + result.skipped + result.pending == 3
        self.published.append(keys)
        hits = self.client.lookup([*keys, *chunk_keys(NS, [n + 1] * 16)])
        # An index back empty names them once the store registered again.
        assert hits == 3 or not index_up, hits
        bufs = sentinel_buffers(3, CHUNK)
        got = self.client.get_into(keys, bufs)
        assert self.tally.add(keys, bufs, got, lambda k: payload(k, CHUNK)) == 3

    def _run(self) -> None:
        n = 100
        try:
            while not self._stop.is_set():
                n += 2
                self.cycle(n, index_up=False)
        except BaseException as exc:  # the test's thread reports it
            self.errors.append(exc)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        assert not self._thread.is_alive() and not self.errors, self.errors


def _first_put(client: KVDepotClient, keys: list[bytes], since: float) -> float:
    """Seconds from ``since`` until a put of ``keys`` is not refused."""
    while True:
        try:
            assert client.put(keys, [payload(k, CHUNK) for k in keys]).failed == 0
            return time.monotonic() - since
        except Unavailable:
            assert time.monotonic() - since < 10, "no put after the restart"
            time.sleep(0.01)


def _all_indexed_and_exact(client: KVDepotClient, node: NodeClient) -> None:
    deadline = time.monotonic() + 10
    while not all(client.lookup(keys) == 3 for keys in node.published):
        assert time.monotonic() < deadline, "published chunks not all indexed"
        time.sleep(0.1)
    every = [k for keys in node.published for k in keys]
    bufs = sentinel_buffers(len(every), CHUNK)
    got = client.get_into(every, bufs)
    assert node.tally.add(every, bufs, got, lambda k: payload(k, CHUNK)) == len(every)


def test_a_client_with_its_nodes_store_rides_out_redis_restarted_empty(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis is killed, then restarted empty on the same port, under a client
    whose node's store is the cluster's (``node_id``) and one with none.

    The first puts, looks up and loads chunks throughout, and none fails: its
    lookups are answered by its store, its loads read it, its puts go into
    it (the store owes their index commits). Every byte read is the
    published one. The store registers again within a heartbeat of the
    restart, and the client with no store of its own, refused while Redis
    was down, puts again by then. Every chunk published meanwhile is in the
    rebuilt index. The fallbacks are logged a line per kind, not per call.
    """
    caplog.set_level(logging.INFO, logger="kvdepot.connector.fallback")
    binary = _redis_binaries("redis-server")["redis-server"]
    port = free_port()
    procs = [_start_redis(binary, tmp_path / "redis", port)]
    try:
        with LocalCluster(
            nodes=1,
            capacity="64MiB",
            lease_ttl_s=1.5,
            heartbeat_interval_s=HEARTBEAT_S,
            log_dir=tmp_path / "logs",
            index=f"redis://127.0.0.1:{port}/0",
        ) as cl:
            address = cl.metadata_address
            node_id = cl.stores[0].info["node_id"]
            config = ClientConfig(metadata=address, rpc_timeout_s=5)
            with (
                KVDepotClient(replace(config, node_id=node_id)) as mine,
                KVDepotClient(config) as other,
            ):
                node = NodeClient(mine)
                node.cycle(0, index_up=True)  # learns its store's address
                probe = chunk_keys(NS, [7] * 16)
                procs[0].kill()
                procs[0].wait()
                killed = time.monotonic()
                node.start()
                try:
                    with pytest.raises(Unavailable, match="redis index unavailable"):
                        other.put(probe, [payload(probe[0], CHUNK)])
                    time.sleep(max(0.0, killed + RESTART_AFTER_S - time.monotonic()))
                    outage_cycles = len(node.published)
                    procs.append(_start_redis(binary, tmp_path / "redis", port))  # empty
                    took = _first_put(other, probe, time.monotonic())
                    time.sleep(1.0)  # the client of the node goes on meanwhile
                finally:
                    node.stop()
                # Before: ~1.5 s (the store's next heartbeat, backed off), ~70 puts refused.
                assert took < 3 * HEARTBEAT_S, f"puts refused for {took:.2f} s after the restart"
                assert node_id in {n.node_id for n in other.stats().nodes}
                assert outage_cycles >= 5, "too few cycles to show anything"
                _all_indexed_and_exact(other, node)
        assert "registering again" in (tmp_path / "logs" / "store-0.log").read_text()
    finally:
        _stop_redis(procs)
    assert node.tally.wrong == 0 and node.tally.misses == 0, node.tally
    fallbacks = [r.getMessage() for r in caplog.records if r.name.endswith("fallback")]
    for kind in ("lookups answered by", "puts stored in"):
        # One line for the outage; one more if the window before the store
        # registered again refused a put after the service answered.
        assert 1 <= len([m for m in fallbacks if kind in m]) <= 2, fallbacks
    assert len(fallbacks) <= 8, fallbacks
