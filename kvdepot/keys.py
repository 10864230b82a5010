"""Chained prefix hashing of token chunks.

A chunk is ``chunk_tokens`` consecutive tokens; its key covers the whole prefix
up to and including it::

    ns   = digest(model, kv dtype, kv layout, tp size, tp rank, chunk_tokens, extra)
    h[0] = xxh3_128(ns || tokens[0:C])
    h[i] = xxh3_128(h[i-1] || tokens[i*C:(i+1)*C])

Tokens are encoded as little-endian uint32 and digests as big-endian 16-byte
strings, so the keys depend on nothing but the inputs: not on
``PYTHONHASHSEED``, the process or the machine.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence, Sized
from dataclasses import dataclass
from typing import NewType

import numpy as np
import xxhash

from kvdepot.errors import InvalidArgument

ChunkKey = NewType("ChunkKey", bytes)
"""16-byte chained digest of a prefix of chunks."""

NamespaceDigest = NewType("NamespaceDigest", bytes)
"""16-byte digest of everything that makes KV bytes incompatible."""

KEY_BYTES = 16
_SCHEME_VERSION = b"kvdepot-keys-v1"
_MAX_TOKEN = 2**32 - 1


def _field(data: bytes) -> bytes:
    # Length-prefixed so that ("ab", "c") and ("a", "bc") never collide.
    return struct.pack("<I", len(data)) + data


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything that must match for two engines to exchange KV bytes.

    Attributes:
        model: Model identifier (name or path, plus revision if any).
        kv_dtype: Data type of the stored KV, e.g. ``"bfloat16"``.
        kv_layout: Layout signature of the KV bytes (device, kernel path, shape).
        tp_size: Tensor-parallel world size of the engine.
        tp_rank: Tensor-parallel rank whose shard this is.
        chunk_tokens: Tokens per chunk.
        extra: Further salts: LoRA id, cache salt, tenant. Order matters.
    """

    model: str
    kv_dtype: str = "bfloat16"
    kv_layout: str = "default"
    tp_size: int = 1
    tp_rank: int = 0
    chunk_tokens: int = 256
    extra: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.model:
            raise InvalidArgument("namespace model must not be empty")
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise InvalidArgument(f"bad tensor parallel rank {self.tp_rank}/{self.tp_size}")
        if self.chunk_tokens < 1:
            raise InvalidArgument("chunk_tokens must be positive")

    def digest(self) -> NamespaceDigest:
        """The 16-byte namespace digest that seeds the key chain."""
        parts = [
            _SCHEME_VERSION,
            self.model.encode(),
            self.kv_dtype.encode(),
            self.kv_layout.encode(),
            struct.pack("<III", self.tp_size, self.tp_rank, self.chunk_tokens),
            struct.pack("<I", len(self.extra)),
            *(e.encode() for e in self.extra),
        ]
        return NamespaceDigest(xxhash.xxh3_128_digest(b"".join(_field(p) for p in parts)))


