"""Heterogeneous P/D on CUDA: engines of other tensor-parallel sizes and
block sizes share KV through kvdepot's canonical chunk format.

What ``tests/integration/vllm/test_hetero.py`` shows on the CPU build, on a
GPU: real vLLM engines (the CUDA build), each in its own process, on a tiny
random Llama (2 KV heads) the script builds, against real kvdepot daemons.
Producers of each shape store the prompts in a namespace of their own (a
cache salt); consumers of another shape load them and must give the tokens of
the producer of their own shape (which computed everything: nothing was
stored before it). Reported per case: tokens loaded against the prompts,
tokens recomputed, and bytes rank 0 read over all the bytes the ranks read
(0.5 at TP=2: each rank reads its own KV heads).

1. **Block sizes**: a producer with 16-token blocks (the GPU default) and a
   consumer with 32-token blocks, and the reverse (one GPU).
2. **TP=2 prefill -> TP=1 decode** and TP=1 -> TP=2 (two GPUs; skipped and
   named in the report on a machine with one).

Run on a CUDA machine: ``python benchmarks/gpu_hetero_check.py [--json]``
(a few minutes). Exits non-zero if an output differs, a load fails, a rank
reads more than its heads, or CUDA is not there.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHUNK = 256


def _case(
    tmp: Path,
    run_engine: Any,
    base: dict[str, Any],
    kv: Any,
    meta: str,
    shapes: tuple[tuple[int, int], tuple[int, int]],
    plain: dict[tuple[int, int], Any],
) -> tuple[dict[str, Any], list[str]]:
    """Producer of shape ``shapes[0]`` (TP, block), consumer of ``shapes[1]``."""
    (ptp, pbs), (ctp, cbs) = shapes
    name = f"tp{ptp}-bs{pbs}-to-tp{ctp}-bs{cbs}"
    salt = f"from-{name}"
    for shape in shapes:
        if shape not in plain:
            s = {**base, "tp": shape[0], "block_size": shape[1], "kv": None}
            plain[shape] = run_engine(tmp, s, f"plain-tp{shape[0]}-bs{shape[1]}")["outputs"]
    prod_kv = kv("kv_producer", meta, "store-0", chunk_tokens=CHUNK, cache_salt=salt)
    run_engine(tmp, {**base, "tp": ptp, "block_size": pbs, "kv": prod_kv}, f"prod-{name}")
    cons_kv = kv("kv_consumer", meta, "store-1", chunk_tokens=CHUNK, cache_salt=salt)
    cons = run_engine(tmp, {**base, "tp": ctp, "block_size": cbs, "kv": cons_kv}, f"cons-{name}")
    e = cons["engine_connector"]  # every rank's counters, summed
    prompt_tokens = sum(len(p) for p in base["prompts"])
    exact = [
        g["tokens"] == w["tokens"] for g, w in zip(cons["outputs"], plain[shapes[1]], strict=True)
    ]
    rank0 = e["bytes_loaded_rank0"] / e["bytes_loaded"] if e.get("bytes_loaded") else None
    row = {
        "tokens_hit": e["tokens_hit"],
        "prompt_tokens": prompt_tokens,
        "recomputed_per_request": (prompt_tokens - e["tokens_hit"]) / len(base["prompts"]),
        "load_errors": e["load_errors"],
        "rank0_bytes_share": rank0,
        "exact": exact,
    }
    failures = []
    if not all(exact) or e["load_errors"]:
        failures.append(f"{name}: {row}")
    if rank0 is None or abs(rank0 - 1 / ctp) > 1e-9:
        failures.append(f"{name}: rank 0 read {rank0} of the bytes, not 1/{ctp}")
    return {name: row}, failures


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("CUDA is not available", file=sys.stderr)
        return 2
    from benchmarks.gpu_connector_check import finish
    from benchmarks.procs import Cluster
    from tests.integration.vllm.engine import build_tiny_llama
    from tests.integration.vllm.test_connector import kv, run_engine

    gpus = torch.cuda.device_count()
    rng = np.random.default_rng(11)
    prompts = [rng.integers(1, 1000, n).tolist() for n in (300, 700, 1000)]
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "gpus": gpus}
    failures: list[str] = []
    cases = [((1, 16), (1, 32)), ((1, 32), (1, 16))]
    if gpus >= 2:
        cases += [((2, 16), (1, 16)), ((1, 16), (2, 16))]
    else:
        report["skipped"] = "TP=2 <-> TP=1 needs two GPUs"
    with tempfile.TemporaryDirectory(prefix="kvdepot-gpu-hetero-") as d:
        tmp = Path(d)
        model = str(build_tiny_llama(tmp / "model"))
        base = {"model": model, "prompts": prompts, "max_tokens": 32, "ignore_eos": True}
        plain: dict[tuple[int, int], Any] = {}
        with Cluster(nodes=2, capacity="1GiB", log_dir=tmp / "logs", lease_ttl_s=60) as c:
            for shapes in cases:
                row, bad = _case(tmp, run_engine, base, kv, c.metadata_address, shapes, plain)
                report.update(row)
                failures += bad
    return finish(report, failures, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
