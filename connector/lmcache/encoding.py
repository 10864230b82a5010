"""How LMCache's memory objects become kvdepot chunks, and back.

Two encodings; LMCache's configuration picks one for all chunks, and it is
part of every key (:mod:`kvdepot.connector.lmcache.engine_keys`), so bytes are never
read back in an encoding they were not written in.

``raw`` (LMCache's ``naive`` serde, chunk-wise storage: the usual setup)
    A chunk is exactly the memory object's bytes, sent straight from its
    buffer and read straight into an object allocated from LMCache's
    ``LocalCPUBackend``: no copy on either side. Shape, dtypes and format are
    those of a full chunk in LMCache's configuration; a shorter chunk (the
    last one of a prompt) is the same layout with fewer tokens, which its size
    tells, and LMCache's ``reshape_partial_chunk`` gives it its shape.

``framed`` (any other serde, or layer-wise storage)
    The objects' shapes cannot be derived from the configuration, so each
    chunk starts with LMCache's own ``RemoteMetadata`` header (length, format,
    dtype and shape per group), as its Redis and Mooncake connectors store it.
    This costs a copy each way and a size lookup before a read.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lmcache.v1.protocol import RemoteMetadata

from kvdepot.connector.client import GetResult, KVDepotClient
from kvdepot.errors import InvalidArgument
from kvdepot.keys import ChunkKey

logger = logging.getLogger(__name__)

MemoryObj = Any  # lmcache.v1.memory_management.MemoryObj
Allocate = Callable[[Any, Any, Any], "MemoryObj | None"]


def release(objs: Sequence[MemoryObj | None]) -> None:
    """Give memory objects back to LMCache's allocator."""
    for obj in objs:
        if obj is not None:
            obj.ref_count_down()


def _bytes(obj: MemoryObj) -> memoryview:
    view = obj.byte_array
    return view if isinstance(view, memoryview) else memoryview(view)


@dataclass(frozen=True, slots=True)
class ChunkGeometry:
    """A full LMCache chunk as the configuration describes it.

    Attributes:
        shapes: Per KV group, the shape of a full chunk, tokens in dim 2.
        dtypes: Per KV group, the dtype.
        fmt: LMCache's ``MemoryFormat`` of chunk objects.
        full_bytes: Bytes of a full chunk.
        token_bytes: Bytes of one token (all layers, all groups).
    """

    shapes: tuple[Any, ...]
    dtypes: tuple[Any, ...]
    fmt: Any
    full_bytes: int
    token_bytes: int

    def tokens_of(self, nbytes: int) -> int | None:
        """Tokens in a chunk of ``nbytes``, or None if no chunk has that size."""
        if nbytes <= 0 or nbytes > self.full_bytes or nbytes % self.token_bytes:
            return None
        if nbytes != self.full_bytes and len(self.shapes) != 1:
            # LMCache can only shorten single-group chunks (reshape_partial_chunk).
            return None
        return nbytes // self.token_bytes

    def check(self, obj: MemoryObj) -> str:
        """Why ``obj`` is not a chunk of this geometry ("" if it is one)."""
        try:
            if obj.get_memory_format() != self.fmt:
                return f"format {obj.get_memory_format()} is not {self.fmt}"
            if tuple(obj.get_dtypes()) != self.dtypes:
                return f"dtypes {obj.get_dtypes()} are not {list(self.dtypes)}"
            n = obj.get_size()
            tokens = self.tokens_of(n)
            if tokens is None:
                return f"{n} bytes is not a whole number of tokens of this chunk layout"
            if len(self.shapes) == 1:
                want = list(self.shapes[0])
                want[2] = tokens
                if list(obj.get_shape()) != want:
                    return f"shape {list(obj.get_shape())} is not {want}"
        except (AssertionError, AttributeError, TypeError) as exc:
            return f"not a tensor memory object ({exc})"
        return ""


