"""Registration at production size, against a real ``kvdepot metadata`` daemon.

Synthetic nodes speak the real gRPC API: a node with millions of chunks
registers in pages while another node heartbeats and a reader looks up, on
the memory index and on a real Redis. What must hold: no other node expires,
lookups are answered throughout, the whole inventory is indexed, a second
registration replaces the first, and a registration cut off half-way never
leaves a chunk named that the node does not hold.
"""

from __future__ import annotations

import contextlib
import itertools
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from kvdepot.apps.cluster import wait_ready
from kvdepot.proto.gen import metadata_pb2, metadata_pb2_grpc

pytestmark = [pytest.mark.integration]

BIG = 5_000_000
LEASE_S = 2.0


@contextlib.contextmanager
def metadata_daemon(index: str, log: Path) -> Iterator[str]:
    """A ``kvdepot metadata`` subprocess; yields its gRPC address."""
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "kvdepot.apps.cli", "--log-level", "INFO",
                "metadata", "--host", "127.0.0.1", "--port", "0", "--index", index,
                "--lease-ttl", str(LEASE_S), "--heartbeat-interval", "0.5",
            ],
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    try:
        info = wait_ready(proc, "metadata", 60)
        yield f"127.0.0.1:{info['port']}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def inventory(count: int, seed: int) -> bytes:
    """``count`` distinct random 16-byte keys, concatenated."""
    return np.random.default_rng(seed).bytes(16 * count)


class Node:
    """A synthetic store node: registers an inventory in pages, heartbeats."""

    def __init__(self, stub: Any, node_id: str, instance: str = "i1") -> None:
        self.stub = stub
        self.node_id = node_id
        self.instance = instance
        self.epoch = 0

    def begin(self) -> int:
        reply = self.stub.RegisterNode(
            metadata_pb2.RegisterNodeRequest(
                node_id=self.node_id,
                address=f"127.0.0.1:{hash(self.node_id) % 30000 + 20000}",
                instance_id=self.instance,
                paged=True,
            ),
            timeout=10,
        )
        self.epoch = reply.epoch
        return int(reply.max_page_chunks)

    def pages(self, keys: bytes, page: int, *, stop_after: int | None = None) -> int:
        """Send ``keys`` in pages (the last one marked, unless stopped early)."""
        count = len(keys) // 16
        chunks = 0
        for sent, start in enumerate(range(0, count, page)):
            if stop_after is not None and sent >= stop_after:
                return chunks
            n = min(page, count - start)
            reply = self.stub.RegisterInventory(
                metadata_pb2.RegisterInventoryRequest(
                    node_id=self.node_id,
                    epoch=self.epoch,
                    keys=keys[16 * start : 16 * (start + n)],
                    sizes=[4096] * n,
                    last=start + n >= count,
                ),
                timeout=30,
            )
            chunks = reply.chunks
        if count == 0:
            reply = self.stub.RegisterInventory(
                metadata_pb2.RegisterInventoryRequest(
                    node_id=self.node_id, epoch=self.epoch, last=True
                ),
                timeout=30,
            )
            chunks = reply.chunks
        return chunks

    def register(self, keys: bytes) -> int:
        return self.pages(keys, self.begin())

    def heartbeat(self) -> None:
        self.stub.Heartbeat(
            metadata_pb2.HeartbeatRequest(node_id=self.node_id, epoch=self.epoch), timeout=5
        )


class Keeper(Node):
    """A small node that heartbeats, and registers again when the index forgot it."""

    def __init__(self, stub: Any, keys: bytes) -> None:
        super().__init__(stub, "keeper")
        self.keys = keys
        self.registrations = 0
        self.paused = False

    def register_again(self) -> None:
        assert self.register(self.keys) == len(self.keys) // 16
        self.registrations += 1

    def beat(self) -> None:
        if self.paused:
            return
        try:
            self.heartbeat()
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise
            self.register_again()  # as a store does after an index loss


def lose_the_index(index_url: str) -> None:
    """Delete every key of the index (a Redis flush, for this test's prefix)."""
    import redis

    url, _, prefix = index_url.partition("?prefix=")
    r = redis.Redis.from_url(url)
    try:
        keys = r.scan_iter(f"{prefix}:*", count=10000)
        while batch := list(itertools.islice(keys, 10000)):
            r.unlink(*batch)
    finally:
        r.close()


class Background:
    """A thread calling ``step`` until stopped; keeps the first error and the slowest call."""

    def __init__(self, step: Any, pause_s: float) -> None:
        self.step = step
        self.pause_s = pause_s
        self.error: BaseException | None = None
        self.calls = 0
        self.slowest_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                self.step()
            except BaseException as exc:
                self.error = exc
                return
            self.slowest_s = max(self.slowest_s, time.monotonic() - t0)
            self.calls += 1
            self._stop.wait(self.pause_s)

    def __enter__(self) -> Background:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def lookup(stub: Any, keys: bytes, count: int = 128) -> int:
    reply = stub.Lookup(
        metadata_pb2.LookupRequest(
            keys=[keys[16 * i : 16 * (i + 1)] for i in range(count)], packed=True
        ),
        timeout=5,
    )
    return int(reply.hits)


def node_chunks(stub: Any) -> dict[str, int]:
    stats = stub.GetStats(metadata_pb2.GetStatsRequest(), timeout=10)
    return {n.node_id: n.chunks_indexed for n in stats.nodes}


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def index_url(request: pytest.FixtureRequest) -> str:
    if request.param == "memory":
        return "memory://"
    server: str = request.getfixturevalue("redis_server")
    return f"{server}?prefix=scale{time.monotonic_ns()}"


