"""Heterogeneous prefill/decode: engines of different tensor parallelism and
block size share KV through kvdepot's canonical chunk format.

Each producer runs with nothing stored, so its outputs are the plain outputs
of its shape (the connector computes everything itself); each consumer
loads what a producer of another shape stored and must match the producer
of its own shape token for token. Producers are kept apart by cache salts:
the same prompts stored by two shapes land in two namespaces.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvdepot.apps.cluster import LocalCluster

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvdepot[vllm]')")

from .test_connector import CHUNK, PROMPT_A, PROMPT_B, kv, run_engine, spec
from .test_connector import model as model
from .test_connector import workdir as workdir

pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.timeout(1200)]

PROMPTS = [PROMPT_A, PROMPT_B]  # 300 and 456 tokens: neither a whole number of blocks
HEADS, LAYERS, HEAD_SIZE, UNIT = 2, 2, 32, 32


def object_bytes(tokens: int) -> int:
    """One KV head of ``tokens`` tokens: the 64-byte header, then per layer
    K and V of ``tokens x 32`` bf16 values."""
    return 64 + LAYERS * 2 * tokens * HEAD_SIZE * 2


def loaded_bytes(hit: int) -> int:
    """Bytes of every head of the objects that cover ``hit`` tokens."""
    chunks, rest = divmod(hit, CHUNK)
    units = -(-rest // UNIT)
    return HEADS * (chunks * object_bytes(CHUNK) + units * object_bytes(UNIT))


def expected_hit(prompt: list[int], block: int) -> int:
    """Tokens a consumer with ``block``-token blocks loads: what was stored
    (whole chunks, then 32-token tail units), in whole blocks."""
    n = len(prompt)
    stored = n // CHUNK * CHUNK + (n % CHUNK) // UNIT * UNIT
    return stored // block * block


def run(
    workdir: Path, model: str, name: str, kvcfg: dict[str, Any], tp: int = 1, block: int = 128
) -> dict[str, Any]:
    s = {**spec(model, PROMPTS, kvcfg), "tp": tp, "block_size": block}
    out = run_engine(workdir, s, name)
    assert out["block_size"] == block
    return out


def test_tp1_tp2_and_block_sizes_exchange_kv_token_exact(
    model: str,
    workdir: Path,
    cluster: LocalCluster,
) -> None:
    meta = cluster.metadata_address

    def cfg(role: str, salt: str, node: str) -> dict[str, Any]:
        return kv(role, meta, node, cache_salt=salt)

    # Producers of three shapes, each in a namespace of its own.
    tp1 = run(workdir, model, "h-tp1-128", cfg("kv_producer", "from-tp1", "store-0"))
    tp2 = run(workdir, model, "h-tp2-128", cfg("kv_producer", "from-tp2", "store-0"), tp=2)
    bs64 = run(workdir, model, "h-tp1-64", cfg("kv_producer", "plain-64", "store-0"), block=64)

    cases = [
        # consumer name, reads the namespace of, its TP, its block, its plain outputs
        ("h-tp2-from-tp1", "from-tp1", 2, 128, tp2),
        ("h-tp1-from-tp2", "from-tp2", 1, 128, tp1),
        ("h-bs64-from-bs128", "from-tp1", 1, 64, bs64),
    ]
    for name, salt, tp, block, plain in cases:
        cons = run(workdir, model, name, cfg("kv_consumer", salt, "store-1"), tp=tp, block=block)
        for got, want in zip(cons["outputs"], plain["outputs"], strict=True):
            assert got["tokens"] == want["tokens"], name
        e = cons["engine_connector"]  # the ranks' counters, summed
        hits = [expected_hit(p, block) for p in PROMPTS]
        # It loads, it does not recompute: less than one block per request.
        assert all(len(p) - h < block for p, h in zip(PROMPTS, hits, strict=True)), hits
        assert e["tokens_hit"] == sum(hits) and e["load_errors"] == 0, (name, e)
        whole = sum(loaded_bytes(h) for h in hits)  # every head of what was loaded
        assert e["bytes_loaded"] == whole, (name, e)
        # Each rank reads its own heads only: at TP=2, half of every chunk.
        assert e["bytes_loaded_rank0"] * tp == whole, (name, e)
