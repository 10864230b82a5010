"""The ``tcp`` data plane end to end: DataPlaneServer in-process, TcpTransport,
and raw sockets for what a well-behaved client would never send."""

from __future__ import annotations

import random
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvdepot.connector.transport import (
    GetItem,
    GetStatus,
    PutItem,
    PutStatus,
    TcpTransport,
    available_transports,
    create_transport,
)
from kvdepot.errors import CapacityExceeded, InvalidArgument
from kvdepot.keys import ChunkKey
from kvdepot.store.chunks import ChunkStore, checksum
from kvdepot.store.dataplane import DataPlaneServer
from kvdepot.store.indexer import Indexer
from kvdepot.wire import protocol as p

pytestmark = pytest.mark.integration

KiB = 1 << 10
MiB = 1 << 20
LIMITS = p.ProtocolLimits(max_batch=256, max_chunk_bytes=48 * MiB, max_request_bytes=96 * MiB)


class Node:
    """A chunk store served on 127.0.0.1 with a port of its own."""

    def __init__(self, capacity: int, **server_kwargs: Any) -> None:
        self.removed: list[ChunkKey] = []
        self.chunks = ChunkStore(capacity, on_removed=self.removed.extend)
        kwargs: dict[str, Any] = {"idle_timeout_s": 30.0, "io_timeout_s": 2.0}
        kwargs.update(server_kwargs)
        self.server = DataPlaneServer(self.chunks, limits=LIMITS, **kwargs)
        self.server.start()
        host, port = self.server.address
        self.address = f"{host}:{port}"

    def close(self) -> None:
        self.server.stop()
        self.chunks.close()

    def raw(self) -> socket.socket:
        return socket.create_connection(self.server.address, timeout=5)

    def wait_idle(self) -> None:
        """Wait until the server closed every connection."""
        wait_for(lambda: self.server.stats().connections_open == 0)


@pytest.fixture
def node() -> Iterator[Node]:
    n = Node(64 * MiB)
    yield n
    n.close()


@pytest.fixture
def transport() -> Iterator[TcpTransport]:
    t = TcpTransport(connect_timeout_s=2.0, io_timeout_s=5.0, limits=LIMITS)
    yield t
    t.close()


def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def rand_key(rng: random.Random) -> ChunkKey:
    return ChunkKey(rng.randbytes(16))


def chunk(rng: random.Random, size: int) -> bytes:
    return rng.randbytes(size)


def item(k: ChunkKey, data: bytes) -> PutItem:
    return PutItem(k, data, checksum(data))


def assert_serves(node: Node, seed: int = 99) -> None:
    """A fresh, well-behaved client can store and read back byte-exact chunks."""
    rng = random.Random(seed)
    data = [chunk(rng, rng.randrange(1, 300 * KiB)) for _ in range(4)]
    keys = [rand_key(rng) for _ in data]
    with TcpTransport(limits=LIMITS) as t:
        assert (
            t.put(node.address, [item(k, d) for k, d in zip(keys, data, strict=True)])
            == [PutStatus.OK] * 4
        )
        bufs = [bytearray(len(d)) for d in data]
        outs = t.get_into(
            node.address, [GetItem(k, memoryview(b)) for k, b in zip(keys, bufs, strict=True)]
        )
        assert all(o.ok for o in outs)
        assert bufs == [bytearray(d) for d in data]
        assert t.delete(node.address, keys) == [True] * 4


def read_until_closed(s: socket.socket) -> bytes:
    data = b""
    try:
        while part := s.recv(65536):
            data += part
    except (ConnectionResetError, TimeoutError):
        pass
    s.close()
    return data


def expect_error(s: socket.socket, code: p.ErrorCode) -> None:
    reply = read_until_closed(s)
    header = p.unpack_header(reply[:16])
    assert header.opcode is p.Opcode.ERROR
    assert p.ERROR_CODE.unpack_from(reply, 16)[0] == code
    assert len(reply) == 20 + header.count


