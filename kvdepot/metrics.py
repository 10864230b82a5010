"""Prometheus ``/metrics`` of the daemons (prometheus-client).

Nothing is counted twice: the collectors read, at scrape time, the same
statistics ``GetStats`` answers over gRPC (``ClusterStats`` on the metadata
service, ``StoreStats`` on a store), so the exposition can never drift from
``kvdepot stats``. Each daemon serves them over HTTP on ``--metrics-port``.

Names are prefixed ``kvdepot_``: ``kvdepot_cluster_*`` from a metadata
service (cluster-wide; several replicas sharing one Redis index report the
same values), ``kvdepot_store_*`` from a store (its own node). Counters end in
``_total``; labels are ``node``, ``tier``, ``result`` (hit, miss),
``direction`` (in: received by the store, out: sent by it), and ``namespace``
(its digest) with ``model`` on the per-namespace series.

The vLLM connector's own counters are on each engine's ``/metrics``
(``vllm:kvdepot_*``, see :mod:`kvdepot.connector.vllm.stats`); alerting
rules over both are in ``deploy/prometheus/``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvdepot.errors import InvalidArgument
from kvdepot.proto.gen import common_pb2, metadata_pb2, store_pb2

logger = logging.getLogger(__name__)

T = TypeVar("T")

_NODE = ("node",)
_NODE_TIER = ("node", "tier")
_NODE_DIRECTION = ("node", "direction")

# (metric, help, StoreStats field) of the store's own counters.
_STORE_COUNTERS = (
    ("kvdepot_store_puts", "Chunks stored by data-plane puts.", "puts"),
    (
        "kvdepot_store_gets",
        "Reads served over the data plane (each range of a chunk read range by range).",
        "gets",
    ),
    ("kvdepot_store_get_misses", "Chunk reads that found nothing.", "get_misses"),
    (
        "kvdepot_store_put_rejected",
        "Chunks refused for lack of space or as invalid.",
        "put_rejected",
    ),
    ("kvdepot_store_corrupt_puts", "Chunks whose payload failed its checksum.", "corrupt_puts"),
    (
        "kvdepot_store_protocol_errors",
        "Connections closed for a malformed or stalled request.",
        "protocol_errors",
    ),
    ("kvdepot_store_connections", "Data-plane connections accepted.", "connections"),
    (
        "kvdepot_store_chunks_corrupt",
        "Chunks dropped because they failed their checksum coming off a tier (SSD).",
        "chunks_corrupt",
    ),
    (
        "kvdepot_store_chunks_recovered",
        "Chunks found in the SSD tier when the store started.",
        "chunks_recovered",
    ),
    (
        "kvdepot_store_tier_write_errors",
        "Chunks lost because a tier could not write them (e.g. disk full).",
        "tier_write_errors",
    ),
)

# (metric suffix, help, TierStats field) of per-tier counters.
_TIER_COUNTERS = (
    (
        "hits",
        "Chunk reads that found their chunk in the tier (once per read, whatever its ranges).",
        "hits",
    ),
    ("misses", "Chunk reads that did not find their chunk in the tier.", "misses"),
    ("evictions", "Chunks dropped from the store to make room in the tier.", "evictions"),
    ("promotions", "Chunks moved from the tier to a faster one.", "promotions"),
    ("demotions", "Chunks moved from the tier to a slower one.", "demotions"),
)

# (metric, help, ClusterStats field) of the metadata service's counters.
_CLUSTER_COUNTERS = (
    ("kvdepot_cluster_lookups", "Lookup requests.", "lookups"),
    ("kvdepot_cluster_puts_committed", "Chunks committed into the index.", "puts_committed"),
    ("kvdepot_cluster_committed_bytes", "Bytes of the chunks committed.", "bytes_committed"),
    (
        "kvdepot_cluster_chunks_deduplicated",
        "Chunks a writer was told not to send because they were stored already.",
        "chunks_deduplicated",
    ),
    ("kvdepot_cluster_saved_bytes", "Bytes not sent thanks to deduplication.", "bytes_saved"),
    (
        "kvdepot_cluster_nodes_expired",
        "Store nodes dropped when their lease ran out.",
        "nodes_expired",
    ),
    (
        "kvdepot_cluster_allocations_expired",
        "Put allocations reclaimed uncommitted.",
        "allocations_expired",
    ),
)


def _serving_metric(serving: bool) -> GaugeMetricFamily:
    return GaugeMetricFamily(
        "kvdepot_serving",
        "1 while the daemon's gRPC health is SERVING (store: it holds a metadata lease; "
        "metadata: its index backend answers), else 0.",
        value=1.0 if serving else 0.0,
    )


class _StatsCollector:
    """Shared part of the collectors: health, then the stats if they can be read."""

    def __init__(self, snapshot: Callable[[], Any], serving: Callable[[], bool]) -> None:
        self._snapshot = snapshot
        self._serving = serving
        self._failing = False

    def collect(self) -> Iterator[Metric]:
        yield _serving_metric(self._serving())
        try:
            stats = self._snapshot()
        except Exception as exc:  # a scrape must answer even when the stats cannot be read
            if not self._failing:
                logger.warning("metrics: statistics unavailable: %s", exc)
            self._failing = True
            return
        self._failing = False
        yield from self._families(stats)

    def _families(self, stats: Any) -> Iterator[Metric]:  # pragma: no cover - abstract
        raise NotImplementedError


class StoreCollector(_StatsCollector):
    """``kvdepot_store_*`` of one store daemon, from its ``StoreStats``.

    Args:
        snapshot: Returns the store's current ``StoreStats``.
        serving: Returns whether the store's health is SERVING.
    """

    def __init__(
        self, snapshot: Callable[[], store_pb2.StoreStats], serving: Callable[[], bool]
    ) -> None:
        super().__init__(snapshot, serving)

    def _families(self, s: store_pb2.StoreStats) -> Iterator[Metric]:
        node = s.node_id
        yield from _tier_gauges("kvdepot_store_tier", [(node, t) for t in s.tiers])
        for suffix, doc, field in _TIER_COUNTERS:
            c = CounterMetricFamily(f"kvdepot_store_tier_{suffix}", doc, labels=_NODE_TIER)
            for t in s.tiers:
                c.add_metric((node, t.name), getattr(t, field))
            yield c
        for name, doc, field in _STORE_COUNTERS:
            c = CounterMetricFamily(name, doc, labels=_NODE)
            c.add_metric((node,), getattr(s, field))
            yield c
        c = CounterMetricFamily(
            "kvdepot_store_transfer_bytes", "Chunk payload bytes moved.", labels=_NODE_DIRECTION
        )
        c.add_metric((node, "in"), s.bytes_in)
        c.add_metric((node, "out"), s.bytes_out)
        yield c
        g = GaugeMetricFamily(
            "kvdepot_store_degraded",
            "1 while the store runs on fewer tiers than it started with (a tier's device "
            "failed; `kvdepot stats` says why), else 0.",
            labels=_NODE,
        )
        g.add_metric((node,), 1 if s.degraded else 0)
        yield g
        yield _rate_gauge("kvdepot_store_transfer_bytes_per_second", [(node, s.transfer)])


class ClusterCollector(_StatsCollector):
    """``kvdepot_cluster_*`` of a metadata service, from its ``ClusterStats``.

    Args:
        snapshot: Returns the current ``ClusterStats``; may raise when the
            index backend does not answer (the scrape then has only
            ``kvdepot_serving``).
        serving: Returns whether the service's health is SERVING.
    """

    def __init__(
        self, snapshot: Callable[[], metadata_pb2.ClusterStats], serving: Callable[[], bool]
    ) -> None:
        super().__init__(snapshot, serving)

    def _families(self, s: metadata_pb2.ClusterStats) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "kvdepot_cluster_nodes", "Store nodes holding a lease.", value=len(s.nodes)
        )
        yield GaugeMetricFamily("kvdepot_cluster_chunks", "Chunks in the index.", value=s.chunks)
        for name, doc, field in _CLUSTER_COUNTERS:
            yield CounterMetricFamily(name, doc, value=getattr(s, field))
        keys = CounterMetricFamily(
            "kvdepot_cluster_lookup_keys", "Chunk keys looked up, by result.", labels=("result",)
        )
        keys.add_metric(("hit",), s.hit_keys)
        keys.add_metric(("miss",), s.miss_keys)
        yield keys
        tokens = CounterMetricFamily(
            "kvdepot_cluster_lookup_tokens",
            "Prompt tokens looked up, by result: hits are the leading run kvdepot held when "
            "asked, not what engines loaded (vllm:kvdepot_loaded_tokens_total).",
            labels=("result",),
        )
        tokens.add_metric(("hit",), s.hit_tokens)
        tokens.add_metric(("miss",), s.miss_tokens)
        yield tokens
        yield CounterMetricFamily(
            "kvdepot_cluster_served_tokens",
            "Prompt tokens engines reported loading from kvdepot (served, not just held).",
            value=s.served_tokens,
        )
        yield from _namespace_families(s.namespaces)
        indexed = GaugeMetricFamily(
            "kvdepot_cluster_node_chunks", "Chunks the index places on the node.", labels=_NODE
        )
        lease = GaugeMetricFamily(
            "kvdepot_cluster_node_lease_remaining_seconds",
            "Seconds until the node's lease runs out without a heartbeat.",
            labels=_NODE,
        )
        held = GaugeMetricFamily(
            "kvdepot_cluster_node_chunks_held",
            "Chunks the node reported holding at its last heartbeat.",
            labels=_NODE,
        )
        in_sync = GaugeMetricFamily(
            "kvdepot_cluster_node_in_sync",
            "1 where the index's digest of the node equalled the node's at its last heartbeat.",
            labels=_NODE,
        )
        for n in s.nodes:
            indexed.add_metric((n.node_id,), n.chunks_indexed)
            lease.add_metric((n.node_id,), n.lease_remaining_s)
            if n.HasField("chunks_held"):
                held.add_metric((n.node_id,), n.chunks_held)
                in_sync.add_metric((n.node_id,), 1 if n.in_sync else 0)
        yield indexed
        yield lease
        yield held
        yield in_sync
        yield from _tier_gauges(
            "kvdepot_cluster_node_tier", [(n.node_id, t) for n in s.nodes for t in n.tiers]
        )
        yield _rate_gauge(
            "kvdepot_cluster_node_transfer_bytes_per_second",
            [(n.node_id, n.transfer) for n in s.nodes],
        )


def _namespace_families(
    namespaces: Sequence[metadata_pb2.NamespaceStats],
) -> Iterator[Metric]:
    """Per-namespace counters: a namespace's hit rate falling alone says its
    engines' settings changed, where the cluster's would hide it."""
    labels = ("namespace", "model")
    rows = [
        (n, (n.name, next((f.value for f in n.fields if f.name == "model"), "")))
        for n in namespaces
    ]
    lookups = CounterMetricFamily(
        "kvdepot_cluster_namespace_lookups", "Lookups in the namespace.", labels=labels
    )
    chunks = CounterMetricFamily(
        "kvdepot_cluster_namespace_lookup_chunks",
        "Chunk keys looked up in the namespace, by result.",
        labels=(*labels, "result"),
    )
    held = CounterMetricFamily(
        "kvdepot_cluster_namespace_hit_tokens",
        "Prompt tokens of the namespace kvdepot held when asked.",
        labels=labels,
    )
    served = CounterMetricFamily(
        "kvdepot_cluster_namespace_served_tokens",
        "Prompt tokens of the namespace engines reported loading.",
        labels=labels,
    )
    stored = CounterMetricFamily(
        "kvdepot_cluster_namespace_chunks_stored",
        "Chunks clients reported publishing in the namespace.",
        labels=labels,
    )
    for n, lv in rows:
        lookups.add_metric(lv, n.lookups)
        chunks.add_metric((*lv, "hit"), n.hit_chunks)
        chunks.add_metric((*lv, "miss"), n.miss_chunks)
        held.add_metric(lv, n.hit_tokens)
        served.add_metric(lv, n.served_tokens)
        stored.add_metric(lv, n.chunks_stored)
    yield from (lookups, chunks, held, served, stored)


def _tier_gauges(prefix: str, rows: list[tuple[str, common_pb2.TierStats]]) -> Iterator[Metric]:
    """Capacity, use and chunk count gauges of ``(node, tier)`` pairs."""
    for suffix, doc, field in (
        ("capacity_bytes", "Capacity of the tier.", "capacity_bytes"),
        ("used_bytes", "Bytes in use in the tier.", "used_bytes"),
        ("chunks", "Chunks held in the tier.", "chunks"),
    ):
        g = GaugeMetricFamily(f"{prefix}_{suffix}", doc, labels=_NODE_TIER)
        for n, t in rows:
            g.add_metric((n, t.name), getattr(t, field))
        yield g


def _rate_gauge(name: str, rows: list[tuple[str, common_pb2.TransferRate]]) -> GaugeMetricFamily:
    g = GaugeMetricFamily(
        name,
        "Chunk payload bytes per second over the last ~10 s, as the store measures them.",
        labels=_NODE_DIRECTION,
    )
    for node, rate in rows:
        g.add_metric((node, "in"), rate.bytes_in_per_s)
        g.add_metric((node, "out"), rate.bytes_out_per_s)
    return g


def on_loop(
    loop: asyncio.AbstractEventLoop,
    fn: Callable[[], Coroutine[Any, Any, T]],
    timeout_s: float = 5.0,
) -> Callable[[], T]:
    """A blocking snapshot function that runs the coroutine ``fn()`` on ``loop``.

    The HTTP server answers scrapes on its own thread; the daemons' state
    lives on their event loop, so the collectors read it there.
    """

    def snapshot() -> T:
        future = asyncio.run_coroutine_threadsafe(fn(), loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise

    return snapshot


class MetricsServer:
    """An HTTP server answering ``GET /metrics`` with one collector's metrics.

    Args:
        collector: A :class:`StoreCollector` or :class:`ClusterCollector`.
        host: Address to bind (the daemon's own bind address).
        port: TCP port; 0 picks a free one (see :attr:`port`).

    Raises:
        InvalidArgument: the address cannot be bound.
    """

    def __init__(self, collector: _StatsCollector, host: str, port: int) -> None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(collector)
        try:
            server, thread = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            raise InvalidArgument(f"cannot serve metrics on {host}:{port}: {exc}") from None
        self._server: WSGIServer = server
        self._thread: threading.Thread = thread
        self.host = host
        self.port: int = server.server_port
        logger.info(
            "metrics on http://%s:%d/metrics",
            host,
            self.port,
            extra={"event": "metrics_listening", "port": self.port},
        )

    def close(self) -> None:
        """Stop answering and release the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
