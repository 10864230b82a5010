"""Namespaces as data and ``Explain``, with real daemons on both index backends.

One cluster per backend: a store too small for what is put on it (chunks
evicted), one with an SSD tier whose segment file is corrupted (a chunk
dropped as corrupt) and one SIGKILLed (its chunks lost with it). Each miss
is explained by its reason, node and tier; a prompt published under another
namespace is named with the field that differs.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvdepot.apps.cluster import DaemonProcess, LocalCluster
from kvdepot.apps.explain import Explanation, explain_prompt
from kvdepot.connector.client import ClientConfig, KVDepotClient
from kvdepot.keys import ChunkKey, Namespace, chunk_keys
from kvdepot.namespaces import namespace_fields
from tests.faults.support import payload, sentinel_buffers, store_stats, wait_for
from tests.faults.test_disk_faults import corrupt_record, on_disk

pytestmark = pytest.mark.integration

C = 16
MODEL = "test/explain-model"
NS = Namespace(MODEL, chunk_tokens=C)
SALTED = Namespace(MODEL, chunk_tokens=C, extra=("tenant-b",))
MiB = 1 << 20


def prompt(seed: int, chunks: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 50000, chunks * C)]


def data(key: bytes) -> np.ndarray:
    return payload(key, MiB)


def put(c: KVDepotClient, keys: list[ChunkKey]) -> None:
    for k in keys:  # one at a time: a small store evicts between them
        assert c.put([k], [data(k)]).failed == 0


def reasons(e: Explanation) -> list[str]:
    return [a.reason or a.status for a in e.chunks]


@pytest.fixture(params=["memory", "redis"])
def index_url(request: pytest.FixtureRequest) -> str:
    if request.param == "memory":
        return "memory://"
    server = request.getfixturevalue("redis_server")
    return f"{server}?prefix=explain{os.getpid()}"


@pytest.fixture()
def cluster(tmp_path: Path, index_url: str) -> Iterator[LocalCluster]:
    with LocalCluster(
        nodes=0,
        capacity="64MiB",
        lease_ttl_s=1.5,
        heartbeat_interval_s=0.3,
        log_dir=tmp_path / "logs",
        index=index_url,
    ) as cl:
        yield cl


def client(cl: LocalCluster, node: str, ns: Namespace) -> KVDepotClient:
    c = KVDepotClient(ClientConfig(metadata=cl.metadata_address, node_id=node))
    c.register_namespace(ns, namespace_fields(ns, cache_salt="".join(ns.extra)), "client")
    return c


def test_each_miss_is_explained_with_its_reason_node_and_tier(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    cl = cluster
    ssd = tmp_path / "ssd"
    cl.add_store("small", "--capacity", "4MiB")
    disk = ["--capacity", "16MiB", "--ssd-dir", str(ssd), "--ssd-capacity", "64MiB"]
    # Demoted to SSD in the background, where a segment file is corrupted.
    cl.add_store("disk", *disk, "--ssd-fsync", "never", "--watermarks", "cpu=0.3:0.1")
    doomed = cl.add_store("doomed")
    name = NS.digest().hex()
    check_evicted(cl, name)
    check_lost(cl, doomed, name)
    check_corrupt(cl, ssd, name)
    check_mismatch_and_counters(cl, name)


def check_evicted(cl: LocalCluster, name: str) -> None:
    """8 chunks of 1 MiB into a store of 4 MiB."""
    evicted = prompt(1, 8)
    with client(cl, "small", NS) as c:
        put(c, chunk_keys(NS, evicted))
        wait_for(
            lambda: reasons(explain_prompt(c, evicted, name))[0] == "evicted", 15, "no eviction"
        )
        e = explain_prompt(c, evicted, name)
        first = e.chunks[0]
        assert (first.status, first.node, first.tier) == ("miss", "small", "cpu")
        assert first.at is not None
        assert e.leading_hits == 0
        assert any(a.status == "hit" and a.reason == "not_leading" for a in e.chunks)


def check_lost(cl: LocalCluster, doomed: DaemonProcess, name: str) -> None:
    """SIGKILLed, its lease runs out."""
    lost = prompt(2, 3)
    with client(cl, "doomed", NS) as c:
        put(c, chunk_keys(NS, lost))
        assert explain_prompt(c, lost, name).leading_hits == 3
        os.kill(doomed.pid, signal.SIGKILL)
        doomed.proc.wait()
        wait_for(lambda: c.lookup(chunk_keys(NS, lost)) == 0, 15, "the dead node's chunks listed")
        wait_for(
            lambda: set(reasons(explain_prompt(c, lost, name))) == {"node_lost"},
            10,
            "not explained as lost",
        )
        assert {a.node for a in explain_prompt(c, lost, name).chunks} == {"doomed"}


def check_corrupt(cl: LocalCluster, ssd: Path, name: str) -> None:
    """Corrupt on SSD: found by a read, dropped, reported."""
    corrupt = prompt(3, 12)
    with client(cl, "disk", NS) as c:
        keys = chunk_keys(NS, corrupt)
        put(c, keys)
        wait_for(lambda: any(on_disk(ssd, k) for k in keys), 30, "nothing demoted to SSD")
        victim = next(i for i, k in enumerate(keys) if on_disk(ssd, k))
        wait_for(
            lambda: c.lookup_locations([keys[victim]]).locations[0].replicas[0].tier == "ssd",
            15,
            "the demotion not in the index",
        )
        assert corrupt_record(ssd, keys[victim])
        bufs = sentinel_buffers(1, MiB)
        assert c.get_into([keys[victim]], bufs).loaded == (False,)
        wait_for(
            lambda: explain_prompt(c, corrupt, name).chunks[victim].reason == "corrupt",
            10,
            "not explained as corrupt",
        )
        a = explain_prompt(c, corrupt, name).chunks[victim]
        assert (a.node, a.tier) == ("disk", "ssd")
        assert store_stats(cl.stores[1].info["grpc_address"]).chunks_corrupt == 1


def check_mismatch_and_counters(cl: LocalCluster, name: str) -> None:
    """Another namespace over the same model; a shorter prompt; nothing at all."""
    salted = prompt(4, 3)
    with client(cl, "disk", SALTED) as other:
        put(other, chunk_keys(SALTED, salted))
    with client(cl, "disk", NS) as c:
        e = explain_prompt(c, salted, name)
        assert reasons(e) == ["other_namespace"] * 3
        assert e.chunks[0].namespace == SALTED.digest().hex()
        assert e.chunks[0].differs_in == ("cache_salt",)
        assert e.elsewhere == {SALTED.digest().hex(): (3, 3 * C)}

        longer = prompt(5, 4)
        put(c, chunk_keys(NS, longer)[:2])
        assert reasons(explain_prompt(c, longer, name)) == ["hit"] * 2 + ["shorter_prompt"] * 2
        assert reasons(explain_prompt(c, prompt(6, 2), name)) == ["never_published"] * 2

        # Per-namespace counters: lookups in it, and what an engine loaded.
        before = {n.name: n for n in c.stats().namespaces}[name]
        c.lookup(chunk_keys(NS, longer))
        c.add_usage(served_tokens=2 * C)
        c.flush_usage()
        stats = {n.name: n for n in c.stats().namespaces}
    mine = stats[name]
    assert dict((f.name, f.value) for f in mine.fields)["model"] == MODEL
    assert (
        mine.lookups - before.lookups,
        mine.hit_chunks - before.hit_chunks,
        mine.miss_chunks - before.miss_chunks,
    ) == (1, 2, 2)
    assert mine.served_tokens == 2 * C
    assert mine.chunks_stored >= 8 + 3 + 12 + 2
    assert stats[SALTED.digest().hex()].chunks_stored == 3


def word_tokenizer(where: Path, tokens: list[int]) -> Path:
    """A tokenizer directory whose word ``t<i>`` is token ``i``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{t}": t for t in {*tokens, 1}}
    vocab["<unk>"] = 60000
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = where / "tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(str(path))
    return path


