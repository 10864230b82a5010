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

import numpy as np
import pytest

from kvdepot.apps.cluster import LocalCluster

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvdepot[vllm]')")

from .engine import build_tiny_llama
from .test_connector import kv, run_engine, spec

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
