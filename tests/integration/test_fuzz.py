"""Fuzzing a live store daemon and metadata service with hostile input (hypothesis).

Malformed and random data-plane frames go over real sockets to a store
daemon: random bytes, valid headers with absurd counts, sizes, offsets and
opcodes, truncated frames, oversized key lists, ranged reads past the end,
payloads sent in part before the connection is cut; malformed gRPC requests
go to the metadata service and the store's own service. Every answer must be
a well-formed reply or a clear error (an ERROR frame, a gRPC status with a
message), and a read of known data must be exact. After each run the daemons
must still be up and healthy, the store must hold only the well-behaved data
(no reservation left behind), its heap must not have grown beyond a bound,
and a well-behaved client must put, find and read back data byte-exact.

Bounded for ``make test`` (150 examples per property); ``--fuzz-examples N``
and ``--fuzz-seconds S`` (or ``KVDEPOT_FUZZ_EXAMPLES``, ``KVDEPOT_FUZZ_SECONDS``)
run longer, e.g. ``pytest tests/integration/test_fuzz.py --fuzz-seconds 600``.
"""

from __future__ import annotations

import contextlib
import math
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvdepot.apps.cluster import LocalCluster
from kvdepot.connector.client import ClientConfig, KVDepotClient
from kvdepot.connector.transport import TcpTransport
from kvdepot.keys import ChunkKey, Namespace, chunk_keys
from kvdepot.proto.gen import common_pb2, metadata_pb2, metadata_pb2_grpc
from kvdepot.store.chunks import checksum
from kvdepot.wire import protocol as p
from tests.conftest import FuzzBudget
from tests.integration.hostile import (
    MiB,
    memory_kib,
    serving,
    short_timeout_cluster,
    store_stats,
    used_bytes,
    wait_for,
)

pytestmark = pytest.mark.integration

KiB = 1 << 10
CAPACITY = 128 * MiB
# Sizes a store accepts without evicting the known data: the arena holds
# every reservation one fuzzed request can make next to it.
SMALL_SIZES = [1, 7, 4096, 64 * KiB, 64 * KiB + 1, 1 * MiB]
ABSURD_SIZES = [0, CAPACITY + 1, 1 << 40, 1 << 63, (1 << 64) - 1]
HEAP_GROWTH_BOUND_KIB = 32 * 1024

NS = Namespace("test/fuzz", chunk_tokens=8)
KNOWN_KEYS = chunk_keys(NS, list(range(8 * 6)))
KNOWN_SIZE = 64 * KiB
KNOWN = {
    k: np.random.default_rng(i).integers(0, 256, KNOWN_SIZE, dtype=np.uint8).tobytes()
    for i, k in enumerate(KNOWN_KEYS)
}


@dataclass
class Live:
    """The cluster under fuzz and what is known about it."""

    cluster: LocalCluster
    address: tuple[str, int]
    base_used: int
    base_heap_kib: int
    base_metadata_heap_kib: int
    fuzz_keys: set[ChunkKey] = field(default_factory=set)
    rounds: int = 0

    def client(self) -> KVDepotClient:
        node = self.cluster.stores[0].info["node_id"]
        return KVDepotClient(ClientConfig(metadata=self.cluster.metadata_address, node_id=node))


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    cluster = short_timeout_cluster(tmp_path_factory.mktemp("fuzz") / "logs", capacity="128MiB")
    try:
        with KVDepotClient(
            ClientConfig(
                metadata=cluster.metadata_address, node_id=cluster.stores[0].info["node_id"]
            )
        ) as client:
            client.put(list(KNOWN), list(KNOWN.values()))
            assert client.lookup(list(KNOWN)) == len(KNOWN)
        host, port = cluster.stores[0].info["address"].rsplit(":", 1)
        heap = memory_kib(cluster.stores[0].pid)["RssAnon"]
        assert cluster.metadata is not None
        metadata_heap = memory_kib(cluster.metadata.pid)["RssAnon"]
        yield Live(cluster, (host, int(port)), used_bytes(cluster), heap, metadata_heap)
    finally:
        cluster.stop()