class RawChunks:
    """Chunks are the objects' bytes; shapes derive from the configuration."""

    encoding = "raw"

    def __init__(
        self,
        geometry: ChunkGeometry,
        allocate: Allocate,
        reshape: Callable[[MemoryObj, int], MemoryObj],
    ) -> None:
        """Encode chunks of one configured layout.

        Args:
            geometry: The configured full chunk.
            allocate: LMCache's ``LocalCPUBackend.allocate(shapes, dtypes, fmt)``.
            reshape: LMCache's ``RemoteConnector.reshape_partial_chunk``.
        """
        self.geometry = geometry
        self._allocate = allocate
        self._reshape = reshape

    def payload(self, obj: MemoryObj) -> memoryview:
        """The bytes to store for ``obj``: its own buffer, not a copy.

        Raises:
            InvalidArgument: ``obj`` is not a chunk of the configured layout.
        """
        why = self.geometry.check(obj)
        if why:
            raise InvalidArgument(f"not stored: {why}")
        return _bytes(obj)

    def get(self, client: KVDepotClient, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        """Read the leading stored chunks of ``keys`` into new memory objects."""
        g = self.geometry
        objs: list[MemoryObj] = []
        for _ in keys:
            obj = self._allocate(list(g.shapes), list(g.dtypes), g.fmt)
            if obj is None:
                # LMCache's CPU memory is full: what did not fit is a miss.
                logger.warning(
                    "LMCache CPU memory full: %d chunks read as misses", len(keys) - len(objs)
                )
                break
            objs.append(obj)
        out: list[MemoryObj | None] = [None] * len(keys)
        try:
            result = client.get_into(keys[: len(objs)], [_bytes(o) for o in objs])
            sizes = self._sizes(result)
        except BaseException:
            release(objs)
            raise
        for i, obj in enumerate(objs):
            size = sizes.get(i)
            if size is not None and g.tokens_of(size) is not None:
                out[i] = self._reshape(obj, size)
            else:
                if size is not None:
                    logger.warning("chunk of %d bytes does not fit the configured layout", size)
                obj.ref_count_down()
        return out

    @staticmethod
    def _sizes(result: GetResult) -> dict[int, int]:
        # A chunk shorter than the layout's full size (the last of a
        # sequence) is reshaped to the tokens it holds.
        pairs = zip(result.loaded, result.sizes, strict=True)
        return {i: size for i, (ok, size) in enumerate(pairs) if ok}


class FramedChunks:
    """Chunks carry LMCache's ``RemoteMetadata`` header before the bytes."""

    encoding = "framed"

    def __init__(self, header_bytes: int, allocate: Allocate) -> None:
        """Encode chunks of any layout behind a header.

        Args:
            header_bytes: Size of a ``RemoteMetadata`` header for this engine.
            allocate: LMCache's ``LocalCPUBackend.allocate(shapes, dtypes, fmt)``.
        """
        self._header_bytes = header_bytes
        self._allocate = allocate

    def payload(self, obj: MemoryObj) -> bytearray:
        """Header and bytes of ``obj`` in one new buffer.

        Raises:
            InvalidArgument: ``obj`` cannot be described by a header.
        """
        data = _bytes(obj).cast("B")
        try:
            shapes = obj.get_shapes()
            if len(shapes) == 1:
                shapes = [obj.get_shape()]  # the logical shape of a shortened chunk
            header = RemoteMetadata(
                data.nbytes, shapes, obj.get_dtypes(), obj.get_memory_format()
            ).serialize()
        except (AssertionError, KeyError, ValueError, TypeError, struct.error) as exc:
            raise InvalidArgument(f"not stored: no header for this object ({exc!r})") from None
        if len(header) != self._header_bytes:
            raise InvalidArgument("not stored: object has another number of KV groups")
        buf = bytearray(len(header) + data.nbytes)
        buf[: len(header)] = header
        buf[len(header) :] = data
        return buf

    def get(self, client: KVDepotClient, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        """Read the leading stored chunks of ``keys`` into new memory objects."""
        out: list[MemoryObj | None] = [None] * len(keys)
        reply = client.lookup_locations(keys)
        if not reply.hits:
            return out
        bufs = [bytearray(reply.locations[i].size) for i in range(reply.hits)]
        result = client.get_into(keys[: reply.hits], bufs)
        for i, ok in enumerate(result.loaded):
            if ok:
                try:
                    out[i] = self._decode(bufs[i])
                except BaseException:
                    release(out)
                    raise
        return out

    def _decode(self, buf: bytearray) -> MemoryObj | None:
        h = self._header_bytes
        if len(buf) < h:
            return None
        try:
            meta = RemoteMetadata.deserialize(bytes(buf[:h]))
        except (ValueError, KeyError, struct.error) as exc:
            logger.warning("bad LMCache chunk header: %s", exc)
            return None
        if meta.length != len(buf) - h:
            logger.warning(
                "LMCache chunk header says %d bytes, chunk has %d", meta.length, len(buf) - h
            )
            return None
        obj = self._allocate(meta.shapes, meta.dtypes, meta.fmt)
        if obj is None:
            logger.warning("LMCache CPU memory full: chunk read as a miss")
            return None
        dst = _bytes(obj).cast("B")
        if dst.nbytes != meta.length:
            obj.ref_count_down()
            logger.warning(
                "LMCache allocated %d bytes for a %d-byte chunk", dst.nbytes, meta.length
            )
            return None
        dst[:] = memoryview(buf)[h:]
        return obj
