"""``KVDepotConnector``: vLLM V1 KV connector backed by kvdepot.

Load it with::

    --kv-transfer-config '{"kv_connector": "KVDepotConnector",
                           "kv_connector_module_path": "kvdepot.connector.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"metadata": "127.0.0.1:7700",
                                                         "chunk_tokens": 256}}'

Scheduler side: for each new request, the prompt's chunk keys are looked up in
the metadata service; the leading hits beyond what vLLM's own prefix cache
holds (never the whole prompt: one token must remain to compute) are loaded
into the request's blocks before its first forward pass. Chunks of the prompt
that become fully computed in a step, and are not already stored, are
published after that step.

Worker side: loads pull whole chunks into staging buffers, verify them, and
scatter them layer by layer into the paged cache; a chunk that fails is
reported through ``get_block_ids_with_load_errors`` so vLLM recomputes it.
Saves gather each layer's blocks as the layer finishes and publish the
chunks (skipping those already stored) at the end of the step.

``"kv_codec": "fp8_e4m3"`` in the extra config stores and moves the KV as
e4m3 with per-block scales (about half the bytes of bf16), dequantized on
load; lossy, so it is part of the namespace (see ``kvdepot.connector.codec``).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvdepot.connector.client import ClientConfig, KVDepotClient
from kvdepot.connector.codec import create_codec
from kvdepot.connector.vllm_layout import (
    ConnectorSettings,
    KVLayout,
    layout_from_config,
    namespace_for,
)
from kvdepot.connector.vllm_loader import LayerLoader, LoadJob, header_bytes, write_header
from kvdepot.errors import Corrupt, KVDepotError
from kvdepot.metadata.keys import ChunkKey, chunk_keys

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

_STAT_KEYS = (
    "lookups",
    "tokens_hit",
    "chunks_loaded",
    "bytes_loaded",
    "chunks_saved",
    "bytes_saved",
    "chunks_skipped",
    "load_errors",
    "save_errors",
)

# Cumulative worker-side counters of this process (tests and operators read
# them; vLLM's own stats interface gets per-interval deltas).
PROCESS_STATS: dict[str, int] = dict.fromkeys(_STAT_KEYS, 0)
_stats_lock = threading.Lock()


@dataclass
class KVDepotConnectorStats(KVConnectorStats):
    """Counters for vLLM's stats logger, summed across workers and intervals."""

    def __post_init__(self) -> None:
        for k in _STAT_KEYS:
            self.data.setdefault(k, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(_STAT_KEYS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


@dataclass(frozen=True, slots=True)
class ChunkTransfer:
    """Chunks of one request to load or save, with the blocks they occupy."""

    req_id: str
    keys: tuple[ChunkKey, ...]
    block_ids: tuple[tuple[int, ...], ...]  # per chunk, blocks_per_chunk ids
    skip_blocks: frozenset[int] = frozenset()  # loads: blocks already computed


@dataclass
class KVDepotConnectorMetadata(KVConnectorMetadata):
    """What the workers do in one step."""

    loads: list[ChunkTransfer] = field(default_factory=list)
    saves: list[ChunkTransfer] = field(default_factory=list)
    skipped: int = 0  # chunks not published because they are stored already


@dataclass
class _RequestState:
    token_ids: list[int]
    keys: list[ChunkKey]
    block_ids: list[int] = field(default_factory=list)
    stored_chunks: int = 0  # leading chunks known to be in kvdepot
    saved_chunks: int = 0  # leading chunks saved or known stored
    load: tuple[int, int] | None = None  # chunk range to load
    local_tokens: int = 0  # tokens vLLM's own prefix cache had
    skip_counted: bool = False


class KVDepotConnector(KVConnectorBase_V1):
    """vLLM V1 KV connector publishing to and loading from kvdepot."""

    def __init__(
        self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        self.settings = ConnectorSettings.from_extra(dict(tc.kv_connector_extra_config or {}))
        self.layout: KVLayout = layout_from_config(vllm_config, self.settings)
        self._codec = create_codec(self.settings.codec_spec())
        self.is_producer = bool(tc.is_kv_producer)
        self.is_consumer = bool(tc.is_kv_consumer)
        self._client = KVDepotClient(
            ClientConfig(
                metadata=self.settings.metadata,
                node_id=self.settings.node_id,
                transport=self.settings.transport,
                tokens_per_chunk=self.settings.chunk_tokens,
                # vLLM loads this class: like a command, it reads the environment.
                security=self.settings.security(os.environ),
            )
        )
        if role == KVConnectorRole.SCHEDULER:
            if self.settings.force_recompute_on_load_error and self.is_consumer:
                # The scheduler reads the policy right after creating us: a
                # failed or corrupt chunk must be recomputed, never fail the request.
                tc.kv_load_failure_policy = "recompute"
            self._namespace = namespace_for(vllm_config, self.settings, self.layout, 0)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            try:
                rank = int(get_tensor_model_parallel_rank())
            except (AssertionError, RuntimeError):
                rank = 0
            self._namespace = namespace_for(vllm_config, self.settings, self.layout, rank)
        # scheduler side
        self._requests: dict[str, _RequestState] = {}
        self._pending_loads: set[str] = set()
        # worker side
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._block_dim = 0
        self._load_errors: set[int] = set()
        self._staged: list[tuple[ChunkTransfer, np.ndarray]] = []
        self._layer_index: dict[str, int] = {}
        self._header_bytes = 0
        self._layer_values = 0  # KV values of one layer of one chunk
        self._layer_bytes = 0  # ... encoded by the codec
        self._codec_header = b""
        self._loader: LayerLoader | None = None
        self._load_job: LoadJob | None = None
        self._load_xfers: list[ChunkTransfer] = []
        self._scattered: set[int] = set()
        self._load_timeout_s = 60.0
        self._interval = KVDepotConnectorStats()
        logger.info(
            "KVDepotConnector (%s, %s): metadata %s, %d-token chunks, layout %s",
            role.name,
            tc.kv_role,
            self.settings.metadata,
            self.settings.chunk_tokens,
            self.layout.signature(),
        )

    # ------------------------------------------------------------------ stats
    def _count(self, **deltas: int) -> None:
        with _stats_lock:
            for k, v in deltas.items():
                PROCESS_STATS[k] += v
                self._interval.data[k] += v

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._interval.is_empty():
            return None
        out, self._interval = self._interval, KVDepotConnectorStats()
        return out

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KVDepotConnectorStats(data=dict(data or {}))

    # ========================================================== scheduler side
    def _state(self, request: Request) -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            tokens = list(request.prompt_token_ids or [])
            state = _RequestState(tokens, chunk_keys(self._namespace, tokens))
            self._requests[request.request_id] = state
        return state

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        state = self._state(request)
        if not state.keys:
            return 0, False
        try:
            hits = self._client.lookup(state.keys)
        except KVDepotError as exc:
            logger.warning("kvdepot lookup failed, treating as a miss: %s", exc)
            return 0, False
        self._count(lookups=1)
        state.stored_chunks = hits
        state.saved_chunks = max(state.saved_chunks, hits)
        if not self.is_consumer:
            return 0, False
        c = self.settings.chunk_tokens
        # At least one prompt token must be left for the engine to compute.
        usable = min(hits, (len(state.token_ids) - 1) // c)
        external = usable * c - num_computed_tokens
        if external <= 0:
            return 0, False
        first = num_computed_tokens // c
        state.load = (first, usable)
        state.local_tokens = num_computed_tokens
        return external, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        state = self._requests.get(request.request_id)
        if state is None:
            return
        if num_external_tokens > 0 and state.load is not None:
            self._pending_loads.add(request.request_id)
        else:
            state.load = None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVDepotConnectorMetadata()
        c = self.settings.chunk_tokens
        bpc = self.layout.blocks_per_chunk
        scheduled: list[tuple[str, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                tokens = list(new.prompt_token_ids or [])
                state = _RequestState(tokens, chunk_keys(self._namespace, tokens))
                self._requests[new.req_id] = state
            state.block_ids = list(new.block_ids[0])
            scheduled.append((new.req_id, new.num_computed_tokens))
            if new.req_id in self._pending_loads and state.load is not None:
                first, end = state.load
                # new.num_computed_tokens already counts the tokens we load.
                computed_blocks = state.local_tokens // self.layout.block_size
                meta.loads.append(
                    ChunkTransfer(
                        new.req_id,
                        tuple(state.keys[first:end]),
                        tuple(
                            tuple(state.block_ids[i * bpc : (i + 1) * bpc])
                            for i in range(first, end)
                        ),
                        frozenset(state.block_ids[:computed_blocks]),
                    )
                )
                # Loaded chunks are stored already: never publish them again.
                state.saved_chunks = max(state.saved_chunks, end)
                self._count(tokens_hit=(end - first) * c)
        self._pending_loads.clear()

        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            scheduled.append((req_id, cached.num_computed_tokens[i]))

        if self.is_producer:
            for req_id, computed in scheduled:
                state = self._requests[req_id]
                if not state.skip_counted:
                    meta.skipped += state.saved_chunks
                    state.skip_counted = True
                done = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
                full = min(done, len(state.token_ids)) // c
                full = min(full, len(state.keys), len(state.block_ids) // bpc)
                if full <= state.saved_chunks:
                    continue
                first = state.saved_chunks
                meta.saves.append(
                    ChunkTransfer(
                        req_id,
                        tuple(state.keys[first:full]),
                        tuple(
                            tuple(state.block_ids[j * bpc : (j + 1) * bpc])
                            for j in range(first, full)
                        ),
                    )
                )
                state.saved_chunks = full
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # Saves complete inside the step that computed the chunks (the
        # blocks are copied out before the step ends), so nothing is held.
        self._requests.pop(request.request_id, None)
        self._pending_loads.discard(request.request_id)
        return False, None

    # ============================================================ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = dict(kv_caches)
        self._layer_index = {name: i for i, name in enumerate(self._kv_caches)}
        if len(self._kv_caches) != self.layout.num_layers:
            raise KVDepotError(
                f"engine has {len(self._kv_caches)} KV layers, config says {self.layout.num_layers}"
            )
        first = next(iter(self._kv_caches.values()))
        # CPU and most backends: [num_blocks, ...]; flash-attn: [2, num_blocks, ...].
        self._block_dim = 1 if first.dim() == 5 and first.shape[0] == 2 else 0
        self._header_bytes = header_bytes(len(self._kv_caches))
        per_block = first.numel() // first.shape[self._block_dim]
        self._layer_values = per_block * self.layout.blocks_per_chunk
        # Raises InvalidArgument for a cache the codec cannot take (fp8 over fp8).
        self._codec_header = self._codec.header(self._layer_values, first.dtype).pack()
        self._layer_bytes = self._codec.encoded_bytes(self._layer_values, first.dtype)
        self._loader = LayerLoader(
            self._client, len(self._kv_caches), self._layer_bytes, self._codec_header
        )
        logger.info(
            "kvdepot: %d KV layers of shape %s (%s), codec %s, %d bytes per chunk",
            len(self._kv_caches),
            tuple(first.shape),
            first.dtype,
            self._codec.name,
            self._chunk_bytes(),
        )

    def _layer_chunk_bytes(self) -> int:
        return self._layer_bytes

    def _chunk_bytes(self) -> int:
        return self._header_bytes + self._layer_chunk_bytes() * len(self._kv_caches)

    def _meta(self) -> KVDepotConnectorMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, KVDepotConnectorMetadata) else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._meta()
        if meta is None or not meta.loads or not self._kv_caches or self._loader is None:
            return
        # Fetched layer by layer on a background thread; each attention layer
        # waits only for its own layer (wait_for_layer_load).
        self._load_xfers = list(meta.loads)
        self._load_job = self._loader.start([x.keys for x in meta.loads])
        self._scattered = set()

    def wait_for_layer_load(self, layer_name: str) -> None:
        job = self._load_job
        li = self._layer_index.get(layer_name)
        if job is None or li is None or li in self._scattered:
            return
        ok = job.wait_layer(li, self._load_timeout_s)
        if ok is None:
            logger.warning("kvdepot: layer %s did not arrive in time; recomputing", layer_name)
            job.error = job.error or "timeout"
            return
        self._scattered.add(li)
        kv = list(self._kv_caches.values())[li]
        for xfer, staging, n in zip(self._load_xfers, job.staging, ok, strict=True):
            if n:
                try:
                    self._scatter_layer(kv, li, staging[:n], xfer.block_ids[:n], xfer.skip_blocks)
                except Corrupt as exc:
                    # Checksums matched but the codec rejects the bytes (a
                    # writer bug): recompute everything this step loaded.
                    logger.warning("kvdepot: layer %s does not decode: %s", layer_name, exc)
                    job.error = job.error or str(exc)

    def _finish_load(self) -> None:
        job, self._load_job = self._load_job, None
        if job is None:
            return
        for li in range(len(self._kv_caches)):
            if li not in self._scattered:
                # Its attention ran without the loaded KV (or the layer never
                # came): nothing of this step's loads can be trusted.
                job.wait_layer(li, self._load_timeout_s)
                job.ok = [0] * len(job.ok)
        if job.error:
            job.ok = [0] * len(job.ok)
        size = self._chunk_bytes()
        for xfer, loaded in zip(self._load_xfers, job.ok, strict=True):
            # Everything from the first chunk that did not arrive is recomputed.
            failed = {b for blocks in xfer.block_ids[loaded:] for b in blocks} - xfer.skip_blocks
            self._load_errors |= failed
            self._count(
                chunks_loaded=loaded,
                bytes_loaded=loaded * size,
                load_errors=len(xfer.keys) - loaded,
            )
            if loaded < len(xfer.keys):
                logger.warning(
                    "kvdepot: %d of %d chunks of %s missing or corrupt; recomputing them",
                    len(xfer.keys) - loaded,
                    len(xfer.keys),
                    xfer.req_id,
                )
        self._load_xfers = []

    def _scatter_layer(
        self,
        kv: torch.Tensor,
        li: int,
        staging: np.ndarray,
        block_ids: tuple[tuple[int, ...], ...],
        skip: frozenset[int],
    ) -> None:
        layer_bytes = self._layer_chunk_bytes()
        flat = [b for blocks in block_ids for b in blocks]
        keep = [i for i, b in enumerate(flat) if b not in skip]
        if not keep:
            return
        start = self._header_bytes + li * layer_bytes
        # Decoded on the cache's device: a GPU engine copies the encoded bytes.
        part = torch.from_numpy(staging[:, start : start + layer_bytes]).to(kv.device)
        values = self._codec.decode(part, self._layer_values, kv.dtype)
        blocks = values.reshape(len(flat), *self._block_shape(kv))
        blocks = blocks.index_select(0, torch.tensor(keep, dtype=torch.long, device=kv.device))
        ids = torch.tensor([flat[i] for i in keep], dtype=torch.long, device=kv.device)
        if self._block_dim == 0:
            kv.index_copy_(0, ids, blocks.to(kv.device))
        else:
            kv.index_copy_(1, ids, blocks.transpose(0, 1).to(kv.device))

    def _block_shape(self, kv: torch.Tensor) -> tuple[int, ...]:
        if self._block_dim == 0:
            return tuple(kv.shape[1:])
        return (kv.shape[0], *kv.shape[2:])

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        if not self.is_producer:
            return
        meta = self._meta()
        if meta is None or not meta.saves:
            return
        li = self._layer_index.get(layer_name)
        if li is None:
            return
        if not self._staged:
            size = self._chunk_bytes()
            self._staged = [(x, np.empty((len(x.keys), size), dtype=np.uint8)) for x in meta.saves]
        layer_bytes = self._layer_chunk_bytes()
        start = self._header_bytes + li * layer_bytes
        for xfer, staging in self._staged:
            flat = torch.tensor([b for blocks in xfer.block_ids for b in blocks], dtype=torch.long)
            blocks = kv_layer.index_select(self._block_dim, flat.to(kv_layer.device))
            if self._block_dim == 1:
                blocks = blocks.transpose(0, 1).contiguous()
            # Encoded on the cache's device: a GPU engine copies the encoded bytes.
            raw = self._codec.encode(blocks.reshape(len(xfer.keys), self._layer_values)).cpu()
            staging[:, start : start + layer_bytes] = raw.numpy()

    def wait_for_save(self) -> None:
        meta = self._meta()
        if meta is not None and meta.skipped and self.is_producer:
            self._count(chunks_skipped=meta.skipped)
        staged, self._staged = self._staged, []
        for xfer, staging in staged:
            write_header(
                staging, len(self._kv_caches), self._layer_chunk_bytes(), self._codec_header
            )
            try:
                r = self._client.put(list(xfer.keys), list(staging))
            except KVDepotError as exc:
                logger.warning("kvdepot publish for %s failed: %s", xfer.req_id, exc)
                self._count(save_errors=len(xfer.keys))
                continue
            self._count(
                chunks_saved=r.stored,
                bytes_saved=r.bytes_sent,
                chunks_skipped=r.skipped,
                save_errors=r.failed,
            )

    def get_block_ids_with_load_errors(self) -> set[int]:
        # Called once per step after the forward pass: every layer was used.
        self._finish_load()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def shutdown(self) -> None:
        if self._loader is not None:
            self._loader.close()
        self._client.close()