def put_frame(entries: list[p.PutEntry]) -> bytes:
    return p.Header(p.Opcode.PUT, len(entries)).pack() + p.pack_put_entries(entries)


# --- well-behaved clients -------------------------------------------------------------


def test_registry_creates_tcp() -> None:
    assert "tcp" in available_transports()
    t = create_transport("tcp", io_timeout_s=1.0)
    assert isinstance(t, TcpTransport)
    t.close()
    with pytest.raises(InvalidArgument, match=r"known: .*tcp"):
        create_transport("carrier-pigeon")


def test_batch_of_random_chunks_round_trips_byte_exact(transport: TcpTransport) -> None:
    node = Node(192 * MiB)
    try:
        rng = random.Random(1)
        sizes = [KiB, 4 * MiB] + [int(2 ** rng.uniform(10, 22)) for _ in range(62)]
        data = [chunk(rng, n) for n in sizes]
        keys = [rand_key(rng) for _ in data]
        items = [item(k, d) for k, d in zip(keys, data, strict=True)]
        assert transport.put(node.address, items) == [PutStatus.OK] * 64
        bufs = [bytearray(n) for n in sizes]
        outs = transport.get_into(
            node.address, [GetItem(k, memoryview(b)) for k, b in zip(keys, bufs, strict=True)]
        )
        assert [o.length for o in outs] == sizes
        assert all(o.ok for o in outs)
        assert all(b == d for b, d in zip(bufs, data, strict=True))
        stats = node.server.stats()
        assert (stats.puts, stats.gets, stats.bytes_in, stats.bytes_out) == (
            64,
            64,
            sum(sizes),
            sum(sizes),
        )
        # A second put of the same chunks is a no-op.
        assert transport.put(node.address, items) == [PutStatus.EXISTS] * 64
        assert node.chunks.stats().puts == 64
    finally:
        node.close()


def test_ranged_read_of_one_layer(node: Node, transport: TcpTransport) -> None:
    rng = random.Random(2)
    layers = [chunk(rng, 48 * KiB) for _ in range(8)]
    data = b"".join(layers)
    k = rand_key(rng)
    assert transport.put(node.address, [item(k, data)]) == [PutStatus.OK]
    layer = bytearray(48 * KiB)
    tail = bytearray(len(data))
    big = bytearray(len(data) + 100)
    outs = transport.get_into(
        node.address,
        [
            GetItem(k, memoryview(layer), offset=3 * 48 * KiB, length=48 * KiB),
            GetItem(k, memoryview(tail), offset=5 * 48 * KiB),  # to the end
            GetItem(k, memoryview(big)),  # whole chunk into a larger buffer
            GetItem(k, memoryview(bytearray(10)), offset=len(data), length=1),
            GetItem(k, memoryview(bytearray(10)), offset=len(data) - 5, length=10),
        ],
    )
    assert outs[0].ok and outs[0].length == 48 * KiB and layer == layers[3]
    assert (
        outs[1].ok
        and outs[1].length == 3 * 48 * KiB
        and tail[: outs[1].length] == data[-outs[1].length :]
    )
    assert outs[2].ok and big[: len(data)] == data and big[len(data) :] == bytes(100)
    assert not outs[3].ok and outs[3].error == "invalid range"
    assert not outs[4].ok and outs[4].error == "invalid range"


def test_miss_and_small_buffer_are_not_ok(node: Node, transport: TcpTransport) -> None:
    rng = random.Random(3)
    k, data = rand_key(rng), chunk(rng, 100 * KiB)
    transport.put(node.address, [item(k, data)])
    buf = bytearray(len(data))
    outs = transport.get_into(
        node.address,
        [
            GetItem(rand_key(rng), memoryview(bytearray(10))),
            GetItem(k, memoryview(bytearray(50 * KiB))),  # too small for the whole chunk
            GetItem(k, memoryview(buf)),  # the stream stayed in sync
        ],
    )
    assert (outs[0].ok, outs[0].error) == (False, "not found")
    assert not outs[1].ok and "too small" in outs[1].error
    assert outs[2].ok and buf == data
    assert node.server.stats().get_misses == 1


