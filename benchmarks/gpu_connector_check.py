"""vLLM connector check on a CUDA device: what the CPU tests prove, on a GPU.

Runs real vLLM engines (the CUDA build) on a tiny random Llama the script
builds, each in its own process, against real kvdepot daemons:

1. **Exact loads**: a ``kv_producer`` engine publishes; a ``kv_consumer``
   engine in another process loads (asynchronously: nothing is timed yet) and must
   give exactly the tokens and logprobs of a plain engine.
   The same again with every load inside the engine step
   (``sync_load_max_tokens``), layer by layer beside the forward pass.
2. **Tail and decode chunks**: with 256-token chunks of the GPU's blocks (16 tokens), a
   ``kv_both`` engine publishes a prompt's tail blocks and what it decoded; a
   fresh engine then loads all the whole blocks of the same prompt and of a
   chat's next turn, and matches the plain engine.
3. **Layout and codec**: the same with ``fp8_e4m3`` chunks (bytes per chunk
   halved; tokens compared loosely).
4. **Hybrid model**: a Gemma3 (sliding-window and full-attention layers)
   under vLLM's hybrid KV cache manager: a fresh engine loads its prompt;
   then with chunks twice its window, whose sliding layer is stored and
   read for the window only.
5. **Preemption**: three long sequences in a KV cache too small for them;
   the preempted requests resume and match the plain engine under the same
   pressure.

Saves on a GPU are copied out on a CUDA stream of their own into pinned
memory; every consumer check above reads what such saves published.

Run on a CUDA machine: ``python benchmarks/gpu_connector_check.py [--json]``
(a few minutes). Exits non-zero if an output differs or CUDA is not there.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("CUDA is not available", file=sys.stderr)
        return 2
    from benchmarks.procs import Cluster
    from tests.integration.vllm.engine import build_tiny_gemma3, build_tiny_llama
    from tests.integration.vllm.test_connector import kv, run_engine

    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 1000, n).tolist() for n in (300, 700, 1000)]
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0)}
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="kvdepot-gpu-") as d:
        tmp = Path(d)
        model = str(build_tiny_llama(tmp / "model"))
        base = {"model": model, "max_tokens": 64, "logprobs": 1, "ignore_eos": True}
        plain = run_engine(tmp, {**base, "prompts": prompts, "kv": None}, "plain")["outputs"]
        with Cluster(nodes=2, capacity="1GiB", log_dir=tmp / "logs", lease_ttl_s=60) as c:
            meta = c.metadata_address
            for name, extra in (
                ("none", {}),
                ("in-step", {"sync_load_max_tokens": 100_000}),
                ("fp8", {"kv_codec": "fp8_e4m3"}),
            ):
                cfg = {"chunk_tokens": 256, **extra}
                prod = run_engine(
                    tmp,
                    {**base, "prompts": prompts, "kv": kv("kv_producer", meta, "store-0", **cfg)},
                    f"producer-{name}",
                )
                cons = run_engine(
                    tmp,
                    {**base, "prompts": prompts, "kv": kv("kv_consumer", meta, "store-1", **cfg)},
                    f"consumer-{name}",
                )
                exact = [
                    g["tokens"] == w["tokens"] and g["logprobs"] == w["logprobs"]
                    for g, w in zip(cons["outputs"], plain, strict=True)
                ]
                report[name] = {
                    "producer": prod["connector"],
                    "consumer": cons["connector"],
                    "exact": exact,
                }
                if name != "fp8" and not all(exact):
                    failures.append(f"{name}: consumer output differs from the plain engine")
                if cons["connector"].get("load_errors"):
                    failures.append(f"{name}: load errors {cons['connector']}")
            # A chat's next turn on a fresh engine: its whole history hits.
            turn2 = prompts[0] + plain[0]["tokens"] + rng.integers(1, 1000, 50).tolist()
            ref = run_engine(tmp, {**base, "prompts": [turn2], "kv": None}, "plain-turn2")
            both = kv("kv_both", meta, "store-0", chunk_tokens=256, kv_codec="none")
            run_engine(tmp, {**base, "prompts": [prompts[0]], "kv": both}, "turn1")
            again = run_engine(tmp, {**base, "prompts": [turn2], "kv": both}, "turn2")
            history = len(prompts[0]) + len(plain[0]["tokens"])
            report["multiturn"] = {
                "history_tokens": history,
                "tokens_hit": again["connector"]["tokens_hit"],
                "exact": again["outputs"][0]["tokens"] == ref["outputs"][0]["tokens"],
            }
            if not report["multiturn"]["exact"]:
                failures.append("turn 2 differs from the plain engine")
            failures += _hybrid_and_preemption(tmp, meta, base, build_tiny_gemma3, report)
    return finish(report, failures, args.json)


def finish(report: dict[str, Any], failures: list[str], as_json: bool) -> int:
    """Print ``report`` with its ``failures``; the exit status (1: some failed)."""
    report["failures"] = failures
    if as_json:
        print(json.dumps(report))
    else:
        for k, v in report.items():
            print(f"{k}: {v}")
    return 1 if failures else 0


def _hybrid_and_preemption(
    tmp: Path, meta: str, base: dict[str, Any], build_gemma: Any, report: dict[str, Any]
) -> list[str]:
    from tests.integration.vllm.test_connector import kv, run_engine

    failures: list[str] = []
    rng = np.random.default_rng(9)
    gemma = str(build_gemma(tmp / "gemma3", sliding_window=256))
    prompt = rng.integers(1, 1000, 700).tolist()
    g = {**base, "model": gemma, "prompts": [prompt]}
    plain = run_engine(tmp, {**g, "kv": None}, "gemma-plain")["outputs"][0]
    cfg = {"chunk_tokens": 256}
    prod = run_engine(tmp, {**g, "kv": kv("kv_both", meta, "store-0", **cfg)}, "gemma-producer")
    cons = run_engine(tmp, {**g, "kv": kv("kv_consumer", meta, "store-1", **cfg)}, "gemma-cons")
    report["hybrid"] = {
        "hybrid_manager": cons["hybrid"] and prod["hybrid"],
        "consumer": cons["connector"],
        "exact": cons["outputs"][0] == plain,
    }
    if not report["hybrid"]["exact"] or not report["hybrid"]["hybrid_manager"]:
        failures.append(f"hybrid model: {report['hybrid']}")
    # Chunks twice the window: the sliding layer stored and read for the
    # window only (window parts gathered and scattered on the GPU).
    long_prompt = rng.integers(1, 1000, 1100).tolist()
    w = {**g, "prompts": [long_prompt]}
    plain_w = run_engine(tmp, {**w, "kv": None}, "gemma-w-plain")["outputs"][0]
    cfg = {"chunk_tokens": 512}
    prod = run_engine(tmp, {**w, "kv": kv("kv_both", meta, "store-0", **cfg)}, "gemma-w-prod")
    cons = run_engine(tmp, {**w, "kv": kv("kv_consumer", meta, "store-1", **cfg)}, "gemma-w-cons")
    report["window_parts"] = {
        "producer": prod["connector"],
        "consumer": cons["connector"],
        "exact": cons["outputs"][0] == plain_w,
    }
    if not report["window_parts"]["exact"] or cons["connector"]["tokens_hit"] < 1024:
        failures.append(f"window parts: {report['window_parts']}")
    prompts = [rng.integers(1, 1000, 300).tolist() for _ in range(3)]
    squeeze = {**base, "prompts": prompts, "num_blocks": 64, "max_model_len": 768}
    squeeze |= {"together": True, "max_tokens": 250}
    ref = run_engine(tmp, {**squeeze, "kv": None}, "preempt-plain")
    got = run_engine(tmp, {**squeeze, "kv": kv("kv_both", meta, "store-0")}, "preempt")
    report["preemption"] = {
        "preemptions": [ref["preemptions"], got["preemptions"]],
        "tokens_equal": [o["tokens"] for o in got["outputs"]]
        == [o["tokens"] for o in ref["outputs"]],
        "connector": got["connector"],
    }
    if not report["preemption"]["tokens_equal"]:
        failures.append("preempted requests differ from the plain engine")
    return failures


if __name__ == "__main__":
    raise SystemExit(main())
