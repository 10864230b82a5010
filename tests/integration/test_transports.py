"""The ``shm``, ``auto`` and tuned ``tcp`` transports against real store daemons,
and clients that die mid-transfer as real processes."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvdepot.apps.cluster import LocalCluster
from kvdepot.connector.client import ClientConfig, KVDepotClient
from kvdepot.connector.transport import (
    AutoTransport,
    GetItem,
    PutItem,
    PutStatus,
    ShmTransport,
    TcpTransport,
    create_transport,
)
from kvdepot.errors import InvalidArgument
from kvdepot.keys import ChunkKey
from kvdepot.proto.gen import store_pb2, store_pb2_grpc
from kvdepot.store.chunks import ChunkStore, checksum
from kvdepot.store.dataplane import DataPlaneServer
from kvdepot.wire import protocol as p
from tests.procs import freeze

pytestmark = pytest.mark.integration

KiB = 1 << 10
MiB = 1 << 20


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


def store_stats(grpc_address: str) -> store_pb2.StoreStats:
    with grpc.insecure_channel(grpc_address) as ch:
        return store_pb2_grpc.StoreStub(ch).GetStats(store_pb2.StoreStatsRequest(), timeout=5)


def used_bytes(grpc_address: str) -> int:
    return int(store_stats(grpc_address).tiers[0].used_bytes)


def granted_bytes(t: ShmTransport, address: str) -> int:
    """Arena room the store granted ``t``'s idle connections to ``address``."""
    idle = t._pool._idle.get(address, [])
    page = 4096  # the arena's allocation unit
    return sum(
        -(-size // page) * page * len(offsets) for c in idle for size, offsets in c.grants.items()
    )


def chunks(rng: random.Random, sizes: list[int]) -> tuple[list[ChunkKey], list[bytes]]:
    return [ChunkKey(rng.randbytes(16)) for _ in sizes], [rng.randbytes(n) for n in sizes]


def round_trip(transport: object, address: str, rng: random.Random) -> None:
    """Byte-exact batch, whole and ranged reads, misses, through ``transport``."""
    assert isinstance(transport, ShmTransport | TcpTransport | AutoTransport) or hasattr(
        transport, "put"
    )
    sizes = [1, 4 * KiB + 3, 300 * KiB, 2 * MiB + 17] + [rng.randrange(1, MiB) for _ in range(8)]
    keys, data = chunks(rng, sizes)
    items = [PutItem(k, d) for k, d in zip(keys, data, strict=True)]
    assert transport.put(address, items) == [PutStatus.OK] * len(items)  # type: ignore[attr-defined]
    assert transport.put(address, items[:2]) == [PutStatus.EXISTS] * 2  # type: ignore[attr-defined]
    bufs = [bytearray(n) for n in sizes]
    outs = transport.get_into(  # type: ignore[attr-defined]
        address, [GetItem(k, memoryview(b)) for k, b in zip(keys, bufs, strict=True)]
    )
    assert [o.length for o in outs] == sizes and all(o.ok for o in outs)
    assert bufs == [bytearray(d) for d in data]
    # Whole chunks for a caller that validated its arguments (as KVDepotClient
    # does): the same bytes, a miss where the buffer is too small or the key unknown.
    miss = ChunkKey(rng.randbytes(16))
    views = [memoryview(bytearray(n)) for n in sizes]
    views[1] = memoryview(bytearray(sizes[1] - 1))
    outs = transport.get_whole(address, [*keys, miss], [*views, memoryview(bytearray(9))])  # type: ignore[attr-defined]
    assert [o.ok for o in outs] == [i != 1 for i in range(len(sizes))] + [False]
    assert "too small" in outs[1].error and outs[-1].error == "not found"
    assert all(bytes(v) == d for i, (v, d) in enumerate(zip(views, data, strict=True)) if i != 1)
    for bad in ([memoryview(bytearray(9))] * 2, [memoryview(bytearray(0))]):
        with pytest.raises(InvalidArgument):
            transport.get_whole(address, keys[:1], bad)  # type: ignore[attr-defined]
    big = data[3]
    layer = bytearray(64 * KiB)
    outs = transport.get_into(  # type: ignore[attr-defined]
        address,
        [
            GetItem(keys[3], memoryview(layer), offset=MiB, length=64 * KiB),
            GetItem(keys[3], memoryview(bytearray(10)), offset=len(big), length=1),
            GetItem(miss, memoryview(bytearray(10))),
            GetItem(keys[2], memoryview(bytearray(10))),
        ],
    )
    assert outs[0].ok and layer == big[MiB : MiB + 64 * KiB]
    assert (outs[1].ok, outs[1].error) == (False, "invalid range")
    assert (outs[2].ok, outs[2].error) == (False, "not found")
    assert not outs[3].ok and "too small" in outs[3].error


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Metadata + one store daemon whose arena is shared under /dev/shm (the default)."""
    c = LocalCluster(nodes=1, capacity="96MiB", log_dir=tmp_path_factory.mktemp("logs"))
    c.start()
    try:
        yield c
    finally:
        c.stop()


def test_shm_round_trips_batches_and_ranges(stores: LocalCluster) -> None:
    info = stores.stores[0].info
    assert info["arena_path"].startswith("/dev/shm/")
    assert os.stat(info["arena_path"]).st_mode & 0o777 == 0o600
    with ShmTransport(io_timeout_s=5) as t:
        assert t.usable(info["address"])
        round_trip(t, info["address"], random.Random(1))
    assert store_stats(info["grpc_address"]).connections >= 1


def test_shm_concurrent_clients_are_byte_exact(stores: LocalCluster) -> None:
    address = stores.stores[0].info["address"]
    errors: list[BaseException] = []
    with ShmTransport() as t:

        def client(seed: int) -> None:
            try:
                rng = random.Random(seed)
                for _ in range(3):
                    keys, data = chunks(rng, [rng.randrange(KiB, 700 * KiB) for _ in range(5)])
                    items = [PutItem(k, d) for k, d in zip(keys, data, strict=True)]
                    assert t.put(address, items) == [PutStatus.OK] * 5
                    bufs = [bytearray(len(d)) for d in data]
                    gets = [GetItem(k, memoryview(b)) for k, b in zip(keys, bufs, strict=True)]
                    assert all(o.ok for o in t.get_into(address, gets))
                    assert bufs == data
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=client, args=(100 + s,)) for s in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
    assert errors == []


def test_shm_put_with_a_wrong_given_checksum_stores_nothing(stores: LocalCluster) -> None:
    info = stores.stores[0].info
    rng = random.Random(7)
    keys, data = chunks(rng, [300 * KiB, 200 * KiB])
    before = used_bytes(info["grpc_address"])
    with ShmTransport() as t:
        items = [PutItem(keys[0], data[0], checksum(data[0]) ^ 1), PutItem(keys[1], data[1])]
        assert t.put(info["address"], items) == [PutStatus.CORRUPT, PutStatus.OK]
        bufs = [memoryview(bytearray(len(d))) for d in data]
        outs = t.get_into(info["address"], [GetItem(k, b) for k, b in zip(keys, bufs, strict=True)])
        assert [o.ok for o in outs] == [False, True]
        assert t.delete(info["address"], [keys[1]]) == [True]
    # The refused chunk's reservation was given back, not left to expire.
    wait_for(lambda: used_bytes(info["grpc_address"]) == before)


def test_shm_reads_end_their_leases_without_waiting_for_the_answer(stores: LocalCluster) -> None:
    info = stores.stores[0].info
    rng = random.Random(13)
    keys, data = chunks(rng, [300 * KiB, 5 * KiB])
    before = used_bytes(info["grpc_address"])
    with ShmTransport(max_idle_per_peer=1) as t:
        assert t.put(info["address"], [PutItem(k, d) for k, d in zip(keys, data, strict=True)])
        for _ in range(3):  # each read reuses the connection whose RELEASE answer is unread
            bufs = [bytearray(len(d)) for d in data]
            gets = [GetItem(k, memoryview(b)) for k, b in zip(keys, bufs, strict=True)]
            assert all(o.ok for o in t.get_into(info["address"], gets)) and bufs == data
        assert t.delete(info["address"], keys) == [True, True]
        # A chunk still leased would keep its bytes after the delete (the
        # connection keeps the room granted for its next put).
        granted = granted_bytes(t, info["address"])
        assert granted == 308 * KiB  # 300 KiB and 5 KiB, page-aligned
        wait_for(lambda: used_bytes(info["grpc_address"]) == before + granted)
        outs = t.get_into(info["address"], [GetItem(keys[0], memoryview(bytearray(10)))])
        assert outs[0].error == "not found"


def test_client_publishes_to_its_own_node_through_shm(stores: LocalCluster) -> None:
    info = stores.stores[0].info
    config = ClientConfig(metadata=stores.metadata_address, node_id=info["node_id"])
    assert config.transport == "auto"
    rng = random.Random(2)
    keys, data = chunks(rng, [MiB] * 4)
    with KVDepotClient(config) as client:
        result = client.put(keys, data)
        assert result.stored == 4
        transport = client._transport
        assert isinstance(transport, AutoTransport)
        assert transport.choice(info["address"]) == "shm"
        bufs = [bytearray(MiB) for _ in keys]
        assert client.get_into(keys, bufs).leading == 4 and bufs == data


def test_a_node_reads_its_own_chunks_without_the_metadata_service(tmp_path: Path) -> None:
    with LocalCluster(nodes=1, capacity="32MiB", log_dir=tmp_path) as c:
        info = c.stores[0].info
        config = ClientConfig(metadata=c.metadata_address, node_id=info["node_id"], rpc_timeout_s=2)
        keys, data = chunks(random.Random(21), [MiB, 300 * KiB, 5])
        other = ChunkKey(random.Random(22).randbytes(16))
        with KVDepotClient(config) as client:
            assert client.put(keys, data).stored == 3
            assert c.metadata is not None
            freeze(c.metadata.proc.pid)
            try:
                bufs = [bytearray(len(d)) for d in data]
                result = client.get_into(keys, bufs)
                assert result.loaded == (True,) * 3 and bufs == data
                assert result.sizes == (MiB, 300 * KiB, 5)
                # A chunk this node lacks needs the lookup, which the stopped
                # service cannot answer: a miss that says so, the rest served.
                result = client.get_into([*keys, other], [*bufs, bytearray(10)])
                assert result.loaded == (True, True, True, False)
                assert "not found" in result.reasons[3] and "no answer" in result.reasons[3]
            finally:
                c.metadata.proc.send_signal(signal.SIGCONT)
            result = client.get_into([*keys, other], [*bufs, bytearray(10)])
            assert result.loaded == (True, True, True, False)
            assert result.sizes == (MiB, 300 * KiB, 5, 0)


def test_auto_uses_tcp_when_the_arena_is_not_shared(tmp_path: Path) -> None:
    env = dict(os.environ, KVDEPOT_STORE_SHM="0")
    with LocalCluster(nodes=1, capacity="16MiB", env=env, log_dir=tmp_path) as c:
        info = c.stores[0].info
        assert info["arena_path"] == ""
        with AutoTransport() as t:
            assert t.choice(info["address"]) == "tcp"
            round_trip(t, info["address"], random.Random(3))


@pytest.mark.parametrize("verify", [False, True])
def test_a_wrong_shm_commit_is_never_served(
    stores: LocalCluster, tmp_path: Path, verify: bool
) -> None:
    # A store told to verify refuses the commit; by default it records the
    # client's checksum and every reader checks it: a miss either way.
    rng = random.Random(11)
    key, data = ChunkKey(rng.randbytes(16)), rng.randbytes(300 * KiB)
    with contextlib.ExitStack() as stack:
        if verify:
            env = dict(os.environ, KVDEPOT_STORE_VERIFY_SHM_COMMITS="1")
            cluster = stack.enter_context(
                LocalCluster(nodes=1, capacity="16MiB", env=env, log_dir=tmp_path)
            )
        else:
            cluster = stores
        address = cluster.stores[0].info["address"]
        t = stack.enter_context(ShmTransport())
        if verify:
            round_trip(t, address, random.Random(12))  # pipelined COMMITs
        conn, mapping = t._open(address)
        assert bool(conn.info.flags & p.AttachFlags.VERIFIES_SHM) is verify
        (r,) = conn.reserve([p.PutEntry(key, len(data), 0)])
        mapping.view[r.offset : r.offset + len(data)] = data
        conn.send_commit([p.CommitEntry(key, checksum(data) ^ 1)])
        assert conn.finish_commits([1])[0] == [p.PutCode.CORRUPT if verify else p.PutCode.OK]
        conn.close()
        buf = bytearray(len(data))
        (out,) = t.get_into(address, [GetItem(key, memoryview(buf))])
        assert not out.ok
        assert out.error == ("not found" if verify else "checksum mismatch")


def test_tcp_put_with_trailing_checksums_over_parallel_connections(stores: LocalCluster) -> None:
    address = stores.stores[0].info["address"]
    rng = random.Random(4)
    keys, data = chunks(rng, [3 * MiB + i for i in range(6)])
    with TcpTransport(streams=3) as t:
        assert (
            t.put(address, [PutItem(k, d) for k, d in zip(keys, data, strict=True)])
            == [PutStatus.OK] * 6
        )
        bufs = [bytearray(len(d)) for d in data]
        outs = t.get_into(
            address, [GetItem(k, memoryview(b)) for k, b in zip(keys, bufs, strict=True)]
        )
        assert all(o.ok for o in outs) and bufs == data
        assert t.delete(address, keys) == [True] * 6


def test_tcp_misses_between_small_payloads_keep_their_places(stores: LocalCluster) -> None:
    # Small payloads of one reply are received together and settled after:
    # a miss between them must stay a miss, and each hit its own outcome.
    address = stores.stores[0].info["address"]
    rng = random.Random(7)
    sizes = [4 * KiB, 10 * KiB, 1 * KiB, 3 * KiB, 600 * KiB, 2 * KiB]
    keys, data = chunks(rng, sizes)
    with TcpTransport() as t:
        assert t.put(address, [PutItem(k, d) for k, d in zip(keys, data, strict=True)]) == (
            [PutStatus.OK] * len(sizes)
        )
        wanted = [
            (keys[0], 0, 0, True),
            (ChunkKey(rng.randbytes(16)), 0, 0, False),  # not found
            (keys[1], 0, 0, True),
            (keys[2], 2 * KiB, 1, False),  # invalid range
            (keys[3], 0, 0, True),
            (ChunkKey(rng.randbytes(16)), 0, 0, False),
            (keys[4], 0, 0, True),  # larger than a hash block: settles the pending ones
            (keys[5], KiB, KiB, True),
            (ChunkKey(rng.randbytes(16)), 0, 0, False),
        ]
        bufs = [bytearray(16 * KiB if i != 6 else 600 * KiB) for i in range(len(wanted))]
        outs = t.get_into(
            address,
            [
                GetItem(k, memoryview(b), offset=off, length=n)
                for (k, off, n, _), b in zip(wanted, bufs, strict=True)
            ],
        )
    assert [o.ok for o in outs] == [w[3] for w in wanted]
    assert [o.error for o in outs if not o.ok] == [
        "not found", "invalid range", "not found", "not found"
    ]  # fmt: skip
    expect = {0: data[0], 2: data[1], 4: data[3], 6: data[4], 7: data[5][KiB : 2 * KiB]}
    for i, want in expect.items():
        assert outs[i].length == len(want) and bytes(bufs[i][: len(want)]) == want


def test_tcp_trailing_checksum_mismatch_is_corrupt(stores: LocalCluster) -> None:
    host, port = stores.stores[0].info["address"].rsplit(":", 1)
    rng = random.Random(5)
    key, data = ChunkKey(rng.randbytes(16)), rng.randbytes(100 * KiB)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        head = p.Header(p.Opcode.PUT_TRAILED, 1).pack()
        s.sendall(head + p.pack_put_entries([p.PutEntry(key, len(data), 0)]))
        s.sendall(data + p.CHECKSUM.pack(checksum(data) ^ 1))
        p.recv_reply_header(s, p.Opcode.PUT_REPLY, 1)
        assert p.recv_exact(s, 1) == bytes([p.PutCode.CORRUPT])
    with TcpTransport() as t:
        assert not t.get_into(
            stores.stores[0].info["address"], [GetItem(key, memoryview(bytearray(10)))]
        )[0].ok


DYING_CLIENT = textwrap.dedent(
    """
    import os, sys, time
    from kvdepot.connector.transport.control import ControlPool
    from kvdepot.wire import protocol as p
    from kvdepot.keys import ChunkKey
    address, mode, key_hex = sys.argv[1], sys.argv[2], sys.argv[3]
    conn = ControlPool(p.AttachKind.SHM, 5, 5).checkout(address)
    key = ChunkKey(bytes.fromhex(key_hex))
    if mode == "reserve":
        replies = conn.reserve([p.PutEntry(key, 8 << 20, 0)])
        assert replies[0].status is p.PutCode.OK, replies
    elif mode == "grant":
        conn.grant([8 << 20])
        assert conn.grants == {8 << 20: [conn.grants[8 << 20][0]]}, conn.grants
    else:
        replies = conn.lease([p.GetEntry(key)])
        assert replies[0].status is p.GetCode.OK, replies
    print("holding", flush=True)
    time.sleep(60)
    """
)


@pytest.mark.parametrize("mode", ["reserve", "grant", "lease"])
def test_client_that_dies_frees_what_it_held(stores: LocalCluster, mode: str) -> None:
    info = stores.stores[0].info
    address, grpc_address = info["address"], info["grpc_address"]
    rng = random.Random(f"dies-{mode}")
    key = ChunkKey(rng.randbytes(16))
    with ShmTransport() as t:
        if mode == "lease":
            assert t.put(address, [PutItem(key, rng.randbytes(8 * MiB))]) == [PutStatus.OK]
        before = used_bytes(grpc_address)
        child = subprocess.Popen(
            [sys.executable, "-c", DYING_CLIENT, address, mode, key.hex()],
            stdout=subprocess.PIPE,
        )
        try:
            assert child.stdout is not None and child.stdout.readline() == b"holding\n"
            if mode == "grant":
                assert used_bytes(grpc_address) == before + 8 * MiB
            elif mode == "reserve":
                assert used_bytes(grpc_address) == before + 8 * MiB
                # Being written: another writer of the same key is told it exists.
                assert t.put(address, [PutItem(key, b"x")]) == [PutStatus.EXISTS]
                before += granted_bytes(t, address)  # that put's room for the next
            else:
                # Leased: deleting hides it at once, its memory stays until release.
                assert t.delete(address, [key]) == [True]
                assert used_bytes(grpc_address) == before
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(10)
            assert child.stdout is not None
            child.stdout.close()
        expected = before - 8 * MiB if mode == "lease" else before
        wait_for(lambda: used_bytes(grpc_address) == expected)
        if mode == "reserve":
            data = rng.randbytes(MiB)
            assert t.put(address, [PutItem(key, data)]) == [PutStatus.OK]


def test_shm_client_survives_a_store_restart_without_stale_reads(tmp_path: Path) -> None:
    with LocalCluster(nodes=0, capacity="16MiB", log_dir=tmp_path) as c:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        first = c.add_store("store-r", "--port", str(port))
        address = first.info["address"]
        rng = random.Random(7)
        key, data = ChunkKey(rng.randbytes(16)), rng.randbytes(MiB)
        with ShmTransport(io_timeout_s=5) as t:
            assert t.put(address, [PutItem(key, data)]) == [PutStatus.OK]
            old_generation = t.generation(address)
            assert old_generation == first.info["generation"]
            first.proc.send_signal(signal.SIGTERM)
            first.proc.wait(10)
            assert not os.path.exists(first.info["arena_path"])
            second = c.add_store("store-r", "--port", str(port))
            assert second.info["address"] == address
            # The old chunk is gone with the old arena: a miss, never stale bytes.
            buf = bytearray(MiB)
            out = t.get_into(address, [GetItem(key, memoryview(buf))])
            assert (out[0].ok, out[0].error) == (False, "not found")
            assert t.generation(address) == second.info["generation"] != old_generation
            assert t.put(address, [PutItem(key, data)]) == [PutStatus.OK]
            assert t.get_into(address, [GetItem(key, memoryview(buf))])[0].ok and buf == data


def test_shm_refuses_a_store_on_another_host(tmp_path: Path) -> None:
    # Same file, another host identity: the client must not map it.
    path = f"/dev/shm/kvdepot-test-{os.getpid()}"
    chunks_ = ChunkStore(4 * MiB, arena_path=path)
    server = DataPlaneServer(chunks_)
    server.start()
    try:
        import dataclasses

        server.attach_info = dataclasses.replace(server.attach_info, host_id="boot:elsewhere")
        host, port = server.address
        with ShmTransport() as t:
            assert not t.usable(f"{host}:{port}")
            k = ChunkKey(bytes(16))
            assert t.put(f"{host}:{port}", [PutItem(k, b"abc")]) == [PutStatus.FAILED]
        with AutoTransport() as auto:
            assert auto.choice(f"{host}:{port}") == "tcp"
            assert auto.put(f"{host}:{port}", [PutItem(k, b"abc")]) == [PutStatus.OK]
    finally:
        server.stop()
        chunks_.close()
    assert not os.path.exists(path)


def test_registry_knows_every_transport() -> None:
    for name in ("tcp", "shm", "auto"):
        t = create_transport(name, io_timeout_s=1.0)
        t.close()


def test_steady_shm_puts_take_one_round_trip(
    stores: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvdepot.connector.transport.control import ControlConnection

    info = stores.stores[0].info
    address = info["address"]
    calls: list[str] = []
    for name in ("reserve", "grant", "commit_granted", "send_commit"):
        real = getattr(ControlConnection, name)

        def spy(self: ControlConnection, *a: Any, _n: str = name, _r: Any = real, **k: Any) -> Any:
            calls.append(_n)
            return _r(self, *a, **k)

        monkeypatch.setattr(ControlConnection, name, spy)
    rng = random.Random(31)
    with ShmTransport(max_idle_per_peer=1) as t:
        batches = [chunks(rng, [256 * KiB] * 8) for _ in range(3)]
        for keys, data in batches:
            items = [PutItem(k, d) for k, d in zip(keys, data, strict=True)]
            assert t.put(address, items) == [PutStatus.OK] * 8
        # The first put asks for room, every later one only commits.
        assert calls == ["grant", "commit_granted"] + ["commit_granted"] * 2
        # A batch already stored is copied into granted room and answered EXISTS.
        before = used_bytes(info["grpc_address"])
        keys, data = batches[0]
        items = [PutItem(k, d) for k, d in zip(keys, data, strict=True)]
        assert t.put(address, items) == [PutStatus.EXISTS] * 8
        assert used_bytes(info["grpc_address"]) == before
        for keys, data in batches:
            bufs = [bytearray(len(d)) for d in data]
            gets = [GetItem(k, memoryview(b)) for k, b in zip(keys, bufs, strict=True)]
            assert all(o.ok for o in t.get_into(address, gets)) and bufs == data
        # Larger than what this small store grants a connection (8 MiB):
        # refused once, then reserved by key at once.
        large = []
        for n in range(2):
            calls.clear()
            keys, data = chunks(rng, [3 * MiB] * 3)
            large += keys
            items = [PutItem(k, d) for k, d in zip(keys, data, strict=True)]
            assert t.put(address, items) == [PutStatus.OK] * 3
            assert calls == ["grant"] * (n == 0) + ["reserve", "send_commit"]
        t.delete(address, [k for keys, _ in batches for k in keys] + large)


def test_a_connection_holding_grants_is_not_cut_for_idleness(tmp_path: Path) -> None:
    path = f"/dev/shm/kvdepot-test-grants-{os.getpid()}"
    chunks_ = ChunkStore(16 * MiB, arena_path=path)
    server = DataPlaneServer(chunks_, idle_timeout_s=0.3)
    server.start()
    host, port = server.address
    address = f"{host}:{port}"
    rng = random.Random(37)
    try:
        with ShmTransport(max_idle_per_peer=1) as granted, ShmTransport() as plain:
            keys, data = chunks(rng, [MiB] * 2)
            assert (
                granted.put(address, [PutItem(k, d) for k, d in zip(keys, data, strict=True)])
                == [PutStatus.OK] * 2
            )
            assert plain.usable(address)  # a connection without grants
            wait_for(lambda: server.stats().connections_open == 1)  # it was cut
            time.sleep(1.0)
            (conn,) = granted._pool._idle[address]
            assert conn.grants and not conn.readable()  # alive, nothing unread
            keys, data = chunks(rng, [MiB] * 2)
            assert (
                granted.put(address, [PutItem(k, d) for k, d in zip(keys, data, strict=True)])
                == [PutStatus.OK] * 2
            )
            assert granted._pool._idle[address] == [conn]  # the same connection
        # The client closed it: its grants are freed, its chunks stay.
        wait_for(lambda: server.stats().connections_open == 0)
        assert chunks_.stats().used_bytes == 4 * MiB
    finally:
        server.stop()
        chunks_.close()


@pytest.mark.parametrize("kind", [ShmTransport, TcpTransport])
def test_a_deferring_writers_put_returns_before_the_store_answers(
    stores: LocalCluster, kind: type[ShmTransport | TcpTransport]
) -> None:
    """The store commits one put while the writer goes on; the writer's own
    reads wait for that commit, and its next sync says what became of it."""
    address = stores.stores[0].info["address"]
    rng = random.Random(41 if kind is ShmTransport else 42)  # chunks new to the index
    with kind(max_idle_per_peer=1) as t:
        pipeline = t._pool.pipeline(address)
        batches = [chunks(rng, [256 * KiB] * 8) for _ in range(2)]
        for keys, data in batches:
            items = [PutItem(k, d) for k, d in zip(keys, data, strict=True)]
            statuses, indexed = t.put_indexed(address, items, writer=7)
            assert statuses == [PutStatus.OK] * 8
            assert indexed == [p.IndexCode.PENDING] * 8
            # Sent, its answer unread: the next exchange on the connection reads it.
            assert pipeline.open_until(pipeline.issued())
        for keys, data in batches:
            bufs = [bytearray(len(d)) for d in data]
            gets = [GetItem(k, memoryview(b)) for k, b in zip(keys, bufs, strict=True)]
            assert all(o.ok for o in t.get_into(address, gets)) and bufs == data
        assert not pipeline.open_until(pipeline.issued())
        # Published again: the store held them; the writer learns it on sync.
        keys, data = batches[0]
        items = [PutItem(k, d) for k, d in zip(keys, data, strict=True)]
        assert t.put_indexed(address, items, writer=7)[0] == [PutStatus.OK] * 8
        settled = t.sync_index(address, 7, 5.0)
        assert settled is not None
        assert (settled.new, settled.skipped, settled.lost, settled.pending) == (16, 8, 0, 0)
        assert t.sync_index(address, 7, 5.0) == p.IndexSettled()
        t.delete(address, [k for keys, _ in batches for k in keys])


@pytest.mark.parametrize("kind", [ShmTransport, TcpTransport])
def test_a_frozen_store_never_holds_a_pipelined_put_and_its_answer_counts_once_it_runs(
    tmp_path: Path, kind: type[ShmTransport | TcpTransport]
) -> None:
    # Over tcp the bytes too must fit the sockets' buffers while the store
    # reads nothing: small chunks. A reader that waited its bound for the
    # answer gives up, not the connection: once the store runs again its
    # answer is read and the writer's sync counts what it did.
    size = 64 * KiB if kind is ShmTransport else 8 * KiB
    with LocalCluster(nodes=1, capacity="32MiB", log_dir=tmp_path) as c:
        store = c.stores[0]
        address = store.info["address"]
        rng = random.Random(43)
        with kind(io_timeout_s=1.0, max_idle_per_peer=1) as t:
            keys, data = chunks(rng, [size] * 4)
            items = [PutItem(k, d) for k, d in zip(keys, data, strict=True)]
            assert t.put_indexed(address, items, writer=9)[0] == [PutStatus.OK] * 4
            assert t.sync_index(address, 9, 5.0) is not None  # answered; grants in hand
            freeze(store.pid)
            try:
                keys, data = chunks(rng, [size] * 4)
                items = [PutItem(k, d) for k, d in zip(keys, data, strict=True)]
                t0 = time.monotonic()
                statuses, indexed = t.put_indexed(address, items, writer=9)
                assert time.monotonic() - t0 < 1.0  # nothing waited on the frozen store
                assert (statuses, indexed) == ([PutStatus.OK] * 4, [p.IndexCode.PENDING] * 4)
                # A read waits a bounded time for the commit, then misses:
                # one I/O timeout, however many exchanges it had left.
                bufs = [bytearray(size) for _ in keys]
                gets = [GetItem(k, memoryview(b)) for k, b in zip(keys, bufs, strict=True)]
                t0 = time.monotonic()
                assert not any(o.ok for o in t.get_into(address, gets))
                assert time.monotonic() - t0 < 2.5
                assert t.stalled(address)
            finally:
                os.kill(store.pid, signal.SIGCONT)
            # Tried again once a probe saw it answer.
            wait_for(lambda: not t.stalled(address))
            settled = t.sync_index(address, 9, 5.0)
            assert (settled.new, settled.lost, settled.pending) == (4, 0, 0)


@pytest.mark.parametrize("kind", [ShmTransport, TcpTransport])
def test_closing_a_transport_waits_a_frozen_stores_answer_only_briefly(
    tmp_path: Path, kind: type[ShmTransport | TcpTransport]
) -> None:
    with LocalCluster(nodes=1, capacity="32MiB", log_dir=tmp_path) as c:
        store = c.stores[0]
        address = store.info["address"]
        rng = random.Random(47)
        t = kind(io_timeout_s=30.0, max_idle_per_peer=1)
        try:
            keys, data = chunks(rng, [8 * KiB] * 4)
            items = [PutItem(k, d) for k, d in zip(keys, data, strict=True)]
            assert t.put_indexed(address, items, writer=11)[0] == [PutStatus.OK] * 4
            if kind is ShmTransport:
                # Answered, and the grants the next put copies into in hand.
                assert t.sync_index(address, 11, 5.0) is not None
            freeze(store.pid)
            keys, data = chunks(rng, [8 * KiB] * 4)
            items = [PutItem(k, d) for k, d in zip(keys, data, strict=True)]
            assert t.put_indexed(address, items, writer=11)[0] == [PutStatus.OK] * 4
            t0 = time.monotonic()
            t.close()  # the answer never comes: a bounded wait, not the I/O timeout
            assert time.monotonic() - t0 < 5.0
        finally:
            os.kill(store.pid, signal.SIGCONT)
            t.close()
