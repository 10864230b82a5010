"""A hit is loaded only when that pays: real engines against a store made slow.

The store runs 2 ms in every 252 (SIGSTOP / SIGCONT), so a load of a few
chunks takes tenths of a second while the tiny model computes them in a few
milliseconds. The consumer's first loads go ahead (nothing is measured yet)
and are timed; later requests' loads are declined and their tokens computed,
with the same greedy tokens as the same consumer with ``cost_gate`` off,
which loads every hit.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from kvdepot.apps.cluster import LocalCluster
from kvdepot.proto.gen import store_pb2, store_pb2_grpc

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvdepot[vllm]')")

from .engine import build_tiny_llama
from .test_connector import kv, object_bytes, run_engine, spec

pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.timeout(900)]

PROMPTS = [np.random.default_rng(40 + i).integers(1, 1000, 600).tolist() for i in range(6)]


@contextmanager
def throttled(pid: int, run_s: float = 0.002, stop_s: float = 0.25) -> Iterator[None]:
    """``pid`` runs ``run_s`` of every ``run_s + stop_s`` seconds meanwhile."""
    done = threading.Event()

    def cycle() -> None:
        while not done.is_set():
            os.kill(pid, signal.SIGSTOP)
            done.wait(stop_s)
            os.kill(pid, signal.SIGCONT)
            done.wait(run_s)

    t = threading.Thread(target=cycle, daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join()
        os.kill(pid, signal.SIGCONT)


def test_loads_slower_than_computing_are_declined(tmp_path: Path) -> None:
    model = str(build_tiny_llama(tmp_path / "model"))
    with LocalCluster(nodes=1, capacity="64MiB", log_dir=tmp_path / "logs") as cluster:
        meta, node = cluster.metadata_address, cluster.stores[0].info["node_id"]
        run_engine(tmp_path, spec(model, PROMPTS, kv("kv_producer", meta, node)), "producer")
        runs = {}
        with throttled(cluster.stores[0].pid):
            for gate in (True, False):
                cfg = kv("kv_consumer", meta, node, cost_gate=gate, load_timeout_s=30.0)
                runs[gate] = run_engine(tmp_path, spec(model, PROMPTS, cfg), f"gate-{gate}")

    # Declined requests computed what the others loaded, to the same tokens
    # (loading is token-exact against a plain engine: test_connector.py).
    on_tokens = [o["tokens"] for o in runs[True]["outputs"]]
    assert on_tokens == [o["tokens"] for o in runs[False]["outputs"]]
    on, off = runs[True]["engine_connector"], runs[False]["engine_connector"]
    print("gate on:", {k: v for k, v in on.items() if "load" in k or "declined" in k})
    print("gate off:", {k: v for k, v in off.items() if "load" in k or "declined" in k})
    # Off: every request's hit (4 chunks of 128 and tail units) is loaded.
    assert off["loads_declined_cost"] == 0
    assert off["loads_async"] + off["loads_sync"] == len(PROMPTS)
    assert off["tokens_hit"] >= len(PROMPTS) * 512
    # On: the first loads measure the store; then loads are declined and the
    # declined tokens are computed (served is what was loaded, no more).
    assert on["load_timed"] >= 2
    assert on["loads_declined_cost"] >= 2, on
    assert on["tokens_declined_cost"] >= on["loads_declined_cost"] * 512
    loads = on["loads_async"] + on["loads_sync"]
    assert loads + on["loads_declined_cost"] == len(PROMPTS)
    assert on["tokens_hit"] <= off["tokens_hit"] - on["tokens_declined_cost"]


def test_a_slow_store_does_not_stop_loads_from_a_fast_one(tmp_path: Path) -> None:
    """The gate judges each store by its own loads: prompts published to a
    store made slow are declined, those on a fast store beside it are all
    loaded, each read first from the store the lookup named; a prompt whose
    first chunks are on the fast store and the rest on the slow one loads
    the first and computes the rest. The model is wider than the others'
    (same KV: 2 layers, 2 KV heads of 32): its 512 tokens take tens of
    milliseconds to compute, more than a fast store's load."""
    model = str(build_tiny_llama(tmp_path / "model", hidden=512, heads=16))
    slow_prompts = PROMPTS
    fast_prompts = [np.random.default_rng(80 + i).integers(1, 1000, 600).tolist() for i in range(6)]
    split = [np.random.default_rng(90 + i).integers(1, 1000, 600).tolist() for i in range(4)]
    with LocalCluster(nodes=2, capacity="64MiB", log_dir=tmp_path / "logs") as cluster:
        meta = cluster.metadata_address
        slow, fast = cluster.stores
        # The fast store first: the split prompts' first two chunks go there,
        # and the slow store's producer publishes only the rest of them.
        made = {}
        for name, store, prompts in (
            ("fast", fast, fast_prompts + [p[:256] for p in split]),
            ("slow", slow, slow_prompts + split),
        ):
            cfg = kv("kv_producer", meta, store.info["node_id"])
            made[name] = run_engine(tmp_path, spec(model, prompts, cfg), name)["outputs"]
        served_before = store_stats(fast).bytes_out
        mixed = [p for pair in zip(slow_prompts, fast_prompts, strict=True) for p in pair]
        cfg = kv("kv_consumer", meta, fast.info["node_id"], load_timeout_s=30.0)
        with throttled(slow.pid, stop_s=0.5):
            run = run_engine(tmp_path, spec(model, mixed + split, cfg), "consumer")
        served = store_stats(fast).bytes_out - served_before

    # Token-exact against the producers, which computed every prompt.
    n = len(slow_prompts)
    pairs = zip(made["slow"][:n], made["fast"][:n], strict=True)
    wanted = [o["tokens"] for pair in pairs for o in pair] + [o["tokens"] for o in made["slow"][n:]]
    assert [o["tokens"] for o in run["outputs"]] == wanted
    c = run["engine_connector"]
    print({k: v for k, v in c.items() if v}, "fast served", served)
    # Every prompt's load was decided once; the slow store's later ones
    # declined, the split prompts' loads cut after their fast chunks.
    assert c["loads_async"] + c["loads_sync"] + c["loads_declined_cost"] == len(mixed + split)
    assert 2 <= c["loads_declined_cost"] < len(slow_prompts)
    assert c["loads_cut_cost"] == len(split)
    declined = c["loads_declined_cost"] * 512 + len(split) * 256
    assert c["tokens_declined_cost"] == declined
    # Every fast prompt's four whole chunks and the split prompts' first two
    # came from the fast store (one fast prompt declined would leave it short).
    assert served >= (len(fast_prompts) * 4 + len(split) * 2) * object_bytes("none")


def store_stats(store: Any) -> Any:
    """The store's own counters, over its gRPC service."""
    with grpc.insecure_channel(store.info["grpc_address"]) as ch:
        return store_pb2_grpc.StoreStub(ch).GetStats(store_pb2.StoreStatsRequest(), timeout=5)
