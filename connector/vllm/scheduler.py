"""The scheduler side: how much of a request kvdepot holds, what to load and save.

Nothing here waits on kvdepot for longer than ``lookup_timeout_max_s``: a
new request's lookup has a deadline that follows the measured lookup latency
(:mod:`kvdepot.connector.vllm.lookups`), and after ``lookup_breaker_after``
failures in a row a breaker keeps later requests from calling at all for
``lookup_breaker_s`` (doubling while failures continue). Loads are
asynchronous (the request waits in ``WAITING_FOR_REMOTE_KVS`` while the
batch keeps running, and the workers report it in ``get_finished``) unless
:class:`LoadPacer` expects one to take less than a step; such a load runs
inside the step, with a deadline of two.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from kvdepot.connector.client import KVDepotClient
from kvdepot.connector.vllm.chunk_format import (
    FULL_PART,
    WINDOW_PART,
    head_key,
    part_key,
    tail_tokens,
    window_tokens,
)
from kvdepot.connector.vllm.layout import CacheGroups, KVLayout
from kvdepot.connector.vllm.lookups import LookupBreaker, LookupDeadline
from kvdepot.connector.vllm.namespace_report import report_served
from kvdepot.connector.vllm.pacing import LoadPacer
from kvdepot.connector.vllm.plan import (
    KVDepotConnectorMetadata,
    KVObject,
    LoadPlan,
    PrefixKeys,
    SavePlan,
    Source,
    prefix_keys,
    tail_keys,
)
from kvdepot.connector.vllm.settings import ConnectorSettings
from kvdepot.connector.vllm.stats import SOURCES_KEY, Counters
from kvdepot.keys import ChunkKey, Namespace
from kvdepot.repeat_log import RepeatLog
from kvdepot.types import Replica

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

# A prefill engine names the tokens it published in its response's
# kv_transfer_params; a decode engine given them waits for those tokens.
PD_TOKENS_PARAM = "kvdepot_tokens"
_LOOKUP_REUSE_S = 2.0  # a request that could not be scheduled asks again
_CONNECT_S = 5.0
_NO_CUT = 1 << 62  # every run of the hit pays


@dataclass
class _Request:
    request: Request
    chunks: list[ChunkKey] = field(default_factory=list)
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group
    saved_chunks: int = 0  # leading chunks published or known stored
    saved_tail: int = 0  # tail blocks published after them
    hit_tokens: int = 0  # tokens the last lookup found
    looked_up: float = -1e9
    wait_for_commit: bool = False
    # (first token, end token, in-step deadline or None: asynchronous)
    load: tuple[int, int, float | None] | None = None
    loading: frozenset[int] = frozenset()  # blocks of the load under way
    load_failed: bool = False  # then the request recomputes: no second try
    decline_counted: bool = False
    skip_counted: bool = False
    paying: int | None = None  # where its load ends: what follows is slower to load than compute
    sources: tuple[Source, ...] = ()  # per hit chunk, where the lookup found it


class SchedulerSide:
    """The connector's scheduler role."""

    def __init__(
        self,
        settings: ConnectorSettings,
        layout: KVLayout,
        namespace: Namespace,
        client: KVDepotClient,
        *,
        kv_role: str,
        is_producer: bool,
        is_consumer: bool,
        counters: Counters,
        groups: CacheGroups | None = None,
    ) -> None:
        self.settings = settings
        self.layout = layout
        self.groups = groups or CacheGroups()
        self.ns = namespace
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        self.save_decode = settings.saves_decode(kv_role)
        self._counters = counters
        self._client = client
        self._warn = RepeatLog(logger)
        # A chunk hits only when every KV head of it is stored.
        digest = namespace.digest()
        heads = [partial(head_key, digest, head=h) for h in range(1, layout.total_kv_heads)]
        if self.groups.window:
            # ... and every head of its window part.
            heads += [
                partial(part_key, digest, head=h, part=WINDOW_PART)
                for h in range(layout.total_kv_heads)
            ]
        self._tail = tail_tokens(namespace.chunk_tokens)
        self._breaker = LookupBreaker(
            client,
            LookupDeadline(settings.lookup_timeout_s, settings.lookup_ceiling_s()),
            settings.lookup_breaker_s,
            settings.lookup_breaker_after,
            self._warn,
            heads,
        )
        self._requests: dict[str, _Request] = {}
        self._loads: list[LoadPlan] = []
        self._pacer = LoadPacer(settings.sync_load_tokens(), settings.load_timeout_s)
        # Connected at engine start, so the first lookups' short deadline is
        # not spent on the connection; a service down now is a miss later.
        if not client.connect(_CONNECT_S):
            logger.warning("kvdepot metadata %s not reachable at start", settings.metadata)

    # -------------------------------------------------------------- lookups
    def _state(self, request: Request) -> _Request:
        state = self._requests.get(request.request_id)
        if state is None:
            state = _Request(request)
            self._requests[request.request_id] = state
        return state

    def _keys(self, state: _Request, tokens: list[int]) -> PrefixKeys:
        keys = prefix_keys(self.ns, tokens, self._tail, with_tail=True, chunks=state.chunks)
        state.chunks = list(keys.chunks)
        return keys

    def _lookup(self, state: _Request, tokens: list[int]) -> int:
        """Tokens of ``tokens`` kvdepot holds (leading chunks, then tail blocks)."""
        keys = self._keys(state, tokens)
        if not keys.chunks and not keys.tail:
            return 0
        # A request looked up again (it waited) is counted once by the cluster.
        repeat = state.looked_up > 0
        answer = self._breaker.lookup(keys, self._counters, repeat=repeat)
        if answer is None:
            return 0
        hits = answer.hits
        state.sources = tuple(_source(loc.replicas) for loc in answer.locations[: len(keys.chunks)])
        found = keys.tokens_of(hits)
        if hits < len(keys.chunks) and self._tail < self.ns.chunk_tokens:
            # Chunk `hits` is missing, but units of it may be stored: the
            # tail of an earlier, shorter sequence (the last turn of a chat).
            more = tail_keys(self.ns, tokens, self._tail, hits, keys.chunks)
            extra = self._breaker.lookup_more(more, self._tail, repeat=repeat)
            found = hits * self.ns.chunk_tokens + extra * self._tail
        # The engine loads whole blocks of it.
        usable = found // self.layout.block_size * self.layout.block_size
        if not repeat:
            self._counters.add(lookup_hit_tokens=usable)
        return usable

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        state = self._state(request)
        if state.load_failed:
            # Asked again after its load failed (vLLM resets the request): a
            # second try would likely fail the same way, so it recomputes.
            if not state.decline_counted:
                state.decline_counted = True
                self._counters.add(loads_declined_failed=1)
            return 0, False
        tokens = list(request.all_token_ids)
        now = time.monotonic()
        if now - state.looked_up > _LOOKUP_REUSE_S:
            state.hit_tokens = self._lookup(state, tokens)
            state.looked_up = now
            state.wait_for_commit = False
            announced = self._announced(request, len(tokens))
            if announced > state.hit_tokens:
                state.hit_tokens = announced
                state.wait_for_commit = True
        hit = state.hit_tokens
        # What the lookup found is stored: never publish it again.
        known_chunks = min(hit // self.ns.chunk_tokens, len(state.chunks))
        if known_chunks > state.saved_chunks:
            state.saved_chunks, state.saved_tail = known_chunks, 0
        if known_chunks == state.saved_chunks:
            tail = (hit - known_chunks * self.ns.chunk_tokens) // self._tail
            state.saved_tail = max(state.saved_tail, tail)
        if not self.is_consumer:
            return 0, False
        hit = self._paying(state, num_computed_tokens, hit, now)
        deadline = self._in_step(state, hit, num_computed_tokens, len(tokens), now)
        if deadline is not None:
            # Inside the step whole chunks are loaded, and one prompt token
            # must be left for the engine to compute.
            c = self.ns.chunk_tokens
            hit = min(hit // c, (len(tokens) - 1) // c) * c
        external = hit - num_computed_tokens
        if external <= 0:
            state.load = None
            return 0, False
        state.load = (num_computed_tokens, hit, deadline)
        return external, deadline is None

    def _paying(self, state: _Request, computed: int, hit: int, now: float) -> int:
        """The end of the leading part of the load of ``computed..hit`` that
        is expected to beat computing it (decided once a request)."""
        if state.paying is None:
            if hit <= computed or not self.settings.cost_gate:
                return hit
            state.paying = self._judge(state, computed, hit, now)
        return min(hit, state.paying)

    def _judge(self, state: _Request, computed: int, hit: int, now: float) -> int:
        """Where the load of ``computed..hit`` is cut: before the first run
        of its chunks from one source that is slower to load than to compute
        (counted once; that run may still be fetched, as its source's probe)."""
        for start, end, source in self._runs(state, computed, hit):
            if self._pacer.pays(end - start, now, source.label):
                continue
            bs = self.layout.block_size
            cut = max(computed, start // bs * bs)
            self._counters.add(
                loads_declined_cost=int(cut == computed),
                loads_cut_cost=int(cut > computed),
                tokens_declined_cost=hit - cut,
            )
            if self._pacer.take_probe(source.label):
                self._loads.append(self._load_plan(state, start, end, None, probe=True))
                self._counters.add(loads_probed=1)
            return cut
        return _NO_CUT

    def _runs(self, state: _Request, first: int, end: int) -> list[tuple[int, int, Source]]:
        """``first..end`` as runs of chunks from one source each (tail units
        count as the last chunk found: one writer published both)."""
        c, known = self.ns.chunk_tokens, state.sources
        runs: list[tuple[int, int, Source]] = []
        pos = first
        while pos < end:
            i = pos // c
            source = known[min(i, len(known) - 1)] if known else Source()
            stop = min(end, (i + 1) * c)
            if runs and runs[-1][2] == source:
                runs[-1] = (runs[-1][0], stop, source)
            else:
                runs.append((pos, stop, source))
            pos = stop
        return runs

    def _in_step(
        self, state: _Request, hit: int, computed: int, num_tokens: int, now: float
    ) -> float | None:
        """The deadline of loading ``computed..hit`` inside the step, or None
        to load it asynchronously."""
        # With several KV cache groups vLLM takes a failed load only as a
        # whole request (failed_recving), which in-step loads lack.
        if state.wait_for_commit or self.groups.count > 1:
            return None
        c = self.ns.chunk_tokens
        whole = min(hit // c, (num_tokens - 1) // c) * c
        if whole <= computed:
            return None
        if whole < hit and self.settings.sync_load_tokens() is None:
            # In the step the tail blocks would be recomputed: not worth it.
            return None
        return self._pacer.in_step(whole - computed, now)

    def _announced(self, request: Request, num_tokens: int) -> int:
        """Tokens a prefill engine said it published for this request."""
        params = getattr(request, "kv_transfer_params", None)
        if not self.settings.pd_wait or not isinstance(params, dict):
            return 0
        value = params.get(PD_TOKENS_PARAM)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            return 0
        bs = self.layout.block_size
        return min(value, num_tokens) // bs * bs

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens <= 0 or state.load is None:
            return
        first, _, deadline = state.load
        asynchronous = deadline is None
        state.load = None
        # The scheduler may have trimmed the hit (to a block boundary, say).
        end = first + num_external_tokens
        state.block_ids = [list(g) for g in blocks.get_block_ids()]
        plan = self._load_plan(state, first, end, deadline)
        if asynchronous:
            # A synchronous load's failed blocks are simply recomputed in its
            # step; an asynchronous one's failure makes vLLM ask again.
            state.loading = frozenset(b for o in plan.objects for b in o.blocks[0])
        if plan.objects:
            self._loads.append(plan)
            self._counters.add(**{"loads_async" if asynchronous else "loads_sync": 1})

    def _object(
        self, state: _Request, key: ChunkKey, start: int, n: int, part: int = FULL_PART
    ) -> KVObject:
        """The object of ``key`` over the request's tokens ``start..+n``."""
        bs = self.layout.block_size
        first, last = start // bs, (start + n - 1) // bs + 1
        groups = tuple(tuple(ids[first:last]) for ids in state.block_ids)
        return KVObject(key, first, groups, start, n, part)

    def _parts(self, state: _Request, key: ChunkKey, start: int, n: int) -> list[KVObject]:
        """The objects of chunk (or tail unit) ``key``: its full part, and with
        a sliding-window group its window part (its last window of tokens)."""
        objects = [self._object(state, key, start, n)]
        if self.groups.window:
            w = window_tokens(n, self.groups.window)
            objects.append(self._object(state, key, start + n - w, w, WINDOW_PART))
        return objects

    def _load_plan(
        self, state: _Request, first: int, end: int, deadline: float | None, probe: bool = False
    ) -> LoadPlan:
        """The load of tokens ``first..end``; a ``probe`` (no blocks yet: it
        is never written) reads the objects' full parts."""
        c, bs, u = self.ns.chunk_tokens, self.layout.block_size, self._tail
        tokens = list(state.request.all_token_ids)
        objects: list[KVObject] = []
        full = end // c
        for i in range(first // c, full):
            objects += self._parts(state, state.chunks[i], i * c, c)
        if end > full * c:
            tail = tail_keys(self.ns, tokens[:end], u, full, state.chunks)
            for j, key in enumerate(tail):
                if full * c + (j + 1) * u > first:
                    objects += self._parts(state, key, full * c + j * u, u)
        # A window part is read only where the engine keeps blocks of its
        # tokens in a sliding-window group (the last window of the hit).
        sliding = self.groups.part_groups(WINDOW_PART)
        objects = [o for o in objects if o.part == FULL_PART or (not probe and o.touches(sliding))]
        return LoadPlan(
            state.request.request_id,
            tuple(objects),
            first // bs,
            deadline is None,
            state.wait_for_commit and not probe,
            deadline or 0.0,
            end,
            probe,
            self._source(state, first, end),
        )

    def _source(self, state: _Request, first: int, end: int) -> Source:
        """Where most of the tokens ``first..end`` live."""
        held: Counter[Source] = Counter()
        for start, stop, source in self._runs(state, first, end):
            held[source] += stop - start
        return held.most_common(1)[0][0] if held else Source()

    # ---------------------------------------------------------------- steps
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVDepotConnectorMetadata:
        self._pacer.step(time.monotonic(), scheduler_output.total_num_scheduled_tokens)
        meta = KVDepotConnectorMetadata(loads=self._loads)
        self._loads = []
        scheduled: list[tuple[str, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = [list(g) for g in new.block_ids]
            scheduled.append((new.req_id, new.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                # Preempted and scheduled again: its blocks were all replaced.
                state.block_ids = [list(g) for g in new_ids] if new_ids is not None else []
            elif new_ids is not None:
                if not state.block_ids:
                    state.block_ids = [[] for _ in new_ids]
                for ids, more in zip(state.block_ids, new_ids, strict=True):
                    ids.extend(more)
            scheduled.append((req_id, cached.num_computed_tokens[i]))
        if self.is_producer:
            for req_id, computed in scheduled:
                state = self._requests[req_id]
                if not state.skip_counted:
                    meta.skipped += state.saved_chunks
                    state.skip_counted = True
                done = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
                save = self._save_plan(state, done)
                if save is not None:
                    meta.saves.append(save)
        return meta

    def _extend_chunks(self, state: _Request, tokens: list[int], n: int) -> None:
        """Make sure the request's chunk keys cover its first ``n`` chunks."""
        if len(state.chunks) < n:
            c = self.ns.chunk_tokens
            keys = prefix_keys(
                self.ns,
                tokens[: n * c],
                self.layout.block_size,
                with_tail=False,
                chunks=state.chunks,
            )
            state.chunks = list(keys.chunks)

    def _save_plan(self, state: _Request, done: int) -> SavePlan | None:
        """The objects of a request that are complete once this step is done."""
        bs, c, u = self.layout.block_size, self.ns.chunk_tokens, self._tail
        request = state.request
        limit = len(request.all_token_ids) if self.save_decode else request.num_prompt_tokens
        # Computed tokens in allocated blocks (a unit may end inside a block).
        ready = min([min(done, limit), *(len(ids) * bs for ids in state.block_ids)])
        chunks = ready // c
        objects: list[KVObject] = []
        tokens: list[int] | None = None
        if chunks > state.saved_chunks:
            tokens = list(request.all_token_ids)
            self._extend_chunks(state, tokens, chunks)
            for j in range(state.saved_chunks, chunks):
                objects += self._parts(state, state.chunks[j], j * c, c)
            state.saved_chunks, state.saved_tail = chunks, 0
        tail = (ready - state.saved_chunks * c) // u
        if self.settings.save_tail and u < c and tail > state.saved_tail:
            tokens = tokens if tokens is not None else list(request.all_token_ids)
            region = state.saved_chunks
            self._extend_chunks(state, tokens, region)
            tkeys = tail_keys(self.ns, tokens[:ready], u, region, state.chunks)
            for j in range(state.saved_tail, min(tail, len(tkeys))):
                objects += self._parts(state, tkeys[j], region * c + j * u, u)
            state.saved_tail = tail
        # A sliding-window group frees the blocks that leave its window (a
        # part holds none of its blocks but those of its window part, which
        # are in the window when it is saved), but an object missing a block
        # must never be stored.
        broken = {o.key for o in objects if not o.whole(self.groups.part_groups(o.part))}
        whole = [o for o in objects if o.key not in broken]
        if broken:
            self._counters.add(saves_dropped=len(broken))
        objects = whole
        if not objects:
            return None
        return SavePlan(request.request_id, tuple(objects))

    def update_connector_output(
        self,
        finished_recving: set[str],
        failed: set[str],
        invalid_blocks: set[int],
        stats: Mapping[str, int] | None = None,
    ) -> None:
        """Note which loads failed, and how long loads took, from the
        workers' report of a step."""
        now = time.monotonic()
        if failed or invalid_blocks:
            self._pacer.failed(now)
        if stats:
            self._counters.add_workers(dict(stats))
            report_served(self._client, stats)
            if stats.get("loads_timed_out", 0) or stats.get("load_errors", 0):
                self._pacer.failed(now)
            self._observe(stats.get(SOURCES_KEY))
        for req_id in (*finished_recving, *failed):
            state = self._requests.get(req_id)
            if state is None or not state.loading:
                continue
            if req_id in failed or state.loading & invalid_blocks:
                state.load_failed = True
            state.loading = frozenset()

    def _observe(self, sources: Any) -> None:
        """The workers' timed and late loads, by source, to the pacer."""
        if not isinstance(sources, Mapping):
            return
        for source, figures in sources.items():
            timed, timed_us, timed_tokens, late, late_us, late_tokens = figures
            self._pacer.observe(timed, timed_us / 1e6, timed_tokens, source)
            self._pacer.late(late, late_us / 1e6, late_tokens, source)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # Saves copy the blocks out inside the step that computed them, so
        # nothing is held: the blocks may be freed now.
        state = self._requests.pop(request.request_id, None)
        if state is None or not self.is_producer:
            return False, None
        tokens = state.saved_chunks * self.ns.chunk_tokens + state.saved_tail * self._tail
        tokens = min(tokens, request.num_prompt_tokens)
        if tokens <= 0:
            return False, None
        return False, {PD_TOKENS_PARAM: tokens}

    def reset_cache(self) -> bool:
        # kvdepot's contents are the cluster's, not this engine's: forget
        # only what this scheduler remembered of earlier lookups.
        for state in self._requests.values():
            state.looked_up = -1e9
        return True


def _source(replicas: Sequence[Replica]) -> Source:
    """A chunk's source: its first replica (the lookup lists this node's first)."""
    first = replicas[0] if replicas else None
    return Source(first.node_id, first.address, first.tier) if first else Source()
