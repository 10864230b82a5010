"""Background transfers: asynchronous loads into staging, and publishing.

Neither ever blocks the engine's thread. A load is fetched and verified into
private staging buffers on a worker thread; the engine's thread copies a
finished load into the request's blocks (so a load given up at its deadline
can never write into blocks that were freed meanwhile). Saves are copied out
of the cache inside the step, then published by a thread of their own; the
staging memory they hold is bounded, and a save that does not fit is dropped
and counted.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import numpy as np

from kvdepot.connector.client import KVDepotClient
from kvdepot.connector.vllm.chunk_format import FULL_PART
from kvdepot.connector.vllm.loader import write_header
from kvdepot.connector.vllm.objects import Geometry, ObjectFormat, StagedGroup, stage
from kvdepot.connector.vllm.plan import LoadPlan
from kvdepot.connector.vllm.stats import Counters
from kvdepot.errors import KVDepotError
from kvdepot.keys import ChunkKey
from kvdepot.repeat_log import RepeatLog

logger = logging.getLogger(__name__)

_POLL_FIRST_S = 0.005
_POLL_MAX_S = 0.05


@dataclass
class FetchJob:
    """One request's asynchronous load."""

    plan: LoadPlan
    groups: list[StagedGroup]
    deadline: float
    future: Future[int] | None = None
    ok: int = 0  # leading objects fetched and verified
    timed_out: bool = False
    error: str = ""
    fetch_s: float = 0.0  # how long fetching and verifying took


