"""Faults of the metadata tier: replicas over a shared Redis (or Redis Cluster)
with real stores. A metadata replica SIGKILLed mid-run (clients and stores
fail over to the other), the index flushed, Redis restarted empty (the stores
re-announce their inventory and the index is rebuilt).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvdepot.apps.cluster import LocalCluster, wait_ready
from kvdepot.connector.client import ClientConfig, KVDepotClient, PutResult
from kvdepot.errors import Unavailable
from kvdepot.keys import ChunkKey, Namespace, chunk_keys
from tests.conftest import _redis_binaries, _start_redis, _stop_redis, free_port
from tests.faults.support import ReadTally, sentinel_buffers

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.redis]

NS = Namespace("test/redis-index", chunk_tokens=16)
CHUNK = 64 << 10


def payload(key: bytes) -> np.ndarray:
    rng = np.random.default_rng(int.from_bytes(key, "little"))
    return np.frombuffer(rng.bytes(CHUNK), dtype=np.uint8)


@contextlib.contextmanager
def daemon(args: list[str], log: Path) -> Iterator[dict[str, Any]]:
    """A kvdepot daemon subprocess; yields what its READY line announced, and its "pid"."""
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvdepot.apps.cli", "--log-level", "WARNING", *args],
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
        )
    try:
        yield {**wait_ready(proc, args[0], 60), "pid": proc.pid}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def metadata(
    url: str, log: Path, lease_ttl_s: float = 1.5
) -> contextlib.AbstractContextManager[dict[str, Any]]:
    return daemon(
        [
            "metadata",
            "--host", "127.0.0.1",
            "--port", "0",
            "--index", url,
            "--lease-ttl", str(lease_ttl_s),
            "--heartbeat-interval", "0.3",
        ],
        log,
    )  # fmt: skip


def store(
    metadata_port: int, log: Path, node_id: str = "s0"
) -> contextlib.AbstractContextManager[dict[str, Any]]:
    """A store daemon of 32 MiB registered with the metadata service on ``metadata_port``."""
    return daemon(
        [
            "store",
            "--metadata", f"127.0.0.1:{metadata_port}",
            "--host", "127.0.0.1",
            "--port", "0",
            "--grpc-port", "0",
            "--capacity", "32MiB",
            "--node-id", node_id,
        ],
        log,
    )  # fmt: skip


def refused(port: int) -> bool:
    """Whether nothing listens on ``port`` of 127.0.0.1 any more."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