def test_caller_bugs_raise_invalid_argument(node: Node, transport: TcpTransport) -> None:
    k = ChunkKey(bytes(16))
    with pytest.raises(InvalidArgument):
        transport.put(node.address, [PutItem(ChunkKey(b"short"), b"x", 0)])
    with pytest.raises(InvalidArgument):
        transport.put("no-port", [PutItem(k, b"x", 0)])
    with pytest.raises(InvalidArgument):
        transport.get_into(node.address, [GetItem(k, memoryview(b"readonly"))])
    with pytest.raises(InvalidArgument):
        transport.get_into(node.address, [GetItem(k, memoryview(bytearray(4)), length=5)])
    assert transport.put(node.address, [PutItem(k, b"", 0)]) == [PutStatus.INVALID]
    too_big = memoryview(bytearray(LIMITS.max_chunk_bytes + 1))
    assert transport.put(node.address, [PutItem(k, too_big, 0)]) == [PutStatus.INVALID]


def test_checksum_mismatch_is_corrupt_and_invisible(node: Node, transport: TcpTransport) -> None:
    rng = random.Random(4)
    k, data = rand_key(rng), chunk(rng, 64 * KiB)
    good_k, good = rand_key(rng), chunk(rng, 64 * KiB)
    statuses = transport.put(
        node.address, [PutItem(k, data, checksum(data) ^ 1), item(good_k, good)]
    )
    assert statuses == [PutStatus.CORRUPT, PutStatus.OK]
    assert not node.chunks.contains(k)
    assert node.chunks.contains(good_k)
    assert node.server.stats().corrupt_puts == 1
    assert node.chunks.stats().used_bytes == 64 * KiB


def test_large_batches_are_split_within_limits(node: Node) -> None:
    limits = p.ProtocolLimits(max_batch=7, max_chunk_bytes=1 * MiB, max_request_bytes=1 * MiB)
    rng = random.Random(5)
    data = [chunk(rng, 300 * KiB) for _ in range(20)]
    keys = [rand_key(rng) for _ in data]
    with TcpTransport(limits=limits) as t:
        assert (
            t.put(node.address, [item(k, d) for k, d in zip(keys, data, strict=True)])
            == [PutStatus.OK] * 20
        )
        bufs = [bytearray(len(d)) for d in data]
        outs = t.get_into(
            node.address, [GetItem(k, memoryview(b)) for k, b in zip(keys, bufs, strict=True)]
        )
        assert all(o.ok for o in outs) and bufs == data
        many = [ChunkKey(i.to_bytes(16, "big")) for i in range(30)]
        assert t.delete(node.address, keys[:3] + many) == [True] * 3 + [False] * 30


def test_concurrent_clients_are_byte_exact(node: Node, transport: TcpTransport) -> None:
    errors: list[BaseException] = []

    def client(seed: int) -> None:
        try:
            rng = random.Random(seed)
            for _ in range(4):
                data = [chunk(rng, rng.randrange(KiB, 512 * KiB)) for _ in range(6)]
                keys = [rand_key(rng) for _ in data]
                puts = transport.put(
                    node.address, [item(k, d) for k, d in zip(keys, data, strict=True)]
                )
                assert puts == [PutStatus.OK] * 6
                bufs = [bytearray(len(d)) for d in data]
                outs = transport.get_into(
                    node.address,
                    [GetItem(k, memoryview(b)) for k, b in zip(keys, bufs, strict=True)],
                )
                assert all(o.ok for o in outs) and bufs == data
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(seed,)) for seed in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert node.server.stats().connections_total >= 2


