"""The KV codec interface: how one layer's KV values of a chunk become bytes.

A codec turns ``rows`` x ``values`` KV values (one row per chunk, the values
of one layer of that chunk in cache order) into ``rows`` x
``encoded_bytes(values)`` bytes and back. The encoded size depends only on
the value count and dtype, never on the data, so a reader knows every layer's
offset in a chunk before it reads a byte, and fetches layers one by one.

What a reader needs to decode a section travels in a fixed 16-byte
:class:`CodecHeader` at the front of the chunk (codec, block size, value
count, source dtype); the reader compares it with the header it expects and
treats any difference as a miss, never decoding bytes it does not understand.
The codec is part of the key namespace as well (:meth:`CodecSpec.namespace_key`),
so compressed and uncompressed chunks never share a key in the first place;
the header is the second line of defence.

Codecs work on ``torch`` tensors on any device (the connector encodes on the
KV cache's device, so a GPU engine ships the smaller bytes to the host);
``torch`` is imported by the implementations only.
"""

from __future__ import annotations

import abc
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from kvdepot.errors import Corrupt, InvalidArgument

if TYPE_CHECKING:
    import torch

HEADER_MAGIC = b"KVDC"
HEADER_VERSION = 1
_HEADER = struct.Struct("<4sBBHII")  # magic, version, codec id, dtype code, block, values
HEADER_BYTES = _HEADER.size  # 16

# Source dtypes by stable code; 0 is "opaque bytes" (only the identity codec
# accepts it: an engine whose cache is already quantized keeps its bytes).
DTYPE_CODES: dict[str, int] = {"float16": 1, "bfloat16": 2, "float32": 3}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class CodecSpec:
    """Which codec a namespace stores its KV with.

    Attributes:
        name: A registered codec name (``"none"``, ``"fp8_e4m3"``).
        block: Values that share one scale (codecs with scales only).
    """

    name: str = "none"
    block: int = 128

    def __post_init__(self) -> None:
        if not self.name:
            raise InvalidArgument("codec name must not be empty")
        if not 1 <= self.block <= 1 << 20:
            raise InvalidArgument(f"codec block must be in [1, 2**20], got {self.block}")

    def namespace_key(self) -> str:
        """The codec's part of the key namespace; empty for the identity codec,
        so an uncompressed namespace is the same as before codecs existed."""
        if self.name == "none":
            return ""
        return f"kv-codec:{self.name}:block{self.block}"


@dataclass(frozen=True, slots=True)
class CodecHeader:
    """What a reader must agree with before decoding a chunk's layers.

    Attributes:
        codec_id: The codec's stable numeric id.
        dtype_code: The source dtype (:data:`DTYPE_CODES`; 0 for opaque bytes).
        block: Values per scale (0 for codecs without scales).
        values: KV values per layer section.
    """

    codec_id: int
    dtype_code: int
    block: int
    values: int

    def pack(self) -> bytes:
        return _HEADER.pack(
            HEADER_MAGIC, HEADER_VERSION, self.codec_id, self.dtype_code, self.block, self.values
        )

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> CodecHeader:
        """Parse a header.

        Raises:
            Corrupt: Wrong size, magic or version.
        """
        if len(data) != HEADER_BYTES:
            raise Corrupt(f"codec header is {HEADER_BYTES} bytes, got {len(data)}")
        magic, version, codec_id, dtype_code, block, values = _HEADER.unpack(bytes(data))
        if magic != HEADER_MAGIC or version != HEADER_VERSION:
            raise Corrupt(f"not a kvdepot codec header (magic {magic!r}, version {version})")
        return cls(codec_id, dtype_code, block, values)


class KVCodec(abc.ABC):
    """Encodes and decodes fixed-size sections of KV values."""

    name: ClassVar[str]
    codec_id: ClassVar[int]  # stable: written into every chunk
    accepts: ClassVar[tuple[str, ...] | None] = None  # source dtype names; None: any

    def __init__(self, spec: CodecSpec) -> None:
        if spec.name != self.name:
            raise InvalidArgument(f"spec {spec.name!r} given to codec {self.name!r}")
        self.spec = spec

    @property
    def block(self) -> int:
        """Values per scale as written into the header (0: no scales)."""
        return 0

    def header(self, values: int, dtype: torch.dtype) -> CodecHeader:
        """The header of chunks whose layers hold ``values`` values of ``dtype``."""
        self.check_dtype(dtype)
        return CodecHeader(self.codec_id, DTYPE_CODES.get(dtype_name(dtype), 0), self.block, values)

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Raise :class:`InvalidArgument` if this codec cannot take ``dtype``."""
        if self.accepts is not None and dtype_name(dtype) not in self.accepts:
            raise InvalidArgument(
                f"{self.name} takes {', '.join(self.accepts)} KV, not {dtype_name(dtype)}"
            )

    @abc.abstractmethod
    def encoded_bytes(self, values: int, dtype: torch.dtype) -> int:
        """Size of the encoded section of ``values`` values of ``dtype``."""

    @abc.abstractmethod
    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """``[rows, n]`` values -> ``[rows, encoded_bytes(n)]`` uint8, same device."""

    @abc.abstractmethod
    def decode(self, data: torch.Tensor, values: int, dtype: torch.dtype) -> torch.Tensor:
        """``[rows, encoded_bytes(values)]`` uint8 -> ``[rows, values]`` of ``dtype``.

        Raises:
            Corrupt: The bytes cannot be a section this codec wrote.
        """

    def _check_rows(self, data: torch.Tensor, values: int, dtype: torch.dtype) -> None:
        want = self.encoded_bytes(values, dtype)
        if data.dim() != 2 or data.shape[1] != want or str(data.dtype) != "torch.uint8":
            raise Corrupt(
                f"{self.name}: expected [rows, {want}] uint8, got {tuple(data.shape)} {data.dtype}"
            )
