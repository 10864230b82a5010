"""Wire format of the ``tcp`` data plane (the socket helpers both ends use live
in :mod:`kvdepot.wire.sockets` and are re-exported here).

Every message is a fixed 16-byte header, then fixed-size entries, then raw
payloads back to back. Nothing is serialised per chunk: payload bytes go from
the sender's memory to the wire with ``sendmsg`` of a list of buffers and off
the wire straight into their destination with ``recv_into``. All integers are
little-endian.

Header (16 bytes, every message)::

    offset  size  field
    0       4     magic     b"KVDP"
    4       1     version   1
    5       1     opcode    see Opcode
    6       2     flags     HeaderFlags; bits a receiver does not know are ignored
    8       4     count     entries that follow (ERROR: message length)
    12      4     aux       opcode-specific (PING/PONG: nonce echoed; else 0)

Requests and replies (n = header.count)::

    PUT           header, n x PutEntry, then the n payloads back to back
      PutEntry    0 key 16B | 16 size u64 | 24 checksum u64            (32 bytes)
    PUT_REPLY     header, n x status u8 (PutCode); with HeaderFlags.INDEX
                  (asked for by the PUT), then n x index code u8 (IndexCode)
    GET           header, n x GetEntry
      GetEntry    0 key 16B | 16 offset u64 | 24 length u64 (0 = to the end)  (32 bytes)
    GET_REPLY     header, n x GetReplyEntry, then the payloads of the OK
                  entries back to back, in request order
      GetReplyEntry  0 status u8 (GetCode) | 1 pad 7B | 8 length u64 | 16 checksum u64
                                                                        (24 bytes)
    DELETE        header, n x key 16B
    DELETE_REPLY  header, n x status u8 (DeleteCode)
    PING / PONG   header only, count 0
    ERROR         header (count = message length), code u32 (ErrorCode),
                  then the utf-8 message
    PUT_TRAILED   header, n x PutEntry (checksum sent as 0), then per chunk its
                  payload followed by its checksum u64: the writer hashes each
                  part of a payload right after the kernel read it (hot in
                  cache) instead of in a pass of its own before sending.
                  Answered with PUT_REPLY.
    AUTH          header only (count 0): asks for a challenge; or header
                  (count 32) and the proof HMAC-SHA256(token, label||nonce)
    AUTH_REPLY    header (count 32) and a fresh nonce: the challenge; or
                  header only (count 0): accepted, or no token needed.
                  A store with a token refuses any other request before an
                  accepted proof with ERROR UNAUTHENTICATED and closes the
                  connection (see :mod:`kvdepot.wire.handshake`).

Indexing by the store (``HeaderFlags.INDEX``): a writer publishing into its
own node's store sets the flag on PUT, PUT_TRAILED or COMMIT to ask the store
to commit the chunks this message stores into the cluster's index itself, as
replicas on the store's node, after its own commit (one ``PutStart`` with
``written`` flags, shared with other writers' commits of the moment). The
reply (PUT_REPLY, COMMIT_REPLY) then carries the flag too and, after its n
status bytes, n x index code u8 (IndexCode): NEW (in the index, the first
replica in the cluster), ELSEWHERE (in the index; another node stored the
chunk already, this node is one more replica) or NOT_INDEXED (not stored
here, not asked, or the index did not commit it within the store's bounded
wait: the writer commits it itself). A reply without the flag (a store that
predates it) indexed nothing. Only chunks answered OK are ever indexed.

Deferred indexing (``HeaderFlags.DEFER`` with ``INDEX``, ``aux`` = the
writer's token, a nonzero u32 the writer picks once): the store answers as
soon as its own commit is done, PENDING for each chunk it queued for the
index, and commits them into the index right after, batched across writers.
What the index then did is counted per writer (tenant and token) until the
writer asks::

    SYNC          header (count = longest wait in ms, aux = writer token):
                  wait (at most that long, and at most the store's own
                  bound) until none of the writer's chunks is pending
    SYNC_REPLY    header (count 32), IndexSettled body: 0 new u64
                  | 8 elsewhere u64 | 16 not indexed u64 | 24 pending u64:
                  the writer's outcomes since its last SYNC, and what is
                  still pending

Requests of clients that move the bytes themselves (``shm``: the client maps
the arena; ``nixl``: one-sided RDMA READ/WRITE). Reservations and leases
belong to the connection that took them: when it closes, for whatever reason,
the store revokes every reservation and releases every lease it still holds::

    ATTACH        header (count 0, aux = AttachKind the client means to use)
    ATTACH_REPLY  header (count = body length), AttachInfo body:
      0 generation u64 | 8 arena size u64 | 16 file dev u64 | 24 file inode u64
      | 32 flags u32 (AttachFlags) | 36 path length u16 | 38 host id length u16
      | 40 control address length u16 | 42 pad 6 | 48 the three utf-8 strings
    RESERVE       header, n x PutEntry (checksum sent as 0)
    RESERVE_REPLY header, n x ReserveReplyEntry
      ReserveReplyEntry  0 status u8 (PutCode) | 1 pad 7B | 8 arena offset u64 (16 bytes)
    COMMIT        header, n x CommitEntry: 0 key 16B | 16 checksum u64   (24 bytes)
                  The store hashes the reserved bytes and commits the chunk
                  only if they match: the checksum is checked end to end.
    COMMIT_REPLY  header, n x status u8 (PutCode: OK, CORRUPT, INVALID = not
                  reserved on this connection); with HeaderFlags.INDEX, then
                  n x index code u8 (IndexCode), as a PUT_REPLY
    ABORT         header, n x key 16B: revoke reservations of this connection
    ABORT_REPLY   header, n x status u8 (HeldCode)
    LEASE         header, n x GetEntry
    LEASE_REPLY   header, n x LeaseReplyEntry
      LeaseReplyEntry  0 status u8 (GetCode) | 1 pad 7B | 8 lease id u64
                       | 16 arena offset u64 | 24 length u64 | 32 checksum u64 (40 bytes)
    RELEASE       header, n x lease id u64
    RELEASE_REPLY header, n x status u8 (HeldCode)

Grants (``HeaderFlags.GRANT``, ``shm`` only, offered by ``AttachFlags.GRANTS``): room
given ahead of its key, so a put is copy then COMMIT. RESERVE|GRANT (sizes only) drops the
connection's unused grants and grants each size. COMMIT|GRANT entries are 0 key 16B |
16 checksum u64 | 24 grant offset u64: each grant becomes its chunk, or is freed if the key
is stored (EXISTS); the COMMIT_REPLY|GRANT ends with n x ReserveReplyEntry, new grants of
the sizes committed. Grants are invisible to readers and freed only by their COMMIT or
their connection's end, which idleness and ``hold_timeout_s`` never cause while it holds
grants (an ``shm`` client's death closes its socket): no room being copied into is freed.

The arena offsets are only meaningful for the arena of the generation the
connection attached to: a store that restarts has a new arena with a new
generation, and a client compares it on every new connection.

A GET reply's checksum is the writer's stored checksum for a whole-chunk read
(end to end: the bytes the reader gets are checked against what the writer
hashed), and the xxh3-64 of the served bytes for a ranged read.

A receiver of a malformed frame (bad magic, version or opcode, a count or size
above :class:`ProtocolLimits`, a truncated frame) answers ERROR and closes the
connection: after a framing error the stream cannot be resynchronised.
"""