def test_small_arena_evicts_least_recently_used(transport: TcpTransport) -> None:
    node = Node(8 * MiB)
    try:
        rng = random.Random(6)
        data = [chunk(rng, MiB) for _ in range(20)]
        keys = [rand_key(rng) for _ in data]
        for k, d in zip(keys, data, strict=True):
            assert transport.put(node.address, [item(k, d)]) == [PutStatus.OK]
        assert node.removed == keys[:12]
        bufs = [bytearray(MiB) for _ in keys]
        outs = transport.get_into(
            node.address, [GetItem(k, memoryview(b)) for k, b in zip(keys, bufs, strict=True)]
        )
        assert [o.ok for o in outs] == [False] * 12 + [True] * 8
        assert bufs[12:] == data[12:]
        # A chunk larger than the whole arena is refused, not half stored.
        huge = chunk(rng, 8 * MiB + 1)
        assert transport.put(node.address, [item(rand_key(rng), huge)]) == [PutStatus.NO_SPACE]
        assert node.server.stats().put_rejected == 1
    finally:
        node.close()


def test_unreachable_store_fails_per_item(transport: TcpTransport) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: refused
    k = ChunkKey(bytes(16))
    assert transport.put(dead, [PutItem(k, b"x", checksum(b"x"))] * 2) == [PutStatus.FAILED] * 2
    outs = transport.get_into(dead, [GetItem(k, memoryview(bytearray(1)))])
    assert outs[0].status is GetStatus.FAILED and outs[0].error.startswith("transport")
    assert transport.delete(dead, [k]) == [False]


def test_pooled_connection_closed_by_idle_store_is_replaced(transport: TcpTransport) -> None:
    node = Node(8 * MiB, idle_timeout_s=0.2)
    try:
        assert_serves(node, 7)
        rng = random.Random(8)
        k, data = rand_key(rng), chunk(rng, 1000)
        assert transport.put(node.address, [item(k, data)]) == [PutStatus.OK]
        wait_for(lambda: node.server.stats().connections_open == 0)  # idle timeout hit
        buf = bytearray(1000)
        assert transport.get_into(node.address, [GetItem(k, memoryview(buf))])[0].ok
        assert buf == data
        assert node.server.stats().protocol_errors == 0
    finally:
        node.close()


def test_ping_pong(node: Node) -> None:
    s = node.raw()
    s.sendall(p.Header(p.Opcode.PING, 0, aux=1234).pack())
    assert p.unpack_header(p.recv_exact(s, 16)) == p.Header(p.Opcode.PONG, 0, 1234)
    s.close()


def test_stop_closes_open_connections() -> None:
    node = Node(4 * MiB)
    s = node.raw()
    s.sendall(p.Header(p.Opcode.PING).pack())
    p.recv_exact(s, 16)
    start = time.monotonic()
    node.close()
    assert time.monotonic() - start < 2
    assert read_until_closed(s) == b""


# --- bad input ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (b"XXXX" + bytes([1, 1, 0, 0]) + bytes(8), p.ErrorCode.BAD_MAGIC),
        (b"KVDP" + bytes([2, 1, 0, 0]) + bytes(8), p.ErrorCode.BAD_VERSION),
        (b"KVDP" + bytes([1, 77, 0, 0]) + bytes(8), p.ErrorCode.BAD_OPCODE),
        (p.Header(p.Opcode.PUT_REPLY, 0).pack(), p.ErrorCode.BAD_OPCODE),
        (p.Header(p.Opcode.PUT, LIMITS.max_batch + 1).pack(), p.ErrorCode.LIMIT_EXCEEDED),
        (p.Header(p.Opcode.GET, 0xFFFFFFFF).pack(), p.ErrorCode.LIMIT_EXCEEDED),
        (
            put_frame([p.PutEntry(ChunkKey(bytes(16)), LIMITS.max_chunk_bytes + 1, 0)]),
            p.ErrorCode.LIMIT_EXCEEDED,
        ),
        (
            put_frame([p.PutEntry(ChunkKey(bytes([i]) * 16), 40 * MiB, 0) for i in range(3)]),
            p.ErrorCode.LIMIT_EXCEEDED,  # 120 MiB in one request, above 96 MiB
        ),
        (p.Header(p.Opcode.PING, 3).pack(), p.ErrorCode.MALFORMED),
    ],
    ids=[
        "magic",
        "version",
        "opcode",
        "reply-opcode",
        "count",
        "huge-count",
        "size",
        "total",
        "ping",
    ],
)
def test_malformed_frames_get_an_error_and_a_close(
    node: Node, frame: bytes, code: p.ErrorCode
) -> None:
    s = node.raw()
    s.sendall(frame)
    expect_error(s, code)
    node.wait_idle()
    assert node.server.stats().protocol_errors == 1
    assert node.chunks.stats().used_bytes == 0
    assert_serves(node)


