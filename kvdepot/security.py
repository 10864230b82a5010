"""Authentication and TLS of kvdepot's gRPC services and data plane.

One :class:`SecurityConfig` per process says what it presents and what it
accepts:

* a **cluster token**, a shared secret every daemon and client of the cluster
  holds. It comes from a token file or the ``KVDEPOT_AUTH_TOKEN`` environment
  variable, never from a command line (``ps`` would show it to every user of
  the host). When a daemon has one, every gRPC call must carry it
  (``authorization: Bearer <token>``) and every data-plane connection must
  prove it holds it (see :mod:`kvdepot.store.handshake`); anything else is
  refused with ``UNAUTHENTICATED`` or a closed connection, and logged once per
  peer and minute, not once per request;
* optional **tenant tokens**, bound to a tenant name in a daemon's token file
  (see :func:`parse_token_file`): a client that presents one is that tenant;
* **TLS** for gRPC: a daemon serves its certificate and key; a client verifies
  it against a CA; with ``tls_client_auth`` a daemon also requires client
  certificates signed by that CA (mutual TLS). ``kvdepot certs`` makes a CA
  and certificates for testing.

Everything that opens a gRPC channel or server goes through :func:`channel`,
:func:`aio_channel`, :func:`aio_server` and :func:`add_port`, so a process
configured once is secured everywhere. Without a token and TLS they are plain
``insecure_channel`` / ``add_insecure_port``: nothing changes.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import ipaddress
import logging
import os
import re
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import grpc

from kvdepot.errors import InvalidArgument
from kvdepot.request_guard import MalformedRequestGuard

logger = logging.getLogger(__name__)

TOKEN_MIN_CHARS = 16
"""Shortest token accepted: anything shorter is guessable."""
TOKEN_MAX_CHARS = 4096
AUTH_METADATA_KEY = "authorization"
_BEARER = "Bearer "
_TOKEN_RE = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no spaces: valid gRPC metadata
_TENANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_PROOF_LABEL = b"kvdepot data plane v1\x00"
_REFUSAL_LOG_S = 60.0

ChannelOptions = Sequence[tuple[str, Any]]


# -- tokens -----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request is from, as far as its token says.

    Attributes:
        tenant: The tenant whose token it carried; empty for the cluster token
            (daemons, operators), which sees every chunk.
    """

    tenant: str = ""

    @property
    def is_cluster(self) -> bool:
        return not self.tenant


CLUSTER = Principal()
"""The principal of the cluster token (and of every request where no token is required)."""


@dataclass(frozen=True, slots=True)
class TokenSet:
    """The tokens of one process.

    Attributes:
        token: The token this process presents when it calls others; on a
            daemon also the cluster token it accepts.
        tenants: ``(tenant, token)`` pairs a daemon also accepts.
    """

    token: str = field(default="", repr=False)
    tenants: tuple[tuple[str, str], ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        for tenant, token in ((None, self.token), *self.tenants):
            if token or tenant is not None:
                check_token(token)
            if tenant is not None and not _TENANT_RE.fullmatch(tenant):
                raise InvalidArgument(
                    f"bad tenant name {tenant!r}: letters, digits, '_', '.', '-', at most 64"
                )
        if self.tenants and not self.token:
            raise InvalidArgument("tenant tokens need a cluster token too (the daemons' own)")
        names = [t for t, _ in self.tenants]
        if len(set(names)) != len(names):
            raise InvalidArgument("a tenant is named twice in the token file")
        secrets = [self.token, *(tok for _, tok in self.tenants)]
        if len(set(secrets)) != len(secrets):
            raise InvalidArgument("the same token is given twice in the token file")


def check_token(token: str) -> None:
    """Raise :class:`InvalidArgument` unless ``token`` is usable (never says what it is)."""
    if not TOKEN_MIN_CHARS <= len(token) <= TOKEN_MAX_CHARS:
        raise InvalidArgument(
            f"auth tokens must be {TOKEN_MIN_CHARS} to {TOKEN_MAX_CHARS} characters "
            f"(got {len(token)}); e.g. `openssl rand -hex 32`"
        )
    if not _TOKEN_RE.fullmatch(token):
        raise InvalidArgument("auth tokens must be printable ASCII without spaces")


def parse_token_file(text: str, source: str = "token file") -> TokenSet:
    """Parse a token file.

    Format: ``#`` comments and blank lines are ignored; one bare line is the
    token (the cluster token on a daemon, the token a client presents);
    lines ``tenant NAME TOKEN`` (daemons only) accept ``TOKEN`` as tenant
    ``NAME``'s::

        # /etc/kvdepot/token (mode 0600)
        3f9c…  the cluster token
        tenant team-a 8e1d…
        tenant team-b 0b77…

    Raises:
        InvalidArgument: Malformed lines, no token, bad tokens or names.
    """
    token = ""
    tenants: list[tuple[str, str]] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) == 1:
            if token:
                raise InvalidArgument(f"{source}: line {number}: a second bare token")
            token = parts[0]
        elif len(parts) == 3 and parts[0] == "tenant":
            tenants.append((parts[1], parts[2]))
        else:
            # Never echo the line: it may hold a secret.
            raise InvalidArgument(
                f"{source}: line {number}: expected TOKEN or `tenant NAME TOKEN`"
            )
    if not token and not tenants:
        raise InvalidArgument(f"{source} holds no token")
    try:
        return TokenSet(token, tuple(tenants))
    except InvalidArgument as exc:
        raise InvalidArgument(f"{source}: {exc}") from None


