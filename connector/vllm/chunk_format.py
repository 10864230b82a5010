"""kvdepot's canonical chunk format: the same bytes from every engine shape.

A stored object holds the KV of ``tokens`` consecutive tokens for **one KV
head** of the model, all layers (see ``docs/chunk-format.md``)::

    [ header ][ layer 0: K | V ][ layer 1: K | V ] ... [ layer L-1: K | V ]

each layer section the namespace's codec applied to ``2 * tokens * head_size``
values: K dim-major ``[head_size, tokens]`` (a codec's scale block spans one
channel: keys have outlier channels), then V token-major ``[tokens,
head_size]``. Nothing in it
depends on the writer's tensor-parallel size or rank, its block size or how
its attention kernels pack a block: the worker converts between its paged
cache and this order (:mod:`kvdepot.connector.vllm.paged`). The header is
the checksum header of :mod:`kvdepot.connector.vllm.loader`.

Objects are keyed per (chunk, KV head): head 0 under the chunk's chain key,
head ``h`` under :func:`head_key`. A rank writes the heads it owns (a head
that several ranks hold, with fewer KV heads than ranks, is written by the
first of them only), reads exactly the heads it holds, and a lookup hits
only where every head is stored. An MLA cache (one latent per token, the
same on every rank) is one "head", written by rank 0 and read by all.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from kvdepot.connector.codec.base import KVCodec
from kvdepot.connector.vllm.loader import header_bytes, write_header
from kvdepot.errors import InvalidArgument
from kvdepot.keys import ChunkKey, NamespaceDigest

FORMAT_NAME = "kvdepot-chunk1"
# Tokens per tail unit. Any engine block size works with any unit (objects
# are copied token by token); 32 is the CPU backend's block granularity and
# keeps a prompt's tail to a few objects per head.
TAIL_TOKENS = 32


def tail_tokens(chunk_tokens: int) -> int:
    """Tokens per tail unit of a namespace (it must divide a chunk)."""
    return math.gcd(TAIL_TOKENS, chunk_tokens)


# What layers of a chunk (or tail unit) an object holds: every layer, or
# with sliding-window KV cache groups the full-attention layers; and the
# sliding-window layers of its last window of tokens, stored apart.
FULL_PART = 0
WINDOW_PART = 1

_HEAD_TAG = b"\x03head"


def head_key(ns_digest: NamespaceDigest | bytes, key: ChunkKey, head: int) -> ChunkKey:
    """The key of KV head ``head`` of the chunk (or tail unit) ``key``.

    Head 0 is the chain key itself; ``xxh3_128(tag || ns || key || u32 head)``
    for the others, so every head of every chunk has a key of its own that
    no writer's parallelism changes.
    """
    if head == 0:
        return key
    if head < 0:
        raise InvalidArgument(f"bad KV head {head}")
    return ChunkKey(
        xxhash.xxh3_128_digest(_HEAD_TAG + bytes(ns_digest) + key + struct.pack("<I", head))
    )


_WINDOW_TAG = b"\x04window"


def part_key(ns_digest: NamespaceDigest | bytes, key: ChunkKey, head: int, part: int) -> ChunkKey:
    """The key of KV head ``head`` of part ``part`` of the chunk ``key``:
    :func:`head_key` for its full part (0); ``xxh3_128(tag || ns || key ||
    u32 head)`` with another tag for its window part (1), the sliding-window
    layers of its last window of tokens."""
    if part == FULL_PART:
        return head_key(ns_digest, key, head)
    if part != WINDOW_PART or head < 0:
        raise InvalidArgument(f"bad KV object part {part} or head {head}")
    return ChunkKey(
        xxhash.xxh3_128_digest(_WINDOW_TAG + bytes(ns_digest) + key + struct.pack("<I", head))
    )


def window_tokens(tokens: int, window: int) -> int:
    """Tokens of an object's window part: its last ``window`` (all when it is
    shorter). A reader whose hit ends at the object needs no earlier ones,
    and what a hit ending later needs of it lies in those too."""
    return min(tokens, window) if window > 0 else tokens


@dataclass(frozen=True, slots=True)
class HeadMap:
    """Which of the model's KV heads one tensor-parallel rank holds and writes.

    Attributes:
        total: KV heads of the model (1 for MLA: its latent).
        tp_size: Tensor-parallel ranks.
        tp_rank: This rank.
        shared: Every rank holds the same single head (MLA).
    """

    total: int
    tp_size: int = 1
    tp_rank: int = 0
    shared: bool = False

    def __post_init__(self) -> None:
        if self.total < 1 or self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise InvalidArgument(
                f"bad KV head map: {self.total} heads, rank {self.tp_rank}/{self.tp_size}"
            )
        if not self.shared and self.total >= self.tp_size and self.total % self.tp_size:
            raise InvalidArgument(
                f"{self.total} KV heads do not split over tensor_parallel_size {self.tp_size}"
            )
        if not self.shared and self.total < self.tp_size and self.tp_size % self.total:
            raise InvalidArgument(
                f"tensor_parallel_size {self.tp_size} is not a multiple of {self.total} KV heads"
            )

    @property
    def local(self) -> tuple[int, ...]:
        """The model's heads this rank's cache holds, in its cache's order."""
        if self.shared:
            return (0,)
        if self.total >= self.tp_size:
            per = self.total // self.tp_size
            return tuple(range(self.tp_rank * per, (self.tp_rank + 1) * per))
        # Fewer heads than ranks: each head is replicated on tp/total ranks.
        return (self.tp_rank // (self.tp_size // self.total),)

    @property
    def writes(self) -> tuple[int, ...]:
        """The heads this rank stores: each head has one writer."""
        if self.shared:
            return (0,) if self.tp_rank == 0 else ()
        if self.total >= self.tp_size:
            return self.local
        return self.local if self.tp_rank % (self.tp_size // self.total) == 0 else ()


def build_object(codec: KVCodec, layers: Sequence[np.ndarray | object], dtype: object) -> bytes:
    """The bytes of one object from its layers' canonical KV.

    The reference encoder (tests and tools; the worker encodes many objects
    at once in the same order).

    Args:
        codec: The namespace's codec.
        layers: Per layer, a ``[2, tokens, head_size]`` tensor (K, V).
        dtype: The values' torch dtype.
    """
    import torch

    given = [torch.as_tensor(t) for t in layers]
    if not given or any(t.dim() != 3 or t.shape[0] != 2 for t in given):
        raise InvalidArgument("an object is built from [2, tokens, head_size] layers")
    # K dim-major, V token-major.
    tensors = [torch.cat([t[0].t().reshape(-1), t[1].reshape(-1)]) for t in given]
    values = tensors[0].numel()
    td = dtype if isinstance(dtype, torch.dtype) else tensors[0].dtype
    layer_bytes = codec.encoded_bytes(values, td)
    hb = header_bytes(len(tensors))
    row = np.zeros((1, hb + len(tensors) * layer_bytes), dtype=np.uint8)
    for li, t in enumerate(tensors):
        enc = codec.encode(t.to(td).reshape(1, values).contiguous())
        row[0, hb + li * layer_bytes : hb + (li + 1) * layer_bytes] = enc.numpy()[0]
    write_header(row, len(tensors), layer_bytes, codec.header(values, td).pack())
    return row[0].tobytes()
