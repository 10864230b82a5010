"""The metadata service's framed socket: its two hottest calls without gRPC's cost.

A lookup (every engine's scheduler step, every reader) and a store's index
commit (``PutStart`` with ``written`` flags, every published chunk) are the
metadata calls a request waits for. Over gRPC from Python each costs a round
trip of about 0.4 ms on a small host, 20 times the raw TCP round trip of the
same bytes; the service and its clients spend it in gRPC's own machinery, not
in the index. The metadata service therefore also serves these two calls on a
plain TCP listener, with the very same protobuf messages in length-prefixed
frames (the way Redis or Mooncake's master serve their clients). Everything
else (and every call when this listener is off, TLS is on, or it cannot be
reached) stays on gRPC, which remains the control plane's API.

A connection::

    service -> HELLO   magic "KVDF", version, auth flag, [32-byte nonce if auth]
    client  -> PROOF   HMAC-SHA256(token, label || nonce)     (auth only)
    service -> OK      one byte 1, or the connection is closed
    then, one call at a time:
    client  -> REQUEST u32 length, u8 method, protobuf request
    service -> REPLY   u32 length, u8 status (a gRPC status code), u8 name length,
                       the kvdepot error class name, then the protobuf reply
                       (status OK) or the error message in UTF-8

The proof is the data plane's (:func:`kvdepot.rpc.auth.dataplane_proof`): the
token never crosses the socket, and a proof is good for one nonce only.
"""

from __future__ import annotations

import enum
import struct

MAGIC = b"KVDF"
VERSION = 1
NONCE_BYTES = 32
HELLO = struct.Struct("<4sBB")
"""magic, version, auth (0 or 1); the nonce follows when auth is 1."""
REQUEST = struct.Struct("<IB")
"""payload length, method."""
REPLY = struct.Struct("<IBB")
"""payload length, status code, error class name length (the name precedes the payload)."""
ACCEPTED = b"\x01"

MAX_FRAME = 64 << 20
"""Largest request or reply payload (as the gRPC services' message limit)."""

PORT_KEY = "kvdepot-frames-port"
"""Trailing metadata of a gRPC Lookup or PutStart: the port of this socket."""


class Method(enum.IntEnum):
    """What a request frame calls."""

    LOOKUP = 1
    PUT_START = 2


METHOD_BY_NAME = {"Lookup": Method.LOOKUP, "PutStart": Method.PUT_START}
"""The gRPC method names this socket also serves."""


def pack_request(method: Method, payload: bytes) -> bytes:
    return REQUEST.pack(len(payload), method) + payload


def pack_reply(status: int, payload: bytes, error_type: str = "") -> bytes:
    name = error_type.encode("ascii")
    return REPLY.pack(len(payload), status, len(name)) + name + payload


def pack_hello(nonce: bytes | None) -> bytes:
    return HELLO.pack(MAGIC, VERSION, 1 if nonce else 0) + (nonce or b"")