def test_truncated_put_is_revoked(node: Node) -> None:
    rng = random.Random(9)
    keys = [rand_key(rng) for _ in range(3)]
    payloads = [chunk(rng, 200 * KiB) for _ in keys]
    s = node.raw()
    s.sendall(
        put_frame([p.PutEntry(k, len(d), checksum(d)) for k, d in zip(keys, payloads, strict=True)])
    )
    # Two complete payloads and half of the third, then the client vanishes.
    s.sendall(payloads[0] + payloads[1] + payloads[2][: 100 * KiB])
    wait_for(lambda: node.chunks.stats().used_bytes == 600 * KiB)
    s.close()
    node.wait_idle()
    assert not any(node.chunks.contains(k) for k in keys)
    assert node.chunks.stats().used_bytes == 0
    assert node.server.stats().protocol_errors == 1
    assert_serves(node)
    # The same keys can be written afterwards.
    with TcpTransport(limits=LIMITS) as t:
        assert (
            t.put(node.address, [item(k, d) for k, d in zip(keys, payloads, strict=True)])
            == [PutStatus.OK] * 3
        )


def test_truncated_header_and_entries(node: Node) -> None:
    for frame in (b"KVD", p.Header(p.Opcode.GET, 2).pack() + bytes(40)):
        s = node.raw()
        s.sendall(frame)
        s.shutdown(socket.SHUT_WR)
        expect_error(s, p.ErrorCode.MALFORMED)
    node.wait_idle()
    assert node.server.stats().protocol_errors == 2
    assert_serves(node)


def test_stalled_request_and_idle_connection_time_out() -> None:
    node = Node(4 * MiB, idle_timeout_s=0.3, io_timeout_s=0.3)
    try:
        idle = node.raw()
        stalled = node.raw()
        stalled.sendall(p.Header(p.Opcode.PUT, 1).pack()[:10])
        start = time.monotonic()
        assert read_until_closed(idle) == b""
        expect_error(stalled, p.ErrorCode.MALFORMED)
        assert time.monotonic() - start < 3
        node.wait_idle()
        assert node.server.stats().protocol_errors == 1
        assert_serves(node)
    finally:
        node.close()


def test_trickling_writer_is_cut_off_and_its_reservation_freed() -> None:
    # Every byte arrives well within the I/O timeout, so only the request's
    # deadline (grace + payload at the minimum rate) can end this.
    node = Node(4 * MiB, io_timeout_s=0.5, min_rate=MiB)
    try:
        rng = random.Random(21)
        k, data = rand_key(rng), chunk(rng, 256 * KiB)
        s = node.raw()
        s.sendall(put_frame([p.PutEntry(k, len(data), checksum(data))]))
        wait_for(lambda: node.chunks.stats().used_bytes == 256 * KiB)
        answered = False
        for i in range(0, len(data), 512):
            try:
                s.sendall(data[i : i + 512])
            except OSError:
                answered = True
                break
            if select.select([s], [], [], 0.05)[0]:
                answered = True
                break
        assert answered, "the server served a trickle of 10 KiB/s to the end"
        expect_error(s, p.ErrorCode.LIMIT_EXCEEDED)  # the reason, before the close
        node.wait_idle()
        assert not node.chunks.contains(k)
        assert node.chunks.stats().used_bytes == 0
        assert node.server.stats().protocol_errors == 1
        assert_serves(node)
    finally:
        node.close()


