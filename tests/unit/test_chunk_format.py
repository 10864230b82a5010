"""The canonical chunk format: golden vectors, head ownership, and the
conversion from and to vLLM's paged CPU cache at any block size and TP rank."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import numpy as np
import pytest

from kvdepot.connector.codec import create_codec
from kvdepot.connector.codec.base import CodecSpec
from kvdepot.connector.vllm.chunk_format import (
    FULL_PART,
    WINDOW_PART,
    HeadMap,
    build_object,
    head_key,
    part_key,
    tail_tokens,
    window_tokens,
)
from kvdepot.connector.vllm.layout import CacheGroups, KVLayout
from kvdepot.errors import InvalidArgument
from kvdepot.keys import Namespace, chunk_keys

torch = pytest.importorskip("torch")

NS = Namespace("golden-model", kv_dtype="bfloat16", kv_layout="kvdepot-chunk1:kv:L2:H2:D4")


def golden_layers() -> list[object]:
    """2 layers of one head, 3 tokens of head size 4: value = layer*100 + kv*10 + t + d/4."""
    return [
        torch.tensor(
            [
                [[li * 100 + kv * 10 + t + d / 4 for d in range(4)] for t in range(3)]
                for kv in (0, 1)
            ],
            dtype=torch.bfloat16,
        )
        for li in range(2)
    ]


def test_golden_object_bytes_and_keys() -> None:
    data = build_object(create_codec(CodecSpec("none")), golden_layers(), torch.bfloat16)
    # 64-byte header (2 layer checksums, the codec header), then per layer
    # K [4 dims x 3 tokens] then V [3 tokens x 4 dims] in bf16: 48 bytes a layer.
    assert len(data) == 64 + 2 * 48
    assert data[16:20] == b"KVDC"
    layer0 = np.frombuffer(data[64:112], dtype=np.uint16)
    want = torch.tensor([[t + d / 4 for d in range(4)] for t in range(3)], dtype=torch.bfloat16)
    assert layer0[:12].tolist() == want.t().contiguous().view(torch.int16).flatten().tolist()
    assert layer0[12:].tolist() == (want + 10).view(torch.int16).flatten().tolist()
    assert hashlib.sha256(data).hexdigest()[:16] == GOLDEN_SHA
    key = chunk_keys(replace(NS, chunk_tokens=4), [1, 2, 3, 4])[0]
    assert head_key(NS.digest(), key, 0) == key
    assert head_key(NS.digest(), key, 1).hex() == GOLDEN_HEAD1
    fp8 = build_object(create_codec(CodecSpec("fp8_e4m3", 8)), golden_layers(), torch.bfloat16)
    assert hashlib.sha256(fp8).hexdigest()[:16] == GOLDEN_FP8_SHA


def test_window_parts_have_keys_of_their_own_and_hold_the_last_window() -> None:
    key = chunk_keys(replace(NS, chunk_tokens=4), [1, 2, 3, 4])[0]
    assert part_key(NS.digest(), key, 1, FULL_PART) == head_key(NS.digest(), key, 1)
    window = [part_key(NS.digest(), key, h, WINDOW_PART) for h in (0, 1)]
    assert [w.hex() for w in window] == GOLDEN_WINDOW
    assert key not in window and head_key(NS.digest(), key, 1) not in window
    with pytest.raises(InvalidArgument):
        part_key(NS.digest(), key, 0, 2)
    # Chunks of 512 with a window of 256: their last 256 tokens; a window
    # of a chunk or more, or a 32-token unit: all of it.
    assert window_tokens(512, 256) == 256
    assert window_tokens(256, 1024) == window_tokens(256, 256) == 256
    assert window_tokens(32, 256) == 32 and window_tokens(256, 0) == 256
    hybrid = CacheGroups(("sliding", "full"), (256, 0), (("l0",), ("l1",)))
    assert hybrid.window == 256
    assert hybrid.part_groups(FULL_PART) == (1,) and hybrid.part_groups(WINDOW_PART) == (0,)
    plain = CacheGroups()
    assert plain.window == 0
    assert plain.part_groups(FULL_PART) == (0,) and plain.part_groups(WINDOW_PART) == ()


GOLDEN_WINDOW = ["222bb811260e20645bb7894c3c9b539c", "f531c3c0999e156686ccaadcc8b7a434"]
GOLDEN_SHA = "5efed4dff4ce5f4a"
GOLDEN_HEAD1 = "8793be95485329e764f1f775a99a6ee4"
GOLDEN_FP8_SHA = "169ea019d6821fc6"


@pytest.mark.parametrize(
    ("total", "tp", "local", "writes"),
    [
        (4, 1, [(0, 1, 2, 3)], [(0, 1, 2, 3)]),
        (4, 2, [(0, 1), (2, 3)], [(0, 1), (2, 3)]),
        # Fewer KV heads than ranks: replicated, each head written once.
        (2, 4, [(0,), (0,), (1,), (1,)], [(0,), (), (1,), ()]),
    ],
)
def test_each_head_is_held_by_its_ranks_and_written_once(
    total: int, tp: int, local: list[tuple[int, ...]], writes: list[tuple[int, ...]]
) -> None:
    maps = [HeadMap(total, tp, r) for r in range(tp)]
    assert [m.local for m in maps] == local
    assert [m.writes for m in maps] == writes
    assert sorted(h for m in maps for h in m.writes) == list(range(total))


def test_mla_latent_is_stored_once_and_read_by_every_rank() -> None:
    maps = [HeadMap(1, 2, r, shared=True) for r in range(2)]
    assert [m.local for m in maps] == [(0,), (0,)]
    assert [m.writes for m in maps] == [(0,), ()]


def test_bad_head_splits_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="do not split"):
        HeadMap(6, 4, 0)
    with pytest.raises(InvalidArgument, match="not a multiple"):
        HeadMap(2, 3, 0)


def test_the_namespace_layout_does_not_depend_on_the_engine_shape() -> None:
    base = KVLayout("cpu", "bfloat16", 128, 4, 2, 64, "cpu-avx512", 256, total_kv_heads=2)
    other = KVLayout("cuda", "bfloat16", 64, 4, 1, 64, "default", 256, total_kv_heads=2, tp_size=2)
    assert base.signature() == other.signature() == "kvdepot-chunk1:kv:L4:H2:D64"
    assert KVLayout("cpu", "bfloat16", 128, 4, 2, 128, "k", 256).signature() != base.signature()
    assert tail_tokens(256) == 32 and tail_tokens(8) == 8


def test_engines_of_any_block_size_and_tp_rank_exchange_canonical_kv() -> None:
    """A TP=1 engine with 128-token blocks saves; two TP=2 ranks with 64-token
    blocks load their heads; every K and V value lands where vLLM's own cache
    write puts it."""
    pytest.importorskip("vllm")
    from vllm import _custom_ops as ops

    from kvdepot.connector.vllm.kvcopy import CacheCopier
    from kvdepot.connector.vllm.objects import ObjectFormat
    from kvdepot.connector.vllm.paged import cpu_isa, paged_map
    from kvdepot.connector.vllm.plan import KVObject

    heads, d, tokens = 2, 64, 256
    codec = create_codec(CodecSpec("none"))
    torch.manual_seed(0)
    k, v = (torch.randn(tokens, heads, d).to(torch.bfloat16) for _ in range(2))

    def engine(bs: int, head_ids: list[int]) -> tuple[torch.Tensor, CacheCopier, list[int]]:
        cache = torch.zeros(8, len(head_ids), bs, 2 * d, dtype=torch.bfloat16)
        isa = cpu_isa(torch.bfloat16, bs, d, "bfloat16")
        blocks = [5, 2, 7, 1][: tokens // bs]  # any block ids
        return cache, CacheCopier(paged_map(cache, bs, isa, "bfloat16"), codec, bs, []), blocks

    def write(cache: torch.Tensor, bs: int, blocks: list[int], head_ids: list[int]) -> None:
        slots = torch.tensor([blocks[t // bs] * bs + t % bs for t in range(tokens)])
        view = cache.view(cache.shape[0], len(head_ids), 2 * bs, d)
        kc, vc = view.chunk(2, dim=2)
        isa = cpu_isa(torch.bfloat16, bs, d, "bfloat16")
        ops.cpu_attn_reshape_and_cache(
            k[:, head_ids].contiguous(), v[:, head_ids].contiguous(), kc, vc, slots, isa
        )

    src, copier, blocks = engine(128, [0, 1])
    copier = CacheCopier(copier.pmap, codec, 128, [0, 1])
    write(src, 128, blocks, [0, 1])
    obj = KVObject(b"k" * 16, 0, (tuple(blocks),), 0, tokens)  # type: ignore[arg-type]
    fmt = ObjectFormat(codec, 2 * d, torch.bfloat16, 1)
    rows = copier.gather(src, [obj], 0, tokens)  # [heads, layer bytes]
    # Canonical: head h is K[d, tokens] then V[tokens, d].
    for h in range(heads):
        want = torch.cat([k[:, h].t().reshape(-1), v[:, h].reshape(-1)]).view(torch.uint8)
        assert torch.equal(rows[h], want)
    geo = fmt.geometry(tokens)
    for rank in range(2):
        dst, rcopier, rblocks = engine(64, [rank])
        expect, _, _ = engine(64, [rank])
        write(expect, 64, rblocks, [rank])
        robj = KVObject(b"k" * 16, 0, (tuple(rblocks),), 0, tokens)  # type: ignore[arg-type]
        rcopier.scatter(dst, geo, rows[rank : rank + 1], [robj], 0, 0, tokens)
        assert torch.equal(dst, expect), rank


def test_pipeline_parallelism_is_refused_naming_the_setting() -> None:
    from types import SimpleNamespace

    from kvdepot.connector.vllm.layout import layout_from_config
    from kvdepot.connector.vllm.settings import ConnectorSettings

    config = SimpleNamespace(
        model_config=SimpleNamespace(dtype="bfloat16"),
        parallel_config=SimpleNamespace(pipeline_parallel_size=2, tensor_parallel_size=1),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=128),
        device_config=SimpleNamespace(device_type="cpu"),
    )
    with pytest.raises(InvalidArgument, match="pipeline_parallel_size=2"):
        layout_from_config(config, ConnectorSettings())


def test_a_gpu_flash_layout_round_trips_value_by_value() -> None:
    """[2, blocks, block_size, heads, dim]: K and V runs are not contiguous,
    so values move one by one; the canonical bytes are the same as from CPU."""
    from kvdepot.connector.vllm.kvcopy import CacheCopier
    from kvdepot.connector.vllm.objects import ObjectFormat
    from kvdepot.connector.vllm.paged import paged_map
    from kvdepot.connector.vllm.plan import KVObject

    bs, heads, d, tokens = 16, 2, 8, 32
    codec = create_codec(CodecSpec("none"))
    torch.manual_seed(1)
    src = torch.randn(2, 6, bs, heads, d).to(torch.bfloat16)
    pmap = paged_map(src, bs, None, "auto")
    assert pmap.unit == 1
    obj = KVObject(b"k" * 16, 0, ((4, 1),), 0, tokens)  # type: ignore[arg-type]
    rows = CacheCopier(pmap, codec, bs, [0, 1]).gather(src, [obj], 0, tokens)
    k = torch.cat([src[0, 4], src[0, 1]])  # [tokens, heads, d]
    v = torch.cat([src[1, 4], src[1, 1]])
    want = torch.cat([k[:, 1].t().reshape(-1), v[:, 1].reshape(-1)]).view(torch.uint8)
    assert torch.equal(rows[1], want)
    dst = torch.zeros_like(src)
    geo = ObjectFormat(codec, 2 * d, torch.bfloat16, 1).geometry(tokens)
    CacheCopier(paged_map(dst, bs, None, "auto"), codec, bs, []).scatter(
        dst, geo, rows, [obj], 0, 0, tokens
    )
    assert torch.equal(dst[:, [4, 1]], src[:, [4, 1]])
    assert not dst[:, [0, 2, 3, 5]].any()
