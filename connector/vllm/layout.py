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

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvdepot.connector.codec import CodecSpec, check_codec_name
from kvdepot.errors import InvalidArgument
from kvdepot.metadata.keys import Namespace
from kvdepot.security import SecurityConfig, client_security


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """The connector's ``kv_connector_extra_config``.

    Attributes:
        metadata: Metadata service address(es), ``host:port[,host:port]``.
        chunk_tokens: Tokens per chunk; a multiple of the engine's block size.
        node_id: The store node on this host (local-first puts and reads).
        transport: Data-plane transport name.
        model_id: Overrides the model path in the namespace (engines that load
            the same weights from different paths can then share KV).
        cache_salt: Extra namespace salt (tenant, LoRA, …).
        force_recompute_on_load_error: Make vLLM recompute blocks whose load
            failed instead of failing the request (the connector's contract:
            a failed read is a miss).
        kv_codec: How chunks store KV: ``none`` (the cache's bytes) or
            ``fp8_e4m3`` (about half the bytes of bf16, dequantized on load;
            lossy). Part of the namespace.
        kv_codec_block: Values sharing one scale, for codecs with scales.
        auth_token_file: File with the token the connector presents to a
            cluster that requires one (``KVDEPOT_AUTH_TOKEN`` in the engine's
            environment works too); never the token itself in this config,
            which vLLM logs.
        tls_ca: CA that signed the daemons' certificates (gRPC over TLS).
        tls_cert: Client certificate, for daemons that require one.
        tls_key: Private key of ``tls_cert``.
        tls_server_name: Name expected in the daemons' certificates.
    """

    metadata: str = "127.0.0.1:7700"
    chunk_tokens: int = 256
    node_id: str = ""
    transport: str = "tcp"
    model_id: str = ""
    cache_salt: str = ""
    force_recompute_on_load_error: bool = True
    kv_codec: str = "none"
    kv_codec_block: int = 128
    auth_token_file: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_server_name: str = ""

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1:
            raise InvalidArgument("chunk_tokens must be positive")
        check_codec_name(self.kv_codec)
        self.codec_spec()  # validates the block size

    def security(self, env: Mapping[str, str]) -> SecurityConfig:
        """The client's token and TLS: these settings over ``KVDEPOT_*`` in ``env``."""
        return client_security(env, self)

    def codec_spec(self) -> CodecSpec:
        return CodecSpec(self.kv_codec, self.kv_codec_block)

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorSettings:
        known = set(cls.__dataclass_fields__)
        unknown = set(extra) - known
        if unknown:
            raise InvalidArgument(
                f"unknown kv_connector_extra_config keys: {', '.join(sorted(unknown))}"
            )
        return cls(**extra)


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
        return (
            # fmt3: a header of per-layer checksums and the codec precedes the layers.
            f"vllm-fmt3:{self.device}:{self.kernel}:bs{self.block_size}:"
            f"L{self.num_layers}:H{self.num_kv_heads}:D{self.head_size}"
        )


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
