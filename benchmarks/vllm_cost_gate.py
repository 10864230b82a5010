"""Cost-based loading for :mod:`benchmarks.vllm_serve` (comparison 7): a store
too slow for loading to pay.

The KV of two sets of random prompts is published by a ``kv_both`` engine.
Then the cluster's stores are slowed down (each runs 1 ms in every 2001:
:mod:`benchmarks.throttle`), and three engines without vLLM's own prefix
cache (every request meets a cold engine) are measured in alternating rounds
on the first set, one request at a time:

* ``plain``: no connector;
* ``gate_on``: the connector as shipped (``cost_gate`` on);
* ``gate_off``: the connector loading every hit.

Each ran the second set first, unmeasured: there the connector's first loads
measure the slow store. Reported: TTFT of each (mean of the rounds' means),
``cost_gate_ttft_ratio`` (gate on / plain: loading that cannot pay must cost
no more than noise) and ``cost_gate_off_ttft_ratio`` (what it costs without
the gate), and the gated engine's declined loads and tokens from its
``/metrics``.

Then only the first store stays slow, and ``plain`` and ``gate_on`` are
measured in alternating rounds on a third set a second publisher put on the
other store: the gate judges each store by its own loads, so these load
(``cost_gate_fast_store_ttft_ratio``, gate on / plain: the restart gain,
not the slow store's verdict).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmarks.throttle import throttled
from benchmarks.vllm_servers import (
    Processes,
    Server,
    bench,
    kv_config,
    log,
    metrics,
    random_args,
    start_engine,
    wait_saves_settled,
    warm,
)

MEASURED, WARMUP, FAST = 7000, 7001, 7002  # the prompt sets (random dataset seeds)
DECLINED = "vllm:kvdepot_loads_declined_total"
DECLINED_TOKENS = "vllm:kvdepot_declined_tokens_total"
LOADED = "vllm:kvdepot_loaded_tokens_total"


def _engine(
    procs: Processes, work: Path, model: Path, name: str, kv: dict[str, Any] | None
) -> Server:
    return start_engine(procs, work, name, model, cores="0-1", kv=kv, prefix_caching=False)


def compare_cost_gate(
    procs: Processes,
    work: Path,
    model: Path,
    meta: str,
    chunk: int,
    store_pids: list[int],
    *,
    prompts: int,
    input_len: int,
    rounds: int,
) -> dict[str, Any]:
    print("7. cost-based loading: a store too slow for loading to pay", file=log)

    def args(seed: int) -> list[str]:
        return random_args(prompts, input_len, 4, seed, 1)

    publisher = _engine(
        procs, work, model, "gate-publisher", kv_config("kv_both", meta, "store-0", chunk)
    )
    warm(publisher, 70)
    for seed in (MEASURED, WARMUP):
        bench(work, publisher, model, f"gate-publish-{seed}", args(seed))
    wait_saves_settled(meta)
    procs.stop(publisher)
    publisher = _engine(
        procs, work, model, "gate-publisher-1", kv_config("kv_both", meta, "store-1", chunk)
    )
    warm(publisher, 72)
    bench(work, publisher, model, f"gate-publish-{FAST}", args(FAST))
    wait_saves_settled(meta)
    procs.stop(publisher)

    def consumer(gate: bool) -> dict[str, Any]:
        kv = kv_config("kv_consumer", meta, "store-0", chunk)
        kv["kv_connector_extra_config"]["cost_gate"] = gate
        return kv

    engines = {
        "plain": _engine(procs, work, model, "gate-plain", None),
        "gate_on": _engine(procs, work, model, "gate-on", consumer(True)),
        "gate_off": _engine(procs, work, model, "gate-off", consumer(False)),
    }
    ttft: dict[str, list[float]] = {name: [] for name in engines}
    with throttled(store_pids, run_ms=1.0, stop_ms=2000.0):
        for name, server in engines.items():
            warm(server, 71)
            bench(work, server, model, f"gate-warmup-{name}", args(WARMUP))
        for r in range(rounds):
            order = list(engines.items())
            order = order[r % len(order) :] + order[: r % len(order)]
            for name, server in order:
                result = bench(work, server, model, f"gate-{name}-{r}", args(MEASURED))
                ttft[name].append(float(result["mean_ttft_ms"]) / 1000)
    # The second store, fast again, holds the third set; the first stays slow.
    fast = _fast_store(work, model, engines, store_pids[0], rounds, args(FAST))
    gated = metrics(engines["gate_on"])
    for server in engines.values():
        procs.stop(server)
    mean = {name: statistics.fmean(v) for name, v in ttft.items()}
    return {
        **fast,
        "cost_gate_ttft_ratio": round(mean["gate_on"] / mean["plain"], 4),
        "cost_gate_off_ttft_ratio": round(mean["gate_off"] / mean["plain"], 4),
        "cost_gate": {
            "ttft_mean_s": {name: round(v, 4) for name, v in mean.items()},
            "ttft_per_round_s": {name: [round(x, 4) for x in v] for name, v in ttft.items()},
            "declined_loads": gated.get(DECLINED, 0.0),
            "declined_tokens": gated.get(DECLINED_TOKENS, 0.0),
            "loaded_tokens": gated.get(LOADED, 0.0),
            "store_duty": "1 ms running in every 2001",
        },
    }


def _fast_store(
    work: Path, model: Path, engines: dict[str, Server], slow_pid: int, rounds: int, args: list[str]
) -> dict[str, Any]:
    """``plain`` and ``gate_on`` in alternating rounds on the prompts of
    ``args``, which the second store holds, while the first stays slow."""
    ttft: dict[str, list[float]] = {"plain": [], "gate_on": []}
    with throttled([slow_pid], run_ms=1.0, stop_ms=2000.0):
        for r in range(rounds):
            for name in sorted(ttft, reverse=bool(r % 2)):
                result = bench(work, engines[name], model, f"gate-fast-{name}-{r}", args)
                ttft[name].append(float(result["mean_ttft_ms"]) / 1000)
    mean = {name: statistics.fmean(v) for name, v in ttft.items()}
    return {
        "cost_gate_fast_store_ttft_ratio": round(mean["gate_on"] / mean["plain"], 4),
        "cost_gate_fast_store": {
            "ttft_mean_s": {name: round(v, 4) for name, v in mean.items()},
            "ttft_per_round_s": {name: [round(x, 4) for x in v] for name, v in ttft.items()},
            "store_duty": "first store 1 ms running in every 2001, second store unthrottled",
        },
    }