def dataplane_proof(token: str, nonce: bytes) -> bytes:
    """What a data-plane client answers a store's challenge ``nonce`` with.

    An HMAC of the nonce: the token never crosses the (unencrypted) data
    plane, and a recorded answer is worthless for any other nonce.
    """
    return hmac.new(token.encode(), _PROOF_LABEL + nonce, hashlib.sha256).digest()


PROOF_BYTES = hashlib.sha256().digest_size


class Authenticator:
    """Which principal a presented token or data-plane proof stands for.

    Every comparison runs over all accepted tokens, in constant time, so the
    time a refusal takes says nothing about how close a guess was.
    """

    def __init__(self, tokens: TokenSet) -> None:
        entries = [(tokens.token, CLUSTER)] if tokens.token else []
        entries += [(tok, Principal(tenant)) for tenant, tok in tokens.tenants]
        self._entries = [(tok.encode(), hashlib.sha256(tok.encode()).digest(), p)
                         for tok, p in entries]

    @property
    def required(self) -> bool:
        """Whether callers must present a token at all."""
        return bool(self._entries)

    @property
    def tenants(self) -> bool:
        """Whether any tenant token is accepted."""
        return any(not p.is_cluster for _, _, p in self._entries)

    def verify(self, token: str) -> Principal | None:
        """The principal of a presented token, or ``None`` for a wrong one."""
        if not self._entries:
            return CLUSTER
        presented = hashlib.sha256(token.encode()).digest()
        found: Principal | None = None
        for _, digest, principal in self._entries:
            if hmac.compare_digest(presented, digest):
                found = principal
        return found

    def verify_proof(self, nonce: bytes, proof: bytes) -> Principal | None:
        """The principal whose token produced ``proof`` for ``nonce``, or ``None``."""
        if not self._entries:
            return CLUSTER
        found: Principal | None = None
        for secret, _, principal in self._entries:
            expected = hmac.new(secret, _PROOF_LABEL + nonce, hashlib.sha256).digest()
            if hmac.compare_digest(proof, expected):
                found = principal
        return found


