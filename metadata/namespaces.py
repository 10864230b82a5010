"""The namespace RPCs of the metadata service, and its per-namespace tally.

Lookups name their namespace, and clients report their usage of it; what they add to its counters is
tallied in this process (a dict update on the request's path) and written to
the index's namespace store by the reaper, every pass, and before the
namespaces or the cluster's statistics are read.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable, Mapping

import grpc

from kvdepot.errors import InvalidArgument, KVDepotError
from kvdepot.metadata.index import IndexBackend
from kvdepot.metadata.index.namespaces import (
    NamespaceRecord,
    check_client,
    check_fields,
    check_name,
)
from kvdepot.proto.gen import metadata_pb2

logger = logging.getLogger(__name__)

_MAX_PENDING = 4096
"""Namespaces tallied between two flushes at most (others wait for the flush)."""


def lookup_deltas(deltas: Mapping[str, int]) -> dict[str, int]:
    """A lookup's counter increments (``LookupCounting.deltas``) in a namespace's terms."""
    return {
        "lookups": deltas.get("lookups", 0),
        "hit_chunks": deltas.get("hit_keys", 0),
        "miss_chunks": deltas.get("miss_keys", 0),
        "hit_tokens": deltas.get("hit_tokens", 0),
    }


class NamespaceTally:
    """Per-namespace counts not yet written to the index."""

    def __init__(self, index: IndexBackend) -> None:
        self._index = index
        self._pending: defaultdict[str, defaultdict[str, int]] = defaultdict(
            lambda: defaultdict(int)
        )

    def add(self, namespace: str, deltas: Mapping[str, int]) -> None:
        """Count ``deltas`` for ``namespace`` (an unknown name beyond the bound is dropped)."""
        if namespace not in self._pending and len(self._pending) >= _MAX_PENDING:
            return
        counts = self._pending[namespace]
        for name, n in deltas.items():
            if n:
                counts[name] += n

    async def flush(self) -> None:
        """Write the tally to the index (kept for the next flush if that fails)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, defaultdict(lambda: defaultdict(int))
        try:
            await self._index.namespaces.add(pending)
        except BaseException:
            for name, counts in pending.items():
                self.add(name, counts)
            raise


def check_namespace(name: str) -> str:
    """A request's namespace: "" (none) or a digest in hex."""
    return check_name(name) if name else ""


def record_to_proto(r: NamespaceRecord) -> metadata_pb2.NamespaceStats:
    c = r.counters
    return metadata_pb2.NamespaceStats(
        name=r.name,
        fields=[metadata_pb2.NamespaceField(name=n, value=v) for n, v in r.fields],
        chunks_stored=c.get("chunks_stored", 0),
        lookups=c.get("lookups", 0),
        hit_chunks=c.get("hit_chunks", 0),
        miss_chunks=c.get("miss_chunks", 0),
        hit_tokens=c.get("hit_tokens", 0),
        served_tokens=c.get("served_tokens", 0),
        first_seen=r.first_seen,
        last_seen=r.last_seen,
        clients=list(r.clients),
    )


async def namespace_stats(
    index: IndexBackend, tally: NamespaceTally
) -> list[metadata_pb2.NamespaceStats]:
    """Every namespace the index keeps, with this process's tally written first."""
    await tally.flush()
    return [record_to_proto(r) for r in await index.namespaces.list()]


Guard = Callable[[grpc.aio.ServicerContext, KVDepotError], Awaitable[None]]
"""The servicer's error mapping: aborts the call with ``exc``'s status."""


class NamespaceRPCs:
    """``RegisterNamespace``, ``ListNamespaces`` and ``ReportUsage``; the
    servicer answers them through this, giving it the index, its tally and
    its error mapping."""

    def __init__(self, index: IndexBackend, tally: NamespaceTally, guard: Guard) -> None:
        self._index = index
        self.tally = tally
        self._guard = guard

    async def RegisterNamespace(
        self, request: metadata_pb2.RegisterNamespaceRequest, context: grpc.aio.ServicerContext
    ) -> metadata_pb2.RegisterNamespaceResponse:
        try:
            name = check_name(request.name)
            fields = check_fields([(f.name, f.value) for f in request.fields])
            client = check_client(request.client)
            known = await self._index.namespaces.register(name, fields, client)
            if not known:
                logger.info(
                    "namespace %s registered by %s: %s",
                    name,
                    client or "a client",
                    ", ".join(f"{n}={v}" for n, v in fields),
                    extra={"event": "namespace_registered", "namespace": name},
                )
        except KVDepotError as exc:
            await self._guard(context, exc)
        return metadata_pb2.RegisterNamespaceResponse(known=known)

    async def ListNamespaces(
        self, request: metadata_pb2.ListNamespacesRequest, context: grpc.aio.ServicerContext
    ) -> metadata_pb2.ListNamespacesResponse:
        try:
            found = await namespace_stats(self._index, self.tally)
        except KVDepotError as exc:
            await self._guard(context, exc)
        return metadata_pb2.ListNamespacesResponse(namespaces=found)

    async def ReportUsage(
        self, request: metadata_pb2.ReportUsageRequest, context: grpc.aio.ServicerContext
    ) -> metadata_pb2.ReportUsageResponse:
        try:
            name = check_name(request.namespace)
            if max(request.served_tokens, request.stored_chunks) >= 1 << 40:
                raise InvalidArgument("a usage report's counts must be below 2**40")
            self.tally.add(
                name,
                {"served_tokens": request.served_tokens, "chunks_stored": request.stored_chunks},
            )
        except KVDepotError as exc:
            await self._guard(context, exc)
        return metadata_pb2.ReportUsageResponse()
