"""How a vLLM engine's paged KV cache maps onto kvdepot chunks.

Both sides of the connector (the scheduler, which looks chunks up, and the
workers, which move the bytes) must derive the very same key namespace, so
everything here is computed from the ``VllmConfig`` alone. The workers then
check that the KV tensors they are given match it.

A chunk is ``chunk_tokens`` tokens = ``blocks_per_chunk`` paged blocks, laid out
layer-major: for each attention layer in order, that layer's blocks of the
chunk as they sit in the paged cache, passed through the namespace's KV codec
(``none``: the bytes unchanged; ``fp8_e4m3``: quantized, see
``kvdepot.connector.codec``). Blocks are treated as opaque arrays of values
(the CPU backend packs K and V per kernel path), so the kernel path is part
of the namespace, and so is the codec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvdepot.connector.vllm.settings import ConnectorSettings
from kvdepot.errors import InvalidArgument
from kvdepot.metadata.keys import Namespace


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of the paged KV cache and of the chunks built from it."""

    device: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    kernel: str
    chunk_tokens: int
    sliding_window: int = 0

    def __post_init__(self) -> None:
        if self.chunk_tokens % self.block_size:
            raise InvalidArgument(
                f"chunk_tokens ({self.chunk_tokens}) must be a multiple of the engine's "
                f"block size ({self.block_size})"
            )

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_tokens // self.block_size

    def signature(self) -> str:
        """The layout part of the key namespace."""
        sig = (
            # fmt3: a header of per-layer checksums and the codec precedes the layers.
            f"vllm-fmt3:{self.device}:{self.kernel}:bs{self.block_size}:"
            f"L{self.num_layers}:H{self.num_kv_heads}:D{self.head_size}"
        )
        # A model with a sliding window keeps other KV than one without.
        return f"{sig}:sw{self.sliding_window}" if self.sliding_window else sig


def layout_from_config(vllm_config: Any, settings: ConnectorSettings) -> KVLayout:
    """Derive the KV layout from a ``VllmConfig`` (same result in every process)."""
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    device = str(vllm_config.device_config.device_type or "cpu")
    dtype = str(cache.cache_dtype)
    if dtype == "auto":
        dtype = str(model_config.dtype).removeprefix("torch.")
    kernel = "default"
    if device == "cpu":
        import torch

        # The CPU attention kernels pack blocks differently per ISA.
        kernel = f"cpu-{torch.backends.cpu.get_cpu_capability()}"
    return KVLayout(
        device=device,
        dtype=dtype,
        block_size=int(cache.block_size),
        num_layers=int(model_config.get_num_layers(parallel)),
        num_kv_heads=int(model_config.get_num_kv_heads(parallel)),
        head_size=int(model_config.get_head_size()),
        kernel=kernel,
        chunk_tokens=settings.chunk_tokens,
        sliding_window=int(model_config.get_sliding_window() or 0),
    )


def namespace_for(
    vllm_config: Any, settings: ConnectorSettings, layout: KVLayout, tp_rank: int
) -> Namespace:
    """The key namespace of one tensor-parallel rank of this engine."""
    model = settings.model_id or str(vllm_config.model_config.model)
    extra = (settings.cache_salt,) if settings.cache_salt else ()
    codec_key = settings.codec_spec().namespace_key()
    if codec_key:
        # Compressed and uncompressed chunks of one prompt never share a key.
        extra = (*extra, codec_key)
    return Namespace(
        model=model,
        kv_dtype=layout.dtype,
        kv_layout=layout.signature(),
        tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
        tp_rank=tp_rank,
        chunk_tokens=layout.chunk_tokens,
        extra=extra,
    )
