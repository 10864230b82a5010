"""A store frozen by SIGSTOP: a client call costs at most its I/O timeout.

A frozen store still accepts connections, so nothing fails fast: every
exchange with it waits out the timeout. A plain client (the store is its own
node's) tries the same store several times in one call: a put writes into it
first, then sends what it refused where ``PutStart`` places it, the same
store; a read tries it first, then the replicas the lookup names, the same
store again. Each call must still end within ``io_timeout_s`` (plus the
metadata calls it makes, to a service that is not frozen), whatever
transport carries it; once the store runs again, the next calls succeed, and
``auto`` reaches it over ``shm`` again, not over ``tcp`` from then on.

The NIXL client runs in a child process of its own (see
tests/integration/test_nixl.py).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvdepot.apps.cluster import LocalCluster
from kvdepot.connector.client import ClientConfig, KVDepotClient
from kvdepot.connector.transport import AutoTransport, Transport, create_transport
from kvdepot.keys import ChunkKey
from kvdepot.wire.nixl import nixl_available
from tests.faults.support import wait_for
from tests.procs import freeze

pytestmark = [pytest.mark.faults, pytest.mark.integration]

IO_TIMEOUT_S = 2.0
BOUND_S = 1.2 * IO_TIMEOUT_S
"""What a call may take beside its metadata calls."""
KiB = 1 << 10
CHUNK = 64 * KiB  # a put's bytes fit the sockets' buffers of a store that reads nothing
THAW_S = 10.0
"""Time a thawed store may take to be tried again (a probe each half second)."""


class TimedMetadata:
    """The client's metadata client, timing every call through it: the
    service is not frozen, and what its calls take is not the data plane's."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.spent = 0.0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.monotonic()
            try:
                return attr(*args, **kwargs)
            finally:
                self.spent += time.monotonic() - t0

        return timed


def timed_call(c: KVDepotClient, call: Callable[[], Any]) -> tuple[Any, float, float]:
    """``call()``'s result, its wall time, and the part its metadata calls took."""
    meta = TimedMetadata(c._metadata)
    c._metadata = meta  # type: ignore[assignment]
    try:
        t0 = time.monotonic()
        result = call()
        return result, time.monotonic() - t0, meta.spent
    finally:
        c._metadata = meta._inner


def chunk_set(seed: str, n: int = 4) -> tuple[list[ChunkKey], list[np.ndarray]]:
    rng = random.Random(seed)
    keys = [ChunkKey(rng.randbytes(16)) for _ in range(n)]
    return keys, [np.frombuffer(rng.randbytes(CHUNK), dtype=np.uint8) for _ in keys]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    # A lease far longer than the freezes: the frozen store stays a live node,
    # so lookups and placements keep naming it.
    c = LocalCluster(
        nodes=1, capacity="64MiB", lease_ttl_s=60, log_dir=tmp_path_factory.mktemp("logs")
    )
    c.start()
    try:
        yield c
    finally:
        c.stop()


def client_config(cl: LocalCluster, node_id: str, transport: str) -> ClientConfig:
    return ClientConfig(
        metadata=cl.metadata_address,
        node_id=node_id,
        transport=transport,
        rpc_timeout_s=5.0,
        connect_timeout_s=IO_TIMEOUT_S,
        io_timeout_s=IO_TIMEOUT_S,
    )


FAST_S = 0.5
"""What a call to a store already known to be stalled may take beside its metadata calls."""


def frozen_episode(
    c: KVDepotClient, pid: int, first: Callable[[], Any], second: Callable[[], Any]
) -> tuple[tuple[Any, float, float], tuple[Any, float, float]]:
    """``first`` and then ``second`` with the store at ``pid`` frozen: each
    one's result, wall time and metadata time."""
    freeze(pid)
    try:
        return timed_call(c, first), timed_call(c, second)
    finally:
        os.kill(pid, signal.SIGCONT)


