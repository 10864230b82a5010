"""kvdepot behind a real ``vllm serve``, measured with vLLM's own client.

Every engine is a real ``vllm serve`` (the CPU build here) started as a
process group on 127.0.0.1 with the kvdepot connector configured by
``--kv-transfer-config``; kvdepot is a real local cluster (a metadata service
and two store daemons, :class:`kvdepot.apps.cluster.LocalCluster`); the load comes
from ``vllm bench serve`` run through the venv's ``vllm`` command. The model is
a random-weight Llama built here, saved with a word-level tokenizer trained on
nothing (token ``i`` is the word ``t<i>``, so text and token ids map one to one
and ``vllm bench serve``'s random datasets keep their exact lengths); the hub
is never asked (``HF_HUB_OFFLINE=1``).

Comparisons, each alternating its A and B within this run:

1. Connector overhead with nothing reused: random prompts (a fresh seed per
   round, the same seed for A and B), request throughput and TPOT p99 of a
   ``kv_both`` engine against plain vLLM.
2. Reuse beyond vLLM's own cache: a ``prefix_repetition`` workload sent to a
   ``kv_both`` engine, the engine restarted, the same workload again: TTFT of
   the second run over the first.
3. Multi-turn conversations (each turn's prompt is the history, answers
   included, plus a new question) with vLLM's own prefix cache emptied before
   every request (``/reset_prefix_cache``, so each turn meets a fresh engine):
   prompt tokens vLLM reports as loaded by the connector
   (``usage.prompt_tokens_details.cached_tokens`` and the engine's
   ``vllm:prompt_tokens_by_source{source="external_kv_transfer"}``) over the
   tokens available in principle (the history's KV in whole engine blocks,
   never the prompt's last token).
4. Disaggregated prefill/decode (a ``kv_producer`` and a ``kv_consumer``
   engine, one core each, behind ``kvdepot proxy``) against one colocated
   engine on both cores, long prompts arriving while others decode: TPOT
   p50/p99 and TTFT of both.
5. Prompt tokens the P/D decode engine recomputes per request (prompt tokens
   minus those it loaded: ``usage`` of requests through the proxy, and the
   decode engine's ``vllm:prompt_tokens_by_source{source="local_compute"}``
   over the benchmark's requests).
6. Heterogeneous P/D: a prefill at TP=1 and a decode at TP=2 behind the
   proxy (:mod:`benchmarks.vllm_hetero`): TTFT, TPOT, tokens the decode
   recomputed, its outputs against a plain TP=2 engine's, bytes a decode
   rank read against a whole chunk.
7. Cost-based loading against a store too slow for loading to pay
   (:mod:`benchmarks.vllm_cost_gate`): TTFT of the connector as shipped and
   of one loading every hit, over a plain engine's; then, with that store
   still slow, the shipped connector's TTFT on prompts another store holds.
8. Sliding-window layers on a Gemma3 (:mod:`benchmarks.vllm_swa`): bytes
   stored and moved per token over the whole KV, against the full-attention
   layers plus the window's share of the sliding ones; outputs against a
   plain engine's.

    python benchmarks/vllm_serve.py [--quick] [--json] [--plot FILE.png]
        [--only-hetero | --only-cost-gate | --only-swa]

Needs vLLM (the CPU build works), ``aiohttp`` (the proxy) and ``tokenizers``;
matplotlib for ``--plot``. The float32 model runs eagerly (``--enforce-eager``):
bfloat16 matmuls fall back to a slow path on CPUs without AVX-512 BF16, and
``torch.compile`` adds minutes to every engine start.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repo root

from benchmarks.procs import Cluster, stop_on_sigterm
from benchmarks.vllm_cost_gate import compare_cost_gate
from benchmarks.vllm_hetero import compare_hetero_pd
from benchmarks.vllm_servers import (
    VOCAB,
    Processes,
    Server,
    bench,
    build_model,
    cluster_stats,
    complete,
    delta,
    kv_config,
    log,
    metrics,
    random_args,
    reset_prefix_cache,
    start_engine,
    start_proxy,
    vllm_command,
    wait_saves_settled,
    warm,
)
from benchmarks.vllm_swa import compare_swa


@dataclass(frozen=True, slots=True)
class Plan:
    """Sizes of one run (``--quick`` or full)."""

    layers: int
    hidden: int
    rounds: int  # alternating A/B rounds of comparisons 1 and 4
    restart_pairs: int  # first run / restart / second run, comparison 2
    # 1: random prompts, nothing reused
    random_prompts: int
    random_input: int
    random_output: int
    concurrency: int
    # 2: prefix repetition
    prefix_prompts: int
    prefix_len: int
    suffix_len: int
    num_prefixes: int
    prefix_output: int
    # 3: multi-turn
    conversations: int
    turns: int
    first_turn: int
    question: int
    answer: int
    # 4: P/D vs colocated
    pd_prompts: int
    pd_input: int
    pd_output: int
    pd_rate: float
    # 5: direct requests through the proxy, prompt lengths
    pd_probe_lengths: tuple[int, ...]
    # 8: sliding window, probe prompts of these many chunks (and a token)
    swa_probe_chunks: tuple[int, ...] = (2, 3)


QUICK = Plan(
    layers=4,
    hidden=512,
    rounds=1,
    restart_pairs=1,
    random_prompts=8,
    random_input=512,
    random_output=32,
    concurrency=4,
    prefix_prompts=6,
    prefix_len=1024,
    suffix_len=128,
    num_prefixes=2,
    prefix_output=4,
    conversations=2,
    turns=3,
    first_turn=300,
    question=60,
    answer=48,
    pd_prompts=6,
    pd_input=1024,
    pd_output=48,
    pd_rate=0.5,
    pd_probe_lengths=(700, 1001),
)

# The full run: a model large enough that prefill dominates, more rounds.
FULL = replace(
    QUICK,
    layers=8,
    hidden=1024,
    rounds=2,
    restart_pairs=2,
    turns=4,
    first_turn=400,
    question=80,
    answer=64,
    pd_output=64,
    pd_rate=0.125,
    pd_probe_lengths=(700, 1001, 1500),
    swa_probe_chunks=(2, 3, 4, 6),
)


# --------------------------------------------------------------------------- comparisons


def ms(result: dict[str, Any], key: str) -> float:
    return float(result.get(key, 0.0)) / 1000.0


def compare_no_reuse(
    work: Path, model: Path, plan: Plan, plain: Server, kv: Server
) -> dict[str, Any]:
    print("1. connector overhead, nothing reused (random prompts)", file=log)
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "kv_both": []}
    for r in range(plan.rounds):
        order = [("plain", plain), ("kv_both", kv)]
        if r % 2:
            order.reverse()
        for name, server in order:
            args = random_args(
                plan.random_prompts,
                plan.random_input,
                plan.random_output,
                1000 + r,
                plan.concurrency,
            )
            runs[name].append(bench(work, server, model, f"noreuse-{name}-{r}", args))

    def agg(name: str, key: str) -> float:
        return statistics.median(float(x.get(key, 0.0)) for x in runs[name])

    thr = agg("kv_both", "request_throughput") / agg("plain", "request_throughput")
    tpot = agg("kv_both", "p99_tpot_ms") / agg("plain", "p99_tpot_ms")
    per_round = [
        {
            "round": i,
            "throughput_ratio": round(k["request_throughput"] / p["request_throughput"], 4),
            "tpot_p99_ratio": round(k["p99_tpot_ms"] / p["p99_tpot_ms"], 4),
        }
        for i, (p, k) in enumerate(zip(runs["plain"], runs["kv_both"], strict=True))
    ]
    return {
        "throughput_ratio_no_reuse": round(thr, 4),
        "tpot_p99_ratio_no_reuse": round(tpot, 4),
        "no_reuse_rounds": per_round,
        "no_reuse_plain_req_s": round(agg("plain", "request_throughput"), 4),
        "no_reuse_kv_both_req_s": round(agg("kv_both", "request_throughput"), 4),
        "no_reuse_plain_tpot_p99_s": round(agg("plain", "p99_tpot_ms") / 1000, 4),
        "no_reuse_kv_both_tpot_p99_s": round(agg("kv_both", "p99_tpot_ms") / 1000, 4),
        "no_reuse_plain_ttft_mean_s": round(agg("plain", "mean_ttft_ms") / 1000, 4),
        "no_reuse_kv_both_ttft_mean_s": round(agg("kv_both", "mean_ttft_ms") / 1000, 4),
    }


def prefix_args(plan: Plan, seed: int) -> list[str]:
    return [
        "--dataset-name",
        "prefix_repetition",
        "--prefix-repetition-prefix-len",
        str(plan.prefix_len),
        "--prefix-repetition-suffix-len",
        str(plan.suffix_len),
        "--prefix-repetition-num-prefixes",
        str(plan.num_prefixes),
        "--prefix-repetition-output-len",
        str(plan.prefix_output),
        "--num-prompts",
        str(plan.prefix_prompts),
        "--max-concurrency",
        "1",
        "--request-rate",
        "inf",
        "--seed",
        str(seed),
    ]


def multiturn(server: Server, meta: str, plan: Plan, block: int, seed: int) -> dict[str, Any]:
    """Conversations against an engine whose own cache is emptied before each turn."""
    import random

    print("3. multi-turn conversations, vLLM's cache emptied before every turn", file=log)
    rng = random.Random(seed)
    turns: list[dict[str, Any]] = []
    for c in range(plan.conversations):
        history: list[int] = []
        computed = 0  # tokens of the history whose KV the engine computed
        for t in range(plan.turns):
            new = plan.first_turn if t == 0 else plan.question
            prompt = history + [rng.randrange(3, VOCAB) for _ in range(new)]
            wait_saves_settled(meta)
            reset_prefix_cache(server)
            before = metrics(server)
            out = complete(server, prompt, plan.answer)
            after = metrics(server)
            choice = out["choices"][0]
            answer = list(choice.get("token_ids") or [])
            usage = out.get("usage") or {}
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            external = delta(
                after, before, "vllm:prompt_tokens_by_source_total[external_kv_transfer]"
            )
            # In principle: the history's KV (never the prompt's last token,
            # which the engine always computes), in whole engine blocks.
            avail_tokens = min(computed, len(prompt) - 1)
            avail_blocks = (avail_tokens // block) * block
            if t > 0:
                turns.append(
                    {
                        "conversation": c,
                        "turn": t + 1,
                        "prompt_tokens": len(prompt),
                        "available_tokens": avail_tokens,
                        "available_block_tokens": avail_blocks,
                        "cached_tokens": cached,
                        "external_tokens": int(external),
                    }
                )
                print(
                    f"  conversation {c} turn {t + 1}: prompt {len(prompt)}, "
                    f"from kvdepot {int(external)} (usage {cached}) of {avail_blocks} "
                    f"({avail_tokens} before block rounding)",
                    file=log,
                )
            history = prompt + answer
            # The last generated token was sampled, never fed back: no KV.
            computed = len(prompt) + len(answer) - 1
    got = sum(t["external_tokens"] for t in turns)
    avail = sum(t["available_block_tokens"] for t in turns)
    avail_all = sum(t["available_tokens"] for t in turns)
    return {
        "multiturn_hit_fraction": round(got / avail, 4) if avail else None,
        "multiturn_hit_fraction_of_all_history_tokens": round(got / avail_all, 4)
        if avail_all
        else None,
        "multiturn_tokens_from_kvdepot": got,
        "multiturn_tokens_available": avail,
        "multiturn_turns": turns,
    }


def pd_probe(
    proxy: Server, decode: Server, plain: Server, lengths: tuple[int, ...], seed: int
) -> list[dict[str, Any]]:
    """Requests through the proxy, one at a time: what the decode engine
    recomputed, and whether its greedy tokens are the plain engine's."""
    import random

    rng = random.Random(seed)
    rows = []
    for n in lengths:
        prompt = [rng.randrange(3, VOCAB) for _ in range(n)]
        before = metrics(decode)
        out = complete(proxy, prompt, 8)
        after = metrics(decode)
        reference = complete(plain, prompt, 8)["choices"][0].get("token_ids")
        usage = out.get("usage") or {}
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        local = delta(after, before, "vllm:prompt_tokens_by_source_total[local_compute]")
        external = delta(after, before, "vllm:prompt_tokens_by_source_total[external_kv_transfer]")
        rows.append(
            {
                "prompt_tokens": n,
                "decode_cached_tokens": cached,
                "decode_recomputed_tokens": n - cached,
                "decode_metrics_local_compute": int(local),
                "decode_metrics_external": int(external),
                "tokens_equal_plain": out["choices"][0].get("token_ids") == reference,
            }
        )
        print(
            f"  probe {n} tokens: decode loaded {cached} (metrics: external {int(external)}, "
            f"computed {int(local)}), recomputed {n - cached}; "
            f"tokens = plain engine's: {rows[-1]['tokens_equal_plain']}",
            file=log,
        )
    return rows


