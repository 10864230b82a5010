"""Tokens, token files, the data-plane handshake and certificates (no network)."""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import threading
from pathlib import Path

import pytest

from kvdepot.apps.certs import make_certs
from kvdepot.errors import InvalidArgument, Unauthenticated
from kvdepot.rpc.auth import (
    CLUSTER,
    Authenticator,
    Principal,
    RefusalLog,
    TokenSet,
    dataplane_proof,
    is_loopback,
    parse_token_file,
    peer_host,
)
from kvdepot.rpc.security import server_credentials
from kvdepot.rpc.security_config import SecurityConfig, child_args, load_security
from kvdepot.wire.handshake import NONCE_BYTES, ServerHandshake, authenticate
from kvdepot.wire.protocol import (
    HEADER,
    AuthRefused,
    ErrorCode,
    Header,
    Opcode,
    encode_error,
    recv_reply_header,
    send_all,
    unpack_header,
)

CLUSTER_TOKEN = "c" * 24
TEAM_A = "a" * 24
TEAM_B = "b" * 24


def test_token_file_binds_tenants() -> None:
    tokens = parse_token_file(
        f"# comment\n\n  {CLUSTER_TOKEN}  \ntenant team-a {TEAM_A}\ntenant team.b {TEAM_B}\n"
    )
    assert tokens.token == CLUSTER_TOKEN
    assert tokens.tenants == (("team-a", TEAM_A), ("team.b", TEAM_B))
    # A client's file: its one token.
    assert parse_token_file(TEAM_A + "\n").token == TEAM_A


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "no token"),
        ("short\n", "16 to 4096"),
        (f"{CLUSTER_TOKEN}\n{TEAM_A}\n", "second bare token"),
        (f"{CLUSTER_TOKEN}\ntenant team-a\n", "tenant NAME TOKEN"),
        (f"{CLUSTER_TOKEN}\ntenant bad/name {TEAM_A}\n", "bad tenant name"),
        (f"{CLUSTER_TOKEN}\ntenant x {TEAM_A}\ntenant x {TEAM_B}\n", "named twice"),
        (f"{CLUSTER_TOKEN}\ntenant x {CLUSTER_TOKEN}\n", "given twice"),
        (f"tenant x {TEAM_A}\n", "need a cluster token"),
        ("tøken-with-non-ascii-chars\n", "printable ASCII"),
    ],
)
def test_bad_token_files_are_refused_without_echoing_secrets(text: str, says: str) -> None:
    with pytest.raises(InvalidArgument, match=says) as info:
        parse_token_file(text, "f")
    for secret in (CLUSTER_TOKEN, TEAM_A, TEAM_B):
        assert secret not in str(info.value)


def test_authenticator_maps_tokens_and_proofs_to_principals() -> None:
    auth = Authenticator(TokenSet(CLUSTER_TOKEN, (("team-a", TEAM_A),)))
    assert auth.required and auth.tenants
    assert auth.verify(CLUSTER_TOKEN) == CLUSTER
    assert auth.verify(TEAM_A) == Principal("team-a")
    assert auth.verify(TEAM_B) is None
    assert auth.verify("") is None
    nonce = os.urandom(NONCE_BYTES)
    assert auth.verify_proof(nonce, dataplane_proof(CLUSTER_TOKEN, nonce)) == CLUSTER
    assert auth.verify_proof(nonce, dataplane_proof(TEAM_A, nonce)) == Principal("team-a")
    assert auth.verify_proof(nonce, dataplane_proof(TEAM_B, nonce)) is None
    # A proof answers one nonce only: a recorded one is no good for the next.
    assert auth.verify_proof(os.urandom(NONCE_BYTES), dataplane_proof(CLUSTER_TOKEN, nonce)) is None
    # Without tokens everything is the cluster.
    assert Authenticator(TokenSet()).verify("anything") == CLUSTER