@pytest.mark.parametrize("name", ["tcp", "shm", "auto"])
def test_a_frozen_store_costs_a_call_one_io_timeout(cluster: LocalCluster, name: str) -> None:
    store = cluster.stores[0]
    address, node_id = store.info["address"], store.info["node_id"]
    config = client_config(cluster, node_id, name)
    transport: Transport = create_transport(
        name, connect_timeout_s=IO_TIMEOUT_S, io_timeout_s=IO_TIMEOUT_S
    )
    stored, stored_data = chunk_set(f"stored-{name}")
    # New chunks for each put: one that failed on the frozen store may have
    # been stored once it ran again (the bytes were in its socket).
    fresh = (chunk_set(f"fresh-{name}-{i}") for i in range(3))
    with KVDepotClient(config, transport=transport) as c:
        assert c.put(stored, stored_data).stored == 4
        bufs = [np.zeros(CHUNK, dtype=np.uint8) for _ in stored]

        def get() -> Any:
            return c.get_into(stored, bufs)

        def put() -> Any:
            return c.put(*next(fresh))

        assert all(get().loaded)  # connections pooled, nothing owed
        timings = []
        # Each call first, on a store not yet known to be frozen (its one
        # timeout), then the other, which fails at once.
        for slow, fast in ((put, get), (get, put)):
            (r1, s1, m1), (r2, s2, m2) = frozen_episode(c, store.pid, slow, fast)
            timings.append(f"{slow.__name__} {s1:.2f} s (metadata {m1:.3f} s)")
            timings.append(f"then {fast.__name__} {s2:.2f} s (metadata {m2:.3f} s)")
            put_result, get_result = (r1, r2) if slow is put else (r2, r1)
            assert not any(get_result.loaded)
            assert (put_result.stored, put_result.failed) == (0, 4), put_result
            assert s1 - m1 <= BOUND_S, timings
            assert s2 - m2 <= FAST_S, timings
            assert transport.stalled(address)
            wait_for(lambda: not transport.stalled(address), THAW_S, "the store is tried again")
            assert all(get().loaded)
            assert all(np.array_equal(b, d) for b, d in zip(bufs, stored_data, strict=True))
            if isinstance(transport, AutoTransport):
                assert transport.choice(address) == "shm"  # its best, not tcp from now on
        print(f"\n{name}, io_timeout_s {IO_TIMEOUT_S}, frozen: {'; '.join(timings)}")
        assert put().stored == 4


def test_a_put_larger_than_the_socket_buffers_costs_one_io_timeout(cluster: LocalCluster) -> None:
    """A frozen store's kernel keeps taking bytes while its buffers have room:
    each blocking send comes back short after a whole timeout. The put ends
    at the first of them, not after one timeout per buffer's worth."""
    store = cluster.stores[0]
    config = client_config(cluster, store.info["node_id"], "tcp")
    rng = random.Random("large")
    keys = [ChunkKey(rng.randbytes(16)) for _ in range(2)]
    data = [np.frombuffer(rng.randbytes(4 << 20), dtype=np.uint8) for _ in keys]
    with KVDepotClient(config) as c:
        assert c.put(*chunk_set("large-warm")).stored == 4  # learns its node's store
        freeze(store.pid)
        try:
            result, spent, meta = timed_call(c, lambda: c.put(keys, data))
        finally:
            os.kill(store.pid, signal.SIGCONT)
        assert result.stored == 0
        assert spent - meta <= BOUND_S, f"{spent:.2f} s, metadata {meta:.3f} s"