def test_slow_reader_of_a_reply_is_cut_off_and_its_lease_released() -> None:
    # More than a loopback socket buffers (4 MiB at most): the server is
    # still sending when the deadline (0.5 s + 8 MiB at 4 MiB/s) passes.
    node = Node(16 * MiB, io_timeout_s=0.5, min_rate=4 * MiB)
    try:
        rng = random.Random(22)
        k, data = rand_key(rng), chunk(rng, 8 * MiB)
        with TcpTransport(limits=LIMITS) as t:
            assert t.put(node.address, [item(k, data)]) == [PutStatus.OK]
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(5)
        s.connect(node.server.address)
        s.sendall(p.Header(p.Opcode.GET, 1).pack() + p.pack_get_entries([p.GetEntry(k)]))
        got = 0
        with pytest.raises(OSError):  # reset, or EOF long before the 8 MiB
            while got < len(data):
                part = s.recv(4096)
                if not part:
                    raise ConnectionResetError("closed by the server")
                got += len(part)
                time.sleep(0.02)
        s.close()
        node.wait_idle()
        assert got < len(data)
        # The lease is gone: the chunk's memory can be taken by a new chunk.
        assert node.chunks.delete(k)
        assert node.chunks.stats().used_bytes == 0
        assert node.server.stats().protocol_errors == 1
        assert_serves(node)
    finally:
        node.close()


def test_connection_that_keeps_holding_reservations_is_closed() -> None:
    node = Node(4 * MiB, hold_timeout_s=0.5, idle_timeout_s=30.0)
    try:
        rng = random.Random(23)
        k = rand_key(rng)
        s = node.raw()
        entries = p.pack_put_entries([p.PutEntry(k, MiB, 0)])
        s.sendall(p.Header(p.Opcode.RESERVE, 1).pack() + entries)
        assert p.unpack_header(p.recv_exact(s, 16)).opcode is p.Opcode.RESERVE_REPLY
        (entry,) = p.unpack_reserve_reply_entries(p.recv_exact(s, 16))
        assert entry.status is p.PutCode.OK
        assert node.chunks.stats().used_bytes == MiB
        # Pings keep the connection busy, never idle: the hold timeout still applies.
        with pytest.raises(p.ProtocolError, match="held 1 reservations"):
            for _ in range(200):
                s.sendall(p.Header(p.Opcode.PING).pack())
                p.recv_reply_header(s, p.Opcode.PONG, 0)
                time.sleep(0.05)
        s.close()
        node.wait_idle()
        assert node.chunks.stats().used_bytes == 0
        assert_serves(node)
    finally:
        node.close()


def test_connections_beyond_the_limit_are_refused() -> None:
    node = Node(4 * MiB, max_connections=3)
    try:
        held = [node.raw() for _ in range(3)]
        for s in held:  # served: each is past accept and has its own thread
            s.sendall(p.Header(p.Opcode.PING).pack())
            p.recv_reply_header(s, p.Opcode.PONG, 0)
        extra = node.raw()
        expect_error(extra, p.ErrorCode.LIMIT_EXCEEDED)
        held.pop().close()
        wait_for(lambda: node.server.stats().connections_open == 2)
        assert_serves(node)
        for s in held:
            s.close()
    finally:
        node.close()


