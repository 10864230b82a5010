"""The vLLM connector's settings and key plans (no engine, no network)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

from kvdepot.connector.vllm.layout import KVLayout
from kvdepot.connector.vllm.plan import prefix_keys, tail_keys
from kvdepot.connector.vllm.settings import ConnectorSettings
from kvdepot.errors import InvalidArgument
from kvdepot.keys import Namespace, block_keys, chunk_keys


def test_defaults_are_the_clients() -> None:
    s = ConnectorSettings()
    assert s.transport == "auto"
    assert s.lookup_timeout_s < 0.1  # the scheduler never waits long
    assert s.saves_decode("kv_both") and not s.saves_decode("kv_producer")
    assert ConnectorSettings(save_decode=True).saves_decode("kv_producer")
    assert s.lookup_ceiling_s() == s.lookup_timeout_max_s > s.lookup_timeout_s


def test_a_longer_lookup_deadline_raises_its_ceiling() -> None:
    assert ConnectorSettings(lookup_timeout_s=1.0).lookup_ceiling_s() == 1.0


@pytest.mark.parametrize(
    ("extra", "names"),
    [
        ({"chunk_tokens": 0}, "chunk_tokens"),
        ({"chunk_tokens": "256"}, "chunk_tokens"),
        ({"transport": "carrier-pigeon"}, "transport"),
        ({"lookup_timeout_s": 0}, "lookup_timeout_s"),
        ({"load_timeout_s": -1}, "load_timeout_s"),
        ({"lookup_breaker_s": -1}, "lookup_breaker_s"),
        ({"lookup_timeout_max_s": 0}, "lookup_timeout_max_s"),
        ({"lookup_breaker_after": 0}, "lookup_breaker_after"),
        ({"save_buffer_bytes": -5}, "save_buffer_bytes"),
        ({"sync_load_max_tokens": True}, "sync_load_max_tokens"),
        ({"sync_load_max_tokens": "always"}, "sync_load_max_tokens"),
        ({"sync_load_max_tokens": -1}, "sync_load_max_tokens"),
        ({"no_such_key": 1}, "no_such_key"),
        ({"kv_codec": "zip"}, "zip"),
    ],
)
def test_bad_settings_name_the_setting(extra: dict[str, object], names: str) -> None:
    with pytest.raises(InvalidArgument, match=names):
        ConnectorSettings.from_extra(extra)


def test_chunk_tokens_must_be_whole_blocks() -> None:
    with pytest.raises(InvalidArgument, match="multiple of the engine's block size"):
        KVLayout("cpu", "bfloat16", 128, 2, 2, 32, "k", chunk_tokens=200)
    sw = KVLayout("cpu", "bfloat16", 128, 2, 2, 32, "k", chunk_tokens=256, sliding_window=64)
    plain = KVLayout("cpu", "bfloat16", 128, 2, 2, 32, "k", chunk_tokens=256)
    assert sw.signature() != plain.signature()


def test_prefix_keys_are_chunks_then_tail_blocks() -> None:
    ns = Namespace("m", chunk_tokens=8)
    tokens = list(range(1, 30))  # 3 chunks of 8, then 5 tokens: 2 blocks of 2
    keys = prefix_keys(ns, tokens, 2)
    assert list(keys.chunks) == chunk_keys(ns, tokens)
    assert list(keys.tail) == block_keys(keys.chunks[-1], tokens[24:28], 2)
    assert keys.key_tokens == [8, 8, 8, 2, 2]
    assert keys.tokens_of(2) == 16 and keys.tokens_of(5) == 28
    # Chunk keys computed before are reused, not recomputed.
    again = prefix_keys(ns, tokens, 2, chunks=keys.chunks)
    assert again == keys
    # A whole chunk is never also keyed as blocks: at most chunk/block - 1.
    assert len(tail_keys(ns, tokens, 2, 1, keys.chunks)) == 3
    assert prefix_keys(ns, tokens, 8).tail == ()  # one block per chunk: no tail
    assert prefix_keys(ns, tokens, 2, with_tail=False).tail == ()
