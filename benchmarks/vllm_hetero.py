"""Heterogeneous P/D for :mod:`benchmarks.vllm_serve`: a prefill at one tensor
parallel size, a decode at another, sharing KV through kvdepot.

A ``kv_producer`` engine at TP=1 (core 0) and a ``kv_consumer`` engine at TP=2
(one core per rank, ``VLLM_CPU_OMP_THREADS_BIND="0|1"``) behind ``kvdepot
proxy``. Reported, as the decode engine saw them:

* TTFT and TPOT of a ``vllm bench serve`` run through the proxy;
* probes, one request at a time: prompt tokens the decode engine recomputed
  (prompt tokens minus those vLLM reports as loaded), and whether its greedy
  tokens are those of a plain engine of the decode's shape (TP=2, no
  connector), started first and stopped before the pair;
* bytes a decode rank read over the whole KV of what it loaded (the
  connector's ``vllm:kvdepot_loaded_bytes_total`` on the decode's
  ``/metrics``, every rank's, halved, over the tokens vLLM counted as loaded
  times the model's KV bytes per token): 0.5 plus headers when each rank
  reads its heads' half.
"""

from __future__ import annotations

import random
import statistics
from pathlib import Path
from typing import Any

from benchmarks.vllm_servers import (
    VOCAB,
    Processes,
    bench,
    complete,
    delta,
    kv_config,
    log,
    metrics,
    random_args,
    start_engine,
    start_proxy,
    warm,
)

DECODE_TP = 2
EXTERNAL = "vllm:prompt_tokens_by_source_total[external_kv_transfer]"
LOCAL = "vllm:prompt_tokens_by_source_total[local_compute]"


LOADED_BYTES = "vllm:kvdepot_loaded_bytes_total"
"""The connector's loaded bytes on an engine's ``/metrics``, every rank's."""


def compare_hetero_pd(
    procs: Processes,
    work: Path,
    model: Path,
    meta: str,
    chunk: int,
    *,
    prompts: int,
    input_len: int,
    output_len: int,
    probe_lengths: tuple[int, ...],
    kv_bytes_per_token: int,
) -> dict[str, Any]:
    """TP=1 prefill -> TP=2 decode through kvdepot; the ``hetero_pd_*`` figures."""
    print("6. heterogeneous P/D: prefill TP=1 -> decode TP=2, through kvdepot", file=log)
    rng = random.Random(6000)
    probes = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in probe_lengths]
    plain = start_engine(
        procs, work, "plain-tp2", model, cores="0|1", kv=None, tp=DECODE_TP, prefix_caching=False
    )
    reference = [complete(plain, p, 8)["choices"][0].get("token_ids") for p in probes]
    procs.stop(plain)
    prefill = start_engine(
        procs,
        work,
        "prefill-tp1",
        model,
        cores="0",
        kv=kv_config("kv_producer", meta, "store-0", chunk),
    )
    decode = start_engine(
        procs,
        work,
        "decode-tp2",
        model,
        cores="0|1",
        kv=kv_config("kv_consumer", meta, "store-1", chunk),
        prefix_caching=False,
        tp=DECODE_TP,
    )
    proxy = start_proxy(procs, work, prefill, decode, name="proxy-hetero")
    warm(proxy, 6)
    a = random_args(prompts, input_len, output_len, 6100, 64)
    run = bench(work, proxy, model, "hetero-pd", a)
    rows = []
    before_all = metrics(decode)
    for prompt, ref in zip(probes, reference, strict=True):
        before = metrics(decode)
        out = complete(proxy, prompt, 8)
        after = metrics(decode)
        loaded = delta(after, before, EXTERNAL)
        rows.append(
            {
                "prompt_tokens": len(prompt),
                "decode_loaded_tokens": int(loaded),
                "decode_recomputed_tokens": len(prompt) - int(loaded),
                "decode_metrics_local_compute": int(delta(after, before, LOCAL)),
                "tokens_equal_plain_tp2": out["choices"][0].get("token_ids") == ref,
            }
        )
        print(f"  probe {rows[-1]}", file=log)
    after_all = metrics(decode)
    loaded_tokens = delta(after_all, before_all, EXTERNAL)
    read = delta(after_all, before_all, LOADED_BYTES)
    per_rank = read / DECODE_TP
    ratio = per_rank / (loaded_tokens * kv_bytes_per_token) if loaded_tokens and read else None
    return {
        "hetero_pd_ttft_mean_s": round(float(run.get("mean_ttft_ms", 0.0)) / 1000, 4),
        "hetero_pd_ttft_p50_s": round(float(run.get("median_ttft_ms", 0.0)) / 1000, 4),
        "hetero_pd_tpot_p50_s": round(float(run.get("median_tpot_ms", 0.0)) / 1000, 4),
        "hetero_pd_tpot_p99_s": round(float(run.get("p99_tpot_ms", 0.0)) / 1000, 4),
        "hetero_pd_probes": rows,
        "hetero_pd_outputs_equal": all(r["tokens_equal_plain_tp2"] for r in rows),
        "hetero_pd_recomputed_tokens_max": max(r["decode_recomputed_tokens"] for r in rows),
        "hetero_pd_recomputed_tokens_mean": round(
            statistics.mean(r["decode_recomputed_tokens"] for r in rows), 1
        ),
        "hetero_pd_bytes_per_rank_ratio": None if ratio is None else round(ratio, 4),
    }