def encode_tokens(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Encode token ids as little-endian uint32, rejecting what does not fit."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise InvalidArgument("tokens must be a flat sequence")
    if arr.size and (
        arr.dtype.kind not in "iu" or int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN
    ):
        raise InvalidArgument("token ids must be integers in [0, 2**32)")
    return arr.astype("<u4", copy=False).tobytes()


def chunk_keys(
    namespace: Namespace, tokens: Sequence[int] | np.ndarray, *, full_only: bool = True
) -> list[ChunkKey]:
    """Keys of the chunks of ``tokens``, one per chunk.

    Args:
        namespace: The namespace the chain is seeded with.
        tokens: The prompt's token ids.
        full_only: Drop a trailing partial chunk (the default: only whole
            chunks are stored, as only whole blocks are shared by engines).

    Returns:
        One key per chunk, in prompt order.
    """
    data = encode_tokens(tokens)
    n = len(data) // 4
    c = namespace.chunk_tokens
    count = n // c if full_only else -(-n // c)
    keys: list[ChunkKey] = []
    prev: bytes = namespace.digest()
    step = c * 4
    for i in range(count):
        prev = xxhash.xxh3_128_digest(prev + data[i * step : (i + 1) * step])
        keys.append(ChunkKey(prev))
    return keys


def validate_key(key: object, index: int | None = None) -> ChunkKey:
    """``key`` as a :data:`ChunkKey` (bytes), or a clear error.

    Args:
        key: Bytes, or a bytearray or memoryview (copied).
        index: The key's place in a request, to name it in the error.

    Raises:
        InvalidArgument: ``key`` is not bytes-like or not :data:`KEY_BYTES` long.
    """
    if type(key) is bytes and len(key) == KEY_BYTES:
        return ChunkKey(key)  # the common case, on every put and get
    which = "a key" if index is None else f"key {index}"
    if not isinstance(key, bytes | bytearray | memoryview):
        raise InvalidArgument(
            f"{which} is a {type(key).__name__}; chunk keys are {KEY_BYTES} bytes"
        )
    if len(key) != KEY_BYTES:
        raise InvalidArgument(f"{which} is {len(key)} bytes; chunk keys are {KEY_BYTES}")
    return ChunkKey(bytes(key))


def validate_keys(keys: Iterable[object], limit: int = 0, to: str = "") -> list[ChunkKey]:
    """:func:`validate_key` of each of ``keys``, naming a bad one by its index.

    Raises:
        InvalidArgument: A bad key, or (``limit`` set) more than ``limit``
            keys, named as keys ``to`` do something ("describe").
    """
    if limit and isinstance(keys, Sized) and len(keys) > limit:
        raise InvalidArgument(f"{len(keys)} keys to {to or 'handle'}; the limit is {limit}")
    return [validate_key(k, i) for i, k in enumerate(keys)]


# Distinct from a chunk's input by length (a tag of 5 bytes cannot make up a
# multiple of 4 token bytes), so a block key never equals a chunk key.
_BLOCK_TAG = b"\x01blk"


def block_keys(
    seed: bytes, tokens: Sequence[int] | np.ndarray, block_tokens: int
) -> list[ChunkKey]:
    """Keys of the whole blocks that follow a chunk boundary, one per block.

    The tail of a prompt (its whole engine blocks after the last whole chunk)
    is stored block by block under keys chained from the last chunk's key::

        t[0] = xxh3_128(tag || seed || tokens[0:B])
        t[j] = xxh3_128(tag || t[j-1] || tokens[j*B:(j+1)*B])

    so each block's key covers the exact prefix up to its end, and a longer
    prompt that shares the prefix hits the same blocks.

    Args:
        seed: The key of the chunk before ``tokens`` (``Namespace.digest()``
            when ``tokens`` start the prompt).
        tokens: The tokens after the chunk boundary (a trailing partial block
            is ignored).
        block_tokens: Tokens per engine block.
    """
    if block_tokens < 1:
        raise InvalidArgument("block_tokens must be positive")
    if len(seed) != KEY_BYTES:
        raise InvalidArgument(f"a block key chain is seeded with a {KEY_BYTES}-byte key")
    data = encode_tokens(tokens)
    step = block_tokens * 4
    keys: list[ChunkKey] = []
    prev = bytes(seed)
    for i in range(len(data) // step):
        prev = xxhash.xxh3_128_digest(_BLOCK_TAG + prev + data[i * step : (i + 1) * step])
        keys.append(ChunkKey(prev))
    return keys


_RANK_TAG = b"\x02rank"


def shard_key(namespace: Namespace, key: ChunkKey) -> ChunkKey:
    """The key of one tensor-parallel rank's shard of the chunk or block ``key``.

    The chain (chunk and block keys) is computed once, in rank 0's namespace,
    by the engine's scheduler; each rank stores and loads its own shard under
    this key, so ranks never read each other's KV. Rank 0's shard key is the
    chain key itself.
    """
    if namespace.tp_rank == 0:
        return key
    return ChunkKey(xxhash.xxh3_128_digest(_RANK_TAG + namespace.digest() + key))


def seeded_chunk_keys(
    seed: bytes, chunk_tokens: int, tokens: Sequence[int] | np.ndarray
) -> list[ChunkKey]:
    """:func:`chunk_keys` in the namespace whose digest is ``seed``: what a
    tool that knows a namespace only by its digest (e.g. ``kvdepot explain``)
    needs to recompute a prompt's keys in it."""
    if len(seed) != KEY_BYTES:
        raise InvalidArgument(f"a namespace digest is {KEY_BYTES} bytes, not {len(seed)}")
    if chunk_tokens < 1:
        raise InvalidArgument("chunk_tokens must be positive")
    data = encode_tokens(tokens)
    step = chunk_tokens * 4
    keys: list[ChunkKey] = []
    prev = bytes(seed)
    for i in range(len(data) // step):
        prev = xxhash.xxh3_128_digest(prev + data[i * step : (i + 1) * step])
        keys.append(ChunkKey(prev))
    return keys
