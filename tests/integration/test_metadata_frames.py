"""The metadata service's framed socket, against real daemons.

Lookups and put starts go over it once a gRPC reply named its port, and
answer exactly what gRPC answers; tokens and tenants hold there as over gRPC;
a client that cannot use it (refused, restarted elsewhere, a service started
with ``--no-frames``) is answered over gRPC; junk on the socket closes that
connection and nothing else.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvdepot.apps.cluster import LocalCluster
from kvdepot.connector.client import ClientConfig, KVDepotClient
from kvdepot.errors import Unauthenticated, Unavailable
from kvdepot.rpc.security_config import SecurityConfig
from kvdepot.wire import frames

pytestmark = pytest.mark.integration

CHUNK = 32 << 10


def _chunks(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, CHUNK, dtype=np.uint8) for _ in range(n)]


def _frame_calls(client: KVDepotClient) -> int:
    return sum(link.calls for link in client._metadata.links)


def _frames_port(client: KVDepotClient) -> int:
    return client._metadata.links[0].port


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(nodes=2, capacity="32MiB", log_dir=tmp_path_factory.mktemp("logs")) as c:
        yield c


def test_lookups_and_puts_go_over_the_socket_and_answer_as_grpc(cluster: LocalCluster) -> None:
    keys = [os.urandom(16) for _ in range(6)]
    chunks = _chunks(6, 1)
    with (
        KVDepotClient(ClientConfig(metadata=cluster.metadata_address)) as fast,
        KVDepotClient(
            ClientConfig(metadata=cluster.metadata_address, metadata_frames=False)
        ) as slow,
    ):
        assert fast.put(keys[:4], chunks[:4]).stored == 4  # PutStart: learns the port
        assert _frames_port(fast) > 0
        before = _frame_calls(fast)
        assert fast.lookup(keys) == 4
        assert _frame_calls(fast) == before + 1
        assert fast.lookup_locations(keys, count="none") == slow.lookup_locations(
            keys, count="none"
        )
        assert fast.put(keys, chunks).stored == 2  # 4 of them exist: skipped
        assert _frame_calls(fast) == before + 3  # lookup, lookup, PutStart (PutEnd: gRPC)
        out = [np.zeros(CHUNK, dtype=np.uint8) for _ in keys]
        assert fast.get_into(keys, out).leading == 6
        assert all(np.array_equal(a, b) for a, b in zip(out, chunks, strict=True))
        assert slow._metadata.links == [] and _frame_calls(slow) == 0


def test_junk_on_the_socket_closes_that_connection_only(cluster: LocalCluster) -> None:
    with KVDepotClient(ClientConfig(metadata=cluster.metadata_address)) as client:
        client.lookup([os.urandom(16)])
        client.lookup([os.urandom(16)])
        port = _frames_port(client)
        for junk in (
            b"GET / HTTP/1.1\r\n\r\n",
            frames.pack_request(frames.Method.LOOKUP, b"\xff\xfe not protobuf"),
            struct.pack("<IB", frames.MAX_FRAME + 1, frames.Method.LOOKUP),
            struct.pack("<IB", 4, 99) + b"abcd",
        ):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                assert s.recv(frames.HELLO.size)[:4] == frames.MAGIC
                s.sendall(junk)
                s.settimeout(5)
                assert s.recv(1024) == b""  # closed, nothing answered
        before = _frame_calls(client)
        assert client.lookup([os.urandom(16)]) == 0
        assert _frame_calls(client) == before + 1


def test_a_restarted_service_is_found_on_its_new_socket(tmp_path: Path) -> None:
    with LocalCluster(nodes=1, capacity="32MiB", log_dir=tmp_path) as c:
        keys = [os.urandom(16) for _ in range(3)]
        with KVDepotClient(ClientConfig(metadata=c.metadata_address, rpc_timeout_s=5)) as client:
            assert client.put(keys, _chunks(3, 2)).stored == 3
            old = _frames_port(client)
            assert old > 0
            assert c.metadata is not None
            os.kill(c.metadata.pid, signal.SIGKILL)
            c.metadata.proc.wait(10)
            c.restart(c.metadata)
            deadline = time.monotonic() + 20
            while _lookup(client, keys) != 3:  # the store registers again
                assert time.monotonic() < deadline, "the store did not register again"
                time.sleep(0.1)
            before = _frame_calls(client)
            deadline = time.monotonic() + 15
            while _frame_calls(client) == before:
                assert time.monotonic() < deadline, "the client never used the new socket"
                assert client.lookup(keys) == 3
                time.sleep(0.2)
            assert _frames_port(client) not in (0, old)


def _lookup(client: KVDepotClient, keys: list[bytes]) -> int:
    try:
        return client.lookup(keys)
    except Unavailable:  # the first call on the dead service's channel
        return -1


class _NoFrames(LocalCluster):
    def _metadata_args(self, port: int, metrics_port: int | None) -> list[str]:
        return [*super()._metadata_args(port, metrics_port), "--no-frames"]


def test_a_service_without_the_socket_is_called_over_grpc(tmp_path: Path) -> None:
    with _NoFrames(nodes=1, capacity="32MiB", log_dir=tmp_path) as c:
        keys = [os.urandom(16) for _ in range(2)]
        with KVDepotClient(ClientConfig(metadata=c.metadata_address)) as client:
            assert client.put(keys, _chunks(2, 3)).stored == 2
            assert client.lookup(keys) == 2
            assert _frames_port(client) == 0 and _frame_calls(client) == 0


def test_tokens_and_tenants_hold_on_the_socket(tmp_path: Path) -> None:
    token, team_a, team_b = (secrets.token_hex(24) for _ in range(3))
    token_file = tmp_path / "token"
    token_file.write_text(f"{token}\ntenant team-a {team_a}\ntenant team-b {team_b}\n")
    token_file.chmod(0o600)
    security = SecurityConfig(auth_token_file=str(token_file))
    keys = [os.urandom(16) for _ in range(3)]

    def client(tok: str) -> KVDepotClient:
        return KVDepotClient(
            ClientConfig(metadata=c.metadata_address, security=SecurityConfig(auth_token=tok))
        )

    with LocalCluster(nodes=1, capacity="32MiB", log_dir=tmp_path / "logs", security=security) as c:
        with client(team_a) as a, client(team_b) as b, client(token) as admin:
            assert a.put(keys, _chunks(3, 4)).stored == 3
            assert a.lookup(keys) == 3 and _frame_calls(a) > 0
            assert b.lookup(keys) == 0 and b.lookup(keys) == 0 and _frame_calls(b) == 1
            assert admin.lookup(keys) == 0 and admin.lookup(keys) == 0  # a tenant's key space
            assert _frame_calls(admin) == 1
            port = _frames_port(a)
        with client(secrets.token_hex(24)) as wrong, pytest.raises(Unauthenticated):
            wrong.lookup(keys)
        # A wrong proof is refused on the socket itself: closed, nothing answered.
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            hello = s.recv(frames.HELLO.size + frames.NONCE_BYTES, socket.MSG_WAITALL)
            assert frames.HELLO.unpack(hello[: frames.HELLO.size])[2] == 1
            s.sendall(b"\0" * 32 + frames.pack_request(frames.Method.LOOKUP, b""))
            s.settimeout(5)
            assert s.recv(16) == b""
