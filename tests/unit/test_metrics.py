"""Prometheus collectors over the daemons' stats messages, and the HTTP endpoint."""

from __future__ import annotations

import asyncio
import urllib.request

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvdepot.errors import Unavailable
from kvdepot.metrics import ClusterCollector, MetricsServer, StoreCollector, on_loop
from kvdepot.proto.gen import common_pb2, metadata_pb2, store_pb2


def _scrape(collector: object) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Exposition text parsed back: sample name -> sorted labels -> value."""
    registry = CollectorRegistry()
    registry.register(collector)  # type: ignore[arg-type]
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def _types(collector: object) -> dict[str, str]:
    registry = CollectorRegistry()
    registry.register(collector)  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def _store_stats() -> store_pb2.StoreStats:
    return store_pb2.StoreStats(
        node_id="n1",
        tiers=[
            common_pb2.TierStats(
                name="cpu",
                capacity_bytes=100,
                used_bytes=40,
                chunks=4,
                hits=7,
                misses=2,
                evictions=1,
            )
        ],
        puts=4,
        gets=7,
        get_misses=2,
        bytes_in=400,
        bytes_out=700,
        corrupt_puts=1,
        protocol_errors=3,
        connections=5,
        put_rejected=6,
        transfer=common_pb2.TransferRate(bytes_in_per_s=40.0, bytes_out_per_s=70.0, window_s=10),
        chunks_corrupt=8,
        tier_write_errors=9,
    )


def test_store_collector_names_types_and_labels() -> None:
    c = StoreCollector(_store_stats, lambda: True)
    m = _scrape(c)
    assert m["kvdepot_serving"][()] == 1.0
    cpu = (("node", "n1"), ("tier", "cpu"))
    assert m["kvdepot_store_tier_capacity_bytes"][cpu] == 100
    assert m["kvdepot_store_tier_used_bytes"][cpu] == 40
    assert m["kvdepot_store_tier_chunks"][cpu] == 4
    assert m["kvdepot_store_tier_hits_total"][cpu] == 7
    assert m["kvdepot_store_tier_misses_total"][cpu] == 2
    assert m["kvdepot_store_tier_evictions_total"][cpu] == 1
    n1 = (("node", "n1"),)
    assert m["kvdepot_store_puts_total"][n1] == 4
    assert m["kvdepot_store_gets_total"][n1] == 7
    assert m["kvdepot_store_corrupt_puts_total"][n1] == 1
    assert m["kvdepot_store_protocol_errors_total"][n1] == 3
    assert m["kvdepot_store_connections_total"][n1] == 5
    assert m["kvdepot_store_put_rejected_total"][n1] == 6
    assert m["kvdepot_store_chunks_corrupt_total"][n1] == 8
    assert m["kvdepot_store_tier_write_errors_total"][n1] == 9
    assert m["kvdepot_store_chunks_recovered_total"][n1] == 0
    inn, out = (("direction", "in"), ("node", "n1")), (("direction", "out"), ("node", "n1"))
    assert m["kvdepot_store_transfer_bytes_total"][inn] == 400
    assert m["kvdepot_store_transfer_bytes_total"][out] == 700
    assert m["kvdepot_store_transfer_bytes_per_second"][out] == 70.0
    types = _types(c)
    assert types["kvdepot_store_puts"] == "counter"
    assert types["kvdepot_store_tier_used_bytes"] == "gauge"
    assert types["kvdepot_store_transfer_bytes_per_second"] == "gauge"
    assert all(name.startswith("kvdepot_") for name in m)


def test_cluster_collector() -> None:
    stats = metadata_pb2.ClusterStats(
        nodes=[
            metadata_pb2.NodeStats(
                node_id="a",
                tiers=[common_pb2.TierStats(name="cpu", capacity_bytes=10, used_bytes=5, chunks=2)],
                chunks_indexed=2,
                lease_remaining_s=4.5,
                transfer=common_pb2.TransferRate(bytes_in_per_s=1e9),
            ),
            metadata_pb2.NodeStats(node_id="b"),
        ],
        chunks=2,
        lookups=3,
        hit_keys=4,
        miss_keys=1,
        hit_tokens=1024,
        miss_tokens=256,
        puts_committed=2,
        bytes_committed=20,
        chunks_deduplicated=1,
        bytes_saved=10,
        nodes_expired=1,
        allocations_expired=2,
    )
    m = _scrape(ClusterCollector(lambda: stats, lambda: True))
    assert m["kvdepot_cluster_nodes"][()] == 2
    assert m["kvdepot_cluster_chunks"][()] == 2
    assert m["kvdepot_cluster_lookups_total"][()] == 3
    assert m["kvdepot_cluster_lookup_keys_total"][(("result", "hit"),)] == 4
    assert m["kvdepot_cluster_lookup_keys_total"][(("result", "miss"),)] == 1
    assert m["kvdepot_cluster_lookup_tokens_total"][(("result", "hit"),)] == 1024
    assert m["kvdepot_cluster_lookup_tokens_total"][(("result", "miss"),)] == 256
    assert m["kvdepot_cluster_puts_committed_total"][()] == 2
    assert m["kvdepot_cluster_committed_bytes_total"][()] == 20
    assert m["kvdepot_cluster_saved_bytes_total"][()] == 10
    assert m["kvdepot_cluster_chunks_deduplicated_total"][()] == 1
    assert m["kvdepot_cluster_nodes_expired_total"][()] == 1
    assert m["kvdepot_cluster_allocations_expired_total"][()] == 2
    a_cpu = (("node", "a"), ("tier", "cpu"))
    assert m["kvdepot_cluster_node_tier_capacity_bytes"][a_cpu] == 10
    assert m["kvdepot_cluster_node_tier_used_bytes"][a_cpu] == 5
    assert m["kvdepot_cluster_node_tier_chunks"][a_cpu] == 2
    assert m["kvdepot_cluster_node_chunks"][(("node", "a"),)] == 2
    assert m["kvdepot_cluster_node_lease_remaining_seconds"][(("node", "a"),)] == 4.5
    rate = m["kvdepot_cluster_node_transfer_bytes_per_second"]
    assert rate[(("direction", "in"), ("node", "a"))] == 1e9
    assert rate[(("direction", "out"), ("node", "b"))] == 0


def test_unreadable_stats_leave_only_the_health_gauge() -> None:
    def broken() -> metadata_pb2.ClusterStats:
        raise Unavailable("redis index error: connection refused")

    m = _scrape(ClusterCollector(broken, lambda: False))
    assert m == {"kvdepot_serving": {(): 0.0}}


def test_http_endpoint_reads_the_stats_on_the_daemon_loop() -> None:
    async def main() -> str:
        calls: list[int] = []

        async def snapshot() -> store_pb2.StoreStats:
            calls.append(1)
            return _store_stats()

        server = MetricsServer(
            StoreCollector(on_loop(asyncio.get_running_loop(), snapshot), lambda: True),
            "127.0.0.1",
            0,
        )
        try:
            url = f"http://127.0.0.1:{server.port}/metrics"
            body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
        finally:
            await asyncio.to_thread(server.close)
        assert calls == [1]
        return body.decode()

    text = asyncio.run(main())
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"kvdepot_serving", "kvdepot_store_puts", "kvdepot_store_tier_hits"} <= names


def test_namespaces_served_tokens_and_a_degraded_store() -> None:
    model = metadata_pb2.NamespaceField(name="model", value="llama")
    stats = metadata_pb2.ClusterStats(
        served_tokens=512,
        namespaces=[
            metadata_pb2.NamespaceStats(
                name="ab12",
                fields=[model],
                lookups=3,
                hit_chunks=4,
                miss_chunks=2,
                hit_tokens=1024,
                served_tokens=512,
                chunks_stored=6,
            )
        ],
    )
    m = _scrape(ClusterCollector(lambda: stats, lambda: True))
    ns = (("model", "llama"), ("namespace", "ab12"))
    assert m["kvdepot_cluster_served_tokens_total"][()] == 512
    assert m["kvdepot_cluster_namespace_lookups_total"][ns] == 3
    assert m["kvdepot_cluster_namespace_lookup_chunks_total"][(*ns, ("result", "hit"))] == 4
    assert m["kvdepot_cluster_namespace_lookup_chunks_total"][(*ns, ("result", "miss"))] == 2
    assert m["kvdepot_cluster_namespace_hit_tokens_total"][ns] == 1024
    assert m["kvdepot_cluster_namespace_served_tokens_total"][ns] == 512
    assert m["kvdepot_cluster_namespace_chunks_stored_total"][ns] == 6
    whole = _scrape(StoreCollector(_store_stats, lambda: True))
    assert whole["kvdepot_store_degraded"][(("node", "n1"),)] == 0
    failed = _store_stats()
    failed.degraded = "ssd tier failed: I/O errors"
    assert (
        _scrape(StoreCollector(lambda: failed, lambda: True))["kvdepot_store_degraded"][
            (("node", "n1"),)
        ]
        == 1
    )
