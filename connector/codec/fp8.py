"""FP8 (e4m3) KV with one float32 scale per block of values.

A section of ``n`` values, cut into ``nb = ceil(n / block)`` blocks of
``block`` consecutive values (the last one may be short), is::

    [ nb x float32 scale, little-endian ][ n x e4m3 byte ][ zero pad to 8 B ]

Each block is scaled so that its largest finite magnitude maps to 448, the
largest finite e4m3 value: ``q = round(x / s)`` with ``s = amax / 448``, and
decoded as ``x' = q * s``. e4m3 keeps 3 mantissa bits, so a value in the
normal range comes back within 2**-4 of itself, relatively; values below
``s * 2**-6`` (e4m3's subnormals) within ``s * 2**-10`` absolutely. Against
bf16 (2 bytes a value) a section is ``(n + 4 * nb) / (2 * n)`` the size:
0.516 with 128-value blocks.

Special values, so that no input can make a block undecodable:

- a block of zeros gets scale 1 and decodes to exact zeros;
- NaN stays NaN and does not spoil its block's scale;
- +-inf saturates to +-448 * s (the block's largest finite magnitude), as a
  saturating float-to-fp8 conversion on GPUs does; a block holding nothing
  but infinities decodes to +-448.

A reader rejects (:class:`~kvdepot.errors.Corrupt`) a section of the wrong
size or with a scale that is not a positive finite number.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvdepot.connector.codec.base import KVCodec
from kvdepot.errors import Corrupt

FP8_MAX = 448.0


class Fp8E4M3Codec(KVCodec):
    """e4m3 values, one float32 scale per ``spec.block`` values."""

    name = "fp8_e4m3"
    codec_id = 1
    # An engine whose cache is already quantized (uint8 fp8 bytes) keeps the `none` codec.
    accepts = ("float16", "bfloat16", "float32")

    @property
    def block(self) -> int:
        return self.spec.block

    def _blocks(self, values: int) -> int:
        return -(-values // self.spec.block)

    def encoded_bytes(self, values: int, dtype: torch.dtype) -> int:
        raw = 4 * self._blocks(values) + values
        return -(-raw // 8) * 8

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        self.check_dtype(values.dtype)
        rows, n = values.shape
        b = self.spec.block
        nb = self._blocks(n)
        x = values.to(torch.float32)
        if nb * b != n:
            x = F.pad(x, (0, nb * b - n))
        x = x.reshape(rows, nb, b)
        amax = torch.where(torch.isfinite(x), x.abs(), 0.0).amax(dim=-1)
        # clamp: a block of subnormal values must not get a zero (or
        # subnormal) scale that turns the division into infinities.
        scale = torch.where(
            amax > 0, (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny), 1.0
        )
        # clamp saturates infinities (and values a rounding ulp above 448); NaN passes through.
        q = (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        out = torch.zeros(
            (rows, self.encoded_bytes(n, values.dtype)), dtype=torch.uint8, device=values.device
        )
        out[:, : 4 * nb] = scale.contiguous().view(torch.uint8)
        out[:, 4 * nb : 4 * nb + n] = q.reshape(rows, nb * b)[:, :n].view(torch.uint8)
        return out

    def decode(self, data: torch.Tensor, values: int, dtype: torch.dtype) -> torch.Tensor:
        self.check_dtype(dtype)
        self._check_rows(data, values, dtype)
        rows = data.shape[0]
        b = self.spec.block
        nb = self._blocks(values)
        scale = data[:, : 4 * nb].contiguous().view(torch.float32)
        if not bool((torch.isfinite(scale) & (scale > 0)).all()):
            raise Corrupt("fp8_e4m3: a block scale is not a positive finite number")
        q = data[:, 4 * nb : 4 * nb + values].contiguous().view(torch.float8_e4m3fn)
        x = q.to(torch.float32)
        if nb * b != values:
            x = F.pad(x, (0, nb * b - values))
        x = (x.reshape(rows, nb, b) * scale.unsqueeze(-1)).reshape(rows, nb * b)
        return x[:, :values].to(dtype)
