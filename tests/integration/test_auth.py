"""A cluster with a token refuses every surface without it; tenants; TLS and mutual TLS.

Two clusters of real daemons, one per group of tests: one that requires a
cluster token and accepts two tenant tokens (plaintext gRPC), one that
requires the token, TLS and client certificates made by ``kvdepot certs``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvdepot.apps.cluster import LocalCluster
from kvdepot.connector.client import ClientConfig, KVDepotClient
from kvdepot.connector.transport.base import GetItem, PutItem, PutStatus
from kvdepot.connector.transport.shm import ShmTransport
from kvdepot.connector.transport.tcp import TcpTransport
from kvdepot.errors import Unauthenticated, Unavailable
from kvdepot.proto.gen import metadata_pb2, metadata_pb2_grpc, store_pb2, store_pb2_grpc
from kvdepot.rpc.security import channel
from kvdepot.rpc.security_config import SecurityConfig
from kvdepot.wire.protocol import (
    GET_ENTRY,
    HEADER,
    ErrorCode,
    GetEntry,
    Header,
    Opcode,
    pack_get_entries,
    read_error,
    unpack_header,
)

pytestmark = pytest.mark.integration

KVDEPOT = [sys.executable, "-m", "kvdepot.apps.cli"]
TOKEN = secrets.token_hex(24)
TEAM_A = SecurityConfig(auth_token=secrets.token_hex(24))
TEAM_B = SecurityConfig(auth_token=secrets.token_hex(24))
WRONG = SecurityConfig(auth_token=secrets.token_hex(24))
NONE = SecurityConfig()
KB = 64 << 10


def _keys(tag: int, n: int) -> list[bytes]:
    return [bytes([tag, i]) * 8 for i in range(n)]


def _payloads(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.bytes(KB) for _ in range(n)]


@pytest.fixture(scope="module")
def authed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Metadata + one store requiring TOKEN (or a tenant's), given to them as a file."""
    secrets_dir = tmp_path_factory.mktemp("auth-secrets")
    token_file = secrets_dir / "token"
    token_file.write_text(
        f"{TOKEN}\ntenant team-a {TEAM_A.auth_token}\ntenant team-b {TEAM_B.auth_token}\n"
    )
    token_file.chmod(0o600)
    c = LocalCluster(
        nodes=1,
        capacity="32MiB",
        log_dir=tmp_path_factory.mktemp("auth-logs"),
        security=SecurityConfig(auth_token_file=str(token_file)),
    )
    c.start()
    try:
        yield c
    finally:
        c.stop()


def _refused(code: grpc.StatusCode | None) -> bool:
    return code == grpc.StatusCode.UNAUTHENTICATED


def _call_all_metadata(address: str, security: SecurityConfig) -> dict[str, grpc.StatusCode | None]:
    """Every Metadata method, with an empty request: the status each got."""
    out: dict[str, grpc.StatusCode | None] = {}
    service = metadata_pb2.DESCRIPTOR.services_by_name["Metadata"]
    with channel(address, security) as ch:
        stub = metadata_pb2_grpc.MetadataStub(ch)
        for method in service.methods:
            request = getattr(metadata_pb2, method.input_type.name)()
            try:
                getattr(stub, method.name)(request, timeout=10)
                out[method.name] = None
            except grpc.RpcError as exc:
                out[method.name] = exc.code()
    return out


def test_every_metadata_call_needs_the_token(authed: LocalCluster) -> None:
    for security in (NONE, WRONG):
        codes = _call_all_metadata(authed.metadata_address, security)
        assert len(codes) == 17 and all(_refused(c) for c in codes.values()), codes
    # With the token the same calls reach the service (empty requests may
    # be invalid, but none is refused for want of a token).
    codes = _call_all_metadata(authed.metadata_address, authed.security)
    assert not any(_refused(c) for c in codes.values()), codes
    assert codes["GetStats"] is None


