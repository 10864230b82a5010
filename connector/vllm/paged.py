"""Where each token's K and V values sit in an engine's paged KV cache.

The canonical chunk format (:mod:`kvdepot.connector.vllm.chunk_format`) is
token-major per KV head; the engine's cache is paged and, on the CPU
backend, packed per kernel path (vLLM 0.32's CPU attention keeps a layer as
``[num_blocks, num_kv_heads, block_size, 2 * head_size]``; within a block and
head the first ``block_size * head_size`` values are K, the rest V, each
reordered for the kernel, and K and V are packed differently). The packing
is compiled into vLLM, so it is not restated here: it is measured once at
start by writing index patterns through vLLM's own cache-write operation
into a scratch block, which gives the place of every ``(token, head, K|V,
dim)`` of a block. Gathering a save and scattering a load are then one
indexed copy each, exact for every kernel path, moving the runs of values
that lie together in both orders (:attr:`PagedMap.unit` values each).

Supported: the CPU layout above, the ``[2, num_blocks, block_size, heads,
head_size]`` layout of the GPU flash-attention backends (and FlashInfer's
``[num_blocks, 2, ...]``), and MLA caches (one latent per slot, slot-major).
"""

from __future__ import annotations

import torch

from kvdepot.errors import InvalidArgument

# Integers each dtype holds exactly, the base of the probe's digits.
_EXACT = {torch.float32: 1 << 24, torch.float16: 2048, torch.bfloat16: 256}


