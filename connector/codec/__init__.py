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

import importlib
import threading

from kvdepot.connector.codec.base import CodecHeader, CodecSpec, KVCodec
from kvdepot.errors import InvalidArgument

_lock = threading.Lock()
# name -> "module:Class", imported on first use.
_registry: dict[str, str] = {}


def register_codec(name: str, target: str) -> None:
    """Make the codec class at ``"module:Class"`` available under ``name``."""
    if not name or ":" not in target:
        raise InvalidArgument("register_codec needs a name and a 'module:Class' target")
    with _lock:
        _registry[name] = target


def available_codecs() -> list[str]:
    """Names of the registered codecs, sorted."""
    with _lock:
        return sorted(_registry)


def check_codec_name(name: str) -> None:
    """Raise :class:`InvalidArgument` unless ``name`` is a registered codec."""
    with _lock:
        known = sorted(_registry)
    if name not in known:
        raise InvalidArgument(f"unknown kv codec {name!r}; known: {', '.join(known)}")


def create_codec(spec: CodecSpec) -> KVCodec:
    """Create the codec ``spec`` names.

    Raises:
        InvalidArgument: If no codec is registered under ``spec.name``.
    """
    check_codec_name(spec.name)
    with _lock:
        module, cls = _registry[spec.name].split(":", 1)
    codec: KVCodec = getattr(importlib.import_module(module), cls)(spec)
    return codec


register_codec("none", "kvdepot.connector.codec.none:NoneCodec")
register_codec("fp8_e4m3", "kvdepot.connector.codec.fp8:Fp8E4M3Codec")

__all__ = [
    "CodecHeader",
    "CodecSpec",
    "KVCodec",
    "available_codecs",
    "check_codec_name",
    "create_codec",
    "register_codec",
]
