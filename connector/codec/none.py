"""The identity codec: KV bytes exactly as they sit in the engine's cache."""

from __future__ import annotations

import torch

from kvdepot.connector.codec.base import KVCodec


class NoneCodec(KVCodec):
    """Stores the cache's bytes unchanged (any dtype, including opaque ones)."""

    name = "none"
    codec_id = 0

    def encoded_bytes(self, values: int, dtype: torch.dtype) -> int:
        return int(values * dtype.itemsize)

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        rows = values.shape[0]
        return values.contiguous().view(torch.uint8).reshape(rows, -1)

    def decode(self, data: torch.Tensor, values: int, dtype: torch.dtype) -> torch.Tensor:
        self._check_rows(data, values, dtype)
        return data.contiguous().view(dtype)
