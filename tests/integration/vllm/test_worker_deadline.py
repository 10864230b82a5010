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
from kvdepot.connector.vllm.chunk_format import build_object, head_key
from kvdepot.connector.vllm.layout import KVLayout
from kvdepot.connector.vllm.plan import KVDepotConnectorMetadata, KVObject, LoadPlan, Source
from kvdepot.connector.vllm.settings import ConnectorSettings
from kvdepot.connector.vllm.stats import SOURCES_KEY, Counters
from kvdepot.connector.vllm.worker import WorkerSide
from kvdepot.keys import Namespace, chunk_keys
from tests.procs import freeze

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
    freeze(store.pid)
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
    counts = nonzero(counters)
    # Reported as a load that took at least its deadline (the cost gate's figure).
    late_us = counts.pop("load_late_us")
    assert abs(late_us - DEADLINE_S * 1e6) < 1000, counts
    # ... under no source (the plan named none).
    assert counts.pop(SOURCES_KEY) == {"": [0, 0, 0, 1, late_us, BLOCK]}
    want = {"loads_timed_out": 1, "load_errors": 1, "load_late": 1, "load_late_tokens": BLOCK}
    assert counts == want, counts
    worker.shutdown()
    client.close()


def test_a_probe_is_timed_and_written_nowhere(cluster: LocalCluster) -> None:
    """The cost gate's probe: a declined request's load fetched and timed in
    the background; no request waits for it, no block is written. From a
    frozen store it is given up at the load deadline and reported late."""
    meta = cluster.metadata_address
    settings = ConnectorSettings(
        metadata=meta, chunk_tokens=BLOCK, transport="tcp", load_timeout_s=DEADLINE_S
    )
    layout = KVLayout("cpu", "bfloat16", BLOCK, LAYERS, HEADS, HEAD, "test", BLOCK)
    ns = Namespace("probe", chunk_tokens=BLOCK)
    key = chunk_keys(ns, list(range(BLOCK)))[0]
    counters = Counters()
    store = cluster.stores[0]
    client = KVDepotClient(
        ClientConfig(
            metadata=meta, node_id=store.info["node_id"], transport="tcp", io_timeout_s=5.0
        )
    )
    codec = create_codec(CodecSpec("none", 128))
    worker = WorkerSide(
        settings, layout, codec, client, namespace=ns, is_producer=False, counters=counters
    )
    caches = {f"layer.{i}": torch.zeros((4, 2, BLOCK, HEADS, HEAD), dtype=torch.bfloat16)
              for i in range(LAYERS)}  # fmt: skip
    worker.register_kv_caches(caches)
    objects = [
        build_object(codec, [torch.randn(2, BLOCK, HEAD) for _ in range(LAYERS)], torch.bfloat16)
        for _ in range(HEADS)
    ]
    keys = [head_key(ns.digest(), key, h) for h in range(HEADS)]
    assert client.put(keys, [np.frombuffer(o, dtype=np.uint8) for o in objects]).stored == 2
    source = Source(store.info["node_id"], store.info["address"], "cpu")
    objects = (KVObject(key, 0, (), 0, BLOCK),)
    probe = LoadPlan("req", objects, 0, True, False, 0.0, BLOCK, True, source)

    def run_probe() -> dict[str, int]:
        worker.start_load_kv(KVDepotConnectorMetadata(loads=[probe]))
        deadline = time.monotonic() + 10
        while worker._fetcher is not None and worker._fetcher.pending():
            assert worker.get_finished() == (set(), set())  # no request waits for it
            assert time.monotonic() < deadline
        return nonzero(counters)

    counts = run_probe()
    took_us = counts.pop("load_timed_us")
    assert took_us > 0
    # Its time goes under its source, for the gate of that store alone.
    assert counts.pop(SOURCES_KEY) == {source.label: [1, took_us, BLOCK, 0, 0, 0]}
    assert counts == {"load_timed": 1, "load_timed_tokens": BLOCK}, counts
    assert all(not c.any() for c in caches.values())  # written nowhere
    freeze(store.pid)
    try:
        counts = run_probe()
    finally:
        os.kill(store.pid, signal.SIGCONT)
    late_us = counts.pop("load_late_us")
    assert late_us == int(DEADLINE_S * 1e6)
    assert counts.pop(SOURCES_KEY) == {source.label: [0, 0, 0, 1, late_us, BLOCK]}
    assert counts == {"loads_timed_out": 1, "load_late": 1, "load_late_tokens": BLOCK}, counts
    worker.shutdown()
    client.close()


def nonzero(counters: Counters) -> dict[str, int]:
    """The counts taken since the last call that are not zero."""
    taken = counters.take()
    assert taken is not None
    return {k: v for k, v in taken.data.items() if v}