# --------------------------------------------------------------------------- main


def compare_restart(
    procs: Processes, work: Path, model: Path, plan: Plan, meta: str, engine: Server, chunk: int
) -> tuple[dict[str, Any], Server]:
    """Comparison 2; returns its figures and the engine left running."""
    print("2. prefix repetition, engine restarted between the runs", file=log)
    pairs = []
    current = engine
    for i in range(plan.restart_pairs):
        seed = 2000 + i
        first = bench(work, current, model, f"restart-first-{i}", prefix_args(plan, seed))
        wait_saves_settled(meta)
        procs.stop(current)
        current = start_engine(
            procs,
            work,
            f"kv_both-{i + 1}",
            model,
            cores="0-1",
            kv=kv_config("kv_both", meta, "store-0", chunk),
        )
        warm(current, 10 + i)
        second = bench(work, current, model, f"restart-second-{i}", prefix_args(plan, seed))
        pairs.append(
            {
                "ttft_first_mean_s": round(ms(first, "mean_ttft_ms"), 4),
                "ttft_second_mean_s": round(ms(second, "mean_ttft_ms"), 4),
                "ttft_first_p50_s": round(ms(first, "median_ttft_ms"), 4),
                "ttft_second_p50_s": round(ms(second, "median_ttft_ms"), 4),
                "ratio_mean": round(second["mean_ttft_ms"] / first["mean_ttft_ms"], 4),
            }
        )
    ratio = round(statistics.median(p["ratio_mean"] for p in pairs), 4)
    return {"ttft_ratio_after_restart": ratio, "restart_pairs": pairs}, current


