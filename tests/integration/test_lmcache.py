"""kvdepot as LMCache's remote backend, driven through LMCache's own classes.

LMCache's vLLM connector needs a GPU, but its storage layer runs on the CPU:
each test builds a real ``LMCacheEngineConfig``, ``LMCacheMetadata`` and
``LocalCPUBackend``, and LMCache's ``RemoteBackend``, which loads the kvdepot
plugin through its ``remote_storage_plugins`` framework, against real
metadata and store daemons on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache")
torch = pytest.importorskip("torch")

from lmcache.utils import CacheEngineKey, LayerCacheEngineKey  # noqa: E402
from lmcache.v1.config import (  # noqa: E402
    LMCacheEngineConfig,
    load_engine_config_with_overrides,
)
from lmcache.v1.memory_management import MemoryFormat  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend.connector import CreateConnector  # noqa: E402
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend  # noqa: E402
from lmcache.v1.storage_backend.remote_backend import RemoteBackend  # noqa: E402

from kvdepot.apps.cluster import LocalCluster  # noqa: E402
from kvdepot.connector.lmcache import KVDepotLMCacheConnector, chunk_key  # noqa: E402
from kvdepot.connector.lmcache.settings import PluginSettings, resolve  # noqa: E402
from kvdepot.errors import InvalidArgument  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.lmcache]

CHUNK = 256
LAYERS, HEADS, HEAD_DIM = 4, 2, 64  # a 256-token chunk is 512 KiB in bfloat16
DTYPE = torch.bfloat16


def plugin_config(url: str, **overrides: Any) -> Any:
    """LMCache's configuration with kvdepot as its remote storage plugin."""
    extra = {
        "remote_storage_plugin.kvdepot.module_path": "kvdepot.connector.lmcache",
        "remote_storage_plugin.kvdepot.class_name": "KVDepotConnectorAdapter",
        "remote_storage_plugin.kvdepot.url": url,
    }
    extra.update(overrides.pop("extra_config", {}))
    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK,
        local_cpu=False,
        max_local_cpu_size=0.1,
        remote_storage_plugins=["kvdepot"],
        extra_config=extra,
        **overrides,
    )