def run_property(prop: Callable[..., None], budget: FuzzBudget) -> int:
    """Run a hypothesis property for the budget; returns the rounds run."""
    fuzz = settings(
        max_examples=budget.examples,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )(prop)
    end = time.monotonic() + budget.seconds
    rounds = 0
    while True:
        fuzz()
        rounds += 1
        if time.monotonic() >= end:
            return rounds


# --- data plane: frames ----------------------------------------------------------------


@dataclass(frozen=True)
class Frame:
    """One request's bytes and, for reads of known data, what the reply must say."""

    raw: bytes
    reads: tuple[p.GetEntry, ...] | None = None
    reply: p.Opcode | None = None
    stores: tuple[ChunkKey, ...] = ()
    framed: bool = True
    """False when the store may read this request's end elsewhere (random bytes, or
    a size without its payload): replies after it no longer line up with requests."""


fuzz_keys = st.binary(min_size=16, max_size=16).map(ChunkKey)
any_keys = st.one_of(st.sampled_from(KNOWN_KEYS), fuzz_keys)
sizes = st.one_of(
    st.sampled_from(SMALL_SIZES), st.sampled_from(ABSURD_SIZES), st.integers(0, (1 << 64) - 1)
)
u64 = st.one_of(
    st.sampled_from([0, 1, KNOWN_SIZE - 1, KNOWN_SIZE, KNOWN_SIZE + 1, (1 << 64) - 1]),
    st.integers(0, (1 << 64) - 1),
)
counts = st.one_of(st.integers(0, 8), st.sampled_from([4096, 4097, 1 << 31, (1 << 32) - 1]))


def header(
    opcode: int, count: int, aux: int = 0, version: int = p.VERSION, flags: int = 0
) -> bytes:
    return p.HEADER.pack(p.MAGIC, version, opcode, flags, count, aux)


@st.composite
def junk(draw: st.DrawFn) -> Frame:
    """Bytes from nowhere, or a header of any opcode, version and count and random bytes."""
    if draw(st.booleans()):
        return Frame(draw(st.binary(max_size=2048)), framed=False)
    head = header(
        draw(st.integers(0, 255)),
        draw(counts),
        draw(st.integers(0, (1 << 32) - 1)),
        draw(st.sampled_from([p.VERSION, p.VERSION, 0, 2, 255])),
        draw(st.integers(0, 0xFFFF)),
    )
    return Frame(head + draw(st.binary(max_size=512)), framed=False)


@st.composite
def puts(draw: st.DrawFn) -> Frame:
    """A PUT or PUT_TRAILED: small or absurd sizes, right or wrong checksums."""
    n = draw(st.integers(1, 4))
    trailed = draw(st.booleans())
    entries, payloads = [], []
    framed = True
    for _ in range(n):
        key = draw(any_keys)
        size = draw(sizes)
        body = bytes([draw(st.integers(0, 255))]) * size if size <= 1 * MiB else b""
        framed = framed and len(body) == size
        right = draw(st.booleans())
        ck = checksum(body) if right and body else draw(st.integers(0, (1 << 64) - 1))
        entries.append(p.PutEntry(key, size, 0 if trailed else ck))
        payloads.append(body + (struct.pack("<Q", ck) if trailed else b""))
    op = p.Opcode.PUT_TRAILED if trailed else p.Opcode.PUT
    raw = header(op, n) + p.pack_put_entries(entries) + b"".join(payloads)
    keys = tuple(e.key for e in entries)
    return Frame(raw, reply=p.Opcode.PUT_REPLY, stores=keys, framed=framed)