from __future__ import annotations

import enum
import socket
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from kvdepot.errors import Corrupt, InvalidArgument, Unauthenticated
from kvdepot.keys import KEY_BYTES, ChunkKey
from kvdepot.wire.settled import INDEX_SETTLED as INDEX_SETTLED
from kvdepot.wire.settled import IndexSettled as IndexSettled
from kvdepot.wire.sockets import HASH_BLOCK as HASH_BLOCK
from kvdepot.wire.sockets import IOV_MAX as IOV_MAX
from kvdepot.wire.sockets import PeerClosed as PeerClosed
from kvdepot.wire.sockets import TimedOut as TimedOut
from kvdepot.wire.sockets import byte_view as byte_view
from kvdepot.wire.sockets import drain as drain
from kvdepot.wire.sockets import recv_exact as recv_exact
from kvdepot.wire.sockets import recv_exact_into as recv_exact_into
from kvdepot.wire.sockets import recv_exact_into_many as recv_exact_into_many
from kvdepot.wire.sockets import recv_hashed_into as recv_hashed_into
from kvdepot.wire.sockets import send_all as send_all
from kvdepot.wire.sockets import send_hashed as send_hashed
from kvdepot.wire.sockets import set_io_timeout as set_io_timeout
from kvdepot.wire.sockets import set_recv_timeout as set_recv_timeout
from kvdepot.wire.sockets import set_send_timeout as set_send_timeout

