"""Bad input to the daemons: a clear error, and the daemon keeps serving."""

from __future__ import annotations

import contextlib
import math
import socket
import struct
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from kvdepot.apps.cluster import LocalCluster
from kvdepot.connector.client import ClientConfig, KVDepotClient
from kvdepot.errors import CapacityExceeded, InvalidArgument, Unavailable
from kvdepot.keys import ChunkKey, Namespace, chunk_keys
from kvdepot.proto.gen import common_pb2, metadata_pb2, metadata_pb2_grpc
from kvdepot.wire import protocol as p
from tests.integration.hostile import (
    MiB,
    closed_by_peer,
    connect,
    short_timeout_cluster,
    store_stats,
    used_bytes,
    wait_for,
)

pytestmark = pytest.mark.integration

NS = Namespace("test/bad-input", chunk_tokens=8)


def roundtrip_ok(client: KVDepotClient, seed: int) -> None:
    keys = chunk_keys(NS, [seed] * 8 * 3)
    data = [np.random.default_rng(seed + i).integers(0, 255, 50_000, dtype=np.uint8)
            for i in range(3)]
    client.put(keys, data)
    bufs = [np.zeros(50_000, dtype=np.uint8) for _ in keys]
    assert client.get_into(keys, bufs).leading == 3
    assert all(np.array_equal(a, b) for a, b in zip(data, bufs, strict=True))