def test_security_config_validates(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(CLUSTER_TOKEN + "\n")
    token_file.chmod(0o600)
    with pytest.raises(InvalidArgument, match="not both"):
        SecurityConfig(auth_token=CLUSTER_TOKEN, auth_token_file=str(token_file))
    with pytest.raises(InvalidArgument, match="cannot read token file"):
        SecurityConfig(auth_token_file=str(tmp_path / "missing"))
    with pytest.raises(InvalidArgument, match="KVDEPOT_AUTH_TOKEN"):
        SecurityConfig(auth_token="short")
    with pytest.raises(InvalidArgument, match="go together"):
        SecurityConfig(tls_cert=str(token_file))
    with pytest.raises(InvalidArgument, match="tls_client_auth needs tls_ca"):
        SecurityConfig(tls_client_auth=True)
    with pytest.raises(InvalidArgument, match="not a PEM file"):
        SecurityConfig(tls_ca=str(token_file))
    s = SecurityConfig(auth_token_file=str(token_file))
    assert s.auth and s.tokens().token == CLUSTER_TOKEN and not s.tls_enabled
    # Never shown: not in repr, not in what `--check` prints.
    shown = SecurityConfig(auth_token=CLUSTER_TOKEN)
    assert CLUSTER_TOKEN not in repr(shown)
    assert CLUSTER_TOKEN not in json.dumps(shown.describe())


def test_flags_beat_the_environment_which_beats_the_file(tmp_path: Path) -> None:
    flag_file = tmp_path / "flag-token"
    flag_file.write_text(TEAM_A)
    flag_file.chmod(0o600)
    file_token = tmp_path / "file-token"
    file_token.write_text(TEAM_B)
    file_token.chmod(0o600)
    cfg = tmp_path / "kvdepot.toml"
    cfg.write_text(f'[security]\nauth_token_file = "{file_token}"\ntls_server_name = "kv"\n')
    env = {"KVDEPOT_AUTH_TOKEN": CLUSTER_TOKEN}
    assert load_security({}, cfg).tokens().token == TEAM_B
    from_env = load_security(env, cfg)
    assert from_env.tokens().token == CLUSTER_TOKEN and from_env.tls_server_name == "kv"
    from_flag = load_security(env, cfg, {"auth_token_file": str(flag_file)})
    assert from_flag.tokens().token == TEAM_A
    assert not load_security({}).auth


def test_child_args_never_carry_the_token(tmp_path: Path) -> None:
    args = child_args(SecurityConfig(auth_token=CLUSTER_TOKEN, tls_client_auth=False), tmp_path)
    assert CLUSTER_TOKEN not in " ".join(args)
    path = Path(args[args.index("--auth-token-file") + 1])
    assert path.read_text().strip() == CLUSTER_TOKEN
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_refusals_are_logged_once_per_peer(caplog: pytest.LogCaptureFixture) -> None:
    log = RefusalLog("test service", interval_s=3600)
    with caplog.at_level(logging.WARNING, logger="kvdepot.rpc.auth"):
        for _ in range(50):
            log.refuse("10.0.0.1", "wrong auth token")
        log.refuse("10.0.0.2", "no auth token")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "10.0.0.1" in lines[0] and "10.0.0.2" in lines[1]
    assert log.refused == 51


def test_peer_names() -> None:
    assert peer_host("ipv4:127.0.0.1:5000") == "127.0.0.1"
    assert peer_host("ipv6:[::1]:5000") == "::1"
    assert peer_host("10.1.2.3:7800") == "10.1.2.3"
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1")


# -- the data-plane handshake over a socket pair ---------------------------------------
def _serve_one(auth: Authenticator | None, conn: socket.socket, out: list[object]) -> None:
    gate = ServerHandshake(auth)
    try:
        while True:
            raw = conn.recv(HEADER.size, socket.MSG_WAITALL)
            if not raw:
                return
            header = unpack_header(raw)
            if gate.admit(conn, header):
                send_all(conn, [Header(Opcode.PONG, 0, header.aux).pack()])
    except AuthRefused as exc:
        out.append(exc)
        conn.sendall(encode_error(ErrorCode.UNAUTHENTICATED, exc.detail))
    finally:
        out.append(gate.principal)
        conn.close()


def _handshake(
    auth: Authenticator | None, token: str, first: Opcode = Opcode.AUTH
) -> tuple[Exception | None, list[object]]:
    client, server = socket.socketpair()
    out: list[object] = []
    t = threading.Thread(target=_serve_one, args=(auth, server, out))
    t.start()
    error: Exception | None = None
    try:
        if first is Opcode.AUTH:
            authenticate(client, token)
        send_all(client, [Header(Opcode.PING, 0, 7).pack()])
        recv_reply_header(client, Opcode.PONG, 0)
    except Exception as exc:
        error = exc
    finally:
        client.close()
        t.join(5)
    return error, out


def test_handshake_admits_the_right_token_only() -> None:
    auth = Authenticator(TokenSet(CLUSTER_TOKEN, (("team-a", TEAM_A),)))
    error, out = _handshake(auth, CLUSTER_TOKEN)
    assert error is None and out == [CLUSTER]
    error, out = _handshake(auth, TEAM_A)
    assert error is None and out == [Principal("team-a")]
    error, out = _handshake(auth, TEAM_B)
    assert isinstance(error, AuthRefused) and isinstance(error, Unauthenticated)
    assert "wrong token" in str(error) and out[-1] is None
    # A request before the handshake is refused the same way.
    error, out = _handshake(auth, "", first=Opcode.PING)
    assert isinstance(error, AuthRefused) and "before authenticating" in str(error)


def test_handshake_with_a_store_that_needs_no_token() -> None:
    error, out = _handshake(None, CLUSTER_TOKEN)
    assert error is None and out == [CLUSTER]
    error, out = _handshake(None, "", first=Opcode.PING)
    assert error is None and out == [CLUSTER]


# -- kvdepot certs ----------------------------------------------------------------------
def test_certs_are_a_ca_and_two_certificates(tmp_path: Path) -> None:
    from cryptography import x509

    paths = make_certs(tmp_path / "tls", ["kv.example", "10.0.0.7"])
    for key in (paths.ca_key, paths.server_key, paths.client_key):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    server = x509.load_pem_x509_certificate(paths.server_cert.read_bytes())
    ca = x509.load_pem_x509_certificate(paths.ca.read_bytes())
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["kv.example"]
    assert [str(a) for a in san.get_values_for_type(x509.IPAddress)] == ["10.0.0.7"]
    server.verify_directly_issued_by(ca)
    # Usable as configured: both halves of a daemon's and a client's settings.
    server_credentials(
        SecurityConfig(
            tls_cert=str(paths.server_cert),
            tls_key=str(paths.server_key),
            tls_ca=str(paths.ca),
            tls_client_auth=True,
        )
    )
    with pytest.raises(InvalidArgument, match="--force"):
        make_certs(tmp_path / "tls")
    make_certs(tmp_path / "tls", force=True)


def test_grpc_channels_and_ports_go_through_the_security_module() -> None:
    # A plain channel or port elsewhere would silently skip the token and TLS.
    root = Path(__file__).resolve().parents[2]
    plain = (
        "grpc.insecure_channel(",
        "grpc.secure_channel(",
        "aio.insecure_channel(",
        "aio.secure_channel(",
        "add_insecure_port(",
        "add_secure_port(",
        "grpc.aio.server(",
        "grpc.server(",
    )
    offenders = [
        f"{path.relative_to(root)}: {needle}"
        for folder in ("kvdepot", "store", "metadata", "connector")
        for path in (root / folder).rglob("*.py")
        if path.name != "security.py" and "gen" not in path.parts
        for needle in plain
        if needle in path.read_text()
    ]
    assert not offenders, offenders


def test_vllm_connector_settings_take_a_token_file(tmp_path: Path) -> None:
    from kvdepot.connector.vllm.settings import ConnectorSettings

    token = tmp_path / "token"
    token.write_text(TEAM_A + "\n")
    token.chmod(0o600)
    settings = ConnectorSettings.from_extra({"auth_token_file": str(token)})
    assert settings.security({"KVDEPOT_AUTH_TOKEN": TEAM_B}).tokens().token == TEAM_A
    assert ConnectorSettings().security({"KVDEPOT_AUTH_TOKEN": TEAM_B}).tokens().token == TEAM_B
    with pytest.raises(InvalidArgument, match="unknown"):
        ConnectorSettings.from_extra({"auth_token": TEAM_A})


def test_the_vllm_and_lmcache_settings_share_one_set_of_security_fields(tmp_path: Path) -> None:
    from dataclasses import fields

    from kvdepot.connector.lmcache.settings import PluginSettings
    from kvdepot.connector.vllm.settings import ConnectorSettings
    from kvdepot.rpc.security_config import PluginSecurity

    shared = {f.name: f.default for f in fields(PluginSecurity)}
    for cls in (ConnectorSettings, PluginSettings):
        assert {f.name: f.default for f in fields(cls) if f.name in shared} == shared
    token = tmp_path / "token"
    token.write_text(TEAM_A + "\n")
    token.chmod(0o600)
    extra = {"auth_token_file": str(token), "tls_server_name": "kv"}
    via_vllm = ConnectorSettings.from_extra(extra)
    via_url = PluginSettings.from_url(f"kvdepot://h:1?auth_token_file={token}&tls_server_name=kv")
    env = {"KVDEPOT_AUTH_TOKEN": TEAM_B}
    assert via_vllm.security(env) == via_url.security(env)
    assert via_url.security(env).tokens().token == TEAM_A