@pytest.mark.timeout(900)
def test_millions_of_chunks_register_and_reregister_while_others_live(
    index_url: str, tmp_path: Path
) -> None:
    """A 5 M-chunk inventory registers, then registers again, in pages, while
    a small node's heartbeats keep it alive and lookups are answered."""
    big_keys = inventory(BIG, seed=1)
    with (
        metadata_daemon(index_url, tmp_path / "metadata.log") as address,
        grpc.insecure_channel(address) as channel,
    ):
        stub = metadata_pb2_grpc.MetadataStub(channel)
        keeper_keys = inventory(200, seed=2)
        keeper = Keeper(stub, keeper_keys)
        keeper.register_again()
        big = Node(stub, "big")
        # A registration, a re-registration, and (Redis) one after an index loss.
        attempts = 3 if index_url.startswith("redis") else 2
        with (
            Background(keeper.beat, 0.5) as beats,
            Background(lambda: lookup(stub, keeper_keys), 0.05) as reads,
        ):
            for attempt in range(attempts):
                if attempt == 2:
                    assert keeper.registrations == 1  # never expired so far
                    keeper.paused = True  # no beat while the keys are being deleted
                    lose_the_index(index_url)
                    keeper.paused = False
                    deadline = time.monotonic() + 10
                    while keeper.registrations < 2 and time.monotonic() < deadline:
                        time.sleep(0.1)
                    assert keeper.registrations == 2, "the small node did not register again"
                    assert lookup(stub, keeper_keys) == 128
                t0 = time.monotonic()
                assert big.register(big_keys) == BIG
                took = time.monotonic() - t0
                assert lookup(stub, big_keys) == 128
                assert lookup(stub, big_keys[16 * (BIG - 128) :]) == 128
                print(f"attempt {attempt}: {BIG} chunks registered in {took:.1f} s")
        assert beats.error is None, f"the other node's heartbeat failed: {beats.error!r}"
        assert reads.error is None, f"a lookup failed meanwhile: {reads.error!r}"
        assert reads.calls > 10 and reads.slowest_s < LEASE_S, (reads.calls, reads.slowest_s)
        # Registered once more only after the index loss: never expired meanwhile.
        assert keeper.registrations == (2 if attempts == 3 else 1)
        assert node_chunks(stub) == {"keeper": 200, "big": BIG}


@pytest.mark.timeout(300)
def test_a_registration_cut_off_half_way_names_nothing_the_node_does_not_hold(
    index_url: str, tmp_path: Path
) -> None:
    """A node's pages stop half-way (it crashed); it comes back with another
    inventory. Its first inventory is never named again; a node that never
    comes back is dropped with its lease."""
    first = inventory(300_000, seed=3)
    second = inventory(50_000, seed=4)
    with (
        metadata_daemon(index_url, tmp_path / "metadata.log") as address,
        grpc.insecure_channel(address) as channel,
    ):
        stub = metadata_pb2_grpc.MetadataStub(channel)
        node = Node(stub, "n1")
        page = min(node.begin(), 65536)
        # What a page indexed counts at once: the node confirmed it holds it.
        node.pages(first, page, stop_after=2)
        assert lookup(stub, first) == 128
        # Restarted with another inventory (what it held is gone).
        node.register(second)
        assert lookup(stub, first) == 0
        assert lookup(stub, first[16 * page :]) == 0
        assert lookup(stub, second) == 128
        assert node_chunks(stub) == {"n1": 50_000}
        # A page of the old epoch is refused.
        with pytest.raises(grpc.RpcError) as refused:
            stub.RegisterInventory(
                metadata_pb2.RegisterInventoryRequest(
                    node_id="n1", epoch=node.epoch - 1, keys=first[:16], sizes=[1]
                ),
                timeout=5,
            )
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # Cut off again, and never back: dropped with its lease.
        gone = Node(stub, "n2")
        gone.begin()
        gone.pages(first, page, stop_after=1)
        assert lookup(stub, first) == 128
        deadline = time.monotonic() + 4 * LEASE_S
        while lookup(stub, first) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert lookup(stub, first) == 0
        assert "n2" not in node_chunks(stub)
        with pytest.raises(grpc.RpcError) as late:
            gone.pages(first[16 * page :], page)
        assert late.value.code() == grpc.StatusCode.NOT_FOUND


def test_an_oversized_page_is_refused_with_the_limit(tmp_path: Path) -> None:
    with (
        metadata_daemon("memory://", tmp_path / "metadata.log") as address,
        grpc.insecure_channel(address) as channel,
    ):
        stub = metadata_pb2_grpc.MetadataStub(channel)
        node = Node(stub, "n1")
        limit = node.begin()
        keys = inventory(limit + 1, seed=5)
        with pytest.raises(grpc.RpcError) as refused:
            node.pages(keys, limit + 1)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert str(limit) in (refused.value.details() or "")
        with pytest.raises(grpc.RpcError) as torn:
            stub.RegisterInventory(
                metadata_pb2.RegisterInventoryRequest(
                    node_id="n1", epoch=node.epoch, keys=keys[:20], sizes=[1]
                ),
                timeout=5,
            )
        assert torn.value.code() == grpc.StatusCode.INVALID_ARGUMENT
