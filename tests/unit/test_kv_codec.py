"""KV codecs: fp8_e4m3 round-trip error bounds, exact sizes, rejected bytes;
the codec's place in the namespace and the chunk header."""

from __future__ import annotations

from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from kvdepot.connector.codec import CodecHeader, CodecSpec, available_codecs, create_codec
from kvdepot.connector.codec.base import HEADER_BYTES
from kvdepot.connector.vllm.layout import KVLayout, namespace_for
from kvdepot.connector.vllm.settings import ConnectorSettings
from kvdepot.errors import Corrupt, InvalidArgument


@pytest.fixture()
def torch() -> ModuleType:
    return pytest.importorskip("torch", reason="the codecs run on torch tensors")


# ---------------------------------------------------------------- no torch
def test_registry_and_spec_validation() -> None:
    assert {"none", "fp8_e4m3"} <= set(available_codecs())
    with pytest.raises(InvalidArgument):
        create_codec(CodecSpec("fp4_magic"))
    with pytest.raises(InvalidArgument):
        CodecSpec("fp8_e4m3", block=0)
    with pytest.raises(InvalidArgument):
        ConnectorSettings.from_extra({"kv_codec": "zstd"})
    with pytest.raises(InvalidArgument):
        ConnectorSettings.from_extra({"kv_codec": "fp8_e4m3", "kv_codec_block": -1})


