"""The framed metadata socket's wire form and its errors, as the client raises them."""

from __future__ import annotations

import grpc

from kvdepot.errors import InvalidArgument, NotFound, Unavailable
from kvdepot.metadata_frames import FrameError, FrameLink
from kvdepot.proto.gen import metadata_pb2
from kvdepot.rpc.errors import from_grpc
from kvdepot.wire import frames


def test_a_request_frame_is_its_length_its_method_and_the_protobuf() -> None:
    request = metadata_pb2.LookupRequest(keys=[b"k" * 16, b"j" * 16], packed=True)
    payload = request.SerializeToString()
    frame = frames.pack_request(frames.Method.LOOKUP, payload)
    length, method = frames.REQUEST.unpack_from(frame)
    assert (length, method) == (len(payload), frames.Method.LOOKUP)
    parsed = metadata_pb2.LookupRequest()
    parsed.ParseFromString(frame[frames.REQUEST.size :])
    assert parsed == request


def test_a_reply_frame_carries_the_status_and_the_error_class() -> None:
    frame = frames.pack_reply(
        grpc.StatusCode.INVALID_ARGUMENT.value[0], b"bad keys", "InvalidArgument"
    )
    length, status, name_len = frames.REPLY.unpack_from(frame)
    rest = frame[frames.REPLY.size :]
    assert (length, status) == (8, grpc.StatusCode.INVALID_ARGUMENT.value[0])
    assert rest[:name_len] == b"InvalidArgument" and rest[name_len:] == b"bad keys"
    assert frames.pack_hello(None) == frames.HELLO.pack(frames.MAGIC, frames.VERSION, 0)
    assert len(frames.pack_hello(b"n" * 32)) == frames.HELLO.size + 32


def test_a_frame_error_translates_as_the_grpc_error_would() -> None:
    named = FrameError(grpc.StatusCode.INVALID_ARGUMENT, "3 keys but 2 sizes", "InvalidArgument")
    err = from_grpc(named, "metadata Lookup")
    assert type(err) is InvalidArgument and str(err) == "metadata Lookup: 3 keys but 2 sizes"
    assert type(from_grpc(FrameError(grpc.StatusCode.NOT_FOUND, "gone"))) is NotFound
    timed_out = FrameError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
    assert type(from_grpc(timed_out)) is Unavailable


def test_a_link_learns_its_port_from_trailing_metadata_only() -> None:
    link = FrameLink("127.0.0.1", "")
    assert not link.usable()
    link.learn((("kvdepot-error", "Unavailable"),))
    link.learn(((frames.PORT_KEY, "not a port"),))
    assert not link.usable()
    link.learn(((frames.PORT_KEY, "7702"),))
    assert link.port == 7702 and link.usable()