def test_cli_lists_namespaces_and_explains_a_prompt(cluster: LocalCluster, tmp_path: Path) -> None:
    cl = cluster
    cl.add_store("s0")
    tokens = prompt(7, 2)
    before = time.time()
    with client(cl, "s0", NS) as c:
        put(c, chunk_keys(NS, tokens))
    after = time.time()
    with client(cl, "s0", SALTED):
        pass
    cli = [sys.executable, "-m", "kvdepot.apps.cli"]
    meta = ["--metadata", cl.metadata_address]
    out = subprocess.run(
        [*cli, "namespaces", *meta, "--json"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    listed = {n["name"]: n for n in json.loads(out.stdout)}
    assert listed[NS.digest().hex()]["differs_in"] == ["cache_salt"]
    text = subprocess.run(
        [*cli, "namespaces", *meta], capture_output=True, text=True, timeout=60
    ).stdout
    assert "*cache_salt" in text

    ask = [
        *meta,
        "--namespace",
        NS.digest().hex(),
        "--tokens",
        ",".join(map(str, tokens + [1] * C)),
    ]
    out = subprocess.run(
        [*cli, "explain", *ask, "--json"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    chunks = json.loads(out.stdout)
    assert [(a["index"], a["status"]) for a in chunks] == [(0, "hit"), (1, "hit"), (2, "miss")]
    assert chunks[0]["node"] == "s0" and chunks[0]["tier"] == "cpu"
    assert chunks[2]["reason"] == "shorter_prompt"
    # A hit's age: when its store committed it (whole seconds), and since.
    for hit, key in zip(chunks[:2], chunk_keys(NS, tokens), strict=True):
        assert int(before) <= hit["committed_at"] <= after, (before, hit, after)
        assert 0 <= hit["age_s"] <= time.time() - int(before) + 1, hit
        assert hit["key"] == key.hex()
    assert "age_s" not in chunks[2]
    time.sleep(1.1)
    out = subprocess.run([*cli, "explain", *ask], capture_output=True, text=True, timeout=60)
    assert "would load 2 leading chunks (32 tokens)" in out.stdout, out.stdout
    hit_line = out.stdout.splitlines()[1]
    assert hit_line.startswith("chunk    0  hit   node s0, tier cpu, committed at "), hit_line
    age = int(hit_line.rsplit("(", 1)[1].split(" s ago")[0])
    assert 1 <= age <= time.time() - int(before) + 1, hit_line
    # The same prompt as text, through a tokenizer directory (word t<i> is token i).
    words = " ".join(f"t{t}" for t in tokens + [1] * C)
    as_text = [*ask[:-2], "--text", words, "--tokenizer", str(word_tokenizer(tmp_path, tokens))]
    out = subprocess.run(
        [*cli, "explain", *as_text, "--json"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr

    def aged(answers: list[dict[str, object]]) -> list[dict[str, object]]:
        return [{k: v for k, v in a.items() if k != "age_s"} for a in answers]

    assert aged(json.loads(out.stdout)) == aged(chunks)

    bad = subprocess.run(
        [*cli, "explain", *meta, "--tokens", "1,x", "--namespace", "00" * 16],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "--tokens" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.redis
def test_redis_history_and_namespaces_are_bounded(redis_server: str) -> None:
    from kvdepot.metadata.index.departures import DepartureConfig, RedisDepartures
    from kvdepot.metadata.index.namespaces import RedisNamespaces
    from kvdepot.metadata.index.redis_client import Connection, connect
    from kvdepot.metadata.index.redis_layout import tag

    async def scenario() -> None:
        client = connect(redis_server)
        db = Connection(client)
        prefix = f"bound{os.getpid()}"
        log = RedisDepartures(db, prefix, tag, DepartureConfig(per_node=100, max_nodes=2))
        old = [ChunkKey(os.urandom(16)) for _ in range(150)]
        await log.record("a", old, "evicted", "cpu", at=1.0)
        found = await log.find(old)
        assert [f is not None for f in found] == [False] * 50 + [True] * 100
        await log.record("b", old[:1], "corrupt", "ssd", at=2.0)
        await log.record("c", old[:1], "node_lost", at=3.0)  # "a" is forgotten
        assert await db.one(("LLEN", f"{prefix}:d:{{{tag('a')}}}")) == 0
        (newest,) = await log.find(old[:1])
        assert newest is not None and (newest.node_id, newest.reason) == ("c", "node_lost")

        store = RedisNamespaces(db, prefix, max_namespaces=2)
        names = [Namespace(f"m{i}").digest().hex() for i in range(3)]
        assert not await store.register(names[0], (("model", "m0"),), "vllm", at=1.0)
        assert await store.register(names[0], (("model", "m0"),), "client", at=2.0)
        await store.add({names[1]: {"lookups": 2}}, at=3.0)
        await store.register(names[2], (), "", at=4.0)  # names[0] is forgotten
        listed = await store.list()
        assert [r.name for r in listed] == [names[2], names[1]]
        assert listed[1].counters["lookups"] == 2
        await client.aclose()

    asyncio.run(scenario())
