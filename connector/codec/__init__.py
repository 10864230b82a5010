"""KV codecs, by name: how the vLLM connector stores each layer of a chunk.

``none`` keeps the cache's bytes; ``fp8_e4m3`` stores e4m3 values with one
float32 scale per block (about half the bytes of bf16), dequantized on load.
A codec is chosen per namespace (the connector's ``kv_codec`` option) and is
part of the key namespace::

    codec = create_codec(CodecSpec("fp8_e4m3", block=128))

Implementations import ``torch`` and are loaded on first use, so naming and
validating a codec (scheduler configuration, namespaces) does not need it.
"""

from __future__ import annotations

from kvdepot.connector.codec.base import CodecHeader, CodecSpec, KVCodec
from kvdepot.registry import Registry

CODECS: Registry[type[KVCodec]] = Registry("kv codec", base=KVCodec)
"""The codecs, by name; each module is imported when its codec is first made."""
CODECS.register("none", "kvdepot.connector.codec.none:NoneCodec", needs="torch")
CODECS.register("fp8_e4m3", "kvdepot.connector.codec.fp8:Fp8E4M3Codec", needs="torch")


def register_codec(name: str, target: str | type[KVCodec]) -> None:
    """Make the codec class (or its ``"module:Class"`` path) available under ``name``.

    Raises:
        InvalidArgument: A malformed path, or a name registered already.
    """
    CODECS.register(name, target)


def available_codecs() -> list[str]:
    """Names of the registered codecs, sorted."""
    return CODECS.names()


def check_codec_name(name: str) -> None:
    """Raise :class:`InvalidArgument` unless ``name`` is a registered codec (imports nothing)."""
    CODECS.check(name)


def create_codec(spec: CodecSpec) -> KVCodec:
    """Create the codec ``spec`` names.

    Raises:
        InvalidArgument: If no codec is registered under ``spec.name``.
    """
    return CODECS.get(spec.name)(spec)


__all__ = [
    "CODECS",
    "CodecHeader",
    "CodecSpec",
    "KVCodec",
    "available_codecs",
    "check_codec_name",
    "create_codec",
    "register_codec",
]
