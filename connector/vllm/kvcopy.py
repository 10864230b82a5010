"""Copies between an engine's paged KV cache and canonical objects.

A save gathers each object's tokens, for the heads this rank writes, from
wherever the engine's blocks keep them (:class:`PagedMap`) into the
canonical order (per head: K ``[dim][token]``, then V ``[token][dim]``; an
MLA latent ``[token][dim]``); a load scatters them back, for
the heads this rank holds, into the request's blocks. Objects and blocks are
independent: a 256-token chunk fills four 64-token blocks or two of 128, a
16-token tail unit part of one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from kvdepot.connector.codec.base import KVCodec
from kvdepot.connector.vllm.objects import Geometry
from kvdepot.connector.vllm.paged import PagedMap
from kvdepot.connector.vllm.plan import NULL_BLOCK, KVObject


def token_slots(
    objects: Sequence[KVObject], group: int, block_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per token of ``objects`` in order: its request position, its block id
    in KV cache group ``group``, and its slot (``block * block_size + offset``)."""
    pos: list[np.ndarray] = []
    blk: list[np.ndarray] = []
    for o in objects:
        start, n = o.span(block_size)
        p = np.arange(start, start + n, dtype=np.int64)
        ids = np.asarray(o.blocks[group], dtype=np.int64)
        pos.append(p)
        blk.append(ids[p // block_size - o.position])
    if not pos:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    p_all, b_all = np.concatenate(pos), np.concatenate(blk)
    return p_all, b_all, b_all * block_size + p_all % block_size


_CACHED = 8
"""Index sets a copier keeps: a step's loads or saves, per KV cache group."""


class CacheCopier:
    """Gathers and scatters one rank's heads of canonical objects.

    The indices of a set of objects are the same in every layer of its KV
    cache group: they are computed (and, on a GPU, copied to it) once, for the
    first layer, and reused for the others.

    Args:
        pmap: The cache's map (the same for every layer).
        codec: The namespace's codec.
        block_size: Tokens per engine block.
        writes: Local indices (in the cache's head order) of the heads this
            rank stores.
    """

    def __init__(
        self, pmap: PagedMap, codec: KVCodec, block_size: int, writes: Sequence[int]
    ) -> None:
        self.pmap = pmap
        self.codec = codec
        self.block_size = block_size
        self.writes = torch.tensor(list(writes), dtype=torch.long)
        # (kind, group, span, device, ids of the objects) -> (the objects, indices);
        # the objects are held so that their ids stay theirs while cached.
        self._indices: dict[tuple[object, ...], tuple[Sequence[KVObject], tuple[Any, ...]]] = {}

    def _cached(
        self,
        key: tuple[object, ...],
        objects: Sequence[KVObject],
        make: Callable[[], tuple[Any, ...]],
    ) -> tuple[Any, ...]:
        full = (*key, tuple(map(id, objects)))
        hit = self._indices.get(full)
        if hit is not None:
            return hit[1]
        if len(self._indices) >= _CACHED:
            self._indices.pop(next(iter(self._indices)))
        made = make()
        self._indices[full] = (objects, made)
        return made

    def _gather_index(
        self, objects: Sequence[KVObject], group: int, device: torch.device
    ) -> tuple[Any, ...]:
        _, _, slots = token_slots(objects, group, self.block_size)
        k_idx, v_idx = self.pmap.run_index(torch.from_numpy(slots).to(device))
        return k_idx.index_select(1, self.writes), v_idx.index_select(1, self.writes)

    def _scatter_index(
        self, objects: Sequence[KVObject], group: int, lo: int, hi: int, device: torch.device
    ) -> tuple[Any, ...]:
        pos, blk, slots = token_slots(objects, group, self.block_size)
        # Not the engine's own tokens, nor blocks its sliding window dropped.
        keep = np.nonzero((pos >= lo) & (pos < hi) & (blk != NULL_BLOCK))[0]
        if not len(keep):
            return ()
        r = self.pmap.unit
        k_idx, v_idx = self.pmap.run_index(torch.from_numpy(slots).to(device))
        # Kept tokens come in whole blocks, so in whole runs of r.
        sel = torch.from_numpy(keep).to(device)
        starts = sel[sel % r == 0] // r
        return sel, v_idx.index_select(0, sel), starts, k_idx.index_select(0, starts)

    def to(self, device: torch.device) -> None:
        """Keep the offsets where the cache is."""
        pm = self.pmap
        pm.offsets, pm.k_runs, pm.v_runs = (
            pm.offsets.to(device),
            pm.k_runs.to(device),
            pm.v_runs.to(device),
        )
        self.writes = self.writes.to(device)
        self._indices.clear()

    def gather(
        self, kv: torch.Tensor, objects: Sequence[KVObject], group: int, tokens: int
    ) -> torch.Tensor:
        """Encoded layer sections ``[len(objects) * writes, layer_bytes]`` of
        ``objects`` (each ``tokens`` tokens) from layer tensor ``kv``."""
        k_rows, v_rows = self._cached(
            ("gather", group, kv.device),
            objects,
            lambda: self._gather_index(objects, group, kv.device),
        )
        pm, n, w = self.pmap, len(objects), len(self.writes)
        r, d = pm.unit, pm.head_size
        runs = kv.reshape(-1).view(-1, r)
        # V (or the latent): [n, tokens, w, d / r, r] -> per head [tokens][d].
        v = runs[v_rows].view(n, tokens, w, d)
        parts = [v.permute(0, 2, 1, 3).reshape(n, w, tokens * d)]
        if pm.kv == 2:
            # K: [n, tokens / r, w, d, r] -> per head [d][tokens].
            k = runs[k_rows].view(n, tokens // r, w, d, r)
            parts.insert(0, k.permute(0, 2, 3, 1, 4).reshape(n, w, d * tokens))
        flat = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
        return self.codec.encode(flat.reshape(n * w, -1).contiguous())

    def scatter(
        self,
        kv: torch.Tensor,
        geo: Geometry,
        part: torch.Tensor,
        objects: Sequence[KVObject],
        group: int,
        lo: int,
        hi: int,
    ) -> None:
        """Decode ``part`` (``[len(objects) * heads, layer_bytes]``, every head
        of this rank) and write its tokens in ``[lo, hi)`` into ``kv``.

        Raises:
            Corrupt: The codec rejects the bytes.
        """
        index = self._cached(
            ("scatter", group, lo, hi, kv.device),
            objects,
            lambda: self._scatter_index(objects, group, lo, hi, kv.device),
        )
        if not index:
            return
        sel, v_rows, starts, k_rows = index
        values = self.codec.decode(part.to(kv.device), geo.layer_values, kv.dtype)
        pm, n, t = self.pmap, len(objects), geo.tokens
        r, d, h = pm.unit, pm.head_size, pm.heads
        values = values.view(n, h, -1)
        runs = kv.view(-1).view(-1, r)
        v = values[:, :, t * d * (pm.kv - 1) :].reshape(n, h, t, d).permute(0, 2, 1, 3)
        runs[v_rows] = v.reshape(n * t, h, d // r, r).index_select(0, sel)
        if pm.kv == 2:
            k = values[:, :, : d * t].reshape(n, h, d, t // r, r).permute(0, 3, 1, 2, 4)
            runs[k_rows] = k.reshape(n * t // r, h, d, r).index_select(0, starts)
