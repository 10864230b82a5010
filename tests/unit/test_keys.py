"""The chained prefix hash: golden vectors pin the scheme."""

from __future__ import annotations

import dataclasses
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from kvdepot.errors import InvalidArgument
from kvdepot.keys import (
    Namespace,
    block_keys,
    chunk_keys,
    encode_tokens,
    shard_key,
    validate_key,
    validate_keys,
)

NS = Namespace(
    "meta-llama/Llama-3.1-8B",
    kv_dtype="bfloat16",
    kv_layout="cuda:flash:NHD",
    tp_size=2,
    tp_rank=1,
    chunk_tokens=4,
    extra=("lora:none",),
)


def test_golden_vectors() -> None:
    assert NS.digest().hex() == "4ec49e56b057f17d9ed9c343e24db5f6"
    assert [k.hex() for k in chunk_keys(NS, list(range(10)))] == [
        "e8cc5c857b8f741cbd3ccdf540838324",
        "0e3a582e765bb52a1867f5abcac76c1a",
    ]
    assert [k.hex() for k in chunk_keys(Namespace("m"), list(range(600)))] == [
        "659faf609d0d865f03061dcc67f53cef",
        "84ea2e0ccd0c84ac33133fb157a2a573",
    ]


def test_chain_matches_the_design_formula() -> None:
    tokens = list(range(1000, 1012))
    prev = NS.digest()
    expected = []
    for i in range(3):
        block = struct.pack("<4I", *tokens[i * 4 : (i + 1) * 4])
        prev = xxhash.xxh3_128_digest(prev + block)
        expected.append(prev)
    assert chunk_keys(NS, tokens) == expected


def test_key_i_depends_on_the_whole_prefix() -> None:
    a = chunk_keys(NS, [1, 2, 3, 4, 5, 6, 7, 8])
    b = chunk_keys(NS, [9, 2, 3, 4, 5, 6, 7, 8])
    assert a[0] != b[0] and a[1] != b[1]
    c = chunk_keys(NS, [1, 2, 3, 4, 5, 6, 7, 9])
    assert a[0] == c[0] and a[1] != c[1]


@pytest.mark.parametrize(
    "change",
    [
        {"model": "other"},
        {"kv_dtype": "float16"},
        {"kv_layout": "cpu:amx"},
        {"tp_size": 4},
        {"tp_rank": 0},
        {"chunk_tokens": 2},
        {"extra": ("lora:7",)},
    ],
)
def test_every_namespace_field_changes_the_keys(change: dict[str, object]) -> None:
    fields = {
        "model": NS.model,
        "kv_dtype": NS.kv_dtype,
        "kv_layout": NS.kv_layout,
        "tp_size": NS.tp_size,
        "tp_rank": NS.tp_rank,
        "chunk_tokens": NS.chunk_tokens,
        "extra": NS.extra,
    }
    fields.update(change)
    other = Namespace(**fields)  # type: ignore[arg-type]
    assert chunk_keys(other, list(range(8)))[0] != chunk_keys(NS, list(range(8)))[0]


def test_fields_cannot_be_shifted_into_each_other() -> None:
    assert Namespace("ab", kv_dtype="c").digest() != Namespace("a", kv_dtype="bc").digest()


