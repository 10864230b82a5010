"""Compressed chunks: bytes saved by the fp8_e4m3 KV codec, and what it costs in output.

Runs the CPU build of vLLM on the tiny random-weight Llama the connector tests
use (2 layers, 2 KV heads of 32, bf16 KV), with a local kvdepot cluster of two
store nodes, three ways:

- reference:  a plain engine computes every prompt;
- none:       a producer publishes the prompts' KV uncompressed, a consumer
              on the other node loads it and generates;
- fp8_e4m3:   the same with ``kv_codec: fp8_e4m3`` (e4m3 values, one float32
              scale per ``--block`` values).

Both kvdepot ways share one cluster (their namespaces differ, so neither
ever loads the other's chunks). For each it reports the bytes stored per
prompt token, the greedy tokens of the consumer that agree with the reference
(position by position, and the first divergence per prompt), and |delta
logprob| of the generated tokens against the reference over the positions
where both have generated the same tokens so far (same context, same token).
It also reads every stored chunk back and compares the fp8 KV, decoded, with
the uncompressed KV of the same tokens. Every engine is its own process.

    python benchmarks/kv_codec.py [--json] [--prompts 4] [--max-tokens 32]

(about 6 minutes on the 2-core CI machine kind; results/kv_codec.json is one run.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# vLLM is imported in this process too (engine configs); its INFO lines go to
# stdout, which --json keeps for the result. Engines set their own level.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

from benchmarks.procs import Cluster  # noqa: E402
from tests.integration.vllm.engine import build_tiny_llama  # noqa: E402
from tests.integration.vllm.test_connector import run_engine  # noqa: E402

CHUNK = 128  # the CPU backend's block size


def compare(got: list[dict[str, Any]], ref: list[dict[str, Any]]) -> dict[str, Any]:
    """Greedy agreement and logprob drift of ``got`` against ``ref``, per prompt."""
    agree = total = 0
    first_divergence: list[int | None] = []
    deltas: list[float] = []
    for g, r in zip(got, ref, strict=True):
        n = min(len(g["tokens"]), len(r["tokens"]))
        total += n
        agree += sum(a == b for a, b in zip(g["tokens"][:n], r["tokens"][:n], strict=True))
        div = next((i for i in range(n) if g["tokens"][i] != r["tokens"][i]), None)
        first_divergence.append(div)
        # Same context and same token up to the first divergence (excluded).
        for i in range(n if div is None else div):
            deltas.append(abs(g["logprobs"][i] - r["logprobs"][i]))
    return {
        "greedy_agreement": round(agree / total, 4) if total else None,
        "tokens_compared": total,
        "first_divergence": first_divergence,
        "identical_prompts": sum(d is None for d in first_divergence),
        "logprob_positions": len(deltas),
        "max_abs_dlogprob": round(max(deltas), 4) if deltas else None,
        "mean_abs_dlogprob": round(statistics.fmean(deltas), 5) if deltas else None,
    }


def kv_error(model: str, metadata: str, prompts: list[list[int]], block: int) -> dict[str, Any]:
    """Every stored chunk read back: fp8 KV decoded vs the uncompressed KV."""
    import torch
    from vllm.engine.arg_utils import EngineArgs

    from kvdepot.connector.client import ClientConfig, KVDepotClient
    from kvdepot.connector.codec import create_codec
    from kvdepot.connector.vllm.layout import layout_from_config, namespace_for
    from kvdepot.connector.vllm.loader import header_bytes
    from kvdepot.connector.vllm.settings import ConnectorSettings
    from kvdepot.keys import chunk_keys

    cfg = EngineArgs(
        model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096
    ).create_engine_config()
    got: dict[str, torch.Tensor] = {}
    for name in ("none", "fp8_e4m3"):
        settings = ConnectorSettings(
            metadata=metadata, chunk_tokens=CHUNK, kv_codec=name, kv_codec_block=block
        )
        layout = layout_from_config(cfg, settings)
        ns = namespace_for(cfg, settings, layout, 0)
        codec = create_codec(settings.codec_spec())
        # KV head 0's object of each chunk (stored under the chunk's key).
        values = CHUNK * 2 * layout.head_size
        layer = codec.encoded_bytes(values, torch.bfloat16)
        hb = header_bytes(layout.num_layers)
        keys = [k for ids in prompts for k in chunk_keys(ns, ids)]
        bufs = np.zeros((len(keys), hb + layout.num_layers * layer), dtype=np.uint8)
        with KVDepotClient(ClientConfig(metadata=metadata)) as client:
            res = client.get_into(keys, list(bufs))
        if not all(res.loaded):
            raise SystemExit(f"{name}: {res.loaded.count(False)} chunks missing")
        raw = torch.from_numpy(bufs[:, hb:]).reshape(len(keys) * layout.num_layers, layer)
        got[name] = codec.decode(raw, values, torch.bfloat16).float()
    x, y = got["none"], got["fp8_e4m3"]
    err = (y - x).abs()
    big = x.abs() >= x.abs().amax() * 2**-6  # e4m3's normal range of the largest block
    return {
        "values": x.numel(),
        "rel_rms_error": round(float(err.norm() / x.norm()), 5),
        "max_rel_error_normal_range": round(float((err[big] / x.abs()[big]).max()), 5),
        "kv_abs_max": round(float(x.abs().amax()), 3),
        "kv_rms": round(float(x.pow(2).mean().sqrt()), 4),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--prompts", type=int, default=4, help="prompts (each 2-4 chunks long)")
    p.add_argument("--max-tokens", type=int, default=32, help="generated tokens per prompt")
    p.add_argument("--block", type=int, default=128, help="fp8 values per scale")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    # Lengths that leave a partial chunk: its tokens are computed by the consumer.
    prompts = [
        rng.integers(1, 1000, int(rng.integers(2 * CHUNK + 10, 4 * CHUNK + 100))).tolist()
        for _ in range(args.prompts)
    ]
    work = Path(tempfile.mkdtemp(prefix="kvdepot-codec-"))
    model = str(build_tiny_llama(work / "tiny-llama"))

    def spec(kv: dict[str, Any] | None) -> dict[str, Any]:
        return {
            "model": model,
            "prompts": prompts,
            "max_tokens": args.max_tokens,
            "logprobs": 1,
            "kv": kv,
        }

    def kv(role: str, meta: str, node: str, codec: str) -> dict[str, Any]:
        extra: dict[str, Any] = {"metadata": meta, "chunk_tokens": CHUNK, "node_id": node}
        extra.update(kv_codec=codec, kv_codec_block=args.block)
        return {
            "kv_connector": "KVDepotConnector",
            "kv_connector_module_path": "kvdepot.connector.vllm",
            "kv_role": role,
            "kv_connector_extra_config": extra,
        }

    log = sys.stderr
    print(f"{len(prompts)} prompts of {[len(x) for x in prompts]} tokens", file=log)
    ref = run_engine(work, spec(None), "reference")["outputs"]
    result: dict[str, Any] = {
        "model": {"layers": 2, "hidden": 128, "kv_heads": 2, "head_size": 32, "kv_dtype": "bf16"},
        "prompts": len(prompts),
        "prompt_tokens": [len(x) for x in prompts],
        "max_tokens": args.max_tokens,
        "chunk_tokens": CHUNK,
        "fp8_block": args.block,
    }
    with Cluster(nodes=2, capacity="256MiB", log_dir=work / "logs", lease_ttl_s=600) as c:
        meta = c.metadata_address
        runs = {}
        for codec in ("none", "fp8_e4m3"):
            prod = run_engine(work, spec(kv("kv_producer", meta, "store-0", codec)), f"p-{codec}")
            cons = run_engine(work, spec(kv("kv_consumer", meta, "store-1", codec)), f"c-{codec}")
            runs[codec] = (prod, cons)
        result["fp8_kv_error"] = kv_error(model, meta, prompts, args.block)
    for codec, (prod, cons) in runs.items():
        pc, cc = prod["connector"], cons["connector"]
        stored_tokens = (pc["chunks_saved"] or 1) * CHUNK
        row = {
            "chunks_stored": pc["chunks_saved"],
            "bytes_stored": pc["bytes_saved"],
            "bytes_per_token": round(pc["bytes_saved"] / stored_tokens, 2),
            "tokens_loaded": cc["tokens_hit"],
            "bytes_loaded": cc["bytes_loaded"],
            "load_errors": cc["load_errors"],
            "producer_matches_reference": prod["outputs"] == ref,
            **compare(cons["outputs"], ref),
        }
        result[codec] = row
        print(f"{codec}: {row}", file=log)
    if result["none"]["bytes_stored"]:
        result["fp8_over_none_bytes"] = round(
            result["fp8_e4m3"]["bytes_stored"] / result["none"]["bytes_stored"], 4
        )
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>22}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