@st.composite
def reads(draw: st.DrawFn) -> Frame:
    """A GET or LEASE of known and unknown keys, ranges inside, across and past the end."""
    n = draw(st.integers(1, 8))
    entries = tuple(p.GetEntry(draw(any_keys), draw(u64), draw(u64)) for _ in range(n))
    get = (p.Opcode.GET, p.Opcode.GET_REPLY)
    op, reply = draw(st.sampled_from([get, get, (p.Opcode.LEASE, p.Opcode.LEASE_REPLY)]))
    return Frame(header(op, n) + p.pack_get_entries(entries), entries, reply)


@st.composite
def key_lists(draw: st.DrawFn) -> Frame:
    """DELETE, ABORT or GET of many unknown keys: up to the batch limit and past it."""
    op = draw(st.sampled_from([p.Opcode.DELETE, p.Opcode.ABORT, p.Opcode.GET]))
    n = draw(st.sampled_from([0, 1, 100, 4096, 4097]))
    key = draw(fuzz_keys)  # never a known key: a DELETE of one would be a legitimate delete
    size = 32 if op is p.Opcode.GET else 16
    body = (key + bytes(16))[:size] * min(n, 4097)
    replies = {p.Opcode.DELETE: p.Opcode.DELETE_REPLY, p.Opcode.ABORT: p.Opcode.ABORT_REPLY}
    return Frame(header(op, n) + body, reply=replies.get(op, p.Opcode.GET_REPLY))


@st.composite
def session_ops(draw: st.DrawFn) -> Frame:
    """What an shm/nixl client sends: ATTACH, RESERVE, COMMIT, RELEASE, PING, with lies."""
    kind = draw(st.sampled_from(["attach", "reserve", "commit", "release", "ping"]))
    count, aux = draw(st.sampled_from([0, 0, 1, 5])), draw(st.integers(0, 99))
    if kind == "attach":
        return Frame(header(p.Opcode.ATTACH, count, aux))
    if kind == "ping":
        return Frame(header(p.Opcode.PING, count, aux))
    n = draw(st.integers(0, 4))
    if kind == "reserve":
        entries = [p.PutEntry(draw(any_keys), draw(sizes), 0) for _ in range(n)]
        return Frame(header(p.Opcode.RESERVE, n) + p.pack_put_entries(entries))  # no payload
    if kind == "commit":
        commits = [p.CommitEntry(draw(any_keys), draw(u64)) for _ in range(n)]
        return Frame(header(p.Opcode.COMMIT, n) + p.pack_commit_entries(commits))
    return Frame(header(p.Opcode.RELEASE, n) + p.pack_lease_ids([draw(u64) for _ in range(n)]))


frames = st.lists(
    st.one_of(junk(), puts(), reads(), reads(), key_lists(), session_ops()), min_size=1, max_size=4
)
# How the bytes go: all then half-close; a prefix then half-close (truncated
# frames); a prefix then a reset (a client that dies mid-request).
endings = st.sampled_from(["whole", "whole", "whole", "cut", "reset"])


# --- data plane: what comes back --------------------------------------------------------

_FIXED = {
    p.Opcode.PUT_REPLY: 1,
    p.Opcode.DELETE_REPLY: 1,
    p.Opcode.COMMIT_REPLY: 1,
    p.Opcode.ABORT_REPLY: 1,
    p.Opcode.RELEASE_REPLY: 1,
    p.Opcode.RESERVE_REPLY: p.RESERVE_REPLY_ENTRY.size,
    p.Opcode.LEASE_REPLY: p.LEASE_REPLY_ENTRY.size,
    p.Opcode.ATTACH_REPLY: 1,
    p.Opcode.PONG: 0,
}
if hasattr(p.Opcode, "AUTH_REPLY"):  # the data-plane handshake's answer
    _FIXED[p.Opcode.AUTH_REPLY] = 1