def test_partial_chunk_and_input_types() -> None:
    assert len(chunk_keys(NS, list(range(7)))) == 1
    assert len(chunk_keys(NS, list(range(7)), full_only=False)) == 2
    assert chunk_keys(NS, np.arange(8, dtype=np.int64)) == chunk_keys(NS, list(range(8)))
    assert encode_tokens([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"


def test_bad_inputs() -> None:
    with pytest.raises(InvalidArgument):
        chunk_keys(NS, [-1, 2, 3, 4])
    with pytest.raises(InvalidArgument):
        chunk_keys(NS, [2**32, 1, 2, 3])
    with pytest.raises(InvalidArgument):
        chunk_keys(NS, [[1, 2], [3, 4]])
    with pytest.raises(InvalidArgument):
        Namespace("m", tp_size=2, tp_rank=2)
    with pytest.raises(InvalidArgument):
        Namespace("")
    with pytest.raises(InvalidArgument):
        validate_key(b"short")
    assert validate_key(bytes(16)) == bytes(16)


def test_same_keys_in_other_processes_whatever_the_hash_seed() -> None:
    code = (
        "from kvdepot.keys import Namespace, chunk_keys;"
        "print(chunk_keys(Namespace('m', extra=('a','b')), list(range(512)))[1].hex())"
    )
    outs = set()
    for seed in ("0", "1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        outs.add(out.stdout.strip())
    assert len(outs) == 1
    assert outs == {chunk_keys(Namespace("m", extra=("a", "b")), list(range(512)))[1].hex()}


def test_block_keys_golden_and_formula() -> None:
    chunks = chunk_keys(NS, list(range(10)))
    tail = block_keys(chunks[-1], list(range(8, 10)), 1)
    assert [k.hex() for k in tail] == [
        "2ae07d8ef7c201f7d973704406829b4c",
        "eebb5ac0194cea6fb6df5515506003ad",
    ]
    first = xxhash.xxh3_128_digest(b"\x01blk" + chunks[-1] + struct.pack("<I", 8))
    assert tail[0] == first
    assert tail[1] == xxhash.xxh3_128_digest(b"\x01blk" + first + struct.pack("<I", 9))
    # Seeded by the namespace when no chunk precedes; a partial block is dropped.
    assert [k.hex() for k in block_keys(NS.digest(), [0, 1, 2], 2)] == [
        "0ea08f0b919fd098fe1301510d835afd"
    ]


def test_block_keys_cover_the_exact_prefix_and_never_equal_chunk_keys() -> None:
    ns = Namespace("m", chunk_tokens=4)
    tokens = list(range(100, 120))
    chunks = chunk_keys(ns, tokens)
    # Blocks of 4 tokens chained from the namespace: same tokens as chunk 0,
    # yet a different key.
    assert block_keys(ns.digest(), tokens[:4], 4)[0] != chunks[0]
    a = block_keys(chunks[1], tokens[8:11], 1)
    b = block_keys(chunks[1], [*tokens[8:10], 7], 1)
    assert a[:2] == b[:2] and a[2] != b[2]
    # Another prefix before the boundary changes every block key after it.
    other = chunk_keys(ns, [1, *tokens[1:]])
    assert block_keys(other[1], tokens[8:11], 1)[0] != a[0]
    with pytest.raises(InvalidArgument):
        block_keys(b"short", tokens, 1)
    with pytest.raises(InvalidArgument):
        block_keys(ns.digest(), tokens, 0)


def test_each_tensor_parallel_rank_has_its_own_shard_keys() -> None:
    rank0 = Namespace("m", tp_size=2, tp_rank=0, chunk_tokens=4)
    rank1 = Namespace("m", tp_size=2, tp_rank=1, chunk_tokens=4)
    keys = chunk_keys(rank0, list(range(8)))
    assert [shard_key(rank0, k) for k in keys] == keys
    shards = [shard_key(rank1, k) for k in keys]
    assert len(set(shards) | set(keys)) == 4
    assert shards[0] == xxhash.xxh3_128_digest(b"\x02rank" + rank1.digest() + keys[0])
    golden = dataclasses.replace(NS, tp_rank=0)
    first = chunk_keys(golden, list(range(10)))[0]
    assert shard_key(NS, first).hex() == "3e6bb5c61d2a13354621cdddea4d3630"


def test_one_key_check_names_the_bad_key() -> None:
    good = validate_keys([bytes(16), bytearray(16), memoryview(bytes(16))])
    assert good == [bytes(16)] * 3 and all(type(k) is bytes for k in good)
    with pytest.raises(InvalidArgument, match=r"^key 1 is 3 bytes; chunk keys are 16$"):
        validate_keys([bytes(16), b"abc"])
    with pytest.raises(InvalidArgument, match=r"^key 0 is a str; chunk keys are 16 bytes$"):
        validate_keys(["x" * 16])
    with pytest.raises(InvalidArgument, match=r"^a key is a NoneType"):
        validate_key(None)


def test_a_key_list_over_its_limit_is_refused_with_the_count() -> None:
    from kvdepot.keys import validate_keys

    keys = [bytes([i]) * 16 for i in range(3)]
    assert validate_keys(keys, 3, "describe") == keys
    with pytest.raises(InvalidArgument, match="3 keys to describe; the limit is 2"):
        validate_keys(keys, 2, "describe")
