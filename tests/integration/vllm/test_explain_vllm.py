"""``kvdepot explain`` and the namespace counters with real vLLM engines.

A producer publishes a prompt; a consumer with the same settings loads it,
and the tokens it loaded are what the cluster counts as served. Explained
as engines whose settings differ in one field (cache salt, chunk size, KV
dtype), each chunk is a miss published under the producer's namespace, and
the field that differs is named.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvdepot.apps.cluster import LocalCluster
from kvdepot.apps.explain import explain_prompt
from kvdepot.connector.client import ClientConfig, KVDepotClient
from tests.faults.support import wait_for

from .engine import build_tiny_llama, engine_env
from .test_connector import ROOT, kv, run_engine, spec

pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.timeout(900)]

PROMPT = np.random.default_rng(39).integers(1, 1000, 300).tolist()  # 2 chunks of 128

_NAMESPACES = """
import json, sys
from kvdepot.apps.engine_namespace import engine_namespace
out = [engine_namespace(json.dumps(kv), sys.argv[1], args) for kv, args in json.loads(sys.argv[2])]
print("NAMESPACES " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-explain")


@pytest.fixture(scope="module")
def model(workdir: Path) -> str:
    return str(build_tiny_llama(workdir / "tiny-llama"))


def namespaces_of(
    workdir: Path, model: str, variants: list[tuple[dict[str, Any], list[str]]]
) -> list[tuple[str, dict[str, str]]]:
    """Each variant's (namespace, fields), computed as ``kvdepot explain`` does."""
    proc = subprocess.run(
        [sys.executable, "-c", _NAMESPACES, model, json.dumps(variants)],
        cwd=ROOT,
        env=engine_env(workdir / "engine-tmp"),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("NAMESPACES "):
            return [(n, f) for n, f in json.loads(line[len("NAMESPACES ") :])]
    raise AssertionError(f"no namespaces ({proc.returncode}): {proc.stderr[-3000:]}")


def test_explain_names_the_field_a_consumer_differs_in(
    model: str, workdir: Path, cluster: LocalCluster
) -> None:
    meta = cluster.metadata_address
    run_engine(workdir, spec(model, [PROMPT], kv("kv_producer", meta)), "producer")
    consumer = run_engine(workdir, spec(model, [PROMPT], kv("kv_consumer", meta)), "consumer")
    loaded = consumer["engine_connector"]["tokens_hit"]
    assert loaded == 256

    variants = [
        (kv("kv_consumer", meta), []),
        (kv("kv_consumer", meta, cache_salt="tenant-b"), []),
        (kv("kv_consumer", meta, chunk_tokens=256), []),
        (kv("kv_consumer", meta), ["dtype=float16"]),
    ]
    (same, fields), *others = namespaces_of(workdir, model, variants)
    with KVDepotClient(ClientConfig(metadata=meta)) as c:
        listed = {n.name: n for n in c.namespaces().namespaces}
        assert list(listed) == [same]  # both engines registered the one namespace
        assert listed[same].clients == ["vllm"]
        # Served: what the consumer loaded, reported by its connector.
        wait_for(
            lambda: {n.name: n for n in c.namespaces().namespaces}[same].served_tokens == loaded,
            10,
            "served tokens not reported",
        )
        assert c.stats().served_tokens == loaded
        # Stored: what the producer's workers published (its 2 chunks, at least).
        assert {n.name: n for n in c.namespaces().namespaces}[same].chunks_stored >= 2

        e = explain_prompt(c, PROMPT, same, fields=fields)
        assert [(a.status, a.reason) for a in e.chunks] == [("hit", ""), ("hit", "")]
        assert e.leading_hits == 2
        for (name, theirs), field in zip(
            others, ["cache_salt", "chunk_tokens", "kv_dtype"], strict=True
        ):
            e = explain_prompt(c, PROMPT, name, fields=theirs)
            assert {a.reason for a in e.chunks} == {"other_namespace"}, e
            assert {a.namespace for a in e.chunks} == {same}
            assert e.chunks[0].differs_in == (field,), e.chunks[0]
            assert e.leading_hits == 0 and e.elsewhere[same] == (2, 256)


def test_a_request_looked_up_again_counts_once(cluster: LocalCluster) -> None:
    """vLLM asks again for a waiting request every 2 s: the cluster counts
    the request's lookup once (the repeats go with count "none")."""
    from kvdepot.connector.vllm.lookups import LookupBreaker, LookupDeadline
    from kvdepot.connector.vllm.plan import PrefixKeys
    from kvdepot.connector.vllm.stats import Counters
    from kvdepot.keys import Namespace, chunk_keys
    from kvdepot.repeat_log import RepeatLog

    ns = Namespace("test/repeat", chunk_tokens=16)
    keys = PrefixKeys(tuple(chunk_keys(ns, list(range(64)))), (), 16, 16)
    with KVDepotClient(ClientConfig(metadata=cluster.metadata_address)) as c:
        c.register_namespace(ns, {"model": ns.model}, "vllm")
        breaker = LookupBreaker(
            c, LookupDeadline(1.0, 2.0), 1.0, 3, RepeatLog(logging.getLogger(__name__))
        )
        counters = Counters()
        for repeat in (False, True):
            found = breaker.lookup(keys, counters, repeat=repeat)
            assert found is not None and found.hits == 0
        assert breaker.lookup_more(keys.keys, 16, repeat=True) == 0
        stats = c.stats()
        assert (stats.lookups, stats.miss_keys, stats.miss_tokens) == (1, 4, 64)
        (mine,) = stats.namespaces
        assert (mine.lookups, mine.miss_chunks) == (1, 4)