def parse_replies(data: bytes, reset: bool) -> list[tuple[p.Header, bytes]]:
    """Split what the store sent into messages; each must be well-formed.

    ``reset``: the connection was reset, so its last message may be cut short.
    """
    out: list[tuple[p.Header, bytes]] = []
    pos = 0
    while pos < len(data):
        if len(data) - pos < p.HEADER.size:
            assert reset, f"a reply header cut short: {data[pos:]!r}"
            break
        head = p.unpack_header(data[pos : pos + p.HEADER.size])
        pos += p.HEADER.size
        if head.opcode is p.Opcode.ERROR:
            assert head.count <= p.MAX_ERROR_MESSAGE
            n = p.ERROR_CODE.size + head.count
        elif head.opcode is p.Opcode.GET_REPLY:
            table = data[pos : pos + head.count * p.GET_REPLY_ENTRY.size]
            if len(table) < head.count * p.GET_REPLY_ENTRY.size:
                assert reset, "a GET_REPLY cut short"
                break
            entries = p.unpack_get_reply_entries(table)
            n = len(table) + sum(e.length for e in entries if e.status is p.GetCode.OK)
        else:
            assert head.opcode in _FIXED, f"the store sent {head.opcode.name}"
            n = head.count * _FIXED[head.opcode]
        body = data[pos : pos + n]
        if len(body) < n:
            assert reset, f"a {head.opcode.name} cut short"
            break
        pos += n
        out.append((head, body))
        if head.opcode is p.Opcode.ERROR:
            code = p.ERROR_CODE.unpack_from(body)[0]
            assert code in set(p.ErrorCode), code
            assert body[p.ERROR_CODE.size :], "an ERROR without a message"
            assert pos == len(data), "bytes after an ERROR"
    return out


def expected_read(entry: p.GetEntry) -> tuple[p.GetCode, bytes] | None:
    """What a read of known data must answer; None for unknown keys."""
    data = KNOWN.get(entry.key)
    if data is None:
        return None
    length = entry.length or len(data) - entry.offset
    if entry.offset >= len(data) or length <= 0 or entry.offset + length > len(data):
        return p.GetCode.INVALID, b""
    return p.GetCode.OK, data[entry.offset : entry.offset + length]


def check_read_reply(frame: Frame, head: p.Header, body: bytes, seen: Counter[str]) -> None:
    assert frame.reads is not None
    n = len(frame.reads)
    assert head.count == n
    if head.opcode is p.Opcode.GET_REPLY:
        entries = p.unpack_get_reply_entries(body[: n * p.GET_REPLY_ENTRY.size])
        pos = n * p.GET_REPLY_ENTRY.size
        for req, got in zip(frame.reads, entries, strict=True):
            payload = b""
            if got.status is p.GetCode.OK:
                payload = body[pos : pos + got.length]
                pos += got.length
                assert checksum(payload) == got.checksum
            want = expected_read(req)
            if want is not None:
                assert (got.status, payload) == want, (req, got.status)
                seen[f"known data read {got.status.name}"] += 1
            else:
                assert got.status is not p.GetCode.INVALID or req.offset or req.length
    else:
        leased = p.unpack_lease_reply_entries(body)
        for req, got in zip(frame.reads, leased, strict=True):
            want = expected_read(req)
            if want is not None:
                assert got.status is want[0], (req, got.status)
                seen[f"known data lease {got.status.name}"] += 1
            if got.status is p.GetCode.OK:
                assert got.offset + got.length <= CAPACITY
                if want is not None:
                    assert (got.length, got.checksum) == (len(want[1]), checksum(want[1]))


def exchange(
    address: tuple[str, int], data: bytes, ending: str, cut: float
) -> tuple[bytes, bool] | None:
    """Send ``data`` (or a prefix) as ``ending`` says.

    Returns what came back and whether the store reset the connection; None
    when this end reset it.
    """
    s = socket.create_connection(address, timeout=10)
    try:
        if ending != "whole":
            data = data[: int(len(data) * cut)]
        with contextlib.suppress(OSError):  # the store may close first: its ERROR tells why
            s.sendall(data)
        if ending == "reset":
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return None
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_WR)
        got = bytearray()
        try:
            while part := s.recv(1 << 20):
                got += part
        except ConnectionResetError:
            return bytes(got), True
        return bytes(got), False
    finally:
        s.close()