_E = TypeVar("_E", bound=enum.IntEnum)

MAGIC = b"KVDP"
VERSION = 1

HEADER = struct.Struct("<4sBBHII")
PUT_ENTRY = struct.Struct(f"<{KEY_BYTES}sQQ")
GET_ENTRY = struct.Struct(f"<{KEY_BYTES}sQQ")
GET_REPLY_ENTRY = struct.Struct("<B7xQQ")
RESERVE_REPLY_ENTRY = struct.Struct("<B7xQ")
COMMIT_ENTRY = struct.Struct(f"<{KEY_BYTES}sQ")
GRANTED_COMMIT_ENTRY = struct.Struct(f"<{KEY_BYTES}sQQ")
LEASE_REPLY_ENTRY = struct.Struct("<B7xQQQQ")
LEASE_ID = struct.Struct("<Q")
CHECKSUM = struct.Struct("<Q")
ATTACH_INFO = struct.Struct("<QQQQIHHH6x")
ERROR_CODE = struct.Struct("<I")

MAX_GRANTED_BYTES = 32 << 20
"""Most bytes granted to one connection at once; larger batches reserve by
key. A store grants less where its DRAM is small (see
``kvdepot.store.session.GrantBudget``); a client learns that from the
grants it was refused."""

MAX_ERROR_MESSAGE = 4096
"""Longest ERROR message accepted or sent, in bytes."""


class Opcode(enum.IntEnum):
    """What a message is."""

    PUT = 1
    PUT_REPLY = 2
    GET = 3
    GET_REPLY = 4
    DELETE = 5
    DELETE_REPLY = 6
    PING = 7
    PONG = 8
    ERROR = 9
    ATTACH = 10
    ATTACH_REPLY = 11
    RESERVE = 12
    RESERVE_REPLY = 13
    COMMIT = 14
    COMMIT_REPLY = 15
    ABORT = 16
    ABORT_REPLY = 17
    LEASE = 18
    LEASE_REPLY = 19
    RELEASE = 20
    RELEASE_REPLY = 21
    PUT_TRAILED = 22
    AUTH = 23
    AUTH_REPLY = 24
    SYNC = 25
    SYNC_REPLY = 26


class HeaderFlags(enum.IntFlag):
    """Bits of a header's ``flags``."""

    NONE = 0
    INDEX = 1
    """On PUT, PUT_TRAILED, COMMIT: the store commits what it stores into the
    index too. On PUT_REPLY, COMMIT_REPLY: index codes follow the statuses."""
    DEFER = 2
    """With INDEX on a request: answer after the store's own commit, the index
    commit following (PENDING); ``aux`` is the writer's token (see SYNC)."""
    GRANT = 4
    """On RESERVE, COMMIT and COMMIT_REPLY: room granted ahead of keys ("Grants")."""


class IndexCode(enum.IntEnum):
    """Per chunk, whether the store committed it into the index (HeaderFlags.INDEX)."""

    NOT_INDEXED = 0
    """Not in the index by this request: the writer commits it itself."""
    NEW = 1
    """Committed; no other node had stored it."""
    ELSEWHERE = 2
    """Committed as one more replica; another node had stored it already."""
    PENDING = 3
    """Stored here and queued for the index (``HeaderFlags.DEFER``): the
    writer learns the outcome with SYNC."""


