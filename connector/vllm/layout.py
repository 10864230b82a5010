"""How a vLLM engine's paged KV cache maps onto kvdepot chunks.

Both sides of the connector (the scheduler, which looks chunks up, and the
workers, which move the bytes) must derive the very same key namespace, so
everything here is computed from the ``VllmConfig`` alone. The workers then
check that the KV tensors they are given match it.

A chunk is ``chunk_tokens`` tokens stored in kvdepot's canonical format
(:mod:`kvdepot.connector.vllm.chunk_format`): one object per KV head,
layer-major, K and V token-major, through the namespace's KV codec. The
bytes do not depend on the engine's tensor-parallel size or rank, block size
or kernel path, so none of those is in the namespace: what is, is what
changes the bytes' meaning (model, KV dtype, layers, KV heads of the whole
model, head size, attention kind, codec, chunk size).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from kvdepot.connector.vllm.chunk_format import FORMAT_NAME, FULL_PART, WINDOW_PART, HeadMap
from kvdepot.connector.vllm.model_identity import ModelIdentity, model_identity
from kvdepot.connector.vllm.settings import ConnectorSettings
from kvdepot.errors import InvalidArgument
from kvdepot.keys import Namespace


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
    total_kv_heads: int = 0  # the model's (0: num_kv_heads, one rank's)
    tp_size: int = 1
    mla: bool = False  # one latent per token, the same on every rank

    def __post_init__(self) -> None:
        if self.total_kv_heads == 0:
            object.__setattr__(
                self,
                "total_kv_heads",
                self.num_kv_heads if self.mla else self.num_kv_heads * self.tp_size,
            )
        if self.chunk_tokens % self.block_size:
            raise InvalidArgument(
                f"chunk_tokens ({self.chunk_tokens}) must be a multiple of the engine's "
                f"block size ({self.block_size})"
            )

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_tokens // self.block_size

    def head_map(self, tp_rank: int) -> HeadMap:
        """Which KV heads rank ``tp_rank`` holds and writes."""
        return HeadMap(self.total_kv_heads, self.tp_size, tp_rank, self.mla)

    def signature(self) -> str:
        """The layout part of the key namespace: the canonical format and the
        shape of the model's KV, nothing of the engine's own layout."""
        kind = "mla" if self.mla else "kv"
        sig = f"{FORMAT_NAME}:{kind}:L{self.num_layers}:H{self.total_kv_heads}:D{self.head_size}"
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

        # Logged only: the chunk format does not depend on it.
        kernel = f"cpu-{torch.backends.cpu.get_cpu_capability()}"
    if int(parallel.pipeline_parallel_size) > 1:
        raise InvalidArgument(
            f"kvdepot does not support pipeline parallelism (pipeline_parallel_size="
            f"{parallel.pipeline_parallel_size}); run with pipeline_parallel_size=1"
        )
    mla = bool(getattr(model_config, "use_mla", False))
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
        total_kv_heads=1 if mla else int(model_config.get_total_num_kv_heads()),
        tp_size=int(parallel.tensor_parallel_size),
        mla=mla,
    )


def namespace_for(
    vllm_config: Any,
    settings: ConnectorSettings,
    layout: KVLayout,
    tp_rank: int = 0,
    groups: CacheGroups | None = None,
    identity: ModelIdentity | None = None,
) -> Namespace:
    """The key namespace of this engine, the same on every tensor-parallel
    rank (``tp_rank`` is accepted for callers that name it, and ignored).

    Its model is the model's identity (``identity``, else derived from
    ``vllm_config``): ``model_id`` when set, else a digest of the model's
    files, never the path the engine was given (see ``model_identity``).
    """
    if identity is None:
        identity = model_identity(vllm_config, settings.model_id)
    model = identity.value
    extra = (settings.cache_salt,) if settings.cache_salt else ()
    if groups is not None and groups.count > 1:
        # An engine with vLLM's hybrid manager and one without it are kept
        # apart: the bytes are laid out alike, but a consumer without it
        # decoded NaN once from a hybrid engine's objects in a test run (cause
        # not found), and no check tells such a pair apart by its bytes.
        # With a sliding-window group its layers are stored apart, in window
        # parts (kvdepot-chunk1 stored them in every object: other bytes).
        parts = ":window-parts" if groups.window else ""
        extra = (*extra, f"kv-groups:{groups.describe()}{parts}")
    codec_key = settings.codec_spec().namespace_key()
    if codec_key:
        # Compressed and uncompressed chunks of one prompt never share a key.
        extra = (*extra, codec_key)
    return Namespace(
        model=model,
        kv_dtype=layout.dtype,
        kv_layout=layout.signature(),
        chunk_tokens=layout.chunk_tokens,
        extra=extra,
    )


def describe_namespace(
    ns: Namespace, identity: ModelIdentity | None = None, cache_salt: str = ""
) -> str:
    """``ns`` in one line: its digest, then every field that went into it
    (``cache_salt``, which may be a tenant's secret, by a digest of it)."""
    model = f"{ns.model} ({identity.source})" if identity is not None else ns.model
    hidden = f"cache_salt sha256:{hashlib.sha256(cache_salt.encode()).hexdigest()[:8]}"
    extra = ", ".join(hidden if cache_salt and e == cache_salt else e for e in ns.extra)
    return (
        f"namespace {ns.digest().hex()} = model {model}, kv dtype {ns.kv_dtype}, "
        f"layout {ns.kv_layout}, tp rank {ns.tp_rank}/{ns.tp_size}, "
        f"{ns.chunk_tokens}-token chunks, extra: {extra or 'none'}"
    )


@dataclass(frozen=True, slots=True)
class CacheGroups:
    """The engine's KV cache groups: layers that share one block table.

    With vLLM's hybrid KV cache manager a model with full-attention and
    sliding-window layers has one group of each; a sliding-window group
    keeps only the blocks of its window (the others are vLLM's null
    block). A stored object still holds every layer of its blocks, so its
    bytes are the same whichever way the engine that wrote it grouped them.

    Attributes:
        kinds: Per group, ``"full"`` or ``"sliding"``.
        windows: Per group, its sliding window in tokens (0: full attention).
        layers: Per group, its layer names.
    """

    kinds: tuple[str, ...] = ("full",)
    windows: tuple[int, ...] = (0,)
    layers: tuple[tuple[str, ...], ...] = ()

    @property
    def count(self) -> int:
        return len(self.kinds)

    def group_of(self, layer_names: list[str]) -> list[int]:
        """The group of each of ``layer_names`` (one group: all 0)."""
        if self.count == 1:
            return [0] * len(layer_names)
        where = {name: g for g, names in enumerate(self.layers) for name in names}
        missing = [n for n in layer_names if n not in where]
        if missing:
            raise InvalidArgument(f"KV layers {missing} belong to no KV cache group")
        return [where[n] for n in layer_names]

    @property
    def window(self) -> int:
        """Tokens of an object's window part (0: no sliding-window group, no
        window part): the longest sliding window of the groups."""
        return max(
            (w for k, w in zip(self.kinds, self.windows, strict=True) if k == "sliding"), default=0
        )

    def part_groups(self, part: int) -> tuple[int, ...]:
        """The groups whose layers an object's part ``part`` holds."""
        if not self.window:
            return tuple(range(self.count)) if part == FULL_PART else ()
        want = "sliding" if part == WINDOW_PART else "full"
        return tuple(g for g, k in enumerate(self.kinds) if k == want)

    def describe(self) -> str:
        return ", ".join(
            f"{k} {w}" if w else k for k, w in zip(self.kinds, self.windows, strict=True)
        )


def cache_groups(kv_cache_config: Any, layout: KVLayout) -> CacheGroups:
    """kvdepot's view of ``kv_cache_config``'s groups, or a clear refusal.

    Raises:
        InvalidArgument: A group kvdepot cannot store (not attention, another
            block size, a sliding window shorter than a chunk), naming the
            setting that avoids it.
    """
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) <= 1:
        return CacheGroups()
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    kinds: list[str] = []
    windows: list[int] = []
    for i, group in enumerate(groups):
        spec = group.kv_cache_spec
        name = type(spec).__name__
        hint = "run the engine with --disable-hybrid-kv-cache-manager"
        if isinstance(spec, SlidingWindowSpec) and type(spec) is SlidingWindowSpec:
            kinds.append("sliding")
            windows.append(int(spec.sliding_window))
        elif isinstance(spec, FullAttentionSpec) and spec.sliding_window is None:
            kinds.append("full")
            windows.append(0)
        else:
            raise InvalidArgument(
                f"kvdepot cannot store KV cache group {i} ({name}) of this model; {hint}"
            )
        if int(spec.block_size) != layout.block_size:
            raise InvalidArgument(
                f"KV cache group {i} has {spec.block_size}-token blocks, kvdepot's layout "
                f"{layout.block_size}; {hint}"
            )
        _check_window(spec, windows[-1], layout, hint)
    return CacheGroups(tuple(kinds), tuple(windows), tuple(tuple(g.layer_names) for g in groups))


def _check_window(spec: Any, window: int, layout: KVLayout, hint: str) -> None:
    """Refuse a sliding window whose kept blocks a chunk's window part
    (its last ``window`` tokens, when shorter than a chunk) would not cover.

    A loading engine keeps the blocks from token ``(hit - window + 1)``
    rounded down to its block size; filled only in part, such a block would
    later pass vLLM's prefix cache for tokens never loaded.
    """
    if not window or window >= layout.chunk_tokens:
        return
    extra = int(getattr(spec, "extra_retained_tokens", 0) or 0)
    if window % layout.block_size or extra:
        raise InvalidArgument(
            f"chunk_tokens ({layout.chunk_tokens}) is larger than the model's sliding window "
            f"({window}), which is not whole {layout.block_size}-token blocks"
            f"{' plus the engine retains ' + str(extra) + ' more tokens' if extra else ''}: "
            f"set chunk_tokens <= {window}, or {hint}"
        )
