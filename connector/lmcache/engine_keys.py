"""LMCache's ``CacheEngineKey`` as a kvdepot chunk key.

LMCache names a chunk by model, world size, worker id, chunk hash and dtype,
plus the request's ``lmcache.tag.*`` configs (and, for layer-wise storage, a
layer id). Two LMCache keys are the same chunk exactly when all of these are
equal, so the kvdepot key is a digest of all of them::

    key = xxh3_128(field("lmcache-v1") || field(encoding) || field(kind)
                   || field(model) || field(world_size) || field(worker_id)
                   || field(chunk_hash) || field(dtype) || field(#tags)
                   || field(tag name) || field(tag value) ... [|| field(layer_id)])

where ``field(b) = u32le(len(b)) || b``, so no two different keys encode to
the same bytes. ``encoding`` is how the chunk's bytes are stored (see
:mod:`kvdepot.connector.lmcache.encoding`): bytes written in one encoding are
never read back in another. Integers are signed big-endian in as few bytes
as they need (LMCache's chunk hashes may be negative or wider than 64 bits);
a chunk hash given as bytes is kept apart from an integer one by a type byte.
Tag values are taken as text, as LMCache itself does when it names remote
objects (``CacheEngineKey.to_string``).

Nothing here depends on the process or the machine, so every engine derives
the same key for the same chunk; golden vectors in the tests pin the scheme.
"""

from __future__ import annotations

import struct
from typing import Any, Protocol

import xxhash

from kvdepot.errors import InvalidArgument
from kvdepot.keys import ChunkKey

SCHEME = b"lmcache-v1"
ENCODINGS = ("raw", "framed")


class EngineKey(Protocol):
    """The fields of LMCache's ``CacheEngineKey`` the mapping reads."""

    model_name: str
    world_size: int
    worker_id: int
    chunk_hash: Any
    dtype: Any
    tags: Any


def _field(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


def _int(value: int) -> bytes:
    return int(value).to_bytes(max(1, (int(value).bit_length() + 8) // 8), "big", signed=True)


def _chunk_hash(value: Any) -> bytes:
    if isinstance(value, bytes | bytearray):
        return b"b" + bytes(value)
    if isinstance(value, int):
        return b"i" + _int(value)
    raise InvalidArgument(f"unsupported LMCache chunk hash type {type(value).__name__}")


def _dtype_name(dtype: Any) -> bytes:
    # str(torch.bfloat16) is "torch.bfloat16"; aliases (half/float16) are one object.
    return str(dtype).removeprefix("torch.").encode()


def chunk_key(key: EngineKey, encoding: str) -> ChunkKey:
    """The 16-byte kvdepot key of an LMCache key.

    Args:
        key: A ``CacheEngineKey`` or ``LayerCacheEngineKey``.
        encoding: How the chunk's bytes are stored, one of :data:`ENCODINGS`.

    Raises:
        InvalidArgument: an unknown encoding or a chunk hash of another type.
    """
    if encoding not in ENCODINGS:
        raise InvalidArgument(f"unknown LMCache chunk encoding {encoding!r}")
    layer = getattr(key, "layer_id", None)
    tags = tuple(key.tags or ())
    parts = [
        SCHEME,
        encoding.encode(),
        b"chunk" if layer is None else b"layer",
        key.model_name.encode(),
        _int(key.world_size),
        _int(key.worker_id),
        _chunk_hash(key.chunk_hash),
        _dtype_name(key.dtype),
        _int(len(tags)),
    ]
    for name, value in tags:
        parts.append(str(name).encode())
        parts.append(str(value).encode())
    if layer is not None:
        parts.append(_int(layer))
    return ChunkKey(xxhash.xxh3_128_digest(b"".join(_field(p) for p in parts)))
