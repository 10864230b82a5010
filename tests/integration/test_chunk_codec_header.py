"""The vLLM connector's layer loader against real daemons: a chunk whose codec
header is not the one the reader expects is a miss, never decoded."""

from __future__ import annotations

import numpy as np

from kvdepot.connector.client import KVDepotClient
from kvdepot.connector.codec import CodecHeader
from kvdepot.connector.vllm.loader import LayerLoader, header_bytes, write_header
from kvdepot.keys import ChunkKey, Namespace, chunk_keys

LAYERS = 3
LAYER_BYTES = 4096
FP8 = CodecHeader(codec_id=1, dtype_code=2, block=128, values=4000).pack()
FP8_B64 = CodecHeader(codec_id=1, dtype_code=2, block=64, values=4000).pack()
NONE = CodecHeader(codec_id=0, dtype_code=2, block=0, values=2048).pack()


def chunks(n: int, headers: list[bytes], seed: int) -> np.ndarray:
    rows = np.random.default_rng(seed).integers(
        0, 256, (n, header_bytes(LAYERS) + LAYERS * LAYER_BYTES), dtype=np.uint8
    )
    for i, h in enumerate(headers):
        write_header(rows[i : i + 1], LAYERS, LAYER_BYTES, h)
    return rows


def load(client: KVDepotClient, keys: list[ChunkKey], header: bytes) -> tuple[int, np.ndarray]:
    loader = LayerLoader(client, LAYERS, LAYER_BYTES, header)
    try:
        job = loader.start([keys], 10.0)
        for layer in range(LAYERS):
            assert job.wait_layer(layer, 30) is not None
        return job.ok[0], job.staging[0]
    finally:
        loader.close()


def test_a_chunk_with_another_codec_header_is_a_miss(client: KVDepotClient) -> None:
    ns = Namespace("tiny", chunk_tokens=4)
    good = chunk_keys(ns, list(range(12)))
    rows = chunks(3, [FP8] * 3, seed=1)
    assert client.put(good, list(rows)).stored == 3
    ok, staging = load(client, good, FP8)
    assert ok == 3 and np.array_equal(staging, rows)
    # The same bytes read by a reader expecting another codec, block size or shape.
    for other in (FP8_B64, NONE):
        assert load(client, good, other)[0] == 0

    # A prompt whose second chunk was written with another header: only the
    # first chunk is usable (the prefix ends where the header differs).
    mixed = chunk_keys(ns, list(range(100, 112)))
    rows = chunks(3, [FP8, FP8_B64, FP8], seed=2)
    assert client.put(mixed, list(rows)).stored == 3
    ok, staging = load(client, mixed, FP8)
    assert ok == 1 and np.array_equal(staging[0], rows[0])