def test_data_plane_survives_hostile_frames(live: Live, fuzz_budget: FuzzBudget) -> None:
    errors_before = store_stats(live.cluster).protocol_errors
    seen: Counter[str] = Counter()

    cleaner = TcpTransport()

    @given(frames, endings, st.floats(0.0, 1.0))
    def prop(sent: list[Frame], ending: str, cut: float) -> None:
        stored = {k for f in sent for k in f.stores} - set(KNOWN)
        live.fuzz_keys.update(stored)
        try:
            reply = exchange(live.address, b"".join(f.raw for f in sent), ending, cut)
        finally:
            # A PUT with a right checksum stored legitimate data: drop it, or
            # the arena would fill and evict the known data.
            if stored:
                cleaner.delete(f"{live.address[0]}:{live.address[1]}", sorted(stored))
        if reply is None:
            return
        data, reset = reply
        messages = parse_replies(data, reset)
        for f, (head, body) in zip(sent, messages, strict=False):
            if head.opcode is p.Opcode.ERROR:
                seen[f"ERROR {p.ErrorCode(p.ERROR_CODE.unpack_from(body)[0]).name}"] += 1
                break
            seen[head.opcode.name] += 1
            if f.reply is not None:
                assert head.opcode is f.reply, (f.reply, head)
            if f.reads is not None:
                check_read_reply(f, head, body, seen)
            if not f.framed:
                break  # the next replies answer requests the store read its own way

    try:
        rounds = run_property(prop, fuzz_budget)
    finally:
        cleaner.close()
    print(f"data plane fuzz: {rounds} round(s), answers {dict(sorted(seen.items()))}")
    # The fuzz reached the parsers (a test that cannot fail proves nothing).
    assert store_stats(live.cluster).protocol_errors > errors_before + rounds
    assert_sound(live)


# --- gRPC --------------------------------------------------------------------------------

text = st.one_of(st.text(max_size=40), st.sampled_from(["", " ", "a b", "\x00", "x" * 300]))
node_ids = text.filter(lambda s: s != "store-0")  # never the real store's registration
addresses = st.one_of(text, st.sampled_from(["127.0.0.1:1", "[::1]:9", "h:0", "h:99999", "::"]))
raw_keys = st.one_of(fuzz_keys, st.binary(max_size=40))
key_batches = st.one_of(
    st.lists(raw_keys, max_size=6), st.sampled_from([[bytes(16)] * 65537, [b""] * 3])
)
u64s = st.lists(st.one_of(st.sampled_from([0, 1, 1 << 63, (1 << 64) - 1]), u64), max_size=6)
reals = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -1.0, math.nan])
)
tier_names = st.one_of(st.sampled_from(["cpu", "gpu", "ssd", "", "tape"]), text)
tiers = st.lists(
    st.builds(common_pb2.TierStats, name=tier_names, capacity_bytes=u64, used_bytes=u64),
    max_size=4,
)
rates = st.builds(
    common_pb2.TransferRate, bytes_in_per_s=reals, bytes_out_per_s=reals, window_s=reals
)
refs = st.lists(
    st.builds(common_pb2.ChunkRef, key=raw_keys, size=u64, tier=tier_names), max_size=4
)
candidates = st.lists(
    st.builds(metadata_pb2.RouteCandidate, id=text, node_id=node_ids, load=reals), max_size=4
)
u32 = st.integers(0, (1 << 32) - 1)