def test_random_garbage_never_breaks_the_server(node: Node) -> None:
    rng = random.Random(1234)
    opcodes = list(p.Opcode)
    for i in range(250):
        kind = i % 4
        if kind == 0:  # bytes from nowhere
            frame = rng.randbytes(rng.randrange(1, 200))
        elif kind == 1:  # a valid header, random count and body
            op = rng.choice(opcodes)
            frame = p.Header(op, rng.randrange(0, 10)).pack() + rng.randbytes(rng.randrange(0, 400))
        elif kind == 2:  # a plausible PUT with lies in it
            n = rng.randrange(1, 4)
            entries = [
                p.PutEntry(rand_key(rng), rng.randrange(0, 64 * KiB), rng.getrandbits(64))
                for _ in range(n)
            ]
            frame = put_frame(entries) + rng.randbytes(rng.randrange(0, 100 * KiB))
        else:  # a header with a flipped byte
            raw = bytearray(p.Header(rng.choice(opcodes), rng.randrange(0, 3)).pack())
            raw[rng.randrange(16)] ^= 1 << rng.randrange(8)
            frame = bytes(raw) + rng.randbytes(rng.randrange(0, 100))
        s = node.raw()
        try:
            s.sendall(frame)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server may already have answered and closed
        reply = read_until_closed(s)
        assert reply == b"" or reply.startswith(b"KVDP")
    node.wait_idle()
    stats = node.server.stats()
    assert stats.connections_total == 250
    assert stats.protocol_errors > 100
    assert node.chunks.stats().used_bytes == 0
    assert_serves(node)


def test_peer_that_dies_mid_get_releases_its_leases() -> None:
    node = Node(48 * MiB)
    try:
        rng = random.Random(10)
        k, data = rand_key(rng), chunk(rng, 32 * MiB)
        with TcpTransport(limits=LIMITS) as t:
            assert t.put(node.address, [item(k, data)]) == [PutStatus.OK]
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the reply cannot fit
        s.settimeout(5)
        s.connect(node.server.address)
        s.sendall(p.Header(p.Opcode.GET, 1).pack() + p.pack_get_entries([p.GetEntry(k)]))
        header = p.unpack_header(p.recv_exact(s, 16))
        assert header.opcode is p.Opcode.GET_REPLY
        # The server is blocked sending 32 MiB from the arena: the chunk is leased,
        # so a put that needs its memory cannot evict it.
        with pytest.raises(CapacityExceeded):
            node.chunks.reserve(rand_key(rng), 32 * MiB, 0)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()  # reset mid-reply
        node.wait_idle()
        other = chunk(rng, 32 * MiB)
        with TcpTransport(limits=LIMITS) as t:
            assert t.put(node.address, [item(rand_key(rng), other)]) == [PutStatus.OK]
        assert node.removed == [k]
        assert node.server.stats().protocol_errors == 0
    finally:
        node.close()


# --- indexing by the store (HeaderFlags.INDEX) ----------------------------------------


