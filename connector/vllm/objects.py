"""The bytes of KV objects: their sizes, staging buffers, and verification.

An object of ``n`` engine blocks is ``[header][layer 0]…[layer L-1]``, each
layer the codec's encoding of those ``n`` blocks of that layer's cache (see
:mod:`kvdepot.connector.vllm.loader` for the header: per-layer checksums and
the codec header, which names the value count, so a chunk and a tail block
never pass for each other).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from kvdepot.connector.codec.base import HEADER_BYTES as CODEC_HEADER_BYTES
from kvdepot.connector.codec.base import KVCodec
from kvdepot.connector.vllm.loader import header_bytes
from kvdepot.connector.vllm.plan import KVObject
from kvdepot.wire.xxh3 import checksum


@dataclass(frozen=True, slots=True)
class Geometry:
    """Sizes of an object of ``blocks`` blocks."""

    blocks: int
    layer_values: int
    layer_bytes: int
    codec_header: bytes
    header: int
    size: int


class ObjectFormat:
    """Geometry of the objects of one engine's KV cache."""

    def __init__(
        self, codec: KVCodec, block_values: int, dtype: torch.dtype, num_layers: int
    ) -> None:
        self.codec = codec
        self.block_values = block_values
        self.dtype = dtype
        self.num_layers = num_layers
        self.header = header_bytes(num_layers)
        self.geometry = lru_cache(maxsize=8)(self._geometry)

    def _geometry(self, blocks: int) -> Geometry:
        values = self.block_values * blocks
        layer_bytes = self.codec.encoded_bytes(values, self.dtype)
        return Geometry(
            blocks,
            values,
            layer_bytes,
            self.codec.header(values, self.dtype).pack(),
            self.header,
            self.header + self.num_layers * layer_bytes,
        )

    def verify(self, row: np.ndarray, blocks: int) -> bool:
        """Whether an object read back is whole: its codec header is the one
        expected and every layer matches the checksum its writer recorded."""
        g = self.geometry(blocks)
        at = 8 * self.num_layers
        if bytes(row[at : at + CODEC_HEADER_BYTES]) != g.codec_header:
            return False
        sums = row[:at].view("<u8")
        for li in range(self.num_layers):
            start = g.header + li * g.layer_bytes
            if checksum(row[start : start + g.layer_bytes].data) != int(sums[li]):
                return False
        return True


@dataclass
class StagedGroup:
    """Objects of one request with the same block count, staged together."""

    geometry: Geometry
    index: list[int]  # positions of the objects in their plan
    objects: list[KVObject]
    rows: np.ndarray  # [len(objects), geometry.size]
    pinned: torch.Tensor | None = None  # the same memory, page-locked (GPU engines)

    def flat_blocks(self, group: int = 0) -> list[int]:
        """The objects' blocks of KV cache group ``group``, in order."""
        return [b for o in self.objects for b in o.blocks[group]]


def stage(
    fmt: ObjectFormat, objects: Sequence[KVObject], *, pinned: bool = False
) -> list[StagedGroup]:
    """Staging buffers for ``objects``, grouped by their block count; with
    ``pinned``, in page-locked memory a GPU copies into asynchronously."""
    groups: dict[int, StagedGroup] = {}
    for i, obj in enumerate(objects):
        n = obj.num_blocks
        group = groups.get(n)
        if group is None:
            group = groups[n] = StagedGroup(fmt.geometry(n), [], [], np.empty(0, np.uint8))
        group.index.append(i)
        group.objects.append(obj)
    for group in groups.values():
        shape = (len(group.objects), group.geometry.size)
        if pinned:
            group.pinned = torch.empty(shape, dtype=torch.uint8, pin_memory=True)
            group.rows = group.pinned.numpy()
        else:
            group.rows = np.empty(shape, dtype=np.uint8)
    return list(groups.values())


def staged_bytes(fmt: ObjectFormat, objects: Sequence[KVObject]) -> int:
    return sum(fmt.geometry(o.num_blocks).size for o in objects)