class AttachKind(enum.IntEnum):
    """How an attaching client means to move bytes (the ``aux`` of ATTACH)."""

    PROBE = 0
    """Only asking what the store offers."""
    SHM = 1
    NIXL = 2


class AttachFlags(enum.IntFlag):
    """What a store offers beyond the ``tcp`` data plane (in ATTACH_REPLY)."""

    NONE = 0
    SHM = 1
    """The arena is a file same-host clients may map (``path`` is set)."""
    NIXL = 2
    """A NIXL agent has registered the arena; see the Store's GetTransferInfo."""
    VERIFIES_SHM = 4
    """The store hashes ``shm`` commits again: a client pipelines its COMMITs."""
    GRANTS = 8
    """The store grants ``shm`` connections room ahead of their keys (GRANT)."""


_KNOWN_ATTACH_FLAGS = (
    AttachFlags.SHM | AttachFlags.NIXL | AttachFlags.VERIFIES_SHM | AttachFlags.GRANTS
)
"""Bits of ATTACH_REPLY's flags this version knows (newer stores may set more)."""


class HeldCode(enum.IntEnum):
    """Per-item outcome of ABORT and RELEASE."""

    OK = 0
    NOT_HELD = 1


class PutCode(enum.IntEnum):
    """Per-chunk outcome of a PUT."""

    OK = 0
    EXISTS = 1
    NO_SPACE = 2
    CORRUPT = 3
    INVALID = 4


class GetCode(enum.IntEnum):
    """Per-chunk outcome of a GET."""

    OK = 0
    NOT_FOUND = 1
    INVALID = 2


class DeleteCode(enum.IntEnum):
    """Per-chunk outcome of a DELETE."""

    OK = 0
    NOT_FOUND = 1


class ErrorCode(enum.IntEnum):
    """Why a connection is being closed (the code of an ERROR message)."""

    BAD_MAGIC = 1
    BAD_VERSION = 2
    BAD_OPCODE = 3
    LIMIT_EXCEEDED = 4
    MALFORMED = 5
    INTERNAL = 6
    UNAUTHENTICATED = 7


class ProtocolError(Corrupt):
    """A malformed frame, or an ERROR message from the peer.

    Attributes:
        code: What was wrong.
    """

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.detail = message


class AuthRefused(ProtocolError, Unauthenticated):
    """The connection did not authenticate: no token, or a wrong one (ERROR UNAUTHENTICATED)."""

    rpc_status = Unauthenticated.rpc_status

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.UNAUTHENTICATED, message)


@dataclass(frozen=True, slots=True)
class ProtocolLimits:
    """Bounds a receiver enforces before it reserves memory for a request.

    Attributes:
        max_batch: Most entries in one message.
        max_chunk_bytes: Largest single payload.
        max_request_bytes: Largest sum of the payloads of one PUT; senders
            also split GETs so their replies stay under it.
        max_held: Most reservations plus leases one connection may hold at
            once (RESERVE and LEASE pin arena memory until COMMIT/RELEASE).
    """

    max_batch: int = 4096
    max_chunk_bytes: int = 1 << 30
    max_request_bytes: int = 8 << 30
    max_held: int = 16384

    def __post_init__(self) -> None:
        if min(self.max_batch, self.max_chunk_bytes, self.max_request_bytes, self.max_held) <= 0:
            raise InvalidArgument(f"protocol limits must be positive: {self}")
        if self.max_batch > 0xFFFFFFFF:
            raise InvalidArgument("max_batch must fit in the u32 count field")

    @property
    def largest_chunk(self) -> int:
        """The largest chunk one PUT can carry: both limits apply."""
        return min(self.max_chunk_bytes, self.max_request_bytes)


@dataclass(frozen=True, slots=True)
class Header:
    """The 16-byte header of every message."""

    opcode: Opcode
    count: int = 0
    aux: int = 0
    flags: int = 0

    def pack(self) -> bytes:
        """The header's wire bytes."""
        return HEADER.pack(MAGIC, VERSION, self.opcode, self.flags, self.count, self.aux)