REQUESTS = {
    "RegisterNode": st.builds(
        metadata_pb2.RegisterNodeRequest,
        node_id=node_ids,
        address=addresses,
        grpc_address=addresses,
        tiers=tiers,
        inventory=refs,
    ),
    "Heartbeat": st.builds(
        metadata_pb2.HeartbeatRequest,
        node_id=node_ids,
        tiers=tiers,
        transfer=rates,
        held=st.one_of(st.none(), st.builds(metadata_pb2.InventoryDigest, chunks=u64, digest=u64)),
    ),
    "ReconcileDigests": st.builds(
        metadata_pb2.ReconcileDigestsRequest,
        node_id=node_ids,
        epoch=u64,
        groups=st.one_of(st.binary(max_size=64), st.just(bytes(1024))),
    ),
    "ReconcileBuckets": st.builds(
        metadata_pb2.ReconcileBucketsRequest,
        node_id=node_ids,
        epoch=u64,
        buckets=st.lists(u32, max_size=4),
        counts=st.lists(u32, max_size=4),
        keys=st.one_of(st.binary(max_size=48), st.just(bytes(16))),
        sizes=u64s,
        tiers=st.binary(max_size=4),
    ),
    "ReportRemoved": st.builds(
        metadata_pb2.ReportRemovedRequest, node_id=node_ids, keys=key_batches
    ),
    "ReportMoved": st.builds(
        metadata_pb2.ReportMovedRequest, node_id=node_ids, keys=key_batches, tier=tier_names
    ),
    "PutStart": st.builds(
        metadata_pb2.PutStartRequest, keys=key_batches, sizes=u64s, writer_node_id=node_ids
    ),
    "PutEnd": st.builds(
        metadata_pb2.PutEndRequest, keys=key_batches, node_id=node_ids, sizes=u64s
    ),
    "PutRevoke": st.builds(metadata_pb2.PutRevokeRequest, keys=key_batches, node_id=node_ids),
    "Lookup": st.builds(
        metadata_pb2.LookupRequest, keys=key_batches, client_node_id=node_ids, tokens_per_key=u32
    ),
    "Route": st.builds(
        metadata_pb2.RouteRequest,
        keys=key_batches,
        tokens_per_key=u32,
        candidates=candidates,
        link_bytes_per_s=reals,
        prefill_tokens_per_s=reals,
        load_penalty_s=reals,
    ),
}
# What a bad request may be answered with: a clear refusal, never a crash
# (UNKNOWN: an unexpected exception in a handler) nor a hang.
CLEAR = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
}
METADATA_METHODS = [f"/kvdepot.v1.Metadata/{m}" for m in [*REQUESTS, "GetStats"]]
STORE_METHODS = [
    "/kvdepot.v1.Store/GetStats",
    "/kvdepot.v1.Store/GetTransferInfo",
    "/kvdepot.v1.Store/DescribeChunks",
]


