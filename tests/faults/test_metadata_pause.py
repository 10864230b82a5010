"""A metadata service paused for longer than a lease (SIGSTOP, a stalled host)
must not expire every store when it resumes: none of them failed, their
heartbeats could not be processed. Real daemons, the embedded index, whose
leases only that process keeps. Nor does a client wait out the pause for
chunks it knows a store holds: a read that one store just served whole is
served by it again, without waiting for the paused service's answer."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from kvdepot.connector.client import ClientConfig, KVDepotClient
from kvdepot.connector.fallback import QUIET_S
from kvdepot.keys import Namespace, chunk_keys
from tests.faults.test_metadata_faults import metadata, payload, store, wait_for

pytestmark = [pytest.mark.faults, pytest.mark.integration]

NS = Namespace("test/metadata-pause", chunk_tokens=16)
LEASE_S = 1.5


def test_a_paused_metadata_service_keeps_its_stores_when_it_resumes(tmp_path: Path) -> None:
    with (
        metadata("memory://", tmp_path / "metadata.log", lease_ttl_s=LEASE_S) as meta,
        store(meta["port"], tmp_path / "store.log"),
        KVDepotClient(
            ClientConfig(metadata=f"127.0.0.1:{meta['port']}", rpc_timeout_s=2.0)
        ) as client,
    ):
        assert wait_for(lambda: len(client.stats().nodes) == 1), "store not registered"
        keys = chunk_keys(NS, list(range(16 * 6)))
        assert client.put(keys, [payload(k) for k in keys]).stored == len(keys)
        before = client.stats().nodes_expired

        os.kill(meta["pid"], signal.SIGSTOP)
        try:
            time.sleep(3 * LEASE_S)
        finally:
            os.kill(meta["pid"], signal.SIGCONT)

        # Right after it resumes, and for two leases more: every chunk is
        # still named, and nobody expired or had to register again.
        deadline = time.monotonic() + 2 * LEASE_S
        while time.monotonic() < deadline:
            assert client.lookup(keys, count="none") == len(keys)
            time.sleep(0.1)
        assert client.stats().nodes_expired == before
        assert "registering again" not in (tmp_path / "store.log").read_text()
        assert "did not run" in (tmp_path / "metadata.log").read_text()
        bufs = [np.zeros(len(payload(k)), dtype=np.uint8) for k in keys]
        assert client.get_into(keys, bufs, count="none").leading == len(keys)


def test_a_read_one_store_served_whole_does_not_wait_for_a_paused_service(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvdepot.connector.fallback")
    with (
        metadata("memory://", tmp_path / "metadata.log", lease_ttl_s=LEASE_S) as meta,
        store(meta["port"], tmp_path / "store.log"),
        # No node's store: the store it read from last is all it knows.
        KVDepotClient(
            ClientConfig(metadata=f"127.0.0.1:{meta['port']}", rpc_timeout_s=10.0)
        ) as client,
    ):
        assert wait_for(lambda: len(client.stats().nodes) == 1), "store not registered"
        keys = chunk_keys(NS, list(range(1000, 1000 + 16 * 6)))
        assert client.put(keys, [payload(k) for k in keys]).stored == len(keys)
        # A counted read, through the index: the store served it whole.
        assert client.get_into(keys, _buffers(keys)).leading == len(keys)

        os.kill(meta["pid"], signal.SIGSTOP)
        try:
            time.sleep(2 * LEASE_S)  # longer than a lease
            for _ in range(3):
                bufs = _buffers(keys)
                started = time.monotonic()
                got = client.get_into(keys, bufs)
                took = time.monotonic() - started
                # Before: the lookup waited rpc_timeout_s (10 s), then Unavailable.
                assert took < 2.0, f"{took:.2f} s"
                assert got.leading == len(keys), got.reasons
                for k, buf in zip(keys, bufs, strict=True):
                    assert np.array_equal(buf, payload(k))
        finally:
            os.kill(meta["pid"], signal.SIGCONT)
        time.sleep(QUIET_S)  # then an answer of the service ends the outage in the log
        bufs = _buffers(keys)
        assert client.get_into(keys, bufs).leading == len(keys)
    lines = [r.getMessage() for r in caplog.records]
    # One line for the three reads, one when the service answered again.
    assert len([m for m in lines if "reads served by" in m]) == 1, lines
    assert len([m for m in lines if "answers again" in m and "3 reads" in m]) == 1, lines


def _buffers(keys: Sequence[bytes]) -> list[np.ndarray]:
    return [np.zeros(len(payload(k)), dtype=np.uint8) for k in keys]