# Nothing listens beyond loopback; UCX's InfiniBand modules crash without a device.
UCX_ENV = {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib,ib_mlx5,ib_efa,rdmacm"}

NIXL_CLIENT = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np
    from kvdepot.connector.client import KVDepotClient
    from kvdepot.connector.transport import create_transport
    from tests.faults.test_frozen_store import (
        IO_TIMEOUT_S, THAW_S, chunk_set, client_config, timed_call,
    )

    metadata, address, node_id = sys.argv[1:4]

    class Cluster:
        metadata_address = metadata

    transport = create_transport("nixl", connect_timeout_s=IO_TIMEOUT_S, io_timeout_s=IO_TIMEOUT_S)
    stored, stored_data = chunk_set("stored-nixl")
    fresh = (chunk_set(f"fresh-nixl-{i}") for i in range(3))
    out = {}
    with KVDepotClient(client_config(Cluster, node_id, "nixl"), transport=transport) as c:
        assert c.put(stored, stored_data).stored == 4
        bufs = [np.zeros(d.size, dtype=np.uint8) for d in stored_data]
        assert all(c.get_into(stored, bufs).loaded)
        print("ready", flush=True)
        for first in ("put", "get"):
            assert sys.stdin.readline() == "frozen\\n"
            calls = {"get": lambda: c.get_into(stored, bufs)}
            calls["put"] = lambda: c.put(*next(fresh))
            second = "get" if first == "put" else "put"
            got, out[first + "_s"], out[first + "_rpc_s"] = timed_call(c, calls[first])
            done, out[second + "_s2"], out[second + "_rpc_s2"] = timed_call(c, calls[second])
            get, put = (done, got) if first == "put" else (got, done)
            out["loaded"] = out.get("loaded", 0) + sum(get.loaded)
            out["stored"] = out.get("stored", 0) + put.stored
            out["failed"] = out.get("failed", 0) + put.failed
            out["stalled"] = out.get("stalled", True) and transport.stalled(address)
            print(json.dumps(out), flush=True)
            assert sys.stdin.readline() == "thawed\\n"
            deadline = time.monotonic() + THAW_S
            while transport.stalled(address) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not transport.stalled(address)
            assert all(c.get_into(stored, bufs).loaded)
            print("recovered", flush=True)
        after = {"loaded": sum(c.get_into(stored, bufs).loaded)}
        after["exact"] = all(np.array_equal(b, d) for b, d in zip(bufs, stored_data))
        after["stored"] = c.put(*next(fresh)).stored
        print(json.dumps(after), flush=True)
    """
)


@pytest.mark.nixl
@pytest.mark.skipif(not nixl_available(), reason="NIXL not installed (kvdepot[rdma])")
def test_a_frozen_nixl_store_costs_a_call_one_io_timeout(tmp_path: Path) -> None:
    env = dict(os.environ, KVDEPOT_STORE_NIXL="on", KVDEPOT_STORE_SHM="0", **UCX_ENV)
    with LocalCluster(nodes=1, capacity="48MiB", lease_ttl_s=60, env=env, log_dir=tmp_path) as cl:
        store = cl.stores[0]
        assert store.info["nixl"] is True
        root = Path(__file__).resolve().parents[2]
        info = store.info
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                NIXL_CLIENT,
                cl.metadata_address,
                *(info["address"], info["node_id"]),
            ],
            env=dict(os.environ, **UCX_ENV, PYTHONPATH=str(root)),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdin is not None and child.stdout is not None
        try:
            assert child.stdout.readline() == "ready\n"
            for _ in range(2):
                freeze(store.pid)
                try:
                    child.stdin.write("frozen\n")
                    child.stdin.flush()
                    frozen = json.loads(child.stdout.readline())
                finally:
                    os.kill(store.pid, signal.SIGCONT)
                child.stdin.write("thawed\n")
                child.stdin.flush()
                # Not frozen again before the child saw it run.
                assert child.stdout.readline() == "recovered\n"
            after = json.loads(child.stdout.readline())
            assert child.wait(60) == 0
        finally:
            child.kill()
            child.wait(10)
    print(f"\nnixl: frozen {frozen}, io_timeout_s {IO_TIMEOUT_S}")
    assert (frozen["loaded"], frozen["stored"], frozen["failed"]) == (0, 0, 8)
    assert frozen["stalled"]
    for op in ("get", "put"):
        assert frozen[op + "_s"] - frozen[op + "_rpc_s"] <= BOUND_S, frozen
        assert frozen[op + "_s2"] - frozen[op + "_rpc_s2"] <= FAST_S, frozen
    assert after == {"loaded": 4, "exact": True, "stored": 4}
