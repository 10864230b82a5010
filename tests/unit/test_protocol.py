"""Tests of the data plane wire format and the socket helpers."""

from __future__ import annotations

import array
import os
import socket
import threading
import time
from collections.abc import Iterator, Sequence

import pytest

from kvdepot.errors import Corrupt, InvalidArgument, Unavailable
from kvdepot.keys import ChunkKey
from kvdepot.wire import protocol as p


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.settimeout(10)
    b.settimeout(10)
    yield a, b
    a.close()
    b.close()


def test_header_layout_and_round_trip() -> None:
    raw = p.Header(p.Opcode.GET, count=3, aux=0xDEADBEEF, flags=0).pack()
    assert len(raw) == 16
    assert raw[:4] == b"KVDP" and raw[4] == 1 and raw[5] == p.Opcode.GET
    assert int.from_bytes(raw[8:12], "little") == 3
    assert p.unpack_header(raw) == p.Header(p.Opcode.GET, 3, 0xDEADBEEF, 0)


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"XXXX" + bytes(12), p.ErrorCode.BAD_MAGIC),
        (b"KVDP\x02\x01" + bytes(10), p.ErrorCode.BAD_VERSION),
        (b"KVDP\x01\x63" + bytes(10), p.ErrorCode.BAD_OPCODE),
        (b"KVDP\x01\x00" + bytes(10), p.ErrorCode.BAD_OPCODE),
    ],
)
def test_bad_headers_are_rejected(raw: bytes, code: p.ErrorCode) -> None:
    with pytest.raises(p.ProtocolError) as info:
        p.unpack_header(raw)
    assert info.value.code is code
    assert isinstance(info.value, Corrupt)


def test_entry_sizes_are_fixed() -> None:
    assert (p.HEADER.size, p.PUT_ENTRY.size, p.GET_ENTRY.size) == (16, 32, 32)
    assert p.GET_REPLY_ENTRY.size == 24


def test_put_entries_round_trip() -> None:
    entries = [p.PutEntry(key(i), size=i * 1000 + 1, checksum=(1 << 64) - 1 - i) for i in range(5)]
    raw = p.pack_put_entries(entries)
    assert len(raw) == 5 * 32
    assert p.unpack_put_entries(raw) == entries
    assert p.unpack_put_entries(memoryview(raw)) == entries


def test_get_entries_round_trip() -> None:
    entries = [p.GetEntry(key(1)), p.GetEntry(key(2), offset=4096, length=1 << 40)]
    assert p.unpack_get_entries(p.pack_get_entries(entries)) == entries


def test_get_reply_entries_round_trip() -> None:
    replies = [
        p.GetReplyEntry(p.GetCode.OK, 123, 456),
        p.GetReplyEntry(p.GetCode.NOT_FOUND),
        p.GetReplyEntry(p.GetCode.INVALID),
    ]
    raw = p.pack_get_reply_entries(replies)
    assert len(raw) == 3 * 24
    assert raw[1:8] == bytes(7)  # padding
    assert p.unpack_get_reply_entries(raw) == replies
    with pytest.raises(p.ProtocolError):
        p.unpack_get_reply_entries(b"\x09" + raw[1:24])


def test_row_unpackers_agree_with_the_entry_unpackers() -> None:
    gets = [p.GetEntry(key(1)), p.GetEntry(key(2), offset=4096, length=1 << 40)]
    rows = p.unpack_get_rows(p.pack_get_entries(gets))
    assert [p.GetEntry(ChunkKey(bytes(k)), off, n) for k, off, n in rows] == gets
    replies = [p.GetReplyEntry(p.GetCode.OK, 123, 456), p.GetReplyEntry(p.GetCode.NOT_FOUND)]
    raw = p.pack_get_reply_entries(replies)
    assert [p.GetReplyEntry(p.GetCode(s), n, c) for s, n, c in p.unpack_get_reply_rows(raw)] == (
        replies
    )
    with pytest.raises(p.ProtocolError, match="unknown GET status 9"):
        p.unpack_get_reply_rows(raw[:24] + b"\x09" + raw[25:])


def test_keys_round_trip() -> None:
    keys = [key(i) for i in range(4)]
    assert p.unpack_keys(p.pack_keys(keys)) == keys