def wait_for(check: Any, timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def test_replicas_share_the_index_and_rebuild_it_after_a_flush(
    redis_server: str, tmp_path: Path
) -> None:
    """Two metadata replicas over one Redis share the index (a prefix
    published through A is deduplicated through B); then the index is lost
    (FLUSHALL).

    Lost: nothing committed: the store registers again with its inventory,
    both replicas answer lookups as before and every chunk reads back exact.
    Served wrong: nothing.
    """
    import redis

    url = f"{redis_server}?prefix=e2e-{uuid.uuid4().hex[:8]}"
    with (
        metadata(url, tmp_path / "metadata-a.log") as a,
        metadata(url, tmp_path / "metadata-b.log") as b,
        store(a["port"], tmp_path / "store.log"),
        KVDepotClient(ClientConfig(metadata=f"127.0.0.1:{a['port']}", node_id="s0")) as via_a,
        KVDepotClient(ClientConfig(metadata=f"127.0.0.1:{b['port']}")) as via_b,
    ):
        assert wait_for(lambda: len(via_b.stats().nodes) == 1), "store not visible through B"
        keys = chunk_keys(NS, list(range(16 * 8)))
        data = [payload(k) for k in keys]
        result = via_a.put(keys, data)
        assert result.stored == len(keys)
        # A second publish of the same prefix through the other replica is skipped.
        assert via_b.put(keys, data).skipped == len(keys)

        before_a, before_b = via_a.lookup_locations(keys), via_b.lookup_locations(keys)
        assert before_a.hits == before_b.hits == len(keys)
        assert before_a.locations == before_b.locations
        assert {r.node_id for loc in before_b.locations for r in loc.replicas} == {"s0"}

        def pulled_intact() -> bool:
            bufs = [np.zeros(CHUNK, dtype=np.uint8) for _ in keys]
            got = via_b.get_into(keys, bufs)
            return got.leading == len(keys) and all(
                np.array_equal(x, y) for x, y in zip(bufs, data, strict=True)
            )

        assert pulled_intact()

        # Index loss: the store's next heartbeat is refused and it registers again.
        with redis.Redis.from_url(redis_server) as r:
            r.flushall()
        assert wait_for(lambda: via_b.lookup(keys) == len(keys)), "index not rebuilt"
        assert "registering again" in (tmp_path / "store.log").read_text()
        assert via_b.lookup_locations(keys).locations == before_b.locations
        assert via_a.lookup_locations(keys).locations == before_a.locations
        assert pulled_intact()  # no bytes lost


def test_redis_cluster_replica_killed_mid_run_and_a_dead_store(
    redis_cluster: str, tmp_path: Path
) -> None:
    """Two metadata replicas over a 3-master Redis Cluster: one is SIGKILLed
    mid-run and clients and the store carry on through the other; a SIGKILLed
    store's chunks then vanish from lookups within its lease.

    Lost: nothing committed while replica A died (all six chunks listed and
    exact through B); then the dead store's chunks, which leave the index.
    Served wrong: nothing.
    """
    url = f"{redis_cluster}?prefix=kill-{uuid.uuid4().hex[:8]}"
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(args: list[str], name: str) -> dict[str, Any]:
        p = subprocess.Popen(
            [sys.executable, "-m", "kvdepot.apps.cli", "--log-level", "WARNING", *args],
            stdout=subprocess.PIPE,
            stderr=open(tmp_path / f"{name}.log", "wb"),  # noqa: SIM115 - lives with p
            stdin=subprocess.DEVNULL,
        )
        procs.append(p)
        return wait_ready(p, name, 60)

    try:
        meta = [
            spawn(
                [
                    "metadata",
                    "--port",
                    "0",
                    "--index",
                    url,
                    "--lease-ttl",
                    "1.5",
                    "--heartbeat-interval",
                    "0.3",
                ],
                f"meta{i}",
            )
            for i in range(2)
        ]
        both = ",".join(f"127.0.0.1:{m['port']}" for m in meta)
        spawn(
            ["store", "--port", "0", "--metadata", both, "--capacity", "32MiB", "--node-id", "s0"],
            "store",
        )
        keys = chunk_keys(NS, list(range(16 * 6)))
        with KVDepotClient(ClientConfig(metadata=both, rpc_timeout_s=3)) as client:
            assert wait_for(lambda: client.stats().nodes)
            assert client.put(keys[:3], [payload(k) for k in keys[:3]]).stored == 3
            procs[0].kill()  # metadata replica A, mid-run
            procs[0].wait()
            assert client.put(keys, [payload(k) for k in keys]).stored == 3  # 3 skipped
            assert client.lookup(keys) == 6
            bufs = [np.zeros(CHUNK, dtype=np.uint8) for _ in keys]
            assert client.get_into(keys, bufs).leading == 6
            assert all(np.array_equal(b, payload(k)) for k, b in zip(keys, bufs, strict=True))
            # The store keeps its lease through replica B: still listed later.
            time.sleep(2.0)
            assert wait_for(lambda: client.lookup(keys) == 6, timeout_s=5.0)
            procs[2].kill()  # the store
            procs[2].wait()
            killed = time.monotonic()
            assert wait_for(lambda: client.lookup(keys) == 0, timeout_s=5.0)
            assert time.monotonic() - killed < 1.5 + 3.0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def test_metadata_replica_sigkill_under_load_fails_over(redis_server: str, tmp_path: Path) -> None:
    """Two metadata replicas share one Redis; a client and a store call both
    ("A,B") while a loop publishes and pulls fresh prefixes; A is SIGKILLed
    mid-run, with calls in flight.

    Lost: nothing committed: every prefix a put reported stored, before or
    after the kill, is still listed and reads back exact. Served wrong:
    nothing. No error reached the caller: the client and the store failed
    over to B. (A put whose PutStart A had run just before dying gets the same
    allocations again from B, by its request id, instead of finding its keys
    pending: see the lost-reply test below.)
    """
    url = f"{redis_server}?prefix=failover-{uuid.uuid4().hex[:8]}"
    store_log = tmp_path / "store.log"
    tally = ReadTally()
    # A lease long enough that the store's failover never lets it lapse on a
    # loaded machine: then every read after the kill must hit.
    with (
        metadata(url, tmp_path / "metadata-a.log", lease_ttl_s=3.0) as a,
        metadata(url, tmp_path / "metadata-b.log", lease_ttl_s=3.0) as b,
    ):
        both = f"127.0.0.1:{a['port']},127.0.0.1:{b['port']}"
        store_args = ["store", "--metadata", both, "--port", "0", "--grpc-port", "0",
                      "--capacity", "48MiB", "--node-id", "s0"]  # fmt: skip
        with (
            daemon(store_args, store_log),
            KVDepotClient(ClientConfig(metadata=both, rpc_timeout_s=3)) as client,
        ):
            assert wait_for(lambda: len(client.stats().nodes) == 1), "store not registered"
            cycles: list[tuple[float, PutResult, list[ChunkKey], int]] = []
            errors: list[BaseException] = []
            stop = threading.Event()

            def run() -> None:
                try:
                    seed = 10_000
                    while not stop.is_set():
                        seed += 1
                        keys = chunk_keys(NS, [seed] * 16 * 4)
                        start = time.monotonic()
                        put = client.put(keys, [payload(k) for k in keys])
                        bufs = sentinel_buffers(len(keys), CHUNK)
                        got = tally.add(keys, bufs, client.get_into(keys, bufs), payload)
                        cycles.append((start, put, keys, got))
                except BaseException as exc:  # reported by the assertions below
                    errors.append(exc)

            t = threading.Thread(target=run)
            t.start()
            try:
                assert wait_for(lambda: len(cycles) >= 5 or errors), "no progress before the kill"
                os.kill(a["pid"], signal.SIGKILL)
                assert wait_for(lambda: refused(a["port"])), "replica A still listens"
                killed_at = time.monotonic()  # A is gone: whatever starts now cannot reach it
                assert wait_for(
                    lambda: sum(s > killed_at for s, _, _, _ in cycles) >= 10 or errors,
                    timeout_s=30,
                ), "no progress after the kill"
            finally:
                stop.set()
                t.join(30)
            assert not t.is_alive() and not errors, errors
            after = [(p, n) for s, p, _, n in cycles if s > killed_at]
            assert all(p.stored == 4 and n == 4 for p, n in after), after
            # Nothing committed is lost (a lapsed lease would be re-announced).
            committed = [keys for _, p, keys, _ in cycles if p.stored == len(keys)]
            assert len(committed) >= len(cycles) - 1
            every = [k for keys in committed for k in keys]
            assert wait_for(lambda: all(client.lookup(keys) == 4 for keys in committed))
            bufs = sentinel_buffers(len(every), CHUNK)
            assert tally.add(every, bufs, client.get_into(every, bufs), payload) == len(every)
        assert "failing over to metadata" in store_log.read_text()
    assert tally.wrong == 0, f"{tally.wrong} chunks served with wrong bytes"


def test_redis_restart_empty_rebuilds_the_index_from_the_stores(tmp_path: Path) -> None:
    """Redis (no persistence) under a metadata service and two stores is
    SIGKILLed, then restarted empty on the same port.

    Lost: nothing committed: both stores re-announce their inventory, every
    lookup answers as before (same hits, same replicas), every chunk reads
    back exact and a republish is deduplicated again. Served wrong: nothing;
    while Redis was down a read failed with a clear ``Unavailable``, no bytes.
    """
    binary = _redis_binaries("redis-server")["redis-server"]
    port = free_port()
    redis_dir = tmp_path / "redis"
    procs = [_start_redis(binary, redis_dir, port)]
    tally = ReadTally()
    try:
        with LocalCluster(
            nodes=2,
            capacity="32MiB",
            lease_ttl_s=1.5,
            heartbeat_interval_s=0.3,
            log_dir=tmp_path / "logs",
            index=f"redis://127.0.0.1:{port}/0",
        ) as cl:
            prefixes = [chunk_keys(NS, [20_000 + i] * 16 * 6) for i in range(2)]
            for store, keys in zip(cl.stores, prefixes, strict=True):
                cfg = ClientConfig(metadata=cl.metadata_address, node_id=store.info["node_id"])
                with KVDepotClient(cfg) as c:
                    assert c.put(keys, [payload(k) for k in keys]).stored == len(keys)
            every = [k for keys in prefixes for k in keys]
            cfg = ClientConfig(metadata=cl.metadata_address, rpc_timeout_s=3)
            with KVDepotClient(cfg) as c:
                before = [c.lookup_locations(keys) for keys in prefixes]
                assert [x.hits for x in before] == [6, 6]
                assert {r.node_id for x in before for loc in x.locations for r in loc.replicas} == {
                    s.info["node_id"] for s in cl.stores
                }

                procs[0].kill()
                procs[0].wait()
                bufs = sentinel_buffers(len(every), CHUNK)
                with pytest.raises(Unavailable):
                    c.get_into(every, bufs)
                with pytest.raises(Unavailable):
                    c.put(every[:1], [payload(every[0])])

                procs.append(_start_redis(binary, redis_dir, port))  # empty

                def rebuilt() -> bool:
                    # The first calls after the restart may still find the
                    # service's old connections to Redis dead: Unavailable.
                    try:
                        return all(c.lookup(keys) == 6 for keys in prefixes)
                    except Unavailable:
                        return False

                assert wait_for(rebuilt, timeout_s=20), "index not rebuilt"
                assert [c.lookup_locations(keys) for keys in prefixes] == before
                bufs = sentinel_buffers(len(every), CHUNK)
                assert tally.add(every, bufs, c.get_into(every, bufs), payload) == len(every)
                assert c.put(every, [payload(k) for k in every]).skipped == len(every)
        for name in ("store-0", "store-1"):
            assert "registering again" in (tmp_path / "logs" / f"{name}.log").read_text()
    finally:
        _stop_redis(procs)
    assert tally.wrong == 0, f"{tally.wrong} chunks served with wrong bytes"


class MutedReplies:
    """A TCP relay to ``127.0.0.1:port`` that, once :attr:`muted` is set, drops
    whatever the server sends back: requests still arrive and are acted on,
    their replies are lost, as with a replica that hangs or dies after acting.
    """

    def __init__(self, port: int) -> None:
        self._port = port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.muted = threading.Event()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self._listener.accept()
                up = socket.create_connection(("127.0.0.1", self._port))
            except OSError:
                return
            self._socks += [down, up]
            threading.Thread(target=self._relay, args=(down, up, False), daemon=True).start()
            threading.Thread(target=self._relay, args=(up, down, True), daemon=True).start()

    def _relay(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                if not (replies and self.muted.is_set()):
                    dst.sendall(data)

    def close(self) -> None:
        self._listener.close()
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


def test_put_whose_put_start_reply_was_lost_is_stored_through_the_other_replica(
    redis_server: str, tmp_path: Path
) -> None:
    """Replica A runs a put's PutStart, allocates its keys, and its reply is
    lost; the client's deadline passes and it retries the same request on B.

    Lost: nothing: B recognises the put's request id and hands back A's
    allocations (same node), so every chunk is stored and committed instead
    of skipped as pending until the allocations expire. Served wrong: nothing.
    """
    url = f"{redis_server}?prefix=lost-reply-{uuid.uuid4().hex[:8]}"
    relay: MutedReplies | None = None
    with (
        metadata(url, tmp_path / "metadata-a.log") as a,
        metadata(url, tmp_path / "metadata-b.log") as b,
    ):
        both = f"127.0.0.1:{a['port']},127.0.0.1:{b['port']}"
        store_args = ["store", "--metadata", both, "--port", "0", "--grpc-port", "0",
                      "--capacity", "16MiB", "--node-id", "s0"]  # fmt: skip
        try:
            relay = MutedReplies(a["port"])
            via_relay = f"127.0.0.1:{relay.port},127.0.0.1:{b['port']}"
            with (
                daemon(store_args, tmp_path / "store.log"),
                KVDepotClient(ClientConfig(metadata=via_relay, rpc_timeout_s=2)) as client,
            ):
                # Through A (behind the relay) while its replies still arrive.
                assert wait_for(lambda: len(client.stats().nodes) == 1), "store not registered"
                keys = chunk_keys(NS, list(range(5000, 5000 + 16 * 4)))
                relay.muted.set()
                put = client.put(keys, [payload(k) for k in keys])
                assert (put.stored, put.skipped, put.failed) == (4, 0, 0)
                bufs = sentinel_buffers(len(keys), CHUNK)
                assert client.get_into(keys, bufs).leading == 4
                assert all(np.array_equal(x, payload(k)) for k, x in zip(keys, bufs, strict=True))
        finally:
            if relay is not None:
                relay.close()