class RefusalLog:
    """Logs refused peers once per peer and interval, not once per request.

    A client with a wrong token retries forever; one line per minute per
    peer host says as much without flooding the log. Thread-safe.

    Args:
        what: The service refusing, e.g. ``"metadata gRPC"``.
        interval_s: Least time between two lines about one peer.
        max_peers: Peers remembered; beyond it the memory starts afresh.
    """

    def __init__(self, what: str, interval_s: float = _REFUSAL_LOG_S, max_peers: int = 4096):
        self.what = what
        self._interval_s = interval_s
        self._max_peers = max_peers
        self._lock = threading.Lock()
        self._peers: dict[str, tuple[float, int]] = {}
        self.refused = 0

    def refuse(self, peer: str, reason: str) -> None:
        """Count a refusal of ``peer`` (a host) and log it unless it was logged lately."""
        now = time.monotonic()
        with self._lock:
            self.refused += 1
            last, quiet = self._peers.get(peer, (None, 0))
            if last is not None and now - last < self._interval_s:
                self._peers[peer] = (last, quiet + 1)
                return
            if len(self._peers) >= self._max_peers:
                self._peers.clear()
            self._peers[peer] = (now, 0)
        logger.warning(
            "%s refused %s: %s%s (logged at most once a minute per peer)",
            self.what,
            peer,
            reason,
            f"; {quiet} more refused since the last line" if quiet else "",
            extra={"event": "auth_refused", "peer": peer, "service": self.what},
        )


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``) or ``host:port``."""
    for prefix in ("ipv4:", "ipv6:"):
        if peer.startswith(prefix):
            peer = peer[len(prefix) :]
            break
    host, sep, port = peer.rpartition(":")
    if sep and port.isdigit():
        peer = host
    return peer.strip("[]")


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# -- configuration -------------------------------------------------------------------
def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"cannot read {what} {path}: {exc.strerror}") from None


@dataclass(frozen=True, slots=True)
class SecurityConfig:
    """Authentication and TLS settings of one process (daemon or client).

    Loaded like the other configs (``--auth-token-file`` / ``--tls-*`` flags >
    ``KVDEPOT_AUTH_TOKEN``, ``KVDEPOT_AUTH_TOKEN_FILE``, ``KVDEPOT_TLS_*``
    environment > the ``[security]`` table of ``--config``), but there is no
    flag for the token itself.

    Attributes:
        auth_token: The token itself (from ``KVDEPOT_AUTH_TOKEN``); excludes
            ``auth_token_file``.
        auth_token_file: A file holding the token and, on daemons, tenant
            tokens (see :func:`parse_token_file`); keep it mode 0600.
        tls: Speak TLS to gRPC services (implied by ``tls_ca`` or ``tls_cert``).
        tls_cert: PEM certificate: a daemon serves it; a client presents it
            to daemons that require client certificates.
        tls_key: PEM private key of ``tls_cert``.
        tls_ca: PEM CA certificate(s): clients verify daemons against it,
            daemons verify client certificates against it. Empty on a client:
            the system's roots.
        tls_client_auth: Daemons require a client certificate signed by
            ``tls_ca`` (mutual TLS).
        tls_server_name: The name clients expect in daemons' certificates,
            when it is not the host they connect to.
    """

    auth_token: str = field(default="", repr=False)
    auth_token_file: str = ""
    tls: bool = False
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    tls_client_auth: bool = False
    tls_server_name: str = ""

    def __post_init__(self) -> None:
        if self.auth_token and self.auth_token_file:
            raise InvalidArgument(
                "set the auth token either in the environment or in a token file, not both"
            )
        self.tokens()  # a broken token file fails at start, not at the first call
        if bool(self.tls_cert) != bool(self.tls_key):
            raise InvalidArgument("tls_cert and tls_key go together")
        if self.tls_client_auth and not self.tls_ca:
            raise InvalidArgument("tls_client_auth needs tls_ca (the CA of client certificates)")
        for name in ("tls_cert", "tls_key", "tls_ca"):
            path = getattr(self, name)
            if path and b"-----BEGIN" not in _read(path, name):
                raise InvalidArgument(f"{name} {path} is not a PEM file")

    # -- what the settings mean -------------------------------------------------
    def tokens(self) -> TokenSet:
        """The tokens, read from the token file (each time: it may be rotated)."""
        if self.auth_token_file:
            text = _read(self.auth_token_file, "token file").decode("utf-8", "replace")
            return parse_token_file(text, f"token file {self.auth_token_file}")
        if self.auth_token:
            try:
                return TokenSet(self.auth_token.strip())
            except InvalidArgument as exc:
                raise InvalidArgument(f"KVDEPOT_AUTH_TOKEN: {exc}") from None
        return TokenSet()

    @property
    def auth(self) -> bool:
        """Whether a token is configured."""
        return bool(self.auth_token or self.auth_token_file)

    @property
    def tls_enabled(self) -> bool:
        """Whether gRPC goes over TLS (for a client: whether it dials TLS)."""
        return self.tls or bool(self.tls_ca or self.tls_cert)

    def authenticator(self) -> Authenticator:
        """What a daemon checks presented tokens with."""
        return Authenticator(self.tokens())

    def describe(self) -> dict[str, Any]:
        """The settings for display: the token itself is never shown."""
        return {
            "auth_token": "<set>" if self.auth_token else "",
            "auth_token_file": self.auth_token_file,
            "tls": self.tls_enabled,
            "tls_cert": self.tls_cert,
            "tls_key": self.tls_key,
            "tls_ca": self.tls_ca,
            "tls_client_auth": self.tls_client_auth,
            "tls_server_name": self.tls_server_name,
        }

    def server_credentials(self) -> grpc.ServerCredentials:
        """TLS credentials of a daemon's gRPC server.

        Raises:
            InvalidArgument: No certificate and key configured.
        """
        if not (self.tls_cert and self.tls_key):
            raise InvalidArgument("a TLS server needs tls_cert and tls_key")
        return grpc.ssl_server_credentials(
            [(_read(self.tls_key, "tls_key"), _read(self.tls_cert, "tls_cert"))],
            root_certificates=_read(self.tls_ca, "tls_ca") if self.tls_ca else None,
            require_client_auth=self.tls_client_auth,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """TLS credentials of a client's channel (its certificate, if any, for mutual TLS)."""
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.tls_ca, "tls_ca") if self.tls_ca else None,
            private_key=_read(self.tls_key, "tls_key") if self.tls_key else None,
            certificate_chain=_read(self.tls_cert, "tls_cert") if self.tls_cert else None,
        )

    def channel_options(self) -> list[tuple[str, Any]]:
        if self.tls_enabled and self.tls_server_name:
            return [("grpc.ssl_target_name_override", self.tls_server_name)]
        return []