def test_error_message_round_trip(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.sendall(p.encode_error(p.ErrorCode.LIMIT_EXCEEDED, "too big: ü" + "x" * 10000))
    header = p.unpack_header(p.recv_exact(b, 16))
    assert header.opcode is p.Opcode.ERROR
    assert header.count == p.MAX_ERROR_MESSAGE
    err = p.read_error(b, header)
    assert err.code is p.ErrorCode.LIMIT_EXCEEDED
    assert "too big: ü" in str(err)


def test_recv_reply_header_raises_the_peer_error(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.sendall(p.encode_error(p.ErrorCode.BAD_OPCODE, "nope"))
    with pytest.raises(p.ProtocolError, match="nope"):
        p.recv_reply_header(b, p.Opcode.PUT_REPLY, 1)
    a.sendall(p.Header(p.Opcode.GET_REPLY, 2).pack())
    with pytest.raises(p.ProtocolError, match="expected PUT_REPLY"):
        p.recv_reply_header(b, p.Opcode.PUT_REPLY, 2)


def test_index_flag_and_codes_on_the_wire(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    # The flag is bit 0 of the header's flags field (bytes 6-7).
    raw = p.Header(p.Opcode.COMMIT, 2, flags=int(p.HeaderFlags.INDEX)).pack()
    assert int.from_bytes(raw[6:8], "little") == 1
    assert p.unpack_header(raw).flags & p.HeaderFlags.INDEX
    assert (p.IndexCode.NOT_INDEXED, p.IndexCode.NEW, p.IndexCode.ELSEWHERE) == (0, 1, 2)
    # A reply with the flag: n statuses, then n index codes.
    flagged = p.Header(p.Opcode.PUT_REPLY, 3, flags=int(p.HeaderFlags.INDEX)).pack()
    a.sendall(flagged + bytes([p.PutCode.OK, p.PutCode.EXISTS, p.PutCode.OK]) + bytes([1, 0, 2]))
    header = p.recv_reply_header(b, p.Opcode.PUT_REPLY, 3)
    assert p.unpack_statuses(p.recv_exact(b, 3), p.PutCode)[1] is p.PutCode.EXISTS
    assert p.recv_index_codes(b, header) == [
        p.IndexCode.NEW,
        p.IndexCode.NOT_INDEXED,
        p.IndexCode.ELSEWHERE,
    ]
    # An old-style reply (no flag) carries no codes: nothing was indexed, and
    # nothing more is read from the stream.
    a.sendall(p.Header(p.Opcode.COMMIT_REPLY, 2).pack() + bytes(2) + b"next")
    header = p.recv_reply_header(b, p.Opcode.COMMIT_REPLY, 2)
    p.recv_exact(b, 2)
    assert p.recv_index_codes(b, header) == [p.IndexCode.NOT_INDEXED] * 2
    assert p.recv_exact(b, 4) == b"next"
    a.sendall(flagged + bytes(3) + bytes([0, 9, 0]))
    header = p.recv_reply_header(b, p.Opcode.PUT_REPLY, 3)
    p.recv_exact(b, 3)
    with pytest.raises(p.ProtocolError, match="IndexCode"):
        p.recv_index_codes(b, header)


def test_limits_validate() -> None:
    assert p.ProtocolLimits().max_batch == 4096
    with pytest.raises(InvalidArgument):
        p.ProtocolLimits(max_batch=0)
    with pytest.raises(InvalidArgument):
        p.ProtocolLimits(max_chunk_bytes=-1)
    assert p.ProtocolLimits(max_chunk_bytes=10, max_request_bytes=5).largest_chunk == 5


class TrickleSocket:
    """Accepts at most ``step`` bytes per sendmsg, recording what arrived."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.received = bytearray()
        self.calls = 0
        self.max_buffers = 0
        self.offered: list[int] = []

    def sendmsg(self, buffers: Sequence[memoryview]) -> int:
        self.calls += 1
        self.max_buffers = max(self.max_buffers, len(buffers))
        self.offered.append(sum(b.nbytes for b in buffers))
        budget = self.step
        for buf in buffers:
            take = min(budget, buf.nbytes)
            self.received += buf[:take]
            budget -= take
            if not budget:
                break
        return self.step - budget


@pytest.mark.parametrize("step", [1, 7, 100, 4096, 1 << 20])
def test_send_all_resumes_partial_sends_across_buffers(step: int) -> None:
    shorts = array.array("H", range(300))
    buffers: list[bytes | bytearray | memoryview] = [
        b"head",
        b"",
        memoryview(os.urandom(5000))[17:4017],
        bytearray(b"middle"),
        memoryview(shorts),  # not a byte format: sent as its raw bytes
        os.urandom(9999),
    ]
    expected = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)
    sock = TrickleSocket(step)
    p.send_all(sock, buffers)  # type: ignore[arg-type]
    assert bytes(sock.received) == expected


def test_send_all_respects_iov_max() -> None:
    buffers: list[bytes | bytearray | memoryview] = [bytes([i % 256]) * 3 for i in range(5000)]
    sock = TrickleSocket(1 << 30)
    p.send_all(sock, buffers)  # type: ignore[arg-type]
    assert bytes(sock.received) == b"".join(bytes(b) for b in buffers)
    assert sock.max_buffers <= 1024


def test_send_all_hands_the_kernel_pieces_of_at_most_send_piece_bytes() -> None:
    from kvdepot.wire.sockets import SEND_PIECE

    # A large reply in pieces (the receiver is woken while the rest is
    # copied), a small vector in one call, and every byte in order.
    head, big = b"h" * 40, os.urandom(3 * SEND_PIECE + 12345)
    buffers: list[bytes | bytearray | memoryview] = [head, memoryview(big), b"tail"]
    sock = TrickleSocket(1 << 30)
    p.send_all(sock, buffers)  # type: ignore[arg-type]
    assert bytes(sock.received) == head + big + b"tail"
    assert max(sock.offered) == SEND_PIECE
    assert sock.calls == 4
    small = TrickleSocket(1 << 30)
    p.send_all(small, [head, os.urandom(SEND_PIECE - 100), b"x"])  # type: ignore[arg-type]
    assert small.calls == 1


def test_send_all_with_real_partial_sends(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    for s in pair:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    payloads = [os.urandom(n) for n in (1, 100_000, 3, 65_537, 250_000)]
    total = sum(len(x) for x in payloads)
    out = bytearray(total)

    def reader() -> None:
        view = memoryview(out)
        got = 0
        while got < total:
            # Small, slow reads force the sender into many partial sendmsg calls.
            n = b.recv_into(view[got:], min(3000, total - got))
            got += n
            if got % 7 == 0:
                time.sleep(0.0005)

    t = threading.Thread(target=reader)
    t.start()
    p.send_all(a, [memoryview(x) for x in payloads])
    t.join(10)
    assert bytes(out) == b"".join(payloads)


def test_recv_exact_into_fills_and_detects_eof(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    data = os.urandom(200_000)
    t = threading.Thread(target=a.sendall, args=(data,))
    t.start()
    buf = bytearray(len(data))
    p.recv_exact_into(b, memoryview(buf))
    t.join()
    assert buf == data
    a.sendall(b"abc")
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(p.PeerClosed, match="after 3 of 10"):
        p.recv_exact_into(b, memoryview(bytearray(10)))


def test_recv_exact_into_many_fills_views_in_order_across_partial_arrivals(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    sizes = [1, 0, 4096, 3, 70_000, 17]
    data = os.urandom(sum(sizes))

    def dribble() -> None:
        # Pieces that end inside a view, on a boundary and across several views.
        for i in range(0, len(data), 2999):
            a.sendall(data[i : i + 2999])
            time.sleep(0.001)

    t = threading.Thread(target=dribble)
    t.start()
    bufs = [bytearray(n) for n in sizes]
    p.recv_exact_into_many(b, [memoryview(x) for x in bufs])
    t.join(10)
    assert b"".join(bufs) == data


def test_recv_exact_into_many_detects_eof_and_bounds_the_views(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    a.sendall(b"abcde")
    a.shutdown(socket.SHUT_WR)
    bufs = [bytearray(4), bytearray(4)]
    with pytest.raises(p.PeerClosed, match="after 5 of 8"):
        p.recv_exact_into_many(b, [memoryview(x) for x in bufs])
    assert bufs[0] == b"abcd" and bufs[1][:1] == b"e"
    with pytest.raises(InvalidArgument, match="exceed"):
        p.recv_exact_into_many(b, [memoryview(bytearray(1))] * (p.IOV_MAX + 1))


def test_recv_exact_and_drain(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    t = threading.Thread(target=a.sendall, args=(b"0123456789" + bytes(300_000) + b"tail",))
    t.start()
    assert p.recv_exact(b, 10) == b"0123456789"
    p.drain(b, 300_000, memoryview(bytearray(4096)))
    assert p.recv_exact(b, 4) == b"tail"
    t.join()
    a.sendall(bytes(100))
    p.drain(b, 100)  # per-thread scratch
    a.close()
    with pytest.raises(p.PeerClosed):
        p.drain(b, 1)


def test_kernel_timeouts_surface_as_unavailable(pair: tuple[socket.socket, socket.socket]) -> None:
    _, b = pair
    p.set_io_timeout(b, 0.2)
    assert b.gettimeout() is None
    start = time.monotonic()
    with pytest.raises(Unavailable, match="timed out"):
        p.recv_exact(b, 1)
    assert time.monotonic() - start < 2
    with pytest.raises(InvalidArgument):
        p.set_io_timeout(b, 0)


def test_byte_view_rejects_non_contiguous() -> None:
    with pytest.raises(InvalidArgument):
        p.byte_view(memoryview(bytes(10))[::2])
    assert p.byte_view(memoryview(array.array("d", [1.0, 2.0]))).nbytes == 16


# --- hostile bytes: every parser answers with a value or a ProtocolError ---------------

from hypothesis import given, settings  # noqa: E402 - kept with the tests that use them
from hypothesis import strategies as st  # noqa: E402

PARSERS = [
    p.unpack_put_entries,
    p.unpack_get_entries,
    p.unpack_get_reply_entries,
    p.unpack_get_rows,
    p.unpack_get_reply_rows,
    p.unpack_keys,
    p.unpack_reserve_reply_entries,
    p.unpack_commit_entries,
    p.unpack_lease_reply_entries,
    p.unpack_lease_ids,
    p.unpack_attach_info,
]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_parsers_answer_any_bytes_with_a_value_or_a_protocol_error(data: bytes) -> None:
    for parse in PARSERS:
        try:
            parse(data)
        except p.ProtocolError as exc:
            assert exc.code is p.ErrorCode.MALFORMED


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=16, max_size=16))
def test_any_sixteen_bytes_are_a_header_or_a_protocol_error(raw: bytes) -> None:
    try:
        header = p.unpack_header(raw)
    except p.ProtocolError as exc:
        assert exc.code in (p.ErrorCode.BAD_MAGIC, p.ErrorCode.BAD_VERSION, p.ErrorCode.BAD_OPCODE)
    else:
        assert header.pack()[:6] == raw[:6] and header.pack()[8:] == raw[8:]


def test_partial_entries_are_malformed_not_a_struct_error() -> None:
    whole = p.pack_put_entries([p.PutEntry(key(1), 10, 20)])
    with pytest.raises(p.ProtocolError, match="not whole entries"):
        p.unpack_put_entries(whole[:-1])
    with pytest.raises(p.ProtocolError, match="not whole keys"):
        p.unpack_keys(bytes(17))


@settings(max_examples=100, deadline=None)
@given(
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**64 - 1),
    st.text(max_size=50),
    st.text(max_size=50),
    st.text(max_size=50),
)
def test_attach_info_round_trips(gen: int, size: int, path: str, host: str, ctl: str) -> None:
    info = p.AttachInfo(gen, size, 1, 2, p.AttachFlags.SHM, path, host, ctl)
    assert p.unpack_attach_info(info.pack()) == info
    # A body whose string lengths lie about it is refused, never read past.
    body = bytearray(info.pack())
    body[36:38] = (0xFFFF).to_bytes(2, "little")
    with pytest.raises(p.ProtocolError):
        p.unpack_attach_info(bytes(body))