def compare_pd(
    procs: Processes, work: Path, model: Path, plan: Plan, meta: str, plain: Server, chunk: int
) -> dict[str, Any]:
    """Comparisons 4 and 5: P/D behind the proxy against the colocated engine."""
    print("4. P/D behind kvdepot proxy vs one colocated engine", file=log)
    prefill = start_engine(
        procs,
        work,
        "prefill",
        model,
        cores="0",
        kv=kv_config("kv_producer", meta, "store-0", chunk),
    )
    decode = start_engine(
        procs,
        work,
        "decode",
        model,
        cores="1",
        kv=kv_config("kv_consumer", meta, "store-1", chunk),
        prefix_caching=False,
    )
    proxy = start_proxy(procs, work, prefill, decode)
    warm(proxy, 4)
    runs: dict[str, list[dict[str, Any]]] = {"colocated": [], "pd": []}
    dec_before = metrics(decode)
    pd_requests = 0
    for r in range(plan.rounds):
        order = [("colocated", plain), ("pd", proxy)]
        if r % 2:
            order.reverse()
        for name, server in order:
            a = random_args(plan.pd_prompts, plan.pd_input, plan.pd_output, 4000 + r, 64)
            a[a.index("--request-rate") + 1] = str(plan.pd_rate)
            a += ["--burstiness", "1.0"]
            runs[name].append(bench(work, server, model, f"{name}-{r}", a))
            if name == "pd":
                pd_requests += plan.pd_prompts
    dec_after = metrics(decode)

    def agg(name: str, key: str) -> float:
        return statistics.median(float(x.get(key, 0.0)) for x in runs[name]) / 1000

    result: dict[str, Any] = {}
    for name in ("pd", "colocated"):
        result[f"{name}_tpot_p50_s"] = round(agg(name, "p50_tpot_ms"), 4)
        result[f"{name}_tpot_p99_s"] = round(agg(name, "p99_tpot_ms"), 4)
        result[f"{name}_ttft_mean_s"] = round(agg(name, "mean_ttft_ms"), 4)
        result[f"{name}_ttft_p50_s"] = round(agg(name, "p50_ttft_ms"), 4)
        result[f"{name}_ttft_p99_s"] = round(agg(name, "p99_ttft_ms"), 4)
        result[f"{name}_itl_p99_s"] = round(agg(name, "p99_itl_ms"), 4)
    # 5. Decode-side recompute.
    local = delta(dec_after, dec_before, "vllm:prompt_tokens_by_source_total[local_compute]")
    ext = delta(dec_after, dec_before, "vllm:prompt_tokens_by_source_total[external_kv_transfer]")
    result["pd_bench_decode_prompt_tokens_computed"] = int(local)
    result["pd_bench_decode_prompt_tokens_loaded"] = int(ext)
    result["pd_bench_decode_recomputed_tokens_mean"] = (
        round(local / pd_requests, 1) if pd_requests else None
    )
    probes = pd_probe(proxy, decode, plain, plan.pd_probe_lengths, 5000)
    result["pd_probes"] = probes
    result["pd_decode_recomputed_tokens_max"] = max(p["decode_recomputed_tokens"] for p in probes)
    return result