class PagedMap:
    """Element offsets of a block's ``[tokens, heads, 2, head_size]`` values.

    Attributes:
        block_size: Tokens per block.
        heads: KV heads of this rank's cache.
        head_size: Values per head and token (K or V alone).
        kv: 2, or 1 for an MLA cache (the latent, no separate V).
    """

    def __init__(self, offsets: torch.Tensor, block_stride: int, block_size: int) -> None:
        self.offsets = offsets  # [block_size, heads, kv, head_size], within one block
        self.block_stride = block_stride
        self.block_size = block_size
        _, self.heads, self.kv, self.head_size = offsets.shape
        self.unit = 1
        for r in (32, 16, 8, 4, 2):
            if self._runs(r):
                self.unit = r
                break
        r = self.unit
        # Offsets of the canonical order's runs of ``unit`` values that lie
        # together in the cache: K along tokens (dim-major K), V and a
        # latent along dims. Copies move runs, not single values.
        self.k_runs = offsets[0::r, :, 0, :] // r  # [block_size / r, heads, head_size]
        self.v_runs = offsets[:, :, self.kv - 1, 0::r] // r  # [block_size, heads, dim / r]

    def _runs(self, r: int) -> bool:
        """Whether the canonical order's runs of ``r`` values are contiguous
        and aligned in the cache."""
        o = self.offsets
        bs, _, kv, d = o.shape
        if bs % r or d % r or self.block_stride % r:
            return False
        step = torch.arange(r)
        v = o[:, :, kv - 1, :].reshape(bs, -1, d // r, r)
        if not bool((v == v[..., :1] + step).all()) or bool((v[..., 0] % r).any()):
            return False
        if kv == 1:
            return True
        k = o[:, :, 0, :].reshape(bs // r, r, -1, d).permute(0, 2, 3, 1)
        return bool((k == k[..., :1] + step).all()) and not bool((k[..., 0] % r).any())

    def run_index(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Run indices (in units of ``unit`` values) of ``slots``: K's
        ``[len(slots) / unit, heads, dim]`` (one per ``unit`` slots, which
        must start runs) and V's (or the latent's) ``[len(slots), heads, dim / unit]``."""
        r = self.unit
        blocks = torch.div(slots, self.block_size, rounding_mode="floor")
        within = slots - blocks * self.block_size
        base = (blocks * (self.block_stride // r)).view(-1, 1, 1)
        v = self.v_runs[within] + base
        starts = within[0::r]
        k = self.k_runs[torch.div(starts, r, rounding_mode="floor")] + base[0::r]
        return k, v

    def index(self, slots: torch.Tensor) -> torch.Tensor:
        """Flat element offsets ``[len(slots), heads, kv, head_size]`` of ``slots``
        (``block * block_size + offset``) in the layer's contiguous storage."""
        blocks = torch.div(slots, self.block_size, rounding_mode="floor")
        within = slots - blocks * self.block_size
        return self.offsets[within] + (blocks * self.block_stride).view(-1, 1, 1, 1)


def paged_map(
    kv: torch.Tensor, block_size: int, isa: str | None, cache_dtype: str, *, mla: bool = False
) -> PagedMap:
    """The map of a layer tensor ``kv`` like the ones ``register_kv_caches`` gets.

    Raises:
        InvalidArgument: A cache layout the canonical format cannot address.
    """
    if not kv.is_contiguous():
        raise InvalidArgument(f"kvdepot needs a contiguous KV cache per layer; got {kv.stride()}")
    if mla:
        # vLLM's MLA backends (CPU and AMX included) keep one latent per
        # slot, slot-major, whatever the tensor's nominal shape.
        latent = kv.shape[-1]
        if kv.numel() % (block_size * latent):
            raise InvalidArgument(f"an MLA cache of shape {tuple(kv.shape)} is not slot-major")
        off = (torch.arange(block_size).view(-1, 1) * latent + torch.arange(latent)).view(
            block_size, 1, 1, latent
        )
        return PagedMap(off, block_size * latent, block_size)
    if kv.dim() == 5 and kv.shape[0] == 2 and kv.shape[2] == block_size:
        _, nb, bs, heads, d = kv.shape
        t = torch.arange(bs).view(bs, 1, 1, 1) * heads * d
        h = torch.arange(heads).view(1, heads, 1, 1) * d
        which = torch.arange(2).view(1, 1, 2, 1) * nb * bs * heads * d
        dim = torch.arange(d).view(1, 1, 1, d)
        return PagedMap(t + h + which + dim, bs * heads * d, bs)
    if kv.dim() == 5 and kv.shape[1] == 2 and kv.shape[2] == block_size:
        # FlashInfer's NHD layout: [num_blocks, 2, block_size, heads, head_size].
        nb, _, bs, heads, d = kv.shape
        t = torch.arange(bs).view(bs, 1, 1, 1) * heads * d
        h = torch.arange(heads).view(1, heads, 1, 1) * d
        which = torch.arange(2).view(1, 1, 2, 1) * bs * heads * d
        dim = torch.arange(d).view(1, 1, 1, d)
        return PagedMap(t + h + which + dim, 2 * bs * heads * d, bs)
    if kv.dim() == 4 and kv.shape[2] == block_size and kv.shape[3] % 2 == 0:
        if isa is None:
            raise InvalidArgument("a CPU KV cache needs its attention kernel path")
        return _probe_cpu(kv, block_size, isa, cache_dtype)
    raise InvalidArgument(
        f"kvdepot cannot address a KV cache of shape {tuple(kv.shape)} with "
        f"{block_size}-token blocks"
    )


def _probe_cpu(kv: torch.Tensor, block_size: int, isa: str, cache_dtype: str) -> PagedMap:
    """Measure the CPU kernels' packing of one block by writing index digits
    through vLLM's own cache write and reading where each lands."""
    from vllm import _custom_ops as ops

    _, heads, bs, two_d = kv.shape
    d = two_d // 2
    base = _EXACT.get(kv.dtype)
    if base is None or cache_dtype not in ("auto", "bfloat16", "float16", "float32"):
        raise InvalidArgument(
            f"kvdepot's chunk format takes a {', '.join(str(t) for t in _EXACT)} KV cache on "
            f"CPU, not cache_dtype {cache_dtype} ({kv.dtype}); use a KV codec instead"
        )
    n = bs * heads * d
    canonical = torch.arange(n, dtype=torch.long).view(bs, heads, d)
    found = [torch.zeros(heads * bs * d, dtype=torch.long) for _ in range(2)]
    scale = 1
    while scale < n:
        digit = (torch.div(canonical, scale, rounding_mode="floor") % base).to(kv.dtype)
        scratch = torch.full((1, heads, bs, two_d), -1.0, dtype=kv.dtype)
        view = scratch.view(1, heads, 2 * bs, d)
        key_cache, value_cache = view.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(
            digit, digit, key_cache, value_cache, torch.arange(bs), isa, kv_cache_dtype="auto"
        )
        flat = scratch.view(heads, 2, bs * d).float()
        if (flat < 0).any():
            raise InvalidArgument(f"the CPU KV cache packing ({isa}) is not a permutation")
        for i in range(2):
            found[i] += flat[:, i].reshape(-1).long() * scale
        scale *= base
    offsets = torch.empty(bs, heads, 2, d, dtype=torch.long)
    for i in range(2):
        # found[i][p]: the canonical index whose K (V) value sits at place p
        # of the K (V) half of its head's region.
        got = found[i].view(heads, bs * d)
        for h in range(heads):
            where = torch.full((n,), -1, dtype=torch.long)
            places = torch.arange(bs * d) + h * 2 * bs * d + i * bs * d
            where[got[h]] = places
            own = canonical[:, h, :].reshape(-1)
            if (where[own] < 0).any():
                raise InvalidArgument(f"the CPU KV cache packing ({isa}) mixes heads")
            offsets[:, h, i, :] = where[own].view(bs, d)
    return PagedMap(offsets, heads * 2 * bs * d, bs)


def cpu_isa(dtype: torch.dtype, block_size: int, head_size: int, cache_dtype: str) -> str:
    """The CPU attention kernel path vLLM picks for this cache (as its backend does)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return str(_get_attn_isa(dtype, block_size, head_size, cache_dtype))