def _namespace(**extra: Any) -> bytes:
    cfg = SimpleNamespace(
        model_config=SimpleNamespace(model="tiny"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
    settings = ConnectorSettings.from_extra({"chunk_tokens": 128, **extra})
    layout = KVLayout("cpu", "bfloat16", 128, 2, 2, 32, "cpu-avx2", 128)
    return namespace_for(cfg, settings, layout, 0).digest()


def test_codec_is_part_of_the_namespace() -> None:
    plain = _namespace()
    fp8 = _namespace(kv_codec="fp8_e4m3")
    assert plain == _namespace(kv_codec="none", kv_codec_block=64)  # block is fp8's only
    assert fp8 == _namespace(kv_codec="fp8_e4m3", kv_codec_block=128)
    assert len({plain, fp8, _namespace(kv_codec="fp8_e4m3", kv_codec_block=64)}) == 3
    # A cache salt and the codec both count, and do not alias each other.
    assert _namespace(cache_salt="t1", kv_codec="fp8_e4m3") not in (
        _namespace(cache_salt="t1"),
        fp8,
    )


def test_header_round_trip_and_bad_headers_rejected() -> None:
    h = CodecHeader(codec_id=1, dtype_code=2, block=128, values=16384)
    raw = h.pack()
    assert len(raw) == HEADER_BYTES == 16
    assert CodecHeader.unpack(raw) == h
    with pytest.raises(Corrupt):
        CodecHeader.unpack(raw[:-1])
    with pytest.raises(Corrupt):
        CodecHeader.unpack(b"XXXX" + raw[4:])
    with pytest.raises(Corrupt):
        CodecHeader.unpack(raw[:4] + b"\x09" + raw[5:])  # unknown version


# ------------------------------------------------------------------- torch
def test_fp8_round_trip_error_bounds(torch: Any) -> None:
    codec = create_codec(CodecSpec("fp8_e4m3", block=128))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16384, generator=g) * torch.logspace(-3, 2, 16384)  # 5 decades
    x[0, 100] = 300.0  # an outlier inside one block
    enc = codec.encode(x)
    y = codec.decode(enc, 16384, torch.float32)
    scale = enc[:, : 4 * 128].contiguous().view(torch.float32)
    s = scale.repeat_interleave(128, dim=1)
    err = (y - x).abs()
    # e4m3: 3 mantissa bits -> half an ulp is 2**-4 relative; subnormals 2**-10 * s.
    bound = x.abs() * 2**-4 + s * 2**-10
    assert bool((err <= bound * (1 + 1e-6)).all()), float((err / bound).max())
    # Each block's largest magnitude is exact (it maps to 448 = 1.75 * 2**8).
    xb, yb = x.reshape(4, 128, 128), y.reshape(4, 128, 128)
    idx = xb.abs().argmax(dim=-1, keepdim=True)
    assert torch.allclose(yb.gather(-1, idx), xb.gather(-1, idx), rtol=1e-6, atol=0)
    # Quantization really happens (a no-op codec would pass the bound).
    assert float(err.max()) > 0
    # Through bf16, as the connector stores KV: bf16 rounding adds 2**-9 relative.
    xb16 = x.to(torch.bfloat16)
    y16 = codec.decode(codec.encode(xb16), 16384, torch.bfloat16)
    assert y16.dtype == torch.bfloat16
    err16 = (y16.float() - xb16.float()).abs()
    assert bool((err16 <= xb16.float().abs() * (2**-4 + 2**-8) + s * 2**-9).all())


def test_fp8_size_is_exact_and_about_half_of_bf16(torch: Any) -> None:
    for block in (32, 128, 1024):
        codec = create_codec(CodecSpec("fp8_e4m3", block=block))
        for n in (16384, 1000, 1):
            nb = -(-n // block)
            want = -(-(n + 4 * nb) // 8) * 8
            assert codec.encoded_bytes(n, torch.bfloat16) == want
            assert codec.encode(torch.ones(3, n, dtype=torch.bfloat16)).shape == (3, want)
    codec = create_codec(CodecSpec("fp8_e4m3", block=128))
    assert codec.encoded_bytes(16384, torch.bfloat16) / (2 * 16384) == 0.515625
    assert create_codec(CodecSpec()).encoded_bytes(16384, torch.bfloat16) == 2 * 16384


def test_fp8_zeros_nan_inf_and_short_blocks(torch: Any) -> None:
    codec = create_codec(CodecSpec("fp8_e4m3", block=4))
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0, nan, -0.5, 0.25, inf, -inf, 2.0, -1.0, 1e-30, 3.0]])
    enc = codec.encode(x)
    scales = enc[:, :16].contiguous().view(torch.float32)[0].tolist()
    assert scales[0] == 1.0  # a zero block: no division by zero
    assert scales[1] == pytest.approx(1.0 / 448)  # NaN does not spoil the scale
    y = codec.decode(enc, 14, torch.float32)[0]
    assert y[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert y[5].isnan() and y[[4, 6, 7]].tolist() == [1.0, -0.5, 0.25]
    assert y[8:12].tolist() == [2.0, -2.0, 2.0, -1.0]  # inf saturates to the block's max
    assert y[12] == 0.0 and y[13] == 3.0  # the short last block
    allinf = codec.decode(codec.encode(torch.tensor([[inf, -inf]])), 2, torch.float32)
    assert allinf.tolist() == [[448.0, -448.0]]
    tiny = torch.full((1, 4), 1e-40)  # subnormal float32: a scale that stays finite
    assert bool(torch.isfinite(codec.decode(codec.encode(tiny), 4, torch.float32)).all())


def test_fp8_rejects_bytes_it_did_not_write(torch: Any) -> None:
    codec = create_codec(CodecSpec("fp8_e4m3", block=128))
    enc = codec.encode(torch.randn(2, 1024))
    codec.decode(enc, 1024, torch.bfloat16)
    with pytest.raises(Corrupt):
        codec.decode(enc[:, :-8], 1024, torch.bfloat16)  # wrong size
    with pytest.raises(Corrupt):
        codec.decode(enc, 2048, torch.bfloat16)  # another shape
    with pytest.raises(Corrupt):
        codec.decode(enc.view(torch.int8), 1024, torch.bfloat16)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        broken = enc.clone()
        broken[1, 8:12] = torch.tensor([bad], dtype=torch.float32).view(torch.uint8)
        with pytest.raises(Corrupt):
            codec.decode(broken, 1024, torch.bfloat16)
    with pytest.raises(InvalidArgument):
        codec.encode(torch.zeros(1, 8, dtype=torch.uint8))  # an fp8 cache's raw bytes
    with pytest.raises(InvalidArgument):
        codec.header(1024, torch.uint8)


def test_headers_tell_codecs_blocks_dtypes_and_shapes_apart(torch: Any) -> None:
    fp8 = create_codec(CodecSpec("fp8_e4m3", block=128))
    headers = {
        fp8.header(16384, torch.bfloat16).pack(),
        fp8.header(16384, torch.float16).pack(),
        fp8.header(8192, torch.bfloat16).pack(),
        create_codec(CodecSpec("fp8_e4m3", block=64)).header(16384, torch.bfloat16).pack(),
        create_codec(CodecSpec()).header(16384, torch.bfloat16).pack(),
    }
    assert len(headers) == 5
    assert CodecHeader.unpack(fp8.header(16384, torch.bfloat16).pack()) == CodecHeader(
        1, 2, 128, 16384
    )


def test_none_codec_is_the_identity(torch: Any) -> None:
    codec = create_codec(CodecSpec())
    x = torch.randn(3, 100).to(torch.bfloat16)
    enc = codec.encode(x)
    assert enc.dtype == torch.uint8 and enc.shape == (3, 200)
    assert torch.equal(codec.decode(enc, 100, torch.bfloat16), x)
    assert torch.equal(enc, x.view(torch.uint8))  # the cache's bytes, unchanged
    with pytest.raises(Corrupt):
        codec.decode(enc[:, :-2], 100, torch.bfloat16)
