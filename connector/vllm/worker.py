"""The worker side: moves KV between the engine's paged cache and kvdepot.

Asynchronous loads are fetched on background threads (see
:mod:`kvdepot.connector.vllm.transfer`) and copied into the request's
blocks on the engine's thread when done; small loads may run inside the step,
layer by layer beside the forward pass (:class:`LayerLoader`). Saves copy
each layer's blocks into staging as the layer finishes and hand them to the
publisher at the end of the step: the step never waits on the network.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvdepot.connector.client import KVDepotClient
from kvdepot.connector.codec.base import KVCodec
from kvdepot.connector.vllm.chunk_format import FULL_PART, WINDOW_PART, head_key
from kvdepot.connector.vllm.kvcopy import CacheCopier
from kvdepot.connector.vllm.layout import CacheGroups, KVLayout
from kvdepot.connector.vllm.loader import LayerLoader, LoadJob
from kvdepot.connector.vllm.objects import (
    Geometry,
    ObjectFormat,
    StagedGroup,
    stage,
    staged_bytes,
)
from kvdepot.connector.vllm.paged import PagedMap, cpu_isa, paged_map
from kvdepot.connector.vllm.plan import KVDepotConnectorMetadata, KVObject, LoadPlan
from kvdepot.connector.vllm.settings import ConnectorSettings
from kvdepot.connector.vllm.stats import Counters
from kvdepot.connector.vllm.transfer import Fetcher, FetchJob, Publisher
from kvdepot.errors import Corrupt, KVDepotError
from kvdepot.keys import Namespace
from kvdepot.repeat_log import RepeatLog

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.005


class WorkerSide:
    """The connector's worker role."""

    def __init__(
        self,
        settings: ConnectorSettings,
        layout: KVLayout,
        codec: KVCodec,
        client: KVDepotClient,
        *,
        namespace: Namespace,
        is_producer: bool,
        counters: Counters,
        groups: CacheGroups | None = None,
        tp_rank: int = 0,
    ) -> None:
        self.settings = settings
        self.ns = namespace
        self._digest = bytes(namespace.digest())
        self.heads = layout.head_map(tp_rank)
        self._rank = tp_rank
        self._copier: CacheCopier | None = None
        self.layout = layout
        self.groups = groups or CacheGroups()
        self._layer_group: list[int] = []
        self._layer_part: list[int] = []
        self._layer_slot: list[int] = []
        self._codec = codec
        self._client = client
        self.is_producer = is_producer
        self._counters = counters
        self._warn = RepeatLog(logger)
        self._kv: list[torch.Tensor] = []
        self._layer_index: dict[str, int] = {}
        self._fmt: ObjectFormat | None = None
        self._fetcher: Fetcher | None = None
        self._publisher: Publisher | None = None
        self._load_errors: set[int] = set()
        self._recved: set[str] = set()
        self._failed: set[str] = set()  # loads that failed as a whole request
        # In-step loads (small ones): layer by layer beside the forward pass.
        self._loader: LayerLoader | None = None
        self._sync_job: LoadJob | None = None
        self._sync_plans: list[LoadPlan] = []
        self._scattered: set[int] = set()
        self._forward_ran = False  # this step ran attention layers
        # Saves of the current step, staged layer by layer.
        self._staged: list[tuple[str, list[StagedGroup], int]] | None = None
        self._stream: torch.cuda.Stream | None = None  # a GPU engine's copy-out

    # ------------------------------------------------------------ set-up
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv = list(kv_caches.values())
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        if len(self._kv) != self.layout.num_layers:
            raise KVDepotError(
                f"engine has {len(self._kv)} KV layers, config says {self.layout.num_layers}"
            )
        self._layer_group = self.groups.group_of(list(kv_caches))
        # Each layer's part of an object, and its section there.
        window = set(self.groups.part_groups(WINDOW_PART))
        self._layer_part = [WINDOW_PART if g in window else FULL_PART for g in self._layer_group]
        self._layer_slot = [self._layer_part[:li].count(p) for li, p in enumerate(self._layer_part)]
        first = self._kv[0]
        pmap = self._paged_map(first)
        local = self.heads.local
        # Raises InvalidArgument for a cache the codec cannot take (fp8 over fp8).
        fmt = ObjectFormat(
            self._codec,
            pmap.kv * pmap.head_size,
            first.dtype,
            len(self._kv),
            self._layer_part.count(WINDOW_PART),
        )
        chunk = fmt.geometry(self.layout.chunk_tokens)
        self._fmt = fmt
        self._copier = CacheCopier(
            pmap, self._codec, self.layout.block_size, [local.index(h) for h in self.heads.writes]
        )
        self._copier.to(first.device)
        self._loader = LayerLoader(
            self._client, len(self._kv), chunk.layer_bytes, chunk.codec_header
        )
        self._fetcher = Fetcher(
            self._client,
            fmt,
            self._warn,
            block_size=self.layout.block_size,
            heads=local,
            digest=self._digest,
        )
        if self.is_producer:
            self._publisher = Publisher(
                self._client, fmt, self.settings.save_buffer_bytes, self._counters, self._warn
            )
        logger.info(
            "kvdepot: %d KV layers of shape %s (%s) in KV cache groups (%s), codec %s; "
            "rank %d holds KV heads %s of %d, writes %s; %d bytes per chunk and head",
            len(self._kv),
            tuple(first.shape),
            first.dtype,
            self.groups.describe(),
            self._codec.name,
            self._rank,
            list(local),
            self.heads.total,
            list(self.heads.writes),
            chunk.size,
        )

    def _paged_map(self, first: torch.Tensor) -> PagedMap:
        """The cache's map, checked against the layout."""
        lay = self.layout
        isa = None
        if first.dim() == 4 and not first.is_cuda and not lay.mla:
            isa = cpu_isa(first.dtype, lay.block_size, lay.head_size, lay.dtype)
        pmap = paged_map(first, lay.block_size, isa, lay.dtype, mla=lay.mla)
        if pmap.heads != len(self.heads.local) or pmap.head_size != lay.head_size:
            raise KVDepotError(
                f"KV cache of shape {tuple(first.shape)} holds {pmap.heads} heads of "
                f"{pmap.head_size}; the config says {len(self.heads.local)} of {lay.head_size}"
            )
        return pmap

    # ------------------------------------------------------------- loads
    def start_load_kv(self, meta: KVDepotConnectorMetadata | None) -> None:
        if meta is None or not meta.loads or self._fmt is None:
            return
        loads = meta.loads
        sync = [p for p in loads if not p.asynchronous]
        for plan in loads:
            if plan.asynchronous:
                assert self._fetcher is not None
                self._fetcher.submit(plan, self.settings.load_timeout_s)
        if sync and self._loader is not None:
            # Fetched layer by layer on a background thread; each attention
            # layer waits only for its own layer (wait_for_layer_load).
            self._sync_plans = sync
            timeout = min(p.deadline_s or self.settings.load_timeout_s for p in sync)
            keys = [
                [head_key(self._digest, o.key, h) for o in p.objects for h in self.heads.local]
                for p in sync
            ]
            self._sync_job = self._loader.start(keys, timeout)
            self._scattered = set()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._forward_ran = True
        job = self._sync_job
        li = self._layer_index.get(layer_name)
        if job is None or li is None or li in self._scattered or job.error:
            return
        ok = job.wait_layer(li, max(0.0, job.deadline - time.monotonic()))
        if ok is None:
            # Every later layer is given up too: the step waits once.
            self._warn.warn("layer", "kvdepot: layer %s did not arrive in time", layer_name)
            job.error = "timeout"
            return
        self._scattered.add(li)
        geo = self._chunk_geometry()
        nh = len(self.heads.local)
        for plan, staging, rows in zip(self._sync_plans, job.staging, ok, strict=True):
            n = rows // nh  # objects with every head
            if n:
                try:
                    self._scatter_layer(li, geo, staging[: n * nh], plan.objects[:n], plan)
                except Corrupt as exc:
                    # Checksums matched but the codec rejects the bytes (a
                    # writer bug): recompute everything this step loaded.
                    self._warn.warn(
                        "decode", "kvdepot: layer %s does not decode: %s", layer_name, exc
                    )
                    job.error = job.error or str(exc)

    def _chunk_geometry(self) -> Geometry:
        assert self._fmt is not None
        return self._fmt.geometry(self.layout.chunk_tokens)

    def _finish_sync_load(self) -> None:
        job, self._sync_job = self._sync_job, None
        if job is None:
            return
        if job.error or len(self._scattered) < len(self._kv):
            # An attention layer ran without the loaded KV (or it never
            # came): nothing of this step's loads can be trusted.
            job.ok = [0] * len(job.ok)
        job.ok = [n // len(self.heads.local) for n in job.ok]
        if job.error == "timeout":
            self._counters.add(loads_timed_out=1)
            self._late(self._sync_plans, job.deadline - job.started)
        whole = all(n == len(p.objects) for p, n in zip(self._sync_plans, job.ok, strict=True))
        if whole and job.fetch_s > 0:
            # The step's loads were fetched together: one timed load.
            self._timed(1, job.fetch_s, self._sync_plans)
        for plan, loaded in zip(self._sync_plans, job.ok, strict=True):
            self._account(plan, loaded)
        self._sync_plans = []

    def _timed(self, loads: int, seconds: float, plans: Sequence[LoadPlan]) -> None:
        """Report how long whole loads took (the scheduler paces loads by it)."""
        tokens = sum(p.loaded_tokens(p.objects, self.layout.block_size) for p in plans)
        us = int(seconds * 1e6)
        self._counters.add(load_timed=loads, load_timed_us=us, load_timed_tokens=tokens)
        self._counters.add_source(_source(plans), timed=loads, timed_us=us, timed_tokens=tokens)

    def _account(self, plan: LoadPlan, loaded: int) -> None:
        """Count a finished load; blocks from its first missing object are recomputed."""
        assert self._fmt is not None
        bs = self.layout.block_size
        if loaded < len(plan.objects):
            if self.groups.count > 1:
                # Block ids name no request across groups: vLLM recomputes
                # the whole request instead.
                self._failed.add(plan.req_id)
                loaded = 0
            else:
                missing = plan.loaded_positions(plan.objects[loaded:], bs)
                self._load_errors |= {b for _, b in missing}
        got = plan.objects[:loaded]
        nh = len(self.heads.local)
        nbytes = nh * sum(self._fmt.geometry(o.span(bs)[1], o.part).size for o in got)
        # Chunks and tail units, whatever parts they are stored in.
        wanted = sum(o.part == FULL_PART for o in plan.objects)
        chunks = sum(o.part == FULL_PART for o in got)
        self._counters.add(
            chunks_loaded=chunks,
            bytes_loaded=nbytes,
            bytes_loaded_rank0=nbytes if self._rank == 0 else 0,
            # Every rank loads its heads of the same tokens: counted once.
            tokens_hit=plan.loaded_tokens(got, bs) if self._rank == 0 else 0,
            load_errors=wanted - chunks,
        )
        if chunks < wanted:
            self._warn.warn(
                "missing",
                "kvdepot: %d of %d objects of %s missing, corrupt or late; recomputing them",
                wanted - chunks,
                wanted,
                plan.req_id,
            )

    def _late(self, plans: Sequence[LoadPlan], seconds: float) -> None:
        """Report loads given up at their deadline: they took at least that.
        Rank 0 reports (every rank loads its heads of the same loads, and
        the gate counts such loads in a row)."""
        if self._rank != 0:
            return
        tokens = sum(p.loaded_tokens(p.objects, self.layout.block_size) for p in plans)
        us = int(seconds * 1e6)
        self._counters.add(load_late=1, load_late_us=us, load_late_tokens=tokens)
        self._counters.add_source(_source(plans), late=1, late_us=us, late_tokens=tokens)

    def _finish_probe(self, job: FetchJob) -> None:
        """A probe's time goes to the scheduler; its bytes go nowhere."""
        plan = job.plan
        self._counters.add(loads_timed_out=int(job.timed_out))
        if job.timed_out:
            self._late([plan], self.settings.load_timeout_s)
        elif job.ok == len(plan.objects) and job.fetch_s > 0:
            self._timed(1, job.fetch_s, [plan])

    def _finish_async(self, job: FetchJob) -> None:
        if job.plan.probe:
            self._finish_probe(job)
            return
        ok = job.ok
        if job.timed_out:
            self._late([job.plan], self.settings.load_timeout_s)
            self._counters.add(loads_timed_out=1)
            self._warn.warn(
                "late",
                "kvdepot: load of %s missed its %.1f s deadline",
                job.plan.req_id,
                self.settings.load_timeout_s,
            )
        if ok:
            try:
                for li in range(len(self._kv)):
                    for g in job.groups:
                        # Objects are in prompt order; a group holds those of
                        # one size, so its leading good ones are the ones < ok.
                        n = sum(1 for i in g.index if i < ok)
                        if n:
                            rows = g.rows[: n * g.heads]
                            self._scatter_layer(li, g.geometry, rows, g.objects[:n], job.plan)
            except Corrupt as exc:
                self._warn.warn(
                    "decode", "kvdepot: a load of %s does not decode: %s", job.plan.req_id, exc
                )
                ok = 0
        if ok == len(job.plan.objects) and job.fetch_s > 0:
            self._timed(1, job.fetch_s, [job.plan])
        self._account(job.plan, ok)
        self._recved.add(job.plan.req_id)

    def _scatter_layer(
        self,
        li: int,
        geo: Geometry,
        rows: np.ndarray,
        objects: Sequence[KVObject],
        plan: LoadPlan,
    ) -> None:
        assert self._copier is not None
        if geo.part != self._layer_part[li]:
            return
        start = geo.header + self._layer_slot[li] * geo.layer_bytes
        part = torch.from_numpy(np.ascontiguousarray(rows[:, start : start + geo.layer_bytes]))
        lo = plan.first_block * self.layout.block_size
        # Decoded on the cache's device: a GPU engine copies the encoded bytes.
        self._copier.scatter(self._kv[li], geo, part, objects, self._layer_group[li], lo, plan.end)

    # ------------------------------------------------------------- saves
    def save_kv_layer(
        self, meta: KVDepotConnectorMetadata | None, layer_name: str, kv_layer: torch.Tensor
    ) -> None:
        if not self.is_producer or meta is None or not meta.saves or self._fmt is None:
            return
        if not self.heads.writes:
            return  # another rank stores the heads this one holds
        li = self._layer_index.get(layer_name)
        if li is None:
            return
        if self._staged is None:
            self._staged = self._stage_saves(meta, pinned=kv_layer.is_cuda)
        side = self._side_stream(kv_layer)
        if side is None:
            self._copy_layer_out(li, kv_layer)
            return
        # On a GPU the copy-out runs on a stream of its own, behind this
        # layer's computation, into pinned memory: the step does not wait
        # for it (wait_for_save orders the next step's kernels after it).
        side.wait_stream(torch.cuda.current_stream(kv_layer.device))
        with torch.cuda.stream(side):
            self._copy_layer_out(li, kv_layer)

    def _copy_layer_out(self, li: int, kv_layer: torch.Tensor) -> None:
        assert self._staged is not None and self._copier is not None
        for _, groups, _ in self._staged:
            for g in groups:
                geo = g.geometry
                if geo.part != self._layer_part[li]:
                    continue
                # Encoded on the cache's device: a GPU engine copies the encoded bytes.
                raw = self._copier.gather(kv_layer, g.objects, self._layer_group[li], geo.tokens)
                start = geo.header + self._layer_slot[li] * geo.layer_bytes
                if g.pinned is None:
                    g.rows[:, start : start + geo.layer_bytes] = raw.cpu().numpy()
                    continue
                # One contiguous span per row: a true asynchronous copy.
                for i in range(raw.shape[0]):
                    g.pinned[i, start : start + geo.layer_bytes].copy_(raw[i], non_blocking=True)

    def _side_stream(self, kv_layer: torch.Tensor) -> torch.cuda.Stream | None:
        if not kv_layer.is_cuda:
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(kv_layer.device)
        return self._stream

    def _stage_saves(
        self, meta: KVDepotConnectorMetadata, *, pinned: bool
    ) -> list[tuple[str, list[StagedGroup], int]]:
        assert self._fmt is not None and self._publisher is not None
        staged = []
        for plan in meta.saves:
            bs, writes = self.layout.block_size, self.heads.writes
            nbytes = staged_bytes(self._fmt, plan.objects, bs, len(writes))
            if not self._publisher.reserve(nbytes):
                self._counters.add(saves_dropped=len(plan.objects))
                self._warn.warn(
                    "dropped",
                    "kvdepot: staging full (%d bytes); a save is dropped",
                    self.settings.save_buffer_bytes,
                )
                continue
            groups = stage(self._fmt, plan.objects, bs, writes, self._digest, pinned=pinned)
            staged.append((plan.req_id, groups, nbytes))
        return staged

    def wait_for_save(self, meta: KVDepotConnectorMetadata | None) -> None:
        if meta is not None and meta.skipped and self.is_producer:
            self._counters.add(chunks_skipped=meta.skipped)
        staged, self._staged = self._staged, None
        if not staged:
            return
        assert self._publisher is not None
        copied: Callable[[], None] | None = None
        if self._stream is not None and any(
            g.pinned is not None for _, gs, _ in staged for g in gs
        ):
            done = self._stream.record_event()
            # The next step may reuse these blocks: its kernels wait for the
            # copy-out on the device; the publisher waits for it on its thread.
            torch.cuda.current_stream(self._stream.device).wait_event(done)
            copied = done.synchronize
        for req_id, groups, nbytes in staged:
            self._publisher.submit(req_id, groups, nbytes, copied)

    # -------------------------------------------------------- completions
    def get_finished(self) -> tuple[set[str], set[str]]:
        """Requests whose asynchronous load ended (loaded, failed or late),
        and of those the ones to recompute whole (several KV cache groups)."""
        forward, self._forward_ran = self._forward_ran, False
        if self._fetcher is not None and self._fetcher.pending():
            if not forward:
                # Nothing but loads in flight: vLLM's loop would spin on
                # empty steps, taking a core from the transfers themselves.
                self._fetcher.wait_any(_IDLE_WAIT_S)
            for job in self._fetcher.poll():
                self._finish_async(job)
        done, self._recved = self._recved, set()
        failed, self._failed = self._failed, set()
        return done, failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        # Called once per step after the forward pass: every layer was used.
        self._finish_sync_load()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def wait_published(self, timeout_s: float) -> bool:
        return self._publisher is None or self._publisher.wait_idle(timeout_s)

    def shutdown(self) -> None:
        deadline = time.monotonic() + 5.0
        if self._publisher is not None:
            self._publisher.close(max(0.0, deadline - time.monotonic()))
        if self._fetcher is not None:
            self._fetcher.close()
        if self._loader is not None:
            self._loader.close()


__all__ = ["WorkerSide"]


def _source(plans: Sequence[LoadPlan]) -> str:
    """The source loads fetched together are timed under: theirs where they
    share one, else none ("": a step's in-step loads from several stores)."""
    sources = {p.source.label for p in plans}
    return sources.pop() if len(sources) == 1 else ""