class Engine:
    """One LMCache worker's storage layer: CPU backend, event loop, remote backend."""

    def __init__(self, url: str, model: str, **overrides: Any) -> None:
        self.model = model
        self.config = plugin_config(url, **overrides)
        self.metadata = LMCacheMetadata(
            model_name=model,
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=DTYPE,
            kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_DIM),
            role="worker",
        )
        self.cpu = LocalCPUBackend(self.config, self.metadata, dst_device="cpu")
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.remote = RemoteBackend(
            self.config, self.metadata, self.loop, self.cpu, "cpu", plugin_name="kvdepot"
        )
        self.owned: list[Any] = []

    @property
    def connector(self) -> KVDepotLMCacheConnector:
        assert self.remote.connection is not None, "LMCache did not create the connector"
        inner = self.remote.connection.getWrappedConnector()
        assert isinstance(inner, KVDepotLMCacheConnector)
        return inner

    def key(self, chunk_hash: int, **tags: str) -> Any:
        configs = {f"lmcache.tag.{k}": v for k, v in tags.items()} or None
        return CacheEngineKey(self.model, 1, 0, chunk_hash, DTYPE, request_configs=configs)

    def chunk(self, seed: int, tokens: int = CHUNK) -> Any:
        """A memory object from LMCache's allocator filled with seeded values."""
        obj = self.cpu.allocate(self.metadata.get_shapes(tokens), self.metadata.get_dtypes())
        assert obj is not None
        gen = torch.Generator().manual_seed(seed)
        obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=gen, dtype=torch.float32))
        self.owned.append(obj)
        return obj

    def call(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def put(self, keys: list[Any], objs: list[Any]) -> None:
        """Publish as ``RemoteBackend.batched_submit_put_task`` does, and wait for it.

        (That method is fire-and-forget: it hands back nothing to wait on.)
        """
        for obj in objs:
            obj.ref_count_up()  # the connector wrapper drops one when done
        self.call(self.remote.connection.batched_put(keys, objs))

    @property
    def allocated(self) -> int:
        """Bytes of LMCache's CPU memory held by live memory objects."""
        size: int = self.cpu.memory_allocator.pin_allocator.total_allocated_size
        return size

    def close(self) -> None:
        self.remote.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        for obj in self.owned:
            obj.ref_count_down()


def same(a: Any, b: Any) -> bool:
    return (
        a is not None
        and a.get_shape() == b.get_shape()
        and bytes(a.byte_array) == bytes(b.byte_array)
    )


@pytest.fixture(autouse=True)
def _lmcache_metrics_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LMCache's Prometheus logger writes its counters under
    ``PROMETHEUS_MULTIPROC_DIR``, else into /tmp/lmcache_prometheus for good:
    here, the test's own directory."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "lmcache-prometheus"))


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One cluster for the tests that only add chunks (each under its own model name)."""
    c = LocalCluster(
        nodes=2,
        capacity="64MiB",
        lease_ttl_s=1.5,
        heartbeat_interval_s=0.3,
        log_dir=tmp_path_factory.mktemp("lmcache-cluster"),
    )
    c.start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture()
def make_engine() -> Iterator[Callable[..., Engine]]:
    engines: list[Engine] = []

    def make(url: str, model: str, **overrides: Any) -> Engine:
        engines.append(Engine(url, model, **overrides))
        return engines[-1]

    yield make
    for e in engines:
        e.close()
    # Every memory object the connector handed out or took was given back.
    assert [e.allocated for e in engines] == [0] * len(engines), "LMCache memory leaked"


def cli_stats(
    metadata: str, until: Callable[[dict[str, Any]], bool] | None = None, timeout: float = 15.0
) -> dict[str, Any]:
    """``kvdepot stats --json``; with ``until``, asked again until it holds or ``timeout`` passes.

    Tier figures reach the metadata service with a store's next heartbeat, not with the
    read that changed them, so a test waits for them rather than for a fixed time.
    """
    deadline = time.monotonic() + timeout
    while True:
        out = subprocess.run(
            [sys.executable, "-m", "kvdepot.apps.cli", "stats", "--json", "--metadata", metadata],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        stats: dict[str, Any] = json.loads(out.stdout)
        if until is None or until(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


# -- the key mapping ------------------------------------------------------------------


def test_key_mapping_is_pinned_and_keeps_every_field_apart() -> None:
    base = CacheEngineKey("meta-llama/Llama-3.1-8B", 2, 1, 0x1234ABCD, torch.bfloat16)
    assert chunk_key(base, "raw").hex() == "2abff9027b14a45b9aadfac21b9a56fb"
    variants = [
        CacheEngineKey("meta-llama/Llama-3.1-8B-Instruct", 2, 1, 0x1234ABCD, torch.bfloat16),
        CacheEngineKey("meta-llama/Llama-3.1-8B", 4, 1, 0x1234ABCD, torch.bfloat16),
        CacheEngineKey("meta-llama/Llama-3.1-8B", 2, 0, 0x1234ABCD, torch.bfloat16),
        CacheEngineKey("meta-llama/Llama-3.1-8B", 2, 1, 0x1234ABCE, torch.bfloat16),
        CacheEngineKey("meta-llama/Llama-3.1-8B", 2, 1, -0x1234ABCD, torch.bfloat16),
        CacheEngineKey("meta-llama/Llama-3.1-8B", 2, 1, 2**200 + 0x1234ABCD, torch.bfloat16),
        CacheEngineKey("meta-llama/Llama-3.1-8B", 2, 1, b"\x12\x34\xab\xcd", torch.bfloat16),
        CacheEngineKey("meta-llama/Llama-3.1-8B", 2, 1, 0x1234ABCD, torch.float16),
        CacheEngineKey(
            "meta-llama/Llama-3.1-8B",
            2,
            1,
            0x1234ABCD,
            torch.bfloat16,
            request_configs={"lmcache.tag.user": "alice"},
        ),
        CacheEngineKey(
            "meta-llama/Llama-3.1-8B",
            2,
            1,
            0x1234ABCD,
            torch.bfloat16,
            request_configs={"lmcache.tag.user": "bob"},
        ),
        CacheEngineKey(
            "meta-llama/Llama-3.1-8B",
            2,
            1,
            0x1234ABCD,
            torch.bfloat16,
            request_configs={"lmcache.tag.useralice": ""},
        ),
        LayerCacheEngineKey("meta-llama/Llama-3.1-8B", 2, 1, 0x1234ABCD, torch.bfloat16),
        LayerCacheEngineKey(
            "meta-llama/Llama-3.1-8B", 2, 1, 0x1234ABCD, torch.bfloat16, layer_id=3
        ),
    ]
    keys = {chunk_key(k, "raw") for k in [base, *variants]}
    assert len(keys) == len(variants) + 1, "two different LMCache keys share a kvdepot key"
    assert chunk_key(base, "framed") not in keys
    # What LMCache treats as the same key maps to the same kvdepot key: untagged
    # request configs are not part of its identity, half is float16.
    same_key = CacheEngineKey(
        "meta-llama/Llama-3.1-8B",
        2,
        1,
        0x1234ABCD,
        torch.bfloat16,
        request_configs={"lmcache.lora": "x"},
    )
    assert same_key == base and chunk_key(same_key, "raw") == chunk_key(base, "raw")
    assert chunk_key(CacheEngineKey("m", 1, 0, 7, torch.half), "raw") == chunk_key(
        CacheEngineKey("m", 1, 0, 7, torch.float16), "raw"
    )
    # Round-tripped through LMCache's own string form, the key is the same.
    again = CacheEngineKey.from_string(variants[8].to_string())
    assert chunk_key(again, "raw") == chunk_key(variants[8], "raw")
    with pytest.raises(InvalidArgument):
        chunk_key(base, "zip")


def test_url_settings() -> None:
    s = PluginSettings.from_url("kvdepot://10.0.0.1:7700,10.0.0.2:7700?node_id=n3&io_threads=8")
    assert (s.metadata, s.node_id, s.io_threads, s.transport) == (
        "10.0.0.1:7700,10.0.0.2:7700",
        "n3",
        8,
        "auto",
    )
    for bad in (
        "redis://a:1",
        "kvdepot://",
        "kvdepot://a",
        "kvdepot://a:1/x",
        "kvdepot://a:1?colour=red",
        "kvdepot://a:1?io_threads=many",
    ):
        with pytest.raises(InvalidArgument):
            PluginSettings.from_url(bad)
    extra = {
        "remote_storage_plugin.kvdepot.b.url": "kvdepot://h:1",
        "remote_storage_plugin.kvdepot.b.module_path": "kvdepot.connector.lmcache",
    }
    assert resolve("plugin://kvdepot.b", extra).metadata == "h:1"
    assert resolve("", extra, plugins=["fs", "kvdepot.b"]).metadata == "h:1"
    with pytest.raises(InvalidArgument, match=r"remote_storage_plugin\.kvdepot\.url"):
        resolve("plugin://kvdepot", extra)


# -- LMCache's remote backend on kvdepot ------------------------------------------------


def test_put_exists_get_through_lmcache(
    shared_cluster: LocalCluster, make_engine: Callable[..., Engine]
) -> None:
    url = f"kvdepot://{shared_cluster.metadata_address}?node_id=store-0"
    e = make_engine(url, "test/put-get")
    assert e.remote.connection is not None, "LMCache did not load the kvdepot plugin"
    key, obj = e.key(1), e.chunk(1)
    assert not e.remote.contains(key)
    e.remote.submit_put_task(key, obj).result(30)
    assert e.remote.contains(key)
    assert e.call(e.remote.connection.exists(key))
    got = e.remote.get_blocking(key)
    assert same(got, obj) and got.get_memory_format() == obj.get_memory_format()
    got.ref_count_down()
    # The last chunk of a prompt is shorter; it comes back with its own shape.
    short_key, short = e.key(2), e.chunk(2, tokens=100)
    e.remote.submit_put_task(short_key, short).result(30)
    got = e.remote.get_blocking(short_key)
    assert got.get_shape()[2] == 100 and same(got, short)
    got.ref_count_down()
    # A missing key and a key with other tags are misses, not errors.
    for missing in (e.key(3), e.key(1, user="alice")):
        assert not e.remote.contains(missing)
        assert e.remote.get_blocking(missing) is None
    # Another engine (another process in real life) finds the same chunks.
    other = make_engine(f"kvdepot://{shared_cluster.metadata_address}", "test/put-get")
    got = other.remote.get_blocking(other.key(1))
    assert same(got, obj)
    got.ref_count_down()


def test_batched_operations_take_one_lookup_per_batch(
    shared_cluster: LocalCluster, make_engine: Callable[..., Engine]
) -> None:
    e = make_engine(f"kvdepot://{shared_cluster.metadata_address}?node_id=store-1", "test/batch")
    keys = [e.key(100 + i) for i in range(6)]
    objs = [e.chunk(100 + i) for i in range(5)] + [e.chunk(105, tokens=37)]
    client = e.connector._client
    before = client.stats()
    e.remote.batched_submit_put_task(keys, objs)
    deadline = time.monotonic() + 30
    while e.remote.batched_contains(keys) != 6:
        assert time.monotonic() < deadline, "batched put did not land"
        time.sleep(0.02)
    assert client.stats().puts_committed - before.puts_committed == 6
    assert e.call(e.remote.batched_async_contains("lookup-1", keys)) == 6
    before = client.stats()
    got = e.remote.batched_get_blocking(keys)
    after = client.stats()
    assert all(same(g, o) for g, o in zip(got, objs, strict=True))
    for g in got:
        g.ref_count_down()
    # Full chunks and a short last one, all in this node's store: read from
    # there, sizes included, without asking the metadata service.
    assert after.lookups - before.lookups == 0
    # Another node's engine: one lookup for the batch, the short chunk too.
    url = f"kvdepot://{shared_cluster.metadata_address}?node_id=store-0"
    other = make_engine(url, "test/batch")
    before = client.stats()
    got = other.remote.batched_get_blocking(keys)
    assert client.stats().lookups - before.lookups == 1
    assert all(same(g, o) for g, o in zip(got, objs, strict=True))
    for g in got:
        g.ref_count_down()
    # A hole in the middle: the usable prefix stops there.
    holed = [*keys[:2], e.key(999), *keys[3:]]
    assert e.remote.batched_contains(holed) == 2
    assert e.call(e.remote.batched_async_contains("lookup-2", holed)) == 2
    prefix = e.call(e.remote.batched_get_non_blocking("lookup-2", holed))
    assert len(prefix) == 2 and all(same(g, o) for g, o in zip(prefix, objs, strict=False))
    for g in prefix:
        g.ref_count_down()
    got = e.remote.batched_get_blocking(holed)
    assert got[2:] == [None] * 4 and same(got[0], objs[0])
    for g in got[:2]:
        g.ref_count_down()
    # Publishing the same chunks again sends no bytes: kvdepot deduplicates.
    before = client.stats()
    e.put(keys, objs)
    assert client.stats().chunks_deduplicated - before.chunks_deduplicated == 6


def test_blocking_calls_never_run_on_lmcache_event_loop(
    shared_cluster: LocalCluster, make_engine: Callable[..., Engine]
) -> None:
    e = make_engine(f"kvdepot://{shared_cluster.metadata_address}", "test/threads")
    conn = e.connector
    real = conn._client
    threads: set[str] = set()

    class Recording:
        def __getattr__(self, name: str) -> Any:
            attr = getattr(real, name)

            def call(*args: Any, **kwargs: Any) -> Any:
                threads.add(threading.current_thread().name)
                return attr(*args, **kwargs)

            return call

    conn._client = Recording()  # type: ignore[assignment]
    try:
        key, obj = e.key(1), e.chunk(1)
        e.remote.submit_put_task(key, obj).result(30)
        assert e.remote.contains(key)
        e.remote.get_blocking(key).ref_count_down()
        e.call(e.remote.batched_async_contains("x", [key]))
        assert e.call(e.remote.connection.ping()) == 0
    finally:
        conn._client = real
    assert threads and all(t.startswith("kvdepot-lmcache") for t in threads), threads


def test_concurrent_threads_and_tasks(
    shared_cluster: LocalCluster, make_engine: Callable[..., Engine]
) -> None:
    e = make_engine(f"kvdepot://{shared_cluster.metadata_address}?io_threads=4", "test/concurrent")
    per_worker = 4

    def worker(w: int) -> None:
        keys = [e.key(1000 * w + i) for i in range(per_worker)]
        objs = [e.chunk(1000 * w + i, tokens=CHUNK if i else 64) for i in range(per_worker)]
        futures = [e.remote.submit_put_task(k, o) for k, o in zip(keys, objs, strict=True)]
        for f in futures:
            f.result(30)
        for k, o in zip(keys, objs, strict=True):
            got = e.remote.get_blocking(k)
            assert same(got, o), f"worker {w} read wrong bytes"
            got.ref_count_down()

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(worker, range(4)))

    # Many reads in flight on the event loop at once, as LMCache's prefetch issues them.
    async def read_all() -> list[Any]:
        conn = e.remote.connection
        return await asyncio.gather(
            *(conn.get(e.key(1000 * w + i)) for w in range(4) for i in range(per_worker)),
            conn.get(e.key(424242)),
        )

    got = e.call(read_all())
    assert got[-1] is None
    assert all(g is not None for g in got[:-1])
    for g in got[:-1]:
        g.ref_count_down()


def test_framed_chunks_for_other_serdes(
    shared_cluster: LocalCluster, make_engine: Callable[..., Engine]
) -> None:
    url = f"kvdepot://{shared_cluster.metadata_address}"
    e = make_engine(url, "test/framed", remote_serde="kivi")
    assert e.connector.chunks.encoding == "framed"
    keys = [e.key(1), e.key(2)]
    objs = [e.chunk(1), e.chunk(2, tokens=10)]
    e.put(keys, objs)
    got = e.remote.batched_get_blocking(keys)
    assert same(got[0], objs[0]) and same(got[1], objs[1])
    for g in got:
        g.ref_count_down()
    # A layer-wise object ([tokens, 2, hidden] per layer) under a layer key.
    layer_key = LayerCacheEngineKey(e.model, 1, 0, 3, DTYPE, layer_id=2)
    layer = e.cpu.allocate(torch.Size([CHUNK, 2, HEADS * HEAD_DIM]), DTYPE, MemoryFormat.KV_T2D)
    e.owned.append(layer)
    layer.tensor.copy_(torch.randn(layer.tensor.shape))
    e.put([layer_key], [layer])
    got = e.remote.get_blocking(layer_key)
    assert same(got, layer) and got.get_memory_format() == MemoryFormat.KV_T2D
    got.ref_count_down()
    assert e.remote.get_blocking(e.key(3)) is None  # the chunk key of that hash is another key
    # Bytes stored framed are never read as raw chunks (nor the other way).
    raw = make_engine(url, "test/framed")
    assert raw.connector.chunks.encoding == "raw"
    assert raw.remote.get_blocking(raw.key(1)) is None


README_CONFIG = """
chunk_size: 256
local_cpu: true
max_local_cpu_size: 5
remote_serde: naive
remote_storage_plugins: ["kvdepot"]
extra_config:
  remote_storage_plugin.kvdepot.module_path: kvdepot.connector.lmcache
  remote_storage_plugin.kvdepot.class_name: KVDepotConnectorAdapter
  remote_storage_plugin.kvdepot.url: "kvdepot://METADATA?node_id=store-0"
"""


def test_other_ways_to_load_the_plugin(shared_cluster: LocalCluster, tmp_path: Path) -> None:
    e = Engine(f"kvdepot://{shared_cluster.metadata_address}", "test/load")
    try:
        # The configuration file the README shows, read by LMCache's own loader.
        path = tmp_path / "lmcache.yaml"
        path.write_text(README_CONFIG.replace("METADATA", shared_cluster.metadata_address))
        config = load_engine_config_with_overrides(config_file_path=str(path))
        conn = CreateConnector("plugin://kvdepot", e.loop, e.cpu, config, e.metadata, "kvdepot")
        inner = conn.getWrappedConnector()
        assert isinstance(inner, KVDepotLMCacheConnector) and inner.settings.node_id == "store-0"
        e.call(conn.close())
        # class_name may name the connector class itself (LMCache wraps it), by
        # its name or by the one it had before (configs written then).
        for class_name in ("KVDepotLMCacheConnector", "KVDepotConnector"):
            config = plugin_config(
                f"kvdepot://{shared_cluster.metadata_address}",
                extra_config={"remote_storage_plugin.kvdepot.class_name": class_name},
            )
            conn = CreateConnector("plugin://kvdepot", e.loop, e.cpu, config, e.metadata, "kvdepot")
            assert isinstance(conn.getWrappedConnector(), KVDepotLMCacheConnector)
            e.call(conn.close())
        # Without a URL the plugin says which key is missing.
        config = plugin_config("")
        with pytest.raises(InvalidArgument, match=r"remote_storage_plugin\.kvdepot\.url"):
            CreateConnector("plugin://kvdepot", e.loop, e.cpu, config, e.metadata, "kvdepot")
    finally:
        e.close()


class Slow:
    """A client whose data-plane calls take ``delay_s`` longer."""

    def __init__(self, real: Any, delay_s: float) -> None:
        self._real = real
        self._delay_s = delay_s

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._real, name)
        if name not in ("put", "get_into"):
            return attr

        def slow(*args: Any, **kwargs: Any) -> Any:
            time.sleep(self._delay_s)
            return attr(*args, **kwargs)

        return slow


def test_cancelled_calls_neither_leak_nor_corrupt(
    shared_cluster: LocalCluster,
    make_engine: Callable[..., Engine],
    caplog: pytest.LogCaptureFixture,
) -> None:
    e = make_engine(
        f"kvdepot://{shared_cluster.metadata_address}", "test/cancel", blocking_timeout_secs=1
    )
    conn = e.connector
    keys = [e.key(i) for i in range(3)]
    objs = [e.chunk(i) for i in range(3)]
    e.put(keys, objs)
    baseline = e.allocated
    real = conn._client
    conn._client = Slow(real, 1.5)  # type: ignore[assignment]
    try:
        # LMCache gives up on a read after blocking_timeout_secs and cancels it;
        # the objects the read still allocates and fills go back to LMCache.
        assert e.remote.batched_get_blocking(keys) == [None] * 3
        # A put cancelled (and its object released by LMCache) mid-flight still
        # sends the bytes it was given, never memory reused meanwhile.
        late_key, late = e.key(9), e.chunk(9)
        expected = bytes(late.byte_array)
        late.ref_count_up()
        future = asyncio.run_coroutine_threadsafe(e.remote.connection.put(late_key, late), e.loop)
        time.sleep(0.3)
        future.cancel()
        e.owned.remove(late)
        late.ref_count_down()  # nobody holds it now but the connector
        # Were its memory free, this would reuse it before the bytes are sent.
        before = e.allocated
        filler = e.chunk(10)
        filler_bytes = e.allocated - before
        deadline = time.monotonic() + 10
        while e.allocated != baseline + filler_bytes:
            assert time.monotonic() < deadline, "a cancelled call kept LMCache memory"
            time.sleep(0.05)
        e.owned.remove(filler)
        filler.ref_count_down()
    finally:
        conn._client = real
    got = e.remote.get_blocking(late_key)
    assert got is not None and bytes(got.byte_array) == expected
    got.ref_count_down()
    # Released by the connector, not reclaimed by LMCache's garbage-collection safety net.
    assert "garbage collected" not in caplog.text
    assert "negative" not in caplog.text


# -- failures and statistics ---------------------------------------------------------------


def test_dead_store_and_dead_metadata_are_misses(
    cluster: LocalCluster, make_engine: Callable[..., Engine]
) -> None:
    victim = cluster.stores[1]
    e = make_engine(
        f"kvdepot://{cluster.metadata_address}?node_id={victim.info['node_id']}&rpc_timeout_s=2",
        "test/dead",
    )
    keys = [e.key(i) for i in range(3)]
    e.put(keys, [e.chunk(i) for i in range(3)])
    assert e.remote.batched_contains(keys) == 3
    os.kill(victim.pid, signal.SIGKILL)
    victim.proc.wait()
    started = time.monotonic()
    # The index still lists the chunks until the store's lease runs out:
    # reading them is a miss, never an exception.
    assert e.remote.get_blocking(keys[0]) is None
    assert e.remote.batched_get_blocking(keys) == [None] * 3
    assert e.call(e.remote.batched_get_non_blocking("x", keys)) == []
    assert time.monotonic() - started < 5, "a dead store must fail fast"
    # Once its lease ran out the chunks are gone, and new puts land on the survivor.
    while e.remote.batched_contains(keys):
        assert time.monotonic() - started < cluster.lease_ttl_s + 5, "lease not enforced"
        time.sleep(0.05)
    e.put(keys, [e.chunk(10 + i) for i in range(3)])
    got = e.remote.get_blocking(keys[0])
    assert same(got, e.owned[-3])
    got.ref_count_down()
    # Without the metadata service nothing raises: lookups find nothing (this
    # node's store is the dead one), and what the survivor served whole is
    # still read from it, verified (connector/fallback.py), the rest misses.
    assert cluster.metadata is not None
    os.kill(cluster.metadata.pid, signal.SIGKILL)
    cluster.metadata.proc.wait()
    assert not e.remote.contains(keys[0])
    assert e.remote.batched_contains(keys) == 0
    assert e.call(e.remote.batched_async_contains("y", keys)) == 0
    got = e.remote.get_blocking(keys[0])
    assert got is not None and same(got, e.owned[-3])
    got.ref_count_down()
    assert e.remote.get_blocking(e.key(77)) is None  # never stored: a miss
    e.remote.submit_put_task(e.key(50), e.chunk(50)).result(30)
    assert e.remote.put_failed_count == 0
    assert e.call(e.remote.connection.ping()) != 0


def test_kvdepot_stats_count_lmcache_traffic(
    cluster: LocalCluster, make_engine: Callable[..., Engine]
) -> None:
    e = make_engine(f"kvdepot://{cluster.metadata_address}", "test/stats")
    keys = [e.key(i) for i in range(4)]
    e.put(keys, [e.chunk(i) for i in range(4)])
    assert e.remote.batched_contains([*keys, e.key(99)]) == 4  # 4 hits, 1 miss
    got = e.remote.batched_get_blocking(keys)  # 4 hits
    for g in got:
        g.ref_count_down()

    def tier_hits(stats: dict[str, Any]) -> int:
        return sum(t["hits"] for n in stats["nodes"] for t in n["tiers"])

    stats = cli_stats(cluster.metadata_address, until=lambda s: tier_hits(s) >= 4)
    chunk_bytes = 2 * LAYERS * CHUNK * HEADS * HEAD_DIM * 2
    assert stats["puts_committed"] == 4
    assert stats["bytes_committed"] == 4 * chunk_bytes
    assert stats["chunks"] == 4
    assert (stats["hit_keys"], stats["miss_keys"]) == (8, 1)
    assert (stats["hit_tokens"], stats["miss_tokens"]) == (8 * CHUNK, CHUNK)
    assert tier_hits(stats) >= 4


def test_url_settings_take_a_token_file_never_a_token(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t" * 32 + "\n")
    token.chmod(0o600)
    s = PluginSettings.from_url(f"kvdepot://h:1?auth_token_file={token}&tls_server_name=kv")
    security = s.security({})
    assert security.tokens().token == "t" * 32 and security.tls_server_name == "kv"
    # The environment serves when the URL names no file.
    assert PluginSettings.from_url("kvdepot://h:1").security(
        {"KVDEPOT_AUTH_TOKEN": "e" * 32}
    ).tokens().token == "e" * 32
    with pytest.raises(InvalidArgument):
        PluginSettings.from_url("kvdepot://h:1?auth_token=" + "t" * 32)