class IndexLog(Indexer):
    """An indexer that records what it is asked to commit (deferred ones too)."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[ChunkKey], list[int]]] = []
        self.committed: set[ChunkKey] = set()
        self.deferred: dict[tuple[str, int], int] = {}
        self.check: Any = None  # asserts on each chunk asked for

    def commit(self, keys: Any, sizes: Any) -> list[p.IndexCode]:
        # Asked only after the store's own commit: the chunks are readable.
        if self.check is not None:
            for k in keys:
                self.check(k)
        self.calls.append((list(keys), list(sizes)))
        self.committed.update(keys)
        return [p.IndexCode.NEW] * len(keys)

    def defer(self, writer: tuple[str, int], keys: Any, sizes: Any) -> bool:
        self.commit(keys, sizes)
        self.deferred[writer] = self.deferred.get(writer, 0) + len(keys)
        return True

    def sync(self, writer: tuple[str, int], wait_s: float) -> p.IndexSettled:
        return p.IndexSettled(new=self.deferred.pop(writer, 0))


def test_a_put_asking_for_indexing_indexes_only_what_the_store_committed() -> None:
    log = IndexLog()
    node = Node(16 * MiB, index=log)
    rng = random.Random(41)
    keys = [rand_key(rng) for _ in range(3)]
    data = [chunk(rng, 64 * KiB) for _ in keys]
    try:
        with TcpTransport(limits=LIMITS) as t:
            items = [
                item(keys[0], data[0]),  # a PUT
                PutItem(keys[1], data[1]),  # a PUT_TRAILED
                PutItem(keys[2], data[2], checksum(data[2]) ^ 1),  # corrupt
            ]
            statuses, indexed = t.put_indexed(node.address, items)
            assert statuses == [PutStatus.OK, PutStatus.OK, PutStatus.CORRUPT]
            assert indexed == [p.IndexCode.NEW, p.IndexCode.NEW, p.IndexCode.NOT_INDEXED]
            # PUT and PUT_TRAILED (checksums known and not): one call each.
            assert sorted(k for ks, _ in log.calls for k in ks) == sorted(keys[:2])
            assert all(size == 64 * KiB for _, sizes in log.calls for size in sizes)
            assert all(node.chunks.contains(k) for k in log.committed)
            # Held already: EXISTS, nothing to index.
            calls = len(log.calls)
            statuses, indexed = t.put_indexed(node.address, [item(keys[0], data[0])])
            assert (statuses, indexed) == ([PutStatus.EXISTS], [p.IndexCode.NOT_INDEXED])
            assert len(log.calls) == calls
            # A plain put never asks for indexing.
            more = rand_key(rng)
            assert t.put(node.address, [item(more, data[0])]) == [PutStatus.OK]
            assert more not in log.committed
    finally:
        node.close()


def test_old_style_puts_get_old_style_replies(node: Node) -> None:
    rng = random.Random(42)
    data = chunk(rng, 1000)
    for flags in (0, int(p.HeaderFlags.INDEX)):
        e = p.PutEntry(rand_key(rng), len(data), checksum(data))
        with node.raw() as s:
            head = p.Header(p.Opcode.PUT, 1, flags=flags).pack() + p.pack_put_entries([e])
            s.sendall(head + data)
            header = p.recv_reply_header(s, p.Opcode.PUT_REPLY, 1)
            assert p.recv_exact(s, 1) == bytes([p.PutCode.OK])
            # A store without an index function (no daemon) indexes nothing,
            # and says so where it was asked.
            assert header.flags == flags
            assert p.recv_index_codes(s, header) == [p.IndexCode.NOT_INDEXED]
            s.sendall(p.Header(p.Opcode.PING, 0, 7).pack())
            assert p.recv_reply_header(s, p.Opcode.PONG, 0).aux == 7  # nothing left over


def test_a_deferring_writer_is_answered_pending_and_asks_later() -> None:
    log = IndexLog()
    node = Node(16 * MiB, index=log)
    log.check = lambda k: node.chunks.contains(k)  # never before the store's commit
    rng = random.Random(43)
    keys = [rand_key(rng) for _ in range(3)]
    data = [chunk(rng, 64 * KiB) for _ in keys]
    try:
        with TcpTransport(limits=LIMITS) as t:
            items = [item(keys[0], data[0]), PutItem(keys[1], data[1])]
            statuses, indexed = t.put_indexed(node.address, items, writer=5)
            assert statuses == [PutStatus.OK] * 2
            assert indexed == [p.IndexCode.PENDING] * 2
            # What the index did, for this writer only (a sync reads the
            # put's answer first: the store deferred both chunks).
            assert t.sync_index(node.address, 6, 1.0) == p.IndexSettled()
            assert log.deferred == {("", 5): 2}
            assert t.sync_index(node.address, 5, 1.0) == p.IndexSettled(new=2)
            assert t.sync_index(node.address, 5, 1.0) == p.IndexSettled()
            # Without a writer token the store waits for the index, as before.
            statuses, indexed = t.put_indexed(node.address, [item(keys[2], data[2])])
            assert indexed == [p.IndexCode.NEW] and not log.deferred
    finally:
        node.close()


def test_a_store_without_an_indexer_answers_sync_with_nothing(node: Node) -> None:
    with node.raw() as s:
        s.sendall(p.Header(p.Opcode.SYNC, 100, 9).pack())
        header = p.recv_reply_header(s, p.Opcode.SYNC_REPLY, p.INDEX_SETTLED.size)
        assert p.unpack_index_settled(p.recv_exact(s, header.count)) == p.IndexSettled()
        s.sendall(p.Header(p.Opcode.PING, 0, 7).pack())
        assert p.recv_reply_header(s, p.Opcode.PONG, 0).aux == 7  # nothing left over