def hetero(
    procs: Processes, work: Path, model: Path, plan: Plan, meta: str, chunk: int
) -> dict[str, Any]:
    """Comparison 6 (see :mod:`benchmarks.vllm_hetero`)."""
    heads, kv_heads, dtype_bytes = 16, 4, 4  # build_model's attention, float32
    per_token = plan.layers * 2 * kv_heads * (plan.hidden // heads) * dtype_bytes
    return compare_hetero_pd(
        procs,
        work,
        model,
        meta,
        chunk,
        prompts=plan.pd_prompts,
        input_len=plan.pd_input,
        output_len=plan.pd_output,
        probe_lengths=plan.pd_probe_lengths,
        kv_bytes_per_token=per_token,
    )


def targets(result: dict[str, Any], block: int) -> dict[str, bool]:
    return {
        "throughput_ratio_no_reuse >= 0.97": result.get("throughput_ratio_no_reuse", 0) >= 0.97,
        "tpot_p99_ratio_no_reuse <= 1.05": result.get("tpot_p99_ratio_no_reuse", 9) <= 1.05,
        "ttft_ratio_after_restart <= 0.35": result.get("ttft_ratio_after_restart", 9) <= 0.35,
        # Loading that cannot pay costs no more than noise.
        "cost_gate_ttft_ratio <= 1.1": result.get("cost_gate_ttft_ratio", 9) <= 1.1,
        # ... and a slow store does not stop loads from a fast one that pays.
        "cost_gate_fast_store_ttft_ratio <= 0.5": (
            result.get("cost_gate_fast_store_ttft_ratio", 9) <= 0.5
        ),
        "multiturn_hit_fraction >= 0.95": (result.get("multiturn_hit_fraction") or 0) >= 0.95,
        "pd_decode_recomputed_tokens_max < block_size": result.get(
            "pd_decode_recomputed_tokens_max", 1 << 30
        )
        < block,
        "hetero_pd_outputs_equal": bool(result.get("hetero_pd_outputs_equal")),
        "hetero_pd_recomputed_tokens_max < block_size": result.get(
            "hetero_pd_recomputed_tokens_max", 1 << 30
        )
        < block,
        # A rank's heads' half of each chunk, plus the objects' 64-byte headers.
        "hetero_pd_bytes_per_rank_ratio <= 0.51": (
            result.get("hetero_pd_bytes_per_rank_ratio") or 1.0
        )
        <= 0.51,
        # Full-attention layers plus the window's share of the sliding ones
        # (+1%: the parts' 64-byte headers).
        "swa_bytes_ratio <= bound": (result.get("swa_bytes_ratio") or 9)
        <= 1.01 * result.get("swa_bytes_bound", 0),
        "swa_moved_ratio <= bound": (result.get("swa_moved_ratio") or 9)
        <= 1.01 * result.get("swa_moved_bound", 0),
        "swa_outputs_equal": bool(result.get("swa_outputs_equal")),
    }


def comparisons_1_to_5(
    procs: Processes, work: Path, model: Path, plan: Plan, meta: str, block: int, chunk: int
) -> dict[str, Any]:
    result: dict[str, Any] = {}
    # 1. Plain and kv_both engines, both cores each, alternating.
    plain = start_engine(procs, work, "plain", model, cores="0-1", kv=None)
    warm(plain, 1)
    kv_first = start_engine(
        procs,
        work,
        "kv_both-0",
        model,
        cores="0-1",
        kv=kv_config("kv_both", meta, "store-0", chunk),
    )
    warm(kv_first, 2)
    result.update(compare_no_reuse(work, model, plan, plain, kv_first))
    # 2. Restart: first run, restart, second run.
    figures, current = compare_restart(procs, work, model, plan, meta, kv_first, chunk)
    result.update(figures)
    # 3. Multi-turn on the last kv_both engine.
    result.update(multiturn(current, meta, plan, block, 3000))
    procs.stop(current)
    result.update(compare_pd(procs, work, model, plan, meta, plain, chunk))
    return result


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    plan = QUICK if args.quick else FULL
    chunk = args.chunk_tokens
    block = 128  # the CPU backend's default block size
    t_start = time.monotonic()
    model = build_model(work / "model", plan.layers, plan.hidden)
    print(
        f"model: {plan.layers} layers, hidden {plan.hidden}, float32; chunk {chunk} tokens; "
        f"vllm command: {' '.join(vllm_command())}",
        file=log,
    )
    result: dict[str, Any] = {
        "quick": bool(args.quick),
        "model": {
            "layers": plan.layers,
            "hidden": plan.hidden,
            "heads": 16,
            "kv_heads": 4,
            "vocab": VOCAB,
            "dtype": "float32",
        },
        "block_size": block,
        "chunk_tokens": chunk,
        "plan": {k: getattr(plan, k) for k in plan.__dataclass_fields__},
    }
    procs = Processes()
    try:
        with Cluster(
            nodes=2, capacity="3GiB", log_dir=work / "cluster", lease_ttl_s=120
        ) as cluster:
            meta = cluster.metadata_address
            only = {"hetero": args.only_hetero, "cost": args.only_cost_gate, "swa": args.only_swa}
            chosen = {k for k, v in only.items() if v}
            if not chosen:
                result.update(comparisons_1_to_5(procs, work, model, plan, meta, block, chunk))
                procs.stop_all()
            if chosen <= {"hetero"}:
                result.update(hetero(procs, work, model, plan, meta, chunk))
            if chosen <= {"swa"}:
                result.update(compare_swa(procs, work, meta, probe_chunks=plan.swa_probe_chunks))
            if chosen <= {"cost"}:
                pids = [s.pid for s in cluster.stores]
                result.update(
                    compare_cost_gate(
                        procs, work, model, meta, chunk, pids,
                        prompts=plan.pd_prompts, input_len=plan.pd_input, rounds=plan.rounds + 1,
                    )
                )  # fmt: skip
            result["kvdepot_cluster"] = cluster_stats(meta)
    finally:
        procs.stop_all()
    result["targets"] = targets(result, block)
    result["wall_s"] = round(time.monotonic() - t_start, 1)
    return result


def plot(result: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=log)
        return False
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    ax = axes[0]
    names = [
        "throughput\n(kv_both/plain)",
        "TPOT p99\n(kv_both/plain)",
        "TTFT after\nrestart / first",
        "multi-turn\nhit fraction",
    ]
    vals = [
        result.get("throughput_ratio_no_reuse", 0),
        result.get("tpot_p99_ratio_no_reuse", 0),
        result.get("ttft_ratio_after_restart", 0),
        result.get("multiturn_hit_fraction") or 0,
    ]
    targets = [0.97, 1.05, 0.5, 0.95]
    ax.bar(range(len(vals)), vals, color=["#4c72b0", "#4c72b0", "#55a868", "#c44e52"])
    for i, t in enumerate(targets):
        ax.hlines(t, i - 0.4, i + 0.4, colors="black", linestyles="dashed")
    ax.set_xticks(range(len(vals)), names, fontsize=8)
    ax.set_title("ratios (dashed: targets)")
    ax = axes[1]
    keys = ["tpot_p50_s", "tpot_p99_s", "ttft_p50_s", "ttft_p99_s"]
    x = range(len(keys))
    ax.bar(
        [i - 0.2 for i in x],
        [result.get(f"colocated_{k}", 0) for k in keys],
        0.4,
        label="colocated (2 cores)",
    )
    ax.bar(
        [i + 0.2 for i in x],
        [result.get(f"pd_{k}", 0) for k in keys],
        0.4,
        label="P/D via kvdepot (1+1 cores)",
    )
    ax.set_xticks(list(x), [k.replace("_s", "") for k in keys], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("seconds")
    ax.set_title("P/D vs colocated")
    ax.legend(fontsize=8)
    ax = axes[2]
    probes = result.get("pd_probes", [])
    ax.bar(
        [str(p["prompt_tokens"]) for p in probes], [p["decode_recomputed_tokens"] for p in probes]
    )
    ax.axhline(result.get("block_size", 128), color="black", linestyle="dashed")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("tokens recomputed by decode")
    ax.set_title("P/D decode recompute (dashed: one block)")
    fig.suptitle(
        f"kvdepot + vllm serve (CPU), {result['model']['layers']} layers, "
        f"hidden {result['model']['hidden']}{' (quick)' if result.get('quick') else ''}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller model and workloads")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--plot", type=Path, default=None, metavar="FILE.png", help="write a plot")
    p.add_argument("--chunk-tokens", type=int, default=256, help="connector chunk (x128)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument(
        "--only-hetero", action="store_true", help="only comparison 6 (heterogeneous P/D)"
    )
    p.add_argument(
        "--only-cost-gate",
        action="store_true",
        help="only comparison 7 (cost-based loading against a slow store)",
    )
    p.add_argument(
        "--only-swa",
        action="store_true",
        help="only comparison 8 (sliding-window bytes on a Gemma3)",
    )
    p.add_argument(
        "--replot",
        type=Path,
        default=None,
        metavar="RESULT.json",
        help="only draw --plot from a saved --json result",
    )
    args = p.parse_args(argv)
    if args.replot is not None:
        if args.plot is None:
            p.error("--replot needs --plot")
        return 0 if plot(json.loads(args.replot.read_text()), args.plot) else 1
    work = Path(tempfile.mkdtemp(prefix="kvdepot-vllm-serve-"))
    stop_on_sigterm()
    try:
        result = run(args, work)
    except BaseException:
        print(f"failed; logs in {work}", file=log)
        raise
    if args.plot is not None:
        plot(result, args.plot)
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            if not isinstance(v, list | dict):
                print(f"{k:>44}: {v}")
        for k, ok in result["targets"].items():
            print(f"{k:>44}: {'met' if ok else 'NOT met'}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