NO_SECURITY = SecurityConfig()
"""No token, no TLS: what every process had before."""

ENV_PREFIX = "KVDEPOT_"
"""Environment variables: ``KVDEPOT_AUTH_TOKEN``, ``KVDEPOT_AUTH_TOKEN_FILE``, ``KVDEPOT_TLS_*``."""


def load_security(
    env: Mapping[str, str] | None,
    file: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> SecurityConfig:
    """Build a :class:`SecurityConfig` at an entry point: flags > environment > file.

    Args:
        env: The environment (the caller passes ``os.environ``).
        file: A ``--config`` file; its ``[security]`` table is read.
        overrides: Values from flags (``None``: not given). There is no
            flag for the token itself, only for a token file.

    Raises:
        InvalidArgument: Bad values or unreadable files.
    """
    from kvdepot.config import load_config

    env = env or {}
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    # A token and a token file exclude each other; the higher layer wins.
    if given.get("auth_token_file"):
        given["auth_token"] = ""
    elif env.get(ENV_PREFIX + "AUTH_TOKEN") and not env.get(ENV_PREFIX + "AUTH_TOKEN_FILE"):
        given["auth_token_file"] = ""
    elif env.get(ENV_PREFIX + "AUTH_TOKEN_FILE") and not env.get(ENV_PREFIX + "AUTH_TOKEN"):
        given["auth_token"] = ""
    return load_config(
        SecurityConfig, prefix=ENV_PREFIX, env=env, file=file, section="security", overrides=given
    )


def child_args(security: SecurityConfig, private_dir: Path) -> list[str]:
    """Flags that give a ``kvdepot`` child process these settings.

    A token held in memory is written to ``private_dir/token`` (mode 0600)
    and passed as ``--auth-token-file``: secrets never go on a command line,
    where every user of the host could read them.
    """
    args: list[str] = []
    if security.auth_token_file:
        args += ["--auth-token-file", security.auth_token_file]
    elif security.auth_token:
        path = private_dir / "token"
        if not path.exists():
            private_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(security.auth_token + "\n")
        args += ["--auth-token-file", str(path)]
    for flag, value in (
        ("--tls-cert", security.tls_cert),
        ("--tls-key", security.tls_key),
        ("--tls-ca", security.tls_ca),
        ("--tls-server-name", security.tls_server_name),
    ):
        if value:
            args += [flag, value]
    if security.tls_client_auth:
        args.append("--tls-client-auth")
    if security.tls and not (security.tls_ca or security.tls_cert):
        args.append("--tls")
    return args


# -- clients -------------------------------------------------------------------------
class _CallDetails(
    NamedTuple(
        "_CallDetails",
        [
            ("method", str),
            ("timeout", float | None),
            ("metadata", Any),
            ("credentials", Any),
            ("wait_for_ready", bool | None),
            ("compression", Any),
        ],
    ),
    grpc.ClientCallDetails,
):
    """Call details with the token added (grpc wants its own type)."""


class _TokenInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds ``authorization: Bearer <token>`` to every call of a channel."""

    def __init__(self, token: str) -> None:
        self._pair = (AUTH_METADATA_KEY, _BEARER + token)

    def _details(self, d: Any) -> _CallDetails:
        return _CallDetails(
            d.method,
            d.timeout,
            (*(d.metadata or ()), self._pair),
            d.credentials,
            d.wait_for_ready,
            getattr(d, "compression", None),
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


class _AioTokenInterceptor(
    grpc.aio.UnaryUnaryClientInterceptor,
    grpc.aio.UnaryStreamClientInterceptor,
    grpc.aio.StreamUnaryClientInterceptor,
    grpc.aio.StreamStreamClientInterceptor,
):
    """The ``grpc.aio`` twin of :class:`_TokenInterceptor`."""

    def __init__(self, token: str) -> None:
        self._pair = (AUTH_METADATA_KEY, _BEARER + token)

    def _details(self, d: Any) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata.from_tuple((*(d.metadata or ()), self._pair))
        return grpc.aio.ClientCallDetails(
            d.method, d.timeout, metadata, d.credentials, d.wait_for_ready
        )

    async def intercept_unary_unary(
        self, continuation: Any, client_call_details: Any, request: Any
    ) -> Any:
        return await continuation(self._details(client_call_details), request)

    async def intercept_unary_stream(
        self, continuation: Any, client_call_details: Any, request: Any
    ) -> Any:
        return await continuation(self._details(client_call_details), request)

    async def intercept_stream_unary(
        self, continuation: Any, client_call_details: Any, request_iterator: Any
    ) -> Any:
        return await continuation(self._details(client_call_details), request_iterator)

    async def intercept_stream_stream(
        self, continuation: Any, client_call_details: Any, request_iterator: Any
    ) -> Any:
        return await continuation(self._details(client_call_details), request_iterator)


def call_metadata(security: SecurityConfig | None) -> tuple[tuple[str, str], ...]:
    """The metadata that authenticates one call (for callers that build their own)."""
    token = (security or NO_SECURITY).tokens().token
    return ((AUTH_METADATA_KEY, _BEARER + token),) if token else ()


def channel(
    target: str, security: SecurityConfig | None = None, options: ChannelOptions = ()
) -> grpc.Channel:
    """A synchronous gRPC channel to ``target`` with this process's token and TLS."""
    security = security or NO_SECURITY
    opts = [*options, *security.channel_options()]
    if security.tls_enabled:
        ch = grpc.secure_channel(target, security.channel_credentials(), options=opts)
    else:
        ch = grpc.insecure_channel(target, options=opts)
    token = security.tokens().token
    return grpc.intercept_channel(ch, _TokenInterceptor(token)) if token else ch


def aio_channel(
    target: str, security: SecurityConfig | None = None, options: ChannelOptions = ()
) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel to ``target`` with this process's token and TLS."""
    security = security or NO_SECURITY
    opts = [*options, *security.channel_options()]
    token = security.tokens().token
    interceptors: Any = [_AioTokenInterceptor(token)] if token else None
    if security.tls_enabled:
        return grpc.aio.secure_channel(
            target, security.channel_credentials(), options=opts, interceptors=interceptors
        )
    return grpc.aio.insecure_channel(target, options=opts, interceptors=interceptors)


# -- daemons -------------------------------------------------------------------------
_PRINCIPAL: contextvars.ContextVar[Principal] = contextvars.ContextVar(
    "kvdepot_principal", default=CLUSTER
)


def current_principal() -> Principal:
    """Who the gRPC call being served comes from (inside a servicer)."""
    return _PRINCIPAL.get()


def _ignore_request(_: bytes) -> None:
    # The request of a refused call is never parsed: bytes from someone who
    # could not authenticate reach no parser.
    return None


class _AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without an accepted token with ``UNAUTHENTICATED``."""

    def __init__(self, auth: Authenticator, refusals: RefusalLog) -> None:
        self._auth = auth
        self._refusals = refusals

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        presented: str | None = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == AUTH_METADATA_KEY:
                presented = value if isinstance(value, str) else ""
        if presented is None:
            return self._refusing(handler, "no auth token")
        token = presented[len(_BEARER) :] if presented.startswith(_BEARER) else presented
        principal = self._auth.verify(token)
        if principal is None:
            return self._refusing(handler, "wrong auth token")
        # Interceptors and the handler share one fresh context per call.
        _PRINCIPAL.set(principal)
        return handler

    def _refusing(self, handler: grpc.RpcMethodHandler, reason: str) -> grpc.RpcMethodHandler:
        refusals = self._refusals

        async def refuse(context: grpc.aio.ServicerContext) -> None:
            refusals.refuse(peer_host(context.peer()), reason)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"kvdepot: {reason}")

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await refuse(context)

        async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await refuse(context)
            yield  # pragma: no cover - abort raised

        serialize = handler.response_serializer
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(streaming, _ignore_request, serialize)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(unary, _ignore_request, serialize)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(streaming, _ignore_request, serialize)
        return grpc.unary_unary_rpc_method_handler(unary, _ignore_request, serialize)


def aio_server(
    security: SecurityConfig | None, service: str, options: ChannelOptions = ()
) -> grpc.aio.Server:
    """A ``grpc.aio`` server that refuses calls without an accepted token (when one is set).

    Args:
        security: The daemon's settings.
        service: How refusals are named in the log, e.g. ``"metadata gRPC"``.
        options: gRPC server options.
    """
    security = security or NO_SECURITY
    interceptors: list[grpc.aio.ServerInterceptor] = []
    if security.auth:
        interceptors.append(_AuthInterceptor(security.authenticator(), RefusalLog(service)))
    # After the token check: bytes that do not parse are INVALID_ARGUMENT, not UNKNOWN.
    interceptors.append(MalformedRequestGuard())
    return grpc.aio.server(interceptors=interceptors, options=list(options))


def add_port(server: grpc.aio.Server, address: str, security: SecurityConfig | None) -> int:
    """Bind ``address`` (TLS when a certificate is configured); the port bound, 0 on failure.

    Warns when a daemon without a token listens beyond loopback: anyone who
    reaches the port could then read and write the cache.
    """
    security = security or NO_SECURITY
    if security.tls_enabled and not security.tls_cert:
        raise InvalidArgument("a daemon speaks TLS only with tls_cert and tls_key")
    host = address.rpartition(":")[0].strip("[]")
    if not security.auth and not is_loopback(host):
        logger.warning(
            "listening on %s without an auth token: anyone who can reach it can read and "
            "write the cache (set KVDEPOT_AUTH_TOKEN or --auth-token-file)",
            host,
        )
    if security.tls_cert:
        return server.add_secure_port(address, security.server_credentials())
    return server.add_insecure_port(address)
