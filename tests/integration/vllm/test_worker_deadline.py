"""An in-step load from a frozen store: the engine step waits once, for the
load's deadline, and the load's blocks are recomputed.

The connector's worker side runs here without an engine (its calls are the
ones vLLM makes in a step) against real daemons; the store is stopped with
SIGSTOP, so its socket accepts and nothing answers.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvdepot[vllm]')")
import torch

from kvdepot.apps.cluster import LocalCluster
from kvdepot.connector.client import ClientConfig, KVDepotClient
from kvdepot.connector.codec import CodecSpec, create_codec
from kvdepot.connector.vllm.layout import KVLayout
from kvdepot.connector.vllm.plan import KVDepotConnectorMetadata, KVObject, LoadPlan
from kvdepot.connector.vllm.settings import ConnectorSettings
from kvdepot.connector.vllm.stats import Counters
from kvdepot.connector.vllm.worker import WorkerSide
from kvdepot.keys import Namespace, chunk_keys

pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.timeout(120)]

LAYERS, BLOCK, HEADS, HEAD = 4, 16, 2, 8
DEADLINE_S = 0.5


def test_an_in_step_load_from_a_frozen_store_costs_one_deadline(cluster: LocalCluster) -> None:
    meta = cluster.metadata_address
    settings = ConnectorSettings(metadata=meta, chunk_tokens=BLOCK, transport="tcp")
    layout = KVLayout("cpu", "bfloat16", BLOCK, LAYERS, HEADS, HEAD, "test", BLOCK)
    key = chunk_keys(Namespace("frozen", chunk_tokens=BLOCK), list(range(BLOCK)))[0]
    counters = Counters()
    store = cluster.stores[0]
    client = KVDepotClient(
        ClientConfig(
            metadata=meta, node_id=store.info["node_id"], transport="tcp", io_timeout_s=5.0
        )
    )
    worker = WorkerSide(
        settings,
        layout,
        create_codec(CodecSpec("none", 128)),
        client,
        namespace=Namespace("frozen", chunk_tokens=BLOCK),
        is_producer=False,
        counters=counters,
    )
    names = [f"layer.{i}" for i in range(LAYERS)]
    worker.register_kv_caches(
        {n: torch.zeros((4, 2, BLOCK, HEADS, HEAD), dtype=torch.bfloat16) for n in names}
    )
    # Listed in the index, on the store about to freeze (its bytes are never read).
    assert client.put([key], [np.zeros(4096, dtype=np.uint8)]).stored == 1
    plan = LoadPlan("req", (KVObject(key, 0, ((1,),)),), 0, False, False, DEADLINE_S)
    os.kill(store.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        worker.start_load_kv(KVDepotConnectorMetadata(loads=[plan]))
        for name in names:  # the forward pass, layer by layer
            worker.wait_for_layer_load(name)
        waited = time.monotonic() - t0
        errors = worker.get_block_ids_with_load_errors()
    finally:
        os.kill(store.pid, signal.SIGCONT)
    # Once for the deadline, not once per layer, nor the 5 s I/O timeout.
    assert DEADLINE_S * 0.9 <= waited < DEADLINE_S + 1.0, waited
    assert errors == {1}, errors  # the load's block is recomputed
    assert nonzero(counters) == {"loads_timed_out": 1, "load_errors": 1}
    worker.shutdown()
    client.close()


def nonzero(counters: Counters) -> dict[str, int]:
    """The counts taken since the last call that are not zero."""
    taken = counters.take()
    assert taken is not None
    return {k: v for k, v in taken.data.items() if v}