def unpack_header(data: bytes | bytearray | memoryview) -> Header:
    """Parse a header, rejecting anything that is not this protocol.

    Raises:
        ProtocolError: Bad magic, version or opcode.
    """
    magic, version, opcode, flags, count, aux = HEADER.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(ErrorCode.BAD_MAGIC, f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise ProtocolError(ErrorCode.BAD_VERSION, f"unsupported version {version}")
    op = _OPCODES.get(opcode)
    if op is None:
        raise ProtocolError(ErrorCode.BAD_OPCODE, f"unknown opcode {opcode}")
    return Header(op, count, aux, flags)


# Every message's opcode is looked up here: a dict is several times faster
# than calling the enum.
_OPCODES: dict[int, Opcode] = {int(op): op for op in Opcode}


@dataclass(frozen=True, slots=True)
class PutEntry:
    """One chunk announced in a PUT; its payload follows the entries."""

    key: ChunkKey
    size: int
    checksum: int


@dataclass(frozen=True, slots=True)
class GetEntry:
    """One ranged read in a GET (``length`` 0: to the end of the chunk)."""

    key: ChunkKey
    offset: int = 0
    length: int = 0


@dataclass(frozen=True, slots=True)
class GetReplyEntry:
    """One answer in a GET_REPLY; ``length`` payload bytes follow if OK."""

    status: GetCode
    length: int = 0
    checksum: int = 0


def _entries(
    layout: struct.Struct, data: bytes | bytearray | memoryview
) -> Iterator[tuple[Any, ...]]:
    # Every caller reads exactly count * size bytes; anything else is a bug
    # or a hostile peer, and must not escape as a struct.error.
    if len(data) % layout.size:
        raise ProtocolError(
            ErrorCode.MALFORMED, f"{len(data)} bytes are not whole entries of {layout.size}"
        )
    return layout.iter_unpack(data)


def pack_put_entries(entries: Iterable[PutEntry]) -> bytes:
    """Wire bytes of the entries of a PUT."""
    return b"".join(PUT_ENTRY.pack(e.key, e.size, e.checksum) for e in entries)


def unpack_put_entries(data: bytes | bytearray | memoryview) -> list[PutEntry]:
    """Parse the entries of a PUT (``len(data)`` a multiple of 32)."""
    return [PutEntry(ChunkKey(bytes(k)), size, ck) for k, size, ck in _entries(PUT_ENTRY, data)]


def pack_get_entries(entries: Iterable[GetEntry]) -> bytes:
    """Wire bytes of the entries of a GET."""
    return b"".join(GET_ENTRY.pack(e.key, e.offset, e.length) for e in entries)


def unpack_get_entries(data: bytes | bytearray | memoryview) -> list[GetEntry]:
    """Parse the entries of a GET (``len(data)`` a multiple of 32)."""
    return [GetEntry(ChunkKey(bytes(k)), off, n) for k, off, n in _entries(GET_ENTRY, data)]


def unpack_get_rows(data: bytes | bytearray | memoryview) -> list[tuple[ChunkKey, int, int]]:
    """The entries of a GET as ``(key, offset, length)`` tuples: :func:`unpack_get_entries`
    without an object per entry, for the store's hot path."""
    return list(_entries(GET_ENTRY, data))


def pack_get_reply_entries(entries: Iterable[GetReplyEntry]) -> bytes:
    """Wire bytes of the entries of a GET_REPLY."""
    return b"".join(GET_REPLY_ENTRY.pack(e.status, e.length, e.checksum) for e in entries)


def unpack_get_reply_entries(data: bytes | bytearray | memoryview) -> list[GetReplyEntry]:
    """Parse the entries of a GET_REPLY.

    Raises:
        ProtocolError: An unknown status.
    """
    return [GetReplyEntry(GetCode(s), n, ck) for s, n, ck in unpack_get_reply_rows(data)]


_GET_CODES = frozenset(int(c) for c in GetCode)


def unpack_get_reply_rows(data: bytes | bytearray | memoryview) -> list[tuple[int, int, int]]:
    """The entries of a GET_REPLY as ``(status, length, checksum)`` tuples:
    :func:`unpack_get_reply_entries` without an object per entry, for the
    reader's hot path (``status`` compares equal to its :class:`GetCode`).

    Raises:
        ProtocolError: An unknown status.
    """
    rows: list[tuple[int, int, int]] = list(_entries(GET_REPLY_ENTRY, data))
    for status, _, _ in rows:
        if status not in _GET_CODES:
            raise ProtocolError(ErrorCode.MALFORMED, f"unknown GET status {status}")
    return rows


def pack_keys(keys: Iterable[bytes]) -> bytes:
    """Wire bytes of the keys of a DELETE."""
    return b"".join(keys)


def unpack_keys(data: bytes | bytearray | memoryview) -> list[ChunkKey]:
    """Parse the keys of a DELETE (``len(data)`` a multiple of 16)."""
    raw = bytes(data)
    if len(raw) % KEY_BYTES:
        raise ProtocolError(ErrorCode.MALFORMED, f"{len(raw)} bytes are not whole keys")
    return [ChunkKey(raw[i : i + KEY_BYTES]) for i in range(0, len(raw), KEY_BYTES)]


MAX_ATTACH_BODY = ATTACH_INFO.size + 3 * 0xFFFF
"""Largest ATTACH_REPLY body a client accepts."""


@dataclass(frozen=True, slots=True)
class AttachInfo:
    """What a store tells a client that means to move bytes itself.

    Attributes:
        generation: Random id of this arena; a restarted store has another.
        arena_size: Bytes of the arena.
        file_dev: ``st_dev`` of the arena file (0 when not shareable).
        file_ino: ``st_ino`` of the arena file (0 when not shareable).
        flags: What the store offers (:class:`AttachFlags`).
        arena_path: The arena file; empty when the arena is anonymous memory.
        host_id: Identity of the store's host (its kernel boot id).
        control_address: The store's gRPC ``host:port`` (GetTransferInfo).
    """

    generation: int
    arena_size: int
    file_dev: int = 0
    file_ino: int = 0
    flags: AttachFlags = AttachFlags.NONE
    arena_path: str = ""
    host_id: str = ""
    control_address: str = ""

    def pack(self) -> bytes:
        """The ATTACH_REPLY body."""
        texts = [t.encode("utf-8") for t in (self.arena_path, self.host_id, self.control_address)]
        if any(len(t) > 0xFFFF for t in texts):
            raise InvalidArgument("attach strings must be shorter than 64 KiB")
        head = ATTACH_INFO.pack(
            self.generation,
            self.arena_size,
            self.file_dev,
            self.file_ino,
            int(self.flags),
            *(len(t) for t in texts),
        )
        return head + b"".join(texts)


def unpack_attach_info(data: bytes | bytearray | memoryview) -> AttachInfo:
    """Parse an ATTACH_REPLY body.

    Raises:
        ProtocolError: The body is truncated or its strings are not utf-8.
    """
    raw = bytes(data)
    if len(raw) < ATTACH_INFO.size:
        raise ProtocolError(ErrorCode.MALFORMED, f"ATTACH_REPLY body of {len(raw)} bytes")
    gen, size, dev, ino, flags, n_path, n_host, n_ctl = ATTACH_INFO.unpack_from(raw)
    if ATTACH_INFO.size + n_path + n_host + n_ctl != len(raw):
        raise ProtocolError(ErrorCode.MALFORMED, "ATTACH_REPLY strings do not fit its body")
    pos = ATTACH_INFO.size
    texts = []
    for n in (n_path, n_host, n_ctl):
        try:
            texts.append(raw[pos : pos + n].decode("utf-8"))
        except UnicodeDecodeError:
            raise ProtocolError(ErrorCode.MALFORMED, "ATTACH_REPLY string not utf-8") from None
        pos += n
    return AttachInfo(gen, size, dev, ino, AttachFlags(flags & _KNOWN_ATTACH_FLAGS), *texts)


@dataclass(frozen=True, slots=True)
class ReserveReplyEntry:
    """One answer in a RESERVE_REPLY: where to write the chunk, if OK."""

    status: PutCode
    offset: int = 0


@dataclass(frozen=True, slots=True)
class CommitEntry:
    """One chunk of a COMMIT: its key and the writer's checksum of its bytes
    (and, in a COMMIT with ``HeaderFlags.GRANT``, the offset of its grant)."""

    key: ChunkKey
    checksum: int
    offset: int = 0


@dataclass(frozen=True, slots=True)
class LeaseReplyEntry:
    """One answer in a LEASE_REPLY: where the (range of the) chunk is, if OK.

    ``checksum`` is the writer's for a whole chunk and the store's hash of the
    bytes for a range, exactly as in a GET_REPLY.
    """

    status: GetCode
    lease_id: int = 0
    offset: int = 0
    length: int = 0
    checksum: int = 0


def pack_reserve_reply_entries(entries: Iterable[ReserveReplyEntry]) -> bytes:
    """Wire bytes of the entries of a RESERVE_REPLY."""
    return b"".join(RESERVE_REPLY_ENTRY.pack(e.status, e.offset) for e in entries)


def unpack_reserve_reply_entries(data: bytes | bytearray | memoryview) -> list[ReserveReplyEntry]:
    """Parse the entries of a RESERVE_REPLY.

    Raises:
        ProtocolError: An unknown status.
    """
    out = []
    for status, offset in _entries(RESERVE_REPLY_ENTRY, data):
        try:
            out.append(ReserveReplyEntry(PutCode(status), offset))
        except ValueError:
            raise ProtocolError(ErrorCode.MALFORMED, f"unknown RESERVE status {status}") from None
    return out


def pack_commit_entries(entries: Iterable[CommitEntry], *, granted: bool = False) -> bytes:
    """Wire bytes of the entries of a COMMIT (``granted``: of a COMMIT|GRANT)."""
    if granted:
        return b"".join(GRANTED_COMMIT_ENTRY.pack(e.key, e.checksum, e.offset) for e in entries)
    return b"".join(COMMIT_ENTRY.pack(e.key, e.checksum) for e in entries)


def unpack_commit_entries(
    data: bytes | bytearray | memoryview, *, granted: bool = False
) -> list[CommitEntry]:
    """Parse the entries of a COMMIT (of 24 bytes each, 32 in a COMMIT|GRANT)."""
    rows = _entries(GRANTED_COMMIT_ENTRY if granted else COMMIT_ENTRY, data)
    return [CommitEntry(ChunkKey(bytes(k)), *rest) for k, *rest in rows]


def pack_lease_reply_entries(entries: Iterable[LeaseReplyEntry]) -> bytes:
    """Wire bytes of the entries of a LEASE_REPLY."""
    return b"".join(
        LEASE_REPLY_ENTRY.pack(e.status, e.lease_id, e.offset, e.length, e.checksum)
        for e in entries
    )


def unpack_lease_reply_entries(data: bytes | bytearray | memoryview) -> list[LeaseReplyEntry]:
    """Parse the entries of a LEASE_REPLY.

    Raises:
        ProtocolError: An unknown status.
    """
    out = []
    for status, lease_id, offset, length, ck in _entries(LEASE_REPLY_ENTRY, data):
        try:
            code = GetCode(status)
        except ValueError:
            raise ProtocolError(ErrorCode.MALFORMED, f"unknown LEASE status {status}") from None
        out.append(LeaseReplyEntry(code, lease_id, offset, length, ck))
    return out


def pack_lease_ids(ids: Iterable[int]) -> bytes:
    """Wire bytes of the lease ids of a RELEASE."""
    return b"".join(LEASE_ID.pack(i) for i in ids)


def unpack_lease_ids(data: bytes | bytearray | memoryview) -> list[int]:
    """Parse the lease ids of a RELEASE (``len(data)`` a multiple of 8)."""
    return [i for (i,) in _entries(LEASE_ID, data)]


def unpack_statuses(data: bytes, kind: type[_E]) -> list[_E]:
    """Parse one status byte per item as members of ``kind``.

    Raises:
        ProtocolError: An unknown status.
    """
    try:
        return [kind(b) for b in data]
    except ValueError as exc:
        raise ProtocolError(ErrorCode.MALFORMED, f"unknown {kind.__name__}: {exc}") from None


def recv_index_codes(sock: socket.socket, header: Header) -> list[IndexCode]:
    """The index codes of a PUT_REPLY or COMMIT_REPLY whose statuses were read:
    read when its header carries ``HeaderFlags.INDEX``, else all NOT_INDEXED.

    Raises:
        ProtocolError: An unknown code.
        Unavailable: The connection failed.
    """
    if not header.flags & HeaderFlags.INDEX:
        return [IndexCode.NOT_INDEXED] * header.count
    return unpack_statuses(recv_exact(sock, header.count), IndexCode)


def index_flags(index: bool, writer: int = 0) -> int:
    """The header flags of a PUT, PUT_TRAILED or COMMIT: INDEX when ``index``,
    and DEFER when a writer token is given too (the token goes in ``aux``)."""
    if not index:
        return int(HeaderFlags.NONE)
    return int(HeaderFlags.INDEX | HeaderFlags.DEFER if writer else HeaderFlags.INDEX)


def unpack_index_settled(data: bytes | bytearray | memoryview) -> IndexSettled:
    """Parse a SYNC_REPLY body."""
    if len(data) != INDEX_SETTLED.size:
        raise ProtocolError(ErrorCode.MALFORMED, f"SYNC_REPLY body of {len(data)} bytes")
    return IndexSettled(*INDEX_SETTLED.unpack(data))


def encode_error(code: ErrorCode, message: str) -> bytes:
    """A complete ERROR message."""
    text = message.encode("utf-8", "replace")[:MAX_ERROR_MESSAGE]
    return Header(Opcode.ERROR, len(text)).pack() + ERROR_CODE.pack(code) + text


def read_error(sock: socket.socket, header: Header) -> ProtocolError:
    """Read the body of an ERROR message whose header was read; return it as an error.

    Raises:
        ProtocolError: The message is longer than :data:`MAX_ERROR_MESSAGE`.
        Unavailable: The connection failed.
    """
    if header.count > MAX_ERROR_MESSAGE:
        return ProtocolError(ErrorCode.MALFORMED, f"ERROR message of {header.count} bytes")
    body = recv_exact(sock, ERROR_CODE.size + header.count)
    (raw_code,) = ERROR_CODE.unpack_from(body)
    try:
        code = ErrorCode(raw_code)
    except ValueError:
        code = ErrorCode.INTERNAL
    text = body[ERROR_CODE.size :].decode("utf-8", "replace")
    if code is ErrorCode.UNAUTHENTICATED:
        return AuthRefused(f"store refused the connection: {text}")
    return ProtocolError(code, f"peer closed the connection: {text}")


def recv_reply_header(sock: socket.socket, opcode: Opcode, count: int | None) -> Header:
    """Read the header of the reply to a request, checking it is the one expected.

    Args:
        sock: The connection.
        opcode: The reply's opcode.
        count: The entries expected; ``None`` where the count is a body
            length (ATTACH_REPLY), checked by the caller.

    Raises:
        ProtocolError: The peer sent ERROR, or a reply of the wrong kind or size.
        Unavailable: The connection failed.
    """
    header = unpack_header(recv_exact(sock, HEADER.size))
    if header.opcode is Opcode.ERROR:
        raise read_error(sock, header)
    if header.opcode is not opcode or (count is not None and header.count != count):
        raise ProtocolError(
            ErrorCode.MALFORMED,
            f"expected {opcode.name} of {count}, got {header.opcode.name} of {header.count}",
        )
    return header