def _raw(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    return s


def _expect_closed(s: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    s.close()
    return data


@pytest.mark.parametrize(
    "frame",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"KVDP" + bytes([9, 1, 0, 0]) + bytes(8),  # unknown version
        b"KVDP" + bytes([1, 200, 0, 0]) + bytes(8),  # unknown opcode
        b"KVDP" + bytes([1, 1, 0, 0]) + struct.pack("<II", 0xFFFFFFFF, 0),  # huge count
        bytes(range(256)) * 8,
    ],
    ids=["http", "version", "opcode", "count", "garbage"],
)
def test_malformed_frames_get_an_error_and_the_store_keeps_serving(
    cluster: LocalCluster, client: KVDepotClient, frame: bytes
) -> None:
    s = _raw(cluster.stores[0].info["address"])
    s.sendall(frame)
    reply = _expect_closed(s)
    assert reply == b"" or reply.startswith(b"KVDP")
    roundtrip_ok(client, 1)
    assert cluster.stores[0].proc.poll() is None


def test_client_that_disconnects_mid_put_leaves_nothing_visible(
    cluster: LocalCluster, client: KVDepotClient
) -> None:
    from kvdepot.wire import protocol

    keys = chunk_keys(NS, [7] * 8)
    # Announce a 1 MiB chunk, send a part of it, vanish.
    frame = protocol.Header(protocol.Opcode.PUT, count=1).pack() + protocol.pack_put_entries(
        [protocol.PutEntry(keys[0], 1 << 20, 12345)]
    )
    s = _raw(cluster.stores[0].info["address"])
    s.sendall(frame)
    s.sendall(b"x" * 1000)
    s.close()
    assert client.lookup(keys) == 0
    bufs = [np.zeros(1 << 20, dtype=np.uint8)]
    assert client.get_into(keys, bufs).leading == 0
    roundtrip_ok(client, 2)


def register(node_id: str, **fields: Any) -> metadata_pb2.RegisterNodeRequest:
    return metadata_pb2.RegisterNodeRequest(node_id=node_id, address="127.0.0.1:1", **fields)


def ref(size: int, tier: str = "cpu") -> common_pb2.ChunkRef:
    return common_pb2.ChunkRef(key=bytes(16), size=size, tier=tier)


def heartbeat(**rates: float) -> metadata_pb2.HeartbeatRequest:
    return metadata_pb2.HeartbeatRequest(node_id="n", transfer=common_pb2.TransferRate(**rates))


def route(load: float = 0.0, candidate_id: str = "e", **weights: float) -> Any:
    candidate = metadata_pb2.RouteCandidate(id=candidate_id, node_id="n", load=load)
    return metadata_pb2.RouteRequest(keys=[bytes(16)], candidates=[candidate], **weights)


def test_bad_grpc_requests_get_invalid_argument(cluster: LocalCluster) -> None:
    with grpc.insecure_channel(cluster.metadata_address) as ch:
        stub = metadata_pb2_grpc.MetadataStub(ch)
        cases = [
            ("Lookup", metadata_pb2.LookupRequest(keys=[b"short"])),
            ("PutStart", metadata_pb2.PutStartRequest(keys=[bytes(16)], sizes=[])),
            ("PutStart", metadata_pb2.PutStartRequest(keys=[bytes(16)], sizes=[0])),
            ("PutEnd", metadata_pb2.PutEndRequest(keys=[bytes(16)], sizes=[1], node_id="")),
            ("Heartbeat", metadata_pb2.HeartbeatRequest(node_id="")),
            ("RegisterNode", metadata_pb2.RegisterNodeRequest(node_id="x")),
            ("Lookup", metadata_pb2.LookupRequest(keys=[bytes(16)] * 70000)),
            ("Lookup", metadata_pb2.LookupRequest(keys=[bytes(16)], client_node_id="a\x00b")),
            ("PutStart", metadata_pb2.PutStartRequest(keys=[bytes(16)], sizes=[2**64 - 1])),
            (
                "PutStart",
                metadata_pb2.PutStartRequest(keys=[bytes(16)], sizes=[1], request_id=bytes(65)),
            ),
            ("PutEnd", metadata_pb2.PutEndRequest(keys=[bytes(16)], sizes=[2**63], node_id="n")),
            ("RegisterNode", metadata_pb2.RegisterNodeRequest(node_id="x", address="x" * 9999)),
            ("RegisterNode", metadata_pb2.RegisterNodeRequest(node_id="x", address="no-port")),
            ("RegisterNode", register("x", tiers=[common_pb2.TierStats(name="tape")])),
            ("RegisterNode", register("x", inventory=[ref(size=0)])),
            ("RegisterNode", register("x", inventory=[ref(size=1, tier="weird")])),
            ("RegisterNode", register("x", inventory=[ref(size=2**64 - 1)])),
            ("Heartbeat", heartbeat(bytes_in_per_s=math.nan)),
            ("Heartbeat", heartbeat(bytes_out_per_s=-1.0)),
            ("Heartbeat", heartbeat(window_s=math.inf)),
            ("Route", route(load=math.nan)),
            ("Route", route(link_bytes_per_s=math.nan)),
            ("Route", route(prefill_tokens_per_s=math.inf)),
            ("Route", route(candidate_id="u" * 5000)),
        ]
        for method, request in cases:
            with pytest.raises(grpc.RpcError) as info:
                getattr(stub, method)(request, timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
            assert info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            stub.Heartbeat(metadata_pb2.HeartbeatRequest(node_id="nobody"), timeout=5)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        # Bytes that are not a protobuf message at all.
        lookup = ch.unary_unary("/kvdepot.v1.Metadata/Lookup")
        with pytest.raises(grpc.RpcError) as info:
            lookup(b"\x0a\xff\xff", timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed request" in (info.value.details() or "")


def test_inventory_larger_than_one_request_registers(slow_store: LocalCluster) -> None:
    # A store re-announces every chunk it holds in one RegisterNode: the
    # per-request key limit (65536) must not lock a big store out.
    keys = [i.to_bytes(16, "little") for i in range(70_000)]
    inventory = [common_pb2.ChunkRef(key=k, size=4096, tier="ssd") for k in keys]
    with grpc.insecure_channel(slow_store.metadata_address) as ch:
        stub = metadata_pb2_grpc.MetadataStub(ch)
        for _ in range(3):  # this node never heartbeats: its 1.5 s lease may run out first
            stub.RegisterNode(register("big-store", inventory=inventory), timeout=30)
            found = stub.Lookup(metadata_pb2.LookupRequest(keys=keys[-3:]), timeout=10)
            if found.hits:
                break
        assert found.hits == 3
        assert found.locations[0].replicas[0].node_id == "big-store"


def test_client_rejects_bad_arguments(client: KVDepotClient) -> None:
    with pytest.raises(InvalidArgument):
        client.put([b"short"], [b"x"])
    with pytest.raises(InvalidArgument):
        client.put([bytes(16)], [b"x", b"y"])
    with pytest.raises(InvalidArgument):
        client.put([bytes(16)], [b""])
    with pytest.raises(InvalidArgument):
        client.get_into([bytes(16)], [b"readonly"])


def test_oversized_chunk_is_refused_cleanly(cluster: LocalCluster, client: KVDepotClient) -> None:
    keys = chunk_keys(NS, [9] * 8)
    with pytest.raises(CapacityExceeded, match="larger than any store"):
        client.put(keys, [np.zeros(65 << 20, dtype=np.uint8)])  # arenas are 64 MiB
    assert client.lookup(keys) == 0
    roundtrip_ok(client, 3)


# --- slow clients and half-open connections -------------------------------------------


@pytest.fixture(scope="module")
def slow_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One store with short data-plane timeouts (I/O 1 s, idle and hold 3 s, 1 MiB/s)."""
    c = short_timeout_cluster(tmp_path_factory.mktemp("slow-store") / "logs")
    try:
        yield c
    finally:
        c.stop()


def _error_code(reply: bytes | None) -> int | None:
    if not reply:
        return None
    header = p.unpack_header(reply[:16])
    assert header.opcode is p.Opcode.ERROR, header
    return int(p.ERROR_CODE.unpack_from(reply, 16)[0])


class Trickler(threading.Thread):
    """Announces a 4 MiB PUT and sends its payload at 40 KiB/s: never stalls, never ends."""

    def __init__(self, s: socket.socket, key: bytes) -> None:
        super().__init__(daemon=True)
        self.s = s
        self.stop = threading.Event()
        entry = p.PutEntry(ChunkKey(key), 4 << 20, 1)
        s.sendall(p.Header(p.Opcode.PUT, 1).pack() + p.pack_put_entries([entry]))

    def run(self) -> None:
        with contextlib.suppress(OSError):
            while not self.stop.wait(0.1):
                self.s.sendall(bytes(4096))


class Holder(threading.Thread):
    """Reserves 2 MiB like an ``shm`` client, then pings forever instead of committing."""

    def __init__(self, s: socket.socket, key: bytes) -> None:
        super().__init__(daemon=True)
        self.s = s
        self.stop = threading.Event()
        self.error: p.ProtocolError | None = None
        s.sendall(
            p.Header(p.Opcode.RESERVE, 1).pack()
            + p.pack_put_entries([p.PutEntry(ChunkKey(key), 2 << 20, 0)])
        )
        p.recv_reply_header(s, p.Opcode.RESERVE_REPLY, 1)
        (reply,) = p.unpack_reserve_reply_entries(p.recv_exact(s, 16))
        assert reply.status is p.PutCode.OK

    def run(self) -> None:
        try:
            while not self.stop.wait(0.2):
                self.s.sendall(p.Header(p.Opcode.PING).pack())
                p.recv_reply_header(self.s, p.Opcode.PONG, 0)
        except p.ProtocolError as exc:
            self.error = exc
        except (OSError, Unavailable):
            pass


def test_stalled_trickling_silent_and_holding_peers_are_cut_off_and_freed(
    slow_store: LocalCluster,
) -> None:
    c = slow_store
    before = used_bytes(c)
    key = chunk_keys(NS, [31] * 8)[0]
    # Half of a 4 MiB PUT payload, then nothing: the I/O timeout ends it.
    stalled = connect(c)
    stalled.sendall(
        p.Header(p.Opcode.PUT, 1).pack()
        + p.pack_put_entries([p.PutEntry(key, 4 << 20, 1)])
        + bytes(2 << 20)
    )
    # Steady bytes, far too slow: only the request's deadline ends it.
    trickler = Trickler(connect(c), chunk_keys(NS, [32] * 8)[0])
    trickler.start()
    # Connects and says nothing: the idle timeout ends it.
    silent = connect(c)
    # Keeps a reservation while pinging: the hold timeout ends it.
    holder = Holder(connect(c), chunk_keys(NS, [33] * 8)[0])
    holder.start()
    wait_for(lambda: used_bytes(c) >= before + 10 * MiB, what="three reservations")
    try:
        # Other clients are served meanwhile.
        with KVDepotClient(
            ClientConfig(metadata=c.metadata_address, node_id=c.stores[0].info["node_id"])
        ) as client:
            roundtrip_ok(client, 30)
        with_data = used_bytes(c) - 10 * MiB
        assert _error_code(closed_by_peer(stalled, 10)) == p.ErrorCode.MALFORMED
        assert closed_by_peer(silent, 10) == b""
        trickler.join(15)
        holder.join(15)
        assert not trickler.is_alive() and not holder.is_alive()
        assert _error_code(closed_by_peer(trickler.s, 10)) == p.ErrorCode.LIMIT_EXCEEDED
        assert holder.error is not None and holder.error.code is p.ErrorCode.LIMIT_EXCEEDED
        # Nothing any of them reserved outlives them; nothing became visible.
        wait_for(lambda: used_bytes(c) == with_data, what="reservations freed")
        assert client_lookup(c, [key]) == 0
    finally:
        trickler.stop.set()
        holder.stop.set()
        for s in (stalled, silent, trickler.s, holder.s):
            s.close()
    assert c.stores[0].proc.poll() is None
    assert store_stats(c).protocol_errors >= 3


def client_lookup(c: LocalCluster, keys: list[ChunkKey]) -> int:
    with KVDepotClient(ClientConfig(metadata=c.metadata_address)) as client:
        return client.lookup(keys)