class Fetcher:
    """Fetches loads on background threads, each within its deadline."""

    def __init__(
        self,
        client: KVDepotClient,
        fmt: ObjectFormat,
        warn: RepeatLog,
        threads: int = 2,
        *,
        block_size: int = 1,
        heads: Sequence[int] = (0,),
        digest: bytes = b"",
    ) -> None:
        self._client = client
        self._fmt = fmt
        self._block_size = block_size
        self._heads = tuple(heads)
        self._digest = digest
        self._warn = warn
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvdepot-fetch")
        self._jobs: list[FetchJob] = []

    def submit(self, plan: LoadPlan, timeout_s: float) -> FetchJob:
        groups = stage(self._fmt, plan.objects, self._block_size, self._heads, self._digest)
        job = FetchJob(plan, groups, time.monotonic() + timeout_s)
        job.future = self._pool.submit(self._run, job)
        self._jobs.append(job)
        return job

    def pending(self) -> int:
        return len(self._jobs)

    def wait_any(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` until a job finishes (an idle engine
        step calls this instead of spinning while its loads are in flight)."""
        futures = [j.future for j in self._jobs if j.future is not None]
        if futures:
            deadline = min(j.deadline for j in self._jobs)
            wait(futures, max(0.0, min(timeout_s, deadline - time.monotonic())), FIRST_COMPLETED)

    def poll(self) -> list[FetchJob]:
        """Jobs that finished or ran out of time since the last call."""
        now = time.monotonic()
        out: list[FetchJob] = []
        keep: list[FetchJob] = []
        for job in self._jobs:
            fut = job.future
            assert fut is not None
            if fut.done():
                try:
                    job.ok = fut.result()
                except Exception as exc:  # never leave the request waiting
                    job.ok, job.error = 0, repr(exc)
                out.append(job)
            elif now >= job.deadline:
                # Abandoned: its thread may still write into the staging
                # buffers, which nothing else uses.
                fut.cancel()
                job.ok, job.timed_out = 0, True
                out.append(job)
            else:
                keep.append(job)
        self._jobs = keep
        return out

    def _run(self, job: FetchJob) -> int:
        plan = job.plan
        nh = len(self._heads)
        # One row per (object, head), in the plan's order.
        keys: list[ChunkKey] = [b""] * (len(plan.objects) * nh)  # type: ignore[list-item]
        rows: list[np.ndarray | None] = [None] * len(keys)
        geos: list[Geometry | None] = [None] * len(keys)
        for g in job.groups:
            for pos, i in enumerate(g.index):
                for j in range(nh):
                    rows[i * nh + j] = g.rows[pos * nh + j]
                    keys[i * nh + j] = g.keys[pos * nh + j]
                    geos[i * nh + j] = g.geometry
        try:
            if plan.wait_for_commit and not self._wait_committed(keys, job.deadline):
                return 0
            started = time.monotonic()
            prefer = plan.source.address or None
            result = self._client.get_into(keys, rows, count="none", prefer=prefer)
        except KVDepotError as exc:
            self._warn.warn("load", "kvdepot load of %s failed: %s", plan.req_id, exc)
            return 0
        ok = 0
        for i, loaded in enumerate(result.loaded):
            geo, row = geos[i], rows[i]
            assert geo is not None and row is not None
            if not loaded or result.sizes[i] != geo.size:
                break
            if not self._fmt.verify(row, geo):
                self._warn.warn("verify", "kvdepot: an object of %s fails its checks", plan.req_id)
                break
            ok += 1
        job.fetch_s = time.monotonic() - started
        return ok // nh  # objects with every head

    def _wait_committed(self, keys: list[ChunkKey], deadline: float) -> bool:
        """Poll until every key is listed (the prefill is still publishing)."""
        pause = _POLL_FIRST_S
        while True:
            try:
                if self._client.lookup(keys, count="none") >= len(keys):
                    return True
            except KVDepotError:
                pass
            if time.monotonic() + pause >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class _Publish:
    req_id: str
    groups: list[StagedGroup]
    nbytes: int
    copied: Callable[[], None] | None = None  # waits until the staging is filled
    started: float = field(default_factory=time.monotonic)


class Publisher:
    """Publishes staged saves on a thread of its own, within a memory budget."""

    def __init__(
        self,
        client: KVDepotClient,
        fmt: ObjectFormat,
        budget_bytes: int,
        counters: Counters,
        warn: RepeatLog,
    ) -> None:
        self._client = client
        self._fmt = fmt
        self._budget = budget_bytes
        self._counters = counters
        self._warn = warn
        self._lock = threading.Lock()
        self._held = 0
        self._idle = threading.Condition(self._lock)
        self._queue: queue.SimpleQueue[_Publish | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="kvdepot-publish", daemon=True)
        self._thread.start()

    def reserve(self, nbytes: int) -> bool:
        """Take ``nbytes`` of staging, or refuse at once when they do not fit."""
        with self._lock:
            if self._held + nbytes > self._budget:
                return False
            self._held += nbytes
            return True

    def submit(
        self,
        req_id: str,
        groups: list[StagedGroup],
        nbytes: int,
        copied: Callable[[], None] | None = None,
    ) -> None:
        self._queue.put(_Publish(req_id, groups, nbytes, copied))

    def release(self, nbytes: int) -> None:
        with self._lock:
            self._held -= nbytes
            if self._held == 0:
                self._idle.notify_all()

    def held(self) -> int:
        with self._lock:
            return self._held

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until everything submitted was published (tests, shutdown)."""
        with self._lock:
            return self._idle.wait_for(lambda: self._held == 0, timeout_s)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._publish(item)
            except Exception:  # the thread must outlive any one save
                logger.exception("kvdepot publish crashed")
            finally:
                self.release(item.nbytes)

    def _publish(self, item: _Publish) -> None:
        if item.copied is not None:
            item.copied()  # a GPU's copy into the pinned staging
        for g in item.groups:
            geo = g.geometry
            write_header(g.rows, geo.layers, geo.layer_bytes, geo.codec_header)
            keys = g.keys
            try:
                r = self._client.put(keys, list(g.rows))
            except KVDepotError as exc:
                self._warn.warn("publish", "kvdepot publish of %s failed: %s", item.req_id, exc)
                self._counters.add(save_errors=len(keys))
                continue
            # Written into this node's store, the index commit following.
            # Counted per chunk (or tail unit), whatever its heads and parts:
            # with tensor parallelism each rank counts its share.
            counted = max(1, g.heads) if geo.part == FULL_PART else 0
            self._counters.add(
                chunks_saved=(r.stored + r.pending) // counted if counted else 0,
                bytes_saved=r.bytes_sent + r.bytes_pending,
                chunks_skipped=r.skipped // counted if counted else 0,
                save_errors=r.failed,
            )

    def close(self, timeout_s: float = 5.0) -> None:
        """Publish what is queued (up to ``timeout_s``), then stop."""
        self.wait_idle(timeout_s)
        self._queue.put(None)
        self._thread.join(timeout=1.0)