def test_store_grpc_and_health_need_the_token(authed: LocalCluster) -> None:
    store = authed.stores[0].info["grpc_address"]
    for target in (store, authed.metadata_address):
        for security in (NONE, WRONG):
            with channel(target, security) as ch:
                health = health_pb2_grpc.HealthStub(ch)
                with pytest.raises(grpc.RpcError) as info:
                    health.Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert _refused(info.value.code())
                # A streaming method is refused just the same.
                with pytest.raises(grpc.RpcError) as info:
                    next(iter(health.Watch(health_pb2.HealthCheckRequest(), timeout=10)))
                assert _refused(info.value.code())
    for security in (NONE, WRONG):
        with channel(store, security) as ch:
            stub = store_pb2_grpc.StoreStub(ch)
            for call, request in (
                (stub.GetStats, store_pb2.StoreStatsRequest()),
                (stub.GetTransferInfo, store_pb2.TransferInfoRequest()),
                (stub.DescribeChunks, store_pb2.DescribeChunksRequest()),
            ):
                with pytest.raises(grpc.RpcError) as info:
                    call(request, timeout=10)
                assert _refused(info.value.code())
    with channel(store, authed.security) as ch:
        stats = store_pb2_grpc.StoreStub(ch).GetStats(store_pb2.StoreStatsRequest(), timeout=10)
        assert stats.node_id == "store-0"
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_data_plane_needs_the_token(authed: LocalCluster) -> None:
    address = authed.stores[0].info["address"]
    keys, data = _keys(1, 2), _payloads(2, 1)
    items = [PutItem(k, d) for k, d in zip(keys, data, strict=True)]
    for security in (NONE, WRONG):
        with TcpTransport(security=security) as t, pytest.raises(Unauthenticated):
            t.put(address, items)
        with TcpTransport(security=security) as t, pytest.raises(Unauthenticated):
            t.get_into(address, [GetItem(keys[0], memoryview(bytearray(KB)))])
        # shm attaches over the same socket: refused before it learns the arena.
        with ShmTransport(security=security) as shm, pytest.raises(Unauthenticated):
            shm.usable(address)
    with TcpTransport(security=authed.security) as t:
        # Nothing of the refused puts was stored.
        got = t.get_into(address, [GetItem(k, memoryview(bytearray(KB))) for k in keys])
        assert [o.ok for o in got] == [False, False]
        assert t.put(address, items) == [PutStatus.OK, PutStatus.OK]
        buffers = [bytearray(KB) for _ in keys]
        reads = [GetItem(k, memoryview(b)) for k, b in zip(keys, buffers, strict=True)]
        got = t.get_into(address, reads)
        assert all(o.ok for o in got) and [bytes(b) for b in buffers] == data
    with ShmTransport(security=authed.security) as shm:
        assert shm.usable(address)
        out = bytearray(KB)
        assert shm.get_into(address, [GetItem(keys[1], memoryview(out))])[0].ok
        assert bytes(out) == data[1]


def test_raw_requests_before_the_handshake_are_refused(authed: LocalCluster) -> None:
    host, port = authed.stores[0].info["address"].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(Header(Opcode.GET, 1).pack() + pack_get_entries([GetEntry(b"k" * 16)]))
        header = unpack_header(s.recv(HEADER.size, socket.MSG_WAITALL))
        assert header.opcode is Opcode.ERROR
        error = read_error(s, header)
        assert error.code is ErrorCode.UNAUTHENTICATED and isinstance(error, Unauthenticated)
        # ... and the connection is closed (or reset: the entries were never read).
        with contextlib.suppress(ConnectionResetError):
            assert s.recv(GET_ENTRY.size) == b""


def test_client_works_end_to_end_with_the_token(authed: LocalCluster) -> None:
    keys, data = _keys(2, 4), _payloads(4, 2)
    for transport in ("tcp", "shm"):
        config = ClientConfig(
            metadata=authed.metadata_address, transport=transport, security=authed.security
        )
        with KVDepotClient(config) as client:
            put = client.put(keys, data)
            assert put.failed == 0 and put.stored + put.skipped == 4
            assert client.lookup(keys) == 4
            out = [bytearray(KB) for _ in keys]
            assert client.get_into(keys, out).leading == 4
            assert [bytes(b) for b in out] == data
    with (
        KVDepotClient(ClientConfig(metadata=authed.metadata_address)) as anonymous,
        pytest.raises(Unauthenticated, match="no auth token"),
    ):
        anonymous.lookup(keys)


def test_secret_is_on_no_command_line_and_refusals_are_logged_once(
    authed: LocalCluster,
) -> None:
    assert authed.metadata is not None
    for daemon in (authed.metadata, *authed.stores):
        argv = Path(f"/proc/{daemon.pid}/cmdline").read_bytes()
        assert TOKEN.encode() not in argv and b"--auth-token-file" in argv
    for _ in range(20):
        _call_all_metadata(authed.metadata_address, WRONG)
    assert authed.log_dir is not None
    log = (authed.log_dir / "metadata.log").read_text()
    assert 1 <= log.count("metadata gRPC refused 127.0.0.1") <= 2, log
    assert TOKEN not in log and WRONG.auth_token not in log