def test_grpc_services_answer_hostile_requests_clearly(
    live: Live, fuzz_budget: FuzzBudget
) -> None:
    c = live.cluster
    metadata = grpc.insecure_channel(c.metadata_address)
    store = grpc.insecure_channel(c.stores[0].info["grpc_address"])
    stub = metadata_pb2_grpc.MetadataStub(metadata)
    raw_methods = [(m, metadata) for m in METADATA_METHODS] + [(m, store) for m in STORE_METHODS]

    def structured(call: tuple[str, object]) -> None:
        method, request = call
        try:
            getattr(stub, method)(request, timeout=10)
        except grpc.RpcError as exc:
            assert exc.code() in CLEAR, (method, exc.code(), exc.details())
            assert exc.details(), (method, exc.code())

    def raw(target: tuple[str, grpc.Channel], body: bytes) -> None:
        # Often not even protobuf: refused like any other bad field.
        method, channel = target
        call = channel.unary_unary(method)
        try:
            call(body, timeout=10)
        except grpc.RpcError as exc:
            assert exc.code() in CLEAR, (method, exc.code(), exc.details())
            assert exc.details(), (method, exc.code())

    requests = st.sampled_from(sorted(REQUESTS)).flatmap(
        lambda m: st.tuples(st.just(m), REQUESTS[m])
    )

    def fuzz(budget: FuzzBudget) -> None:
        # The run's time goes two thirds to well-formed requests, one third to raw bytes.
        # (A property takes its settings once: each round wraps the checks anew.)
        run_property(
            given(requests)(structured), FuzzBudget(budget.examples, budget.seconds * 2 / 3)
        )
        run_property(
            given(st.sampled_from(raw_methods), st.binary(max_size=256))(raw),
            FuzzBudget(max(10, budget.examples // 3), budget.seconds / 3),
        )

    try:
        # A first, shorter round brings the service's heap to its working size
        # (allocator arenas and gRPC buffers sized by megabyte requests, which
        # the process keeps once freed); a leak keeps growing in the second.
        assert c.metadata is not None
        fuzz(FuzzBudget(max(10, fuzz_budget.examples // 3), fuzz_budget.seconds / 4))
        live.base_metadata_heap_kib = memory_kib(c.metadata.pid)["RssAnon"]
        fuzz(fuzz_budget)
    finally:
        metadata.close()
        store.close()
    assert_sound(live)


# --- after the fuzz ----------------------------------------------------------------------


def assert_sound(live: Live) -> None:
    """Up, healthy, holding nothing but good data, heap bounded, serving exact bytes."""
    c = live.cluster
    for daemon in (c.metadata, *c.stores):
        assert daemon is not None and daemon.proc.poll() is None, f"{daemon} died"
    assert serving(c.metadata_address)
    assert serving(c.stores[0].info["grpc_address"])
    # Chunks a fuzzed PUT stored with a right checksum are legitimate data; drop them,
    # then the store holds exactly the known data: no reservation outlived its connection.
    keys = sorted(live.fuzz_keys - set(KNOWN))
    with TcpTransport() as t:
        for i in range(0, len(keys), 1024):
            t.delete(c.stores[0].info["address"], keys[i : i + 1024])
    wait_for(lambda: used_bytes(c) == live.base_used, what="store back to the known data")
    heap = memory_kib(c.stores[0].pid)
    growth = heap["RssAnon"] - live.base_heap_kib
    print(f"store memory after the fuzz (KiB): {heap}, heap growth {growth}")
    assert growth < HEAP_GROWTH_BOUND_KIB, f"store heap grew by {growth} KiB: {heap}"
    assert c.metadata is not None
    # gRPC gives back the buffers of megabyte requests lazily, as later calls
    # come: the heap must settle under the bound while small calls are served
    # (a leak never does).
    meta: dict[str, int] = {}
    meta_growth = 0
    deadline = time.monotonic() + 20
    with grpc.insecure_channel(c.metadata_address) as channel:
        stub = metadata_pb2_grpc.MetadataStub(channel)
        while True:
            meta = memory_kib(c.metadata.pid)
            meta_growth = meta["RssAnon"] - live.base_metadata_heap_kib
            if meta_growth < HEAP_GROWTH_BOUND_KIB or time.monotonic() > deadline:
                break
            for _ in range(20):
                stub.Lookup(metadata_pb2.LookupRequest(keys=list(KNOWN)[:1]), timeout=10)
            time.sleep(0.2)
    print(f"metadata memory after the fuzz (KiB): {meta}, heap growth {meta_growth}")
    assert meta_growth < HEAP_GROWTH_BOUND_KIB, f"metadata heap grew by {meta_growth} KiB"
    with live.client() as client:
        bufs = [bytearray(KNOWN_SIZE) for _ in KNOWN]
        assert client.get_into(list(KNOWN), bufs).leading == len(KNOWN)
        assert [bytes(b) for b in bufs] == list(KNOWN.values())
        live.rounds += 1
        seed = 1000 + live.rounds
        new_keys = chunk_keys(NS, [seed] * 8 * 3)
        rng = np.random.default_rng(seed)
        data = [rng.integers(0, 256, 100_000, dtype=np.uint8) for _ in new_keys]
        client.put(new_keys, data)
        assert client.lookup(new_keys) == 3
        out = [np.zeros(100_000, dtype=np.uint8) for _ in new_keys]
        assert client.get_into(new_keys, out).leading == 3
        assert all(np.array_equal(a, b) for a, b in zip(data, out, strict=True))
    live.base_used = used_bytes(c)  # the new chunks are well-behaved data from now on
