"""The bytes of KV objects: their sizes, staging buffers, and verification.

An object is one KV head of ``tokens`` tokens (a chunk or a tail unit), in
the canonical format of :mod:`kvdepot.connector.vllm.chunk_format`:
``[header][layer 0]…[layer L-1]`` (its part's layers), each layer the codec's encoding of K then
V, token-major (see :mod:`kvdepot.connector.vllm.loader` for the header:
per-layer checksums and the codec header, which names the value count, so a
chunk and a tail unit never pass for each other).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch

from kvdepot.connector.codec.base import HEADER_BYTES as CODEC_HEADER_BYTES
from kvdepot.connector.codec.base import KVCodec
from kvdepot.connector.vllm.chunk_format import FULL_PART, part_key
from kvdepot.connector.vllm.loader import header_bytes
from kvdepot.connector.vllm.plan import KVObject
from kvdepot.keys import ChunkKey
from kvdepot.wire.xxh3 import checksum


@dataclass(frozen=True, slots=True)
class Geometry:
    """Sizes of an object of ``tokens`` tokens and ``layers`` layers."""

    tokens: int
    layer_values: int
    layer_bytes: int
    codec_header: bytes
    header: int
    size: int
    layers: int = 1
    part: int = FULL_PART


class ObjectFormat:
    """Geometry of the objects of one namespace.

    Args:
        codec: The namespace's codec.
        token_values: Values of one head and token in a layer (K and V:
            ``2 * head_size``; MLA: the latent).
        dtype: The KV values' dtype.
        num_layers: Layers of the model.
        window_layers: Of them, the sliding-window layers an object's window
            part holds (0: objects hold every layer).
    """

    def __init__(
        self,
        codec: KVCodec,
        token_values: int,
        dtype: torch.dtype,
        num_layers: int,
        window_layers: int = 0,
    ) -> None:
        self.codec = codec
        self.token_values = token_values
        self.dtype = dtype
        self.part_layers = (num_layers - window_layers, window_layers)
        self.geometry = lru_cache(maxsize=16)(self._geometry)

    def _geometry(self, tokens: int, part: int = FULL_PART) -> Geometry:
        values = self.token_values * tokens
        layer_bytes = self.codec.encoded_bytes(values, self.dtype)
        layers = self.part_layers[part]
        header = header_bytes(layers)
        return Geometry(
            tokens,
            values,
            layer_bytes,
            self.codec.header(values, self.dtype).pack(),
            header,
            header + layers * layer_bytes,
            layers,
            part,
        )

    def verify(self, row: np.ndarray, g: Geometry) -> bool:
        """Whether an object read back is whole: its codec header is the one
        expected and every layer matches the checksum its writer recorded."""
        at = 8 * g.layers
        if bytes(row[at : at + CODEC_HEADER_BYTES]) != g.codec_header:
            return False
        sums = row[:at].view("<u8")
        for li in range(g.layers):
            start = g.header + li * g.layer_bytes
            if checksum(row[start : start + g.layer_bytes].data) != int(sums[li]):
                return False
        return True


@dataclass
class StagedGroup:
    """Objects of one request with the same token count, staged together:
    one row per (object, head), heads inner."""

    geometry: Geometry  # its objects' (all of one part)
    index: list[int]  # positions of the objects in their plan
    objects: list[KVObject]
    rows: np.ndarray  # [len(objects) * heads, geometry.size]
    heads: int = 1
    keys: list[ChunkKey] = field(default_factory=list)  # of the rows
    pinned: torch.Tensor | None = None  # the same memory, page-locked (GPU engines)


def stage(
    fmt: ObjectFormat,
    objects: Sequence[KVObject],
    block_size: int,
    heads: Sequence[int] = (0,),
    digest: bytes = b"",
    *,
    pinned: bool = False,
) -> list[StagedGroup]:
    """Staging buffers for KV heads ``heads`` of each of ``objects`` (keyed
    in the namespace of ``digest``), grouped by token count; with
    ``pinned``, in page-locked memory a GPU copies into asynchronously."""
    groups: dict[tuple[int, int], StagedGroup] = {}
    for i, obj in enumerate(objects):
        n = obj.span(block_size)[1]
        group = groups.get((obj.part, n))
        if group is None:
            geo = fmt.geometry(n, obj.part)
            group = StagedGroup(geo, [], [], np.empty(0, np.uint8), len(heads))
            groups[obj.part, n] = group
        group.index.append(i)
        group.objects.append(obj)
        group.keys.extend(part_key(digest, obj.key, h, obj.part) for h in heads)
    for group in groups.values():
        shape = (len(group.objects) * len(heads), group.geometry.size)
        if pinned:
            group.pinned = torch.empty(shape, dtype=torch.uint8, pin_memory=True)
            group.rows = group.pinned.numpy()
        else:
            group.rows = np.empty(shape, dtype=np.uint8)
    return list(groups.values())


def staged_bytes(
    fmt: ObjectFormat, objects: Sequence[KVObject], block_size: int, heads: int = 1
) -> int:
    return heads * sum(fmt.geometry(o.span(block_size)[1], o.part).size for o in objects)
