"""``KVDepotLMCacheConnector``: LMCache's remote connector interface on kvdepot.

LMCache's ``RemoteBackend`` calls a remote connector's coroutines on its own
event loop thread. Every kvdepot call blocks (gRPC to the metadata service,
then the data plane), so each runs on this connector's small thread pool and
the loop only awaits it: a slow or dead store never stalls LMCache's loop.

Failures follow LMCache's contract for remote connectors: a chunk that cannot
be read (missing, evicted, on a store that died, corrupt, or the metadata
service unreachable) is a miss, ``None`` / ``False`` / ``0``; a put that fails
is logged and dropped. None of them raises into LMCache.

Batches take one metadata round trip (``Lookup`` for a read, ``PutStart`` and
``PutEnd`` for a write) and one data-plane request per store. A batched read
returns the leading chunks that are stored, as every LMCache retrieval is a
prefix; keys after the first miss are misses.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from kvdepot.connector.client import ClientConfig, KVDepotClient
from kvdepot.connector.lmcache.encoding import (
    ChunkGeometry,
    FramedChunks,
    MemoryObj,
    RawChunks,
    release,
)
from kvdepot.connector.lmcache.engine_keys import chunk_key
from kvdepot.connector.lmcache.namespace import register as register_namespace
from kvdepot.connector.lmcache.settings import PluginSettings, resolve
from kvdepot.errors import InvalidArgument, KVDepotError
from kvdepot.keys import ChunkKey

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Errors that mean "kvdepot could not do it": reported as misses. Anything
# else is a bug and propagates.
_SOFT_ERRORS = (KVDepotError, OSError)
_WARN_INTERVAL_S = 10.0


class KVDepotLMCacheConnector(RemoteConnector):
    """LMCache remote connector storing chunks in a kvdepot cluster."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        local_cpu_backend: Any,
        config: Any,
        metadata: Any = None,
        settings: PluginSettings | None = None,
    ) -> None:
        """Connect to kvdepot (lazily: the metadata service may come up later).

        Args:
            loop: LMCache's event loop, which calls the coroutines.
            local_cpu_backend: LMCache's ``LocalCPUBackend``: read chunks are
                allocated from it.
            config: LMCache's ``LMCacheEngineConfig``.
            metadata: LMCache's ``LMCacheMetadata``; by default the backend's.
            settings: Where kvdepot is; by default found in ``config``
                (see :func:`kvdepot.connector.lmcache.settings.resolve`).

        Raises:
            InvalidArgument: kvdepot is not (or wrongly) configured.
        """
        metadata = (
            metadata if metadata is not None else getattr(local_cpu_backend, "metadata", None)
        )
        if metadata is None:
            raise InvalidArgument("LMCache gave the kvdepot connector no engine metadata")
        super().__init__(config, metadata)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.settings = settings or resolve(
            "", config.extra_config, plugins=tuple(config.remote_storage_plugins or ())
        )
        # The naive serde hands over the engine's chunk objects as they are, so
        # their layout is the configured one; other serdes and layer-wise
        # storage produce objects the configuration does not describe.
        if config.remote_serde == "naive" and not config.use_layerwise:
            self.chunks: RawChunks | FramedChunks = RawChunks(
                ChunkGeometry(
                    tuple(self.meta_shapes),
                    tuple(self.meta_dtypes),
                    self.meta_fmt,
                    self.full_chunk_size_bytes,
                    self.single_token_size,
                ),
                self._allocate,
                self.reshape_partial_chunk,
            )
        else:
            self.chunks = FramedChunks(self.remote_metadata_bytes, self._allocate)
        self._client = KVDepotClient(
            ClientConfig(
                metadata=self.settings.metadata,
                node_id=self.settings.node_id,
                transport=self.settings.transport,
                tokens_per_chunk=int(getattr(config, "chunk_size", 0) or 0),
                rpc_timeout_s=self.settings.rpc_timeout_s,
                io_timeout_s=self.settings.io_timeout_s,
                # LMCache loads this class: like a command, it reads the environment.
                security=self.settings.security(os.environ),
            )
        )
        self._pool = ThreadPoolExecutor(
            self.settings.io_threads, thread_name_prefix="kvdepot-lmcache"
        )
        self._closed = False
        self._pool.submit(register_namespace, self._client, metadata, config, self.chunks.encoding)
        self._warned: dict[str, float] = {}
        self._warn_lock = threading.Lock()
        logger.info(
            "kvdepot LMCache connector: metadata %s, %s chunks of %d bytes, transport %s",
            self.settings.metadata,
            self.chunks.encoding,
            self.full_chunk_size_bytes,
            self.settings.transport,
        )

    def __repr__(self) -> str:
        return f"<KVDepotLMCacheConnector {self.settings.metadata}>"

    # -- plumbing -----------------------------------------------------------------
    def _allocate(self, shapes: Any, dtypes: Any, fmt: Any) -> MemoryObj | None:
        # No busy loop: waiting for LMCache to free memory could wait forever
        # on a pool thread; a chunk that does not fit now is a miss.
        return self.local_cpu_backend.allocate(shapes, dtypes, fmt, eviction=True, busy_loop=False)

    def _key(self, key: Any) -> ChunkKey:
        return chunk_key(key, self.chunks.encoding)

    def _warn(self, what: str, exc: BaseException, outcome: str = "treated as a miss") -> None:
        # A dead store makes every call fail the same way: say so now and then.
        now = time.monotonic()
        with self._warn_lock:
            if now - self._warned.get(what, -_WARN_INTERVAL_S) < _WARN_INTERVAL_S:
                return
            self._warned[what] = now
        logger.warning("kvdepot %s failed (%s): %s", what, outcome, exc)

    async def _run(
        self,
        fn: Callable[..., T],
        *args: Any,
        closed: T,
        abandon: Callable[[T], None] | None = None,
    ) -> T:
        """Run a blocking call on the pool.

        Args:
            fn: The call; it reports kvdepot's failures as misses itself.
            args: Its arguments.
            closed: What to answer once the connector is closed.
            abandon: Frees the call's result if nobody awaits it any more.
        """
        try:
            job: Future[T] = self._pool.submit(fn, *args)
        except RuntimeError:  # the pool is shut down: the connector is closed
            return closed
        try:
            return await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            # LMCache cancels reads that ran past its timeout; the thread may
            # still finish and hand back memory objects nobody will release.
            if abandon is not None:
                cleanup = abandon

                def _done(f: Future[T]) -> None:
                    if not f.cancelled() and f.exception() is None:
                        cleanup(f.result())

                job.add_done_callback(_done)
            raise

    # -- lookups --------------------------------------------------------------------
    def _count(self, keys: Sequence[Any]) -> int:
        if not keys:
            return 0
        try:
            return self._client.lookup([self._key(k) for k in keys])
        except _SOFT_ERRORS as exc:
            self._warn("lookup", exc)
            return 0

    async def exists(self, key: Any) -> bool:
        return await self._run(self._count, [key], closed=0) == 1

    def exists_sync(self, key: Any) -> bool:
        return self._count([key]) == 1

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[Any]) -> int:
        return self._count(keys)

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(
        self, lookup_id: str, keys: list[Any], pin: bool = False
    ) -> int:
        # kvdepot reads take a lease of their own; there is nothing to pin.
        return await self._run(self._count, keys, closed=0)

    # -- reads ------------------------------------------------------------------------
    def _get(self, keys: Sequence[Any]) -> list[MemoryObj | None]:
        if not keys:
            return []
        try:
            return self.chunks.get(self._client, [self._key(k) for k in keys])
        except _SOFT_ERRORS as exc:
            self._warn("get", exc)
            return [None] * len(keys)

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[Any]) -> list[MemoryObj | None]:
        return await self._run(self._get, keys, closed=[None] * len(keys), abandon=release)

    async def get(self, key: Any) -> MemoryObj | None:
        return (await self.batched_get([key]))[0]

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[Any]) -> list[MemoryObj]:
        got = await self.batched_get(keys)
        n = next((i for i, obj in enumerate(got) if obj is None), len(got))
        release(got[n:])
        return [obj for obj in got[:n] if obj is not None]

    # -- writes -----------------------------------------------------------------------
    def _put(self, keys: Sequence[Any], objs: Sequence[MemoryObj]) -> bool:
        # True: ran (and released ``objs``), whatever became of the chunks.
        try:
            ckeys: list[ChunkKey] = []
            bufs: list[Any] = []
            for key, obj in zip(keys, objs, strict=True):
                try:
                    bufs.append(self.chunks.payload(obj))
                    ckeys.append(self._key(key))
                except InvalidArgument as exc:
                    self._warn("put of an unsupported object", exc, "skipped")
            if not ckeys:
                return True
            result = self._client.put(ckeys, bufs)
            if result.failed:
                self._warn(
                    "put", KVDepotError(f"{result.failed} of {len(ckeys)} chunks"), "not stored"
                )
        except _SOFT_ERRORS as exc:
            self._warn("put", exc, "not stored")
        finally:
            release(objs)
        return True

    def _hold(self, objs: Sequence[MemoryObj]) -> None:
        # LMCache drops its reference once put() returns or is cancelled; the
        # pool thread keeps one until it has sent the bytes, so they are never
        # freed (and reused) mid-send.
        for obj in objs:
            obj.ref_count_up()

    async def put(self, key: Any, memory_obj: MemoryObj) -> None:
        await self.batched_put([key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[Any], memory_objs: list[MemoryObj]) -> None:
        self._hold(memory_objs)
        if not await self._run(self._put, list(keys), list(memory_objs), closed=False):
            release(memory_objs)

    # -- the rest of the interface ----------------------------------------------------
    def remove_sync(self, key: Any) -> bool:
        # Chunks leave kvdepot by eviction only; a client cannot delete them.
        return False

    async def list(self) -> list[str]:
        # Keys are digests: there are no names to list.
        return []

    def support_ping(self) -> bool:
        return True

    def _ping(self) -> int:
        try:
            self._client.stats()
            return 0
        except _SOFT_ERRORS as exc:
            self._warn("ping", exc, "reported unhealthy")
            return 1

    async def ping(self) -> int:
        return await self._run(self._ping, closed=1)

    def _close(self) -> None:
        self._pool.shutdown(wait=True)
        self._client.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Waits for puts in flight; off the loop, which they may still need.
        await asyncio.get_running_loop().run_in_executor(None, self._close)
        logger.info("kvdepot LMCache connector closed")


# The class's name before vLLM's connector took the same one; LMCache configs
# written then still say ``class_name: KVDepotConnector``.
KVDepotConnector = KVDepotLMCacheConnector
