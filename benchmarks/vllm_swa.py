"""Sliding-window KV for :mod:`benchmarks.vllm_serve`: bytes stored and moved
per token against the model's whole KV, on a Gemma3.

A random-weight Gemma3 in Gemma3's own layer pattern (5 sliding-window layers
of ``WINDOW`` tokens, then one full-attention layer), 2 KV heads of 32,
served by ``vllm serve`` with vLLM's hybrid KV cache manager and chunks of
``CHUNK`` tokens (twice the window). Probe prompts of whole chunks plus one
token: a ``kv_producer`` engine prefills them (one token generated, so
nothing decoded is saved), then a fresh ``kv_consumer`` engine without vLLM's
prefix cache answers them from kvdepot. Reported:

* ``swa_bytes_ratio``: bytes the producer published (its
  ``vllm:kvdepot_saved_bytes_total``) over the tokens it stored times the
  model's KV bytes per token; its bound ``(F + S x W / chunk) / (F + S)``;
* ``swa_moved_ratio``: bytes the consumer loaded over the tokens vLLM
  counted as loaded times KV bytes per token; its bound
  ``(F x hit + S x W) / ((F + S) x hit)`` summed over the probes;
* whether the consumer's greedy tokens are a plain engine's.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from benchmarks.vllm_hetero import EXTERNAL, LOADED_BYTES
from benchmarks.vllm_servers import (
    VOCAB,
    Processes,
    complete,
    delta,
    kv_config,
    log,
    metrics,
    save_word_tokenizer,
    start_engine,
    wait_saves_settled,
)

WINDOW = 256
CHUNK = 512
SLIDING, FULL = 5, 1
KV_HEADS, HEAD_SIZE, DTYPE_BYTES = 2, 32, 4  # build_tiny_gemma3's, served as float32
SAVED = "vllm:kvdepot_saved_bytes_total"


def build_gemma(path: Path) -> Path:
    from tests.integration.vllm.engine import build_tiny_gemma3

    build_tiny_gemma3(path, sliding_window=WINDOW, sliding_per_full=SLIDING)
    return save_word_tokenizer(path)


def compare_swa(
    procs: Processes, work: Path, meta: str, *, probe_chunks: tuple[int, ...]
) -> dict[str, Any]:
    """The ``swa_*`` figures (comparison 8)."""
    print(f"8. sliding window: Gemma3 {SLIDING}:{FULL}, window {WINDOW}, chunk {CHUNK}", file=log)
    model = build_gemma(work / "gemma3")
    rng = random.Random(8000)
    probes = [[rng.randrange(3, VOCAB) for _ in range(n * CHUNK + 1)] for n in probe_chunks]
    per_token = (SLIDING + FULL) * 2 * KV_HEADS * HEAD_SIZE * DTYPE_BYTES

    plain = start_engine(procs, work, "gemma-plain", model, cores="0-1", kv=None)
    reference = [complete(plain, p, 8)["choices"][0].get("token_ids") for p in probes]
    procs.stop(plain)

    producer = start_engine(
        procs, work, "gemma-producer", model, cores="0-1",
        kv=kv_config("kv_producer", meta, "store-0", CHUNK),
    )  # fmt: skip
    before = metrics(producer)
    for p in probes:
        complete(producer, p, 1)
    wait_saves_settled(meta)
    # The publisher counts a save once it is stored, after the step that
    # computed it; workers report counts with a step: one more, saving nothing.
    complete(producer, [3, 4, 5], 1)
    saved = delta(metrics(producer), before, SAVED)
    procs.stop(producer)  # publishes what it staged before it exits
    stored_tokens = sum(len(p) // CHUNK * CHUNK for p in probes)

    consumer = start_engine(
        procs, work, "gemma-consumer", model, cores="0-1", prefix_caching=False,
        kv=kv_config("kv_consumer", meta, "store-1", CHUNK),
    )  # fmt: skip
    rows = []
    for prompt, ref in zip(probes, reference, strict=True):
        m0 = metrics(consumer)
        out = complete(consumer, prompt, 8)
        m1 = metrics(consumer)
        rows.append(
            {
                "prompt_tokens": len(prompt),
                "loaded_tokens": int(delta(m1, m0, EXTERNAL)),
                "loaded_bytes": int(delta(m1, m0, LOADED_BYTES)),
                "tokens_equal_plain": out["choices"][0].get("token_ids") == ref,
            }
        )
        print(f"  probe {rows[-1]}", file=log)
    procs.stop(consumer)
    loaded = sum(r["loaded_tokens"] for r in rows)
    moved = sum(r["loaded_bytes"] for r in rows)
    layers = SLIDING + FULL
    moved_bound = sum(FULL * r["loaded_tokens"] + SLIDING * WINDOW for r in rows) / (
        layers * loaded or 1
    )
    return {
        "swa_model": {
            "sliding_layers": SLIDING,
            "full_layers": FULL,
            "window": WINDOW,
            "chunk_tokens": CHUNK,
            "kv_bytes_per_token": per_token,
        },
        "swa_probes": rows,
        "swa_bytes_ratio": round(saved / (stored_tokens * per_token), 4) if saved else None,
        "swa_bytes_bound": round((FULL + SLIDING * WINDOW / CHUNK) / layers, 4),
        "swa_moved_ratio": round(moved / (loaded * per_token), 4) if loaded else None,
        "swa_moved_bound": round(moved_bound, 4),
        "swa_loaded_tokens": loaded,
        "swa_recomputed_tokens_max": max(r["prompt_tokens"] - r["loaded_tokens"] for r in rows),
        "swa_outputs_equal": all(r["tokens_equal_plain"] for r in rows),
    }
