"""Chunks a store holds but could not index while the metadata service was
frozen must be indexed once it answers again, not left until the store
registers again (issue 37): they take capacity, and no lookup would name
them. Real daemons, the embedded index, a lease long enough that the store
is not expired by the freeze."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from kvdepot.apps.cluster import LocalCluster
from kvdepot.connector.client import ClientConfig, KVDepotClient
from tests.integration.test_cluster import payload
from tests.procs import freeze

pytestmark = [pytest.mark.faults, pytest.mark.integration]

SIZE = 64 << 10
COMMIT_TIMEOUT_S = 0.5


def _keys(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


def test_chunks_stored_while_the_index_was_frozen_are_indexed_once_it_answers(
    tmp_path: Path,
) -> None:
    env = dict(os.environ, KVDEPOT_STORE_INDEX_COMMIT_TIMEOUT_S=str(COMMIT_TIMEOUT_S))
    with LocalCluster(nodes=1, capacity="32MiB", env=env, log_dir=tmp_path, lease_ttl_s=30.0) as c:
        assert c.metadata is not None
        config = ClientConfig(
            metadata=c.metadata_address,
            node_id=c.stores[0].info["node_id"],
            rpc_timeout_s=1.0,
            defer_index_commit=True,
        )
        # The writer stays open throughout, as an engine would: nothing of
        # its own (a close, a later put) commits what the store did not.
        with KVDepotClient(config) as w:
            w.put(_keys(1), [np.ones(SIZE, dtype=np.uint8)])  # learns its node's store
            batches = [_keys(4) for _ in range(5)]
            freeze(c.metadata.proc.pid)
            try:
                for keys in batches:
                    assert w.put(keys, [payload(k, SIZE) for k in keys]).pending == len(keys)
                # Every deferred commit is past its time: the committer gave up on it.
                time.sleep(COMMIT_TIMEOUT_S * 3)
            finally:
                c.metadata.proc.send_signal(signal.SIGCONT)
            keys = [k for b in batches for k in b]
            with KVDepotClient(ClientConfig(metadata=c.metadata_address)) as reader:
                deadline = time.monotonic() + 10
                while True:
                    hits = reader.lookup(keys, count="none")
                    if hits == len(keys) or time.monotonic() > deadline:
                        break
                    time.sleep(0.1)
                assert hits == len(keys), "chunks held by the store stay unindexed"
                out = [np.zeros(SIZE, dtype=np.uint8) for _ in keys]
                assert reader.get_into(keys, out, count="none").leading == len(keys)
                assert all(
                    np.array_equal(a, payload(k, SIZE)) for a, k in zip(out, keys, strict=True)
                )
    # Said once when commits began to fail, once when what was owed went in.
    log = (tmp_path / "store-0.log").read_text()
    assert log.count("index commits are failing") == 1
    assert log.count("could not index in time are indexed now") == 1
