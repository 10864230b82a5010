"""The departure history and the namespace store of the embedded index, and
``kvdepot explain``'s reading of them, without daemons."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence

import pytest

from kvdepot.apps.explain import (
    explain_prompt,
    explanation_to_json,
    render_explanation,
    with_ages,
)
from kvdepot.apps.namespaces import namespace_to_dict, render_namespaces, with_differences
from kvdepot.errors import InvalidArgument
from kvdepot.keys import ChunkKey, Namespace, chunk_keys, seeded_chunk_keys
from kvdepot.metadata.explain import explain
from kvdepot.metadata.index.base import IndexConfig
from kvdepot.metadata.index.departures import ENTRY_BYTES, DepartureConfig, MemoryDepartures
from kvdepot.metadata.index.memory import MemoryIndex
from kvdepot.metadata.index.namespaces import (
    MemoryNamespaces,
    NamespaceRecord,
    check_fields,
    check_name,
)
from kvdepot.metadata.namespaces import record_to_proto
from kvdepot.namespaces import differing_fields, namespace_fields
from kvdepot.proto.gen import metadata_pb2
from kvdepot.types import NodeInfo


def keys(n: int) -> list[ChunkKey]:
    return [ChunkKey(os.urandom(16)) for _ in range(n)]


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_history_keeps_the_newest_entries_per_node_and_its_memory_is_bounded() -> None:
    log = MemoryDepartures(DepartureConfig(per_node=1000, max_nodes=3))
    old, new = keys(1500), keys(700)

    async def fill() -> None:
        await log.record("a", old, "evicted", "cpu", at=10.0)
        await log.record("a", new, "corrupt", "ssd", at=20.0)
        for n in ("b", "c", "d"):  # "a" is the least recently active: forgotten
            await log.record(n, new[:1], "evicted", at=30.0)

    run(fill())
    # 4 nodes recorded, 3 kept; each ring is allocated whole: 26 bytes an entry.
    assert log.nbytes == 3 * 1000 * ENTRY_BYTES
    assert ENTRY_BYTES == 26

    log = MemoryDepartures(DepartureConfig(per_node=1000))
    run(log.record("a", old, "evicted", "cpu", at=10.0))
    run(log.record("a", new, "corrupt", "ssd", at=20.0))
    found = run(log.find(old[:800] + new[:1]))
    # Of the 1500 old ones, the last 300 are still in the ring (1000 - 700 new).
    assert [f is not None for f in found[:800]] == [False] * 800
    tail = run(log.find(old[-300:]))
    assert all(f is not None and f.reason == "evicted" and f.tier == "cpu" for f in tail)
    assert run(log.find(old[-301:-300])) == [None]
    latest = found[-1]
    assert latest is not None
    assert (latest.node_id, latest.reason, latest.tier, latest.at) == ("a", "corrupt", "ssd", 20.0)


def test_default_history_memory_per_node() -> None:
    """The figure docs/operations.md gives: 26 bytes an entry, 1.7 MB a node
    at the default 65536 entries."""
    log = MemoryDepartures(DepartureConfig(per_node=65536))
    run(log.record("n", keys(70000), "evicted", "cpu"))
    assert log.nbytes == 65536 * 26


def test_newest_departure_wins_across_nodes_and_bad_reasons_are_refused() -> None:
    log = MemoryDepartures()
    k = keys(1)
    run(log.record("a", k, "evicted", "cpu", at=5.0))
    run(log.record("b", k, "node_lost", at=7.0))
    (d,) = run(log.find(k))
    assert d is not None and (d.node_id, d.reason) == ("b", "node_lost")
    with pytest.raises(InvalidArgument, match="unknown departure reason"):
        run(log.record("a", k, "stolen"))
    with pytest.raises(InvalidArgument, match="departures per node"):
        DepartureConfig(per_node=-1)


def test_a_dead_node_s_chunks_are_recorded_as_lost_with_it() -> None:
    async def scenario() -> tuple[list[object], object]:
        index = MemoryIndex(IndexConfig(lease_ttl_s=1.0))
        ks = keys(5)
        await index.register_node(NodeInfo("n1", "127.0.0.1:1"), [], now=0.0)
        await index.put_end("n1", ks, [10] * 5)
        await index.expire(now=10.0)
        found = await index.departures.find(ks)
        answers = await explain(index, ks, "")
        await index.close()
        return found, answers[0]

    found, first = run(scenario())
    assert all(d is not None and d.reason == "node_lost" and d.node_id == "n1" for d in found)
    assert isinstance(first, metadata_pb2.KeyExplanation)
    assert first.departure.reason == metadata_pb2.Departure.NODE_LOST
    assert not first.replicas


def test_namespaces_are_bounded_and_counted() -> None:
    store = MemoryNamespaces(max_namespaces=2)
    a, b, c = (Namespace(f"m{i}").digest().hex() for i in range(3))

    async def use() -> list[str]:
        assert not await store.register(a, (("model", "m0"),), "vllm", at=1.0)
        assert await store.register(a, (("model", "m0"),), "vllm", at=2.0)
        await store.add({b: {"lookups": 1, "hit_chunks": 3}}, at=3.0)
        await store.add({a: {"served_tokens": 32}}, at=4.0)
        await store.register(c, (), "client", at=5.0)  # b: the least recently seen
        return [r.name for r in await store.list()]

    assert run(use()) == [c, a]
    rec = next(r for r in run(store.list()) if r.name == a)
    assert rec.counters["served_tokens"] == 32 and rec.first_seen == 1.0 and rec.last_seen == 4.0
    with pytest.raises(InvalidArgument, match="digest in hex"):
        check_name("not-a-digest")
    with pytest.raises(InvalidArgument, match="lower_case"):
        check_fields([("Bad Name", "x")])


def test_fields_name_the_layout_parts_and_hide_the_salt() -> None:
    ns = Namespace("m", kv_layout="kvdepot-chunk1:kv:L2:H2:D32", extra=("secret", "fp8"))
    f = namespace_fields(ns, cache_salt="secret", codec="fp8", model_source="/m; 5 ms")
    assert f["layers"] == "2" and f["head_size"] == "32" and f["layout"] == "kvdepot-chunk1:kv"
    assert f["cache_salt"].startswith("sha256:") and "secret" not in str(f)
    assert f["codec"] == "fp8" and f["extra"] == "" and f["model_source"] == "/m"
    other = {**f, "model_source": "elsewhere", "chunk_tokens": "512"}
    assert differing_fields(f, other) == ["chunk_tokens"]  # the source is not in the digest


class FakeService:
    """What explain_prompt asks of a client, over a dict of stored keys."""

    def __init__(
        self,
        stored: dict[bytes, str],
        gone: dict[bytes, metadata_pb2.Departure],
        registered: Sequence[tuple[Namespace, dict[str, str]]],
    ) -> None:
        self.stored, self.gone, self.registered = stored, gone, registered

    def namespaces(self) -> metadata_pb2.ListNamespacesResponse:
        return metadata_pb2.ListNamespacesResponse(
            namespaces=[
                metadata_pb2.NamespaceStats(
                    name=ns.digest().hex(),
                    fields=[metadata_pb2.NamespaceField(name=k, value=v) for k, v in f.items()],
                )
                for ns, f in self.registered
            ]
        )

    def explain(self, ks: Sequence[bytes]) -> metadata_pb2.ExplainResponse:
        out = []
        for k in ks:
            e = metadata_pb2.KeyExplanation()
            if k in self.stored:
                e.replicas.add(node_id=self.stored[k], tier="cpu")
            elif k in self.gone:
                e.departure.CopyFrom(self.gone[k])
            out.append(e)
        return metadata_pb2.ExplainResponse(keys=out)


def test_explain_prompt_gives_each_chunk_its_reason() -> None:
    mine = Namespace("m", chunk_tokens=4)
    theirs = Namespace("m", chunk_tokens=4, kv_dtype="float16")
    tokens = list(range(24))  # 6 chunks
    ks = chunk_keys(mine, tokens)
    assert ks == seeded_chunk_keys(mine.digest(), 4, tokens)
    other = chunk_keys(theirs, tokens)
    evicted = metadata_pb2.Departure(
        reason=metadata_pb2.Departure.EVICTED, node_id="s0", tier="cpu", at=100.0
    )
    service = FakeService(
        {ks[0]: "s0", ks[2]: "s1", other[0]: "s1", other[1]: "s1", other[2]: "s1", other[3]: "s1"},
        {ks[1]: evicted},
        [(mine, namespace_fields(mine)), (theirs, namespace_fields(theirs))],
    )
    e = explain_prompt(service, tokens, mine.digest().hex())
    got = [(a.status, a.reason) for a in e.chunks]
    assert got == [
        ("hit", ""),
        ("miss", "evicted"),
        ("hit", "not_leading"),
        ("miss", "other_namespace"),
        ("miss", "shorter_prompt"),
        ("miss", "shorter_prompt"),
    ]
    assert e.chunks[1].node == "s0" and e.chunks[1].at == 100.0
    assert e.chunks[3].differs_in == ("kv_dtype",)
    assert e.leading_hits == 1 and e.elsewhere == {theirs.digest().hex(): (4, 16)}
    text = render_explanation(e, now=110.0)
    assert "evicted from cpu of node s0 at 00:01:40 UTC (10 s ago)" in text
    assert "would load 1 leading chunks (4 tokens)" in text

    # Hits get their age from the node that holds them, per node in one call;
    # a node that cannot say leaves its hits without one.
    asked: list[tuple[str, list[bytes]]] = []

    def describe(node: str, keys: Sequence[bytes]) -> list[tuple[str, float] | None]:
        asked.append((node, list(keys)))
        return [("ssd", 90.0)] * len(keys) if node == "s0" else []

    aged = with_ages(e, describe)
    assert sorted(asked) == [("s0", [ks[0]]), ("s1", [ks[2]])]
    assert aged.chunks[0].committed_at == 90.0 and aged.chunks[0].tier == "ssd"
    assert aged.chunks[2].committed_at is None and aged.chunks[2].tier == "cpu"
    assert "node s0, tier ssd, committed at 00:01:30 UTC (20 s ago)" in render_explanation(
        aged, now=110.0
    )
    as_json = explanation_to_json(aged, now=110.0)
    assert as_json[0]["age_s"] == 20.0 and as_json[0]["key"] == ks[0].hex()
    assert "age_s" not in as_json[1] and "age_s" not in as_json[2]

    nothing = explain_prompt(service, list(range(100, 108)), mine.digest().hex())
    assert [a.reason for a in nothing.chunks] == ["never_published"] * 2
    with pytest.raises(InvalidArgument, match="not registered"):
        explain_prompt(service, tokens, Namespace("x").digest().hex())


def test_namespaces_table_marks_the_fields_that_differ() -> None:
    a = Namespace("m", chunk_tokens=256)
    b = Namespace("m", chunk_tokens=128)
    c = Namespace("other", kv_dtype="fp8")
    records = [
        record_to_proto(
            NamespaceRecord(ns.digest().hex(), tuple(sorted(namespace_fields(ns).items())))
        )
        for ns in (a, b, c)
    ]
    listed = with_differences([namespace_to_dict(r) for r in records])
    assert [n["differs_in"] for n in listed] == [["chunk_tokens"], ["chunk_tokens"], []]
    table = render_namespaces(listed)
    assert "*chunk_tokens" in table and " kv_dtype" in table