def test_cli_takes_the_token_from_env_or_a_file(authed: LocalCluster, tmp_path: Path) -> None:
    def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("KVDEPOT_")}
        return subprocess.run(
            [*KVDEPOT, *args], capture_output=True, text=True, timeout=60,
            env={**clean, **env}, check=False,
        )

    stats = ("stats", "--json", "--metadata", authed.metadata_address)
    out = run(*stats)
    assert out.returncode == 1 and "no auth token" in out.stderr
    assert run(*stats, KVDEPOT_AUTH_TOKEN=TOKEN).returncode == 0
    token_file = tmp_path / "token"
    token_file.write_text(f"# the cluster's\n{TOKEN}\n")
    token_file.chmod(0o600)
    assert run(*stats, "--auth-token-file", str(token_file)).returncode == 0
    health = ("health", "--target", authed.stores[0].info["grpc_address"])
    assert run(*health).returncode == 1
    out = run(*health, KVDEPOT_AUTH_TOKEN=TOKEN)
    assert out.returncode == 0 and out.stdout.strip() == "SERVING"


# -- TLS -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tls")
    out = subprocess.run(
        [*KVDEPOT, "certs", str(d), "--hosts", "localhost,127.0.0.1"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert out.returncode == 0, out.stderr
    return d


@pytest.fixture(scope="module")
def mtls(tmp_path_factory: pytest.TempPathFactory, tls_dir: Path) -> Iterator[LocalCluster]:
    """Metadata + one store: token, TLS, and client certificates required."""
    c = LocalCluster(
        nodes=1,
        capacity="32MiB",
        log_dir=tmp_path_factory.mktemp("mtls-logs"),
        security=SecurityConfig(
            auth_token=TOKEN,
            tls_cert=str(tls_dir / "server.pem"),
            tls_key=str(tls_dir / "server.key"),
            tls_ca=str(tls_dir / "ca.pem"),
            tls_client_auth=True,
        ),
    )
    c.start()
    try:
        yield c
    finally:
        c.stop()


def _client_security(tls_dir: Path, *, cert: bool = True, token: str = TOKEN) -> SecurityConfig:
    return SecurityConfig(
        auth_token=token,
        tls_ca=str(tls_dir / "ca.pem"),
        tls_cert=str(tls_dir / "client.pem") if cert else "",
        tls_key=str(tls_dir / "client.key") if cert else "",
    )


def _stats(address: str, security: SecurityConfig) -> grpc.StatusCode | None:
    with channel(address, security) as ch:
        try:
            metadata_pb2_grpc.MetadataStub(ch).GetStats(metadata_pb2.GetStatsRequest(), timeout=10)
        except grpc.RpcError as exc:
            return exc.code()
    return None


def test_mutual_tls_cluster_works_end_to_end(mtls: LocalCluster, tls_dir: Path) -> None:
    # The store registered over TLS with its certificate: the cluster formed.
    security = _client_security(tls_dir)
    keys, data = _keys(3, 3), _payloads(3, 3)
    with KVDepotClient(ClientConfig(metadata=mtls.metadata_address, security=security)) as c:
        assert len(c.stats().nodes) == 1
        assert c.put(keys, data).failed == 0
        assert c.lookup(keys) == 3
        out = [bytearray(KB) for _ in keys]
        assert c.get_into(keys, out).leading == 3 and [bytes(b) for b in out] == data


def test_tls_refuses_plaintext_missing_certs_and_tokens(mtls: LocalCluster, tls_dir: Path) -> None:
    address = mtls.metadata_address
    # A plaintext client (even with the token) never gets an answer.
    assert _stats(address, SecurityConfig(auth_token=TOKEN)) == grpc.StatusCode.UNAVAILABLE
    # TLS without a client certificate: the handshake fails.
    assert _stats(address, _client_security(tls_dir, cert=False)) == grpc.StatusCode.UNAVAILABLE
    # A client that does not trust the daemons' CA refuses them.
    distrust = SecurityConfig(auth_token=TOKEN, tls=True)
    assert _stats(address, distrust) == grpc.StatusCode.UNAVAILABLE
    # The certificate does not replace the token.
    assert _refused(_stats(address, _client_security(tls_dir, token="")))
    assert _stats(address, _client_security(tls_dir)) is None
    plaintext = SecurityConfig(auth_token=TOKEN)
    config = ClientConfig(metadata=address, rpc_timeout_s=5, security=plaintext)
    with KVDepotClient(config) as plain, pytest.raises(Unavailable):
        plain.lookup(_keys(4, 1))


def test_cli_speaks_tls(mtls: LocalCluster, tls_dir: Path) -> None:
    tls = [
        "--tls-ca", str(tls_dir / "ca.pem"),
        "--tls-cert", str(tls_dir / "client.pem"),
        "--tls-key", str(tls_dir / "client.key"),
    ]
    env = {**os.environ, "KVDEPOT_AUTH_TOKEN": TOKEN}
    out = subprocess.run(
        [*KVDEPOT, "stats", "--json", "--metadata", mtls.metadata_address, *tls],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )
    assert out.returncode == 0, out.stderr
    out = subprocess.run(
        [*KVDEPOT, "stats", "--metadata", mtls.metadata_address, "--timeout", "2"],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )
    assert out.returncode == 1


# -- tenants -------------------------------------------------------------------------
def _tenant_client(cluster: LocalCluster, security: SecurityConfig) -> KVDepotClient:
    return KVDepotClient(ClientConfig(metadata=cluster.metadata_address, security=security))


def test_tenants_see_only_their_own_chunks(authed: LocalCluster) -> None:
    keys = _keys(5, 3)
    a_data, b_data = _payloads(3, 5), _payloads(3, 6)
    with _tenant_client(authed, TEAM_A) as a, _tenant_client(authed, TEAM_B) as b:
        assert a.put(keys, a_data).stored == 3
        assert a.lookup(keys) == 3
        # Another tenant misses, cannot tell the keys are held elsewhere, and
        # stores its own chunks under the same keys without touching A's.
        assert b.lookup(keys) == 0
        out = [bytearray(KB) for _ in keys]
        assert b.get_into(keys, out).leading == 0
        put = b.put(keys, b_data)
        assert (put.stored, put.skipped) == (3, 0)
        assert b.get_into(keys, out).leading == 3 and [bytes(x) for x in out] == b_data
        assert a.get_into(keys, out).leading == 3 and [bytes(x) for x in out] == a_data
    # The cluster's own namespace is not a tenant's either way.
    with _tenant_client(authed, authed.security) as cluster:
        assert cluster.lookup(keys) == 0
        shared = _keys(6, 2)
        cluster.put(shared, _payloads(2, 7))
    with _tenant_client(authed, TEAM_A) as a:
        assert a.lookup(shared) == 0


def test_the_cluster_token_sees_tenant_chunks_where_they_are(authed: LocalCluster) -> None:
    from kvdepot.rpc.auth import tenant_key

    keys, data = _keys(7, 2), _payloads(2, 8)
    with _tenant_client(authed, TEAM_A) as a:
        a.put(keys, data)
    stored = [tenant_key("team-a", k) for k in keys]
    with _tenant_client(authed, authed.security) as cluster:
        assert cluster.lookup(stored) == 2
        out = [bytearray(KB) for _ in keys]
        assert cluster.get_into(stored, out).leading == 2 and [bytes(x) for x in out] == data


def test_tenants_may_not_manage_nodes_nor_map_arenas(authed: LocalCluster) -> None:
    codes = _call_all_metadata(authed.metadata_address, TEAM_A)
    denied = {m for m, c in codes.items() if c == grpc.StatusCode.PERMISSION_DENIED}
    assert denied == {
        "RegisterNode",
        "RegisterInventory",
        "Heartbeat",
        "ReportRemoved",
        "ReportMoved",
        "ReconcileDigests",
        "ReconcileBuckets",
        "GetStats",
        # The namespace registry spans tenants: a tenant neither reads nor feeds it.
        "RegisterNamespace",
        "ListNamespaces",
        "ReportUsage",
        "Explain",
    }
    store = authed.stores[0].info["grpc_address"]
    with channel(store, TEAM_A) as ch:
        for call, request in (
            (store_pb2_grpc.StoreStub(ch).GetStats, store_pb2.StoreStatsRequest()),
            # Which chunks a store holds spans tenants too.
            (store_pb2_grpc.StoreStub(ch).DescribeChunks, store_pb2.DescribeChunksRequest()),
        ):
            with pytest.raises(grpc.RpcError) as info:
                call(request, timeout=10)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    # The arena holds every tenant's chunks: a tenant is never told where it is.
    address = authed.stores[0].info["address"]
    with ShmTransport(security=TEAM_A) as shm:
        assert not shm.usable(address)
    with ShmTransport(security=authed.security) as shm:
        assert shm.usable(address)
