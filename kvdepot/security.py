"""Authentication and TLS of kvdepot's gRPC services and data plane.

One :class:`SecurityConfig` per process says what it presents and what it
accepts:

* a **cluster token**, a shared secret every daemon and client of the cluster
  holds. It comes from a token file or the ``KVDEPOT_AUTH_TOKEN`` environment
  variable, never from a command line (``ps`` would show it to every user of
  the host). When a daemon has one, every gRPC call must carry it
  (``authorization: Bearer <token>``) and every data-plane connection must
  prove it holds it (see :mod:`kvdepot.wire.handshake`); anything else is
  refused with ``UNAUTHENTICATED`` or a closed connection, and logged once per
  peer and minute, not once per request;
* optional **tenant tokens**, bound to a tenant name in a daemon's token file
  (see :func:`kvdepot.auth.parse_token_file`): a client that presents one is
  that tenant. Its keys are moved into the tenant's own key space on arrival,
  by the metadata service and the stores alike (:func:`kvdepot.auth.tenant_key`), so it finds
  and reads only chunks published with its token, never another tenant's
  (nor those published with the cluster token), cannot tell whether another
  tenant holds a prefix, and cannot overwrite one; it may only publish, look
  up, route and read (:data:`TENANT_METHODS`), and never maps a store's arena;
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

import errno
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import grpc

from kvdepot.auth import (
    Authenticator,
    RefusalLog,
    TokenSet,
    is_loopback,
    parse_token_file,
    peer_host,
    tenant_key,
)
from kvdepot.config import InvalidSetting, load_config, setting, validate
from kvdepot.endpoints import split_endpoint
from kvdepot.errors import InvalidArgument, Unavailable
from kvdepot.request_guard import MalformedRequestGuard

logger = logging.getLogger(__name__)

AUTH_METADATA_KEY = "authorization"
_BEARER = "Bearer "

ChannelOptions = Sequence[tuple[str, Any]]


# -- configuration -------------------------------------------------------------------
def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"cannot read {what} {path}: {exc.strerror}") from None


def _check_private(path: str) -> None:
    """Refuse a token file that users other than its owner may read, as ssh
    refuses such a private key: whoever reads it holds the cluster."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # reading it says why
    if mode & 0o077:
        raise InvalidSetting(
            "auth_token_file",
            f"the token file is open to group or others (mode {mode & 0o777:04o}): "
            f"run chmod 600 {path}",
            path,
        )


SECURITY_GROUP = "security"
"""The ``--help`` section of the security options."""


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
    auth_token_file: str = setting(
        "",
        flag="--auth-token-file",
        metavar="PATH",
        help="file with the cluster token (daemons: also `tenant NAME TOKEN` lines)",
        group=SECURITY_GROUP,
    )
    tls: bool = setting(
        False, flag="--tls", help="speak TLS to gRPC (system CA roots)", group=SECURITY_GROUP
    )
    tls_cert: str = setting(
        "",
        flag="--tls-cert",
        metavar="PEM",
        help="certificate served (daemons) / presented",
        group=SECURITY_GROUP,
    )
    tls_key: str = setting(
        "", flag="--tls-key", metavar="PEM", help="private key of --tls-cert", group=SECURITY_GROUP
    )
    tls_ca: str = setting(
        "",
        flag="--tls-ca",
        metavar="PEM",
        help="CA that verifies peers (implies --tls)",
        group=SECURITY_GROUP,
    )
    tls_client_auth: bool = setting(
        False,
        flag="--tls-client-auth",
        help="daemons require client certificates",
        group=SECURITY_GROUP,
    )
    tls_server_name: str = setting(
        "",
        flag="--tls-server-name",
        help="name expected in daemons' certificates",
        group=SECURITY_GROUP,
    )

    def __post_init__(self) -> None:
        validate(self)
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
        """The tokens: from the token file, read anew on each call (a daemon reads it at start)."""
        if self.auth_token_file:
            _check_private(self.auth_token_file)
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


@dataclass(frozen=True, slots=True)
class PluginSecurity:
    """The token and TLS settings of a client inside another program (the vLLM
    connector's ``kv_connector_extra_config``, the LMCache backend's URL): the
    settings classes of both inherit them. ``""`` is not set; ``KVDEPOT_*`` in
    the program's environment fills what is not set.

    Attributes:
        auth_token_file: File with the token to present to a cluster that
            requires one; never the token itself, which the host program
            would log with its configuration.
        tls_ca: CA that signed the daemons' certificates (gRPC over TLS).
        tls_cert: Client certificate, for daemons that require one.
        tls_key: Private key of ``tls_cert``.
        tls_server_name: Name expected in the daemons' certificates.
    """

    auth_token_file: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_server_name: str = ""

    def security(self, env: Mapping[str, str] | None) -> SecurityConfig:
        """The client's token and TLS: these settings over ``KVDEPOT_*`` in ``env``."""
        names = ("auth_token_file", "tls_ca", "tls_cert", "tls_key", "tls_server_name")
        return load_security(env, None, {f: getattr(self, f) or None for f in names})


def load_security(
    env: Mapping[str, str] | None,
    file: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    flags: Mapping[str, str] | None = None,
) -> SecurityConfig:
    """Build a :class:`SecurityConfig` at an entry point: flags > environment > file.

    Args:
        env: The environment (the caller passes ``os.environ``).
        file: A ``--config`` file; its ``[security]`` table is read.
        overrides: Values from flags (``None``: not given). There is no
            flag for the token itself, only for a token file.
        flags: The flag of each setting in ``overrides``, to name it in errors.

    Raises:
        InvalidArgument: Bad values or unreadable files.
    """
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
        SecurityConfig,
        prefix=ENV_PREFIX,
        env=env,
        file=file,
        section="security",
        overrides=given,
        flags=flags,
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
TENANT_METHODS = frozenset(
    {
        "/kvdepot.v1.Metadata/PutStart",
        "/kvdepot.v1.Metadata/PutEnd",
        "/kvdepot.v1.Metadata/PutRevoke",
        "/kvdepot.v1.Metadata/Lookup",
        "/kvdepot.v1.Metadata/Route",
        "/kvdepot.v1.Store/GetTransferInfo",
        "/grpc.health.v1.Health/Check",
        "/grpc.health.v1.Health/Watch",
    }
)
"""What a tenant token may call: no node management, no cluster statistics."""

_TENANT_KEYED = frozenset(m for m in TENANT_METHODS if m.startswith("/kvdepot.v1.Metadata/"))
"""Methods whose request ``keys`` are moved into the caller's key space."""


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
        if principal.is_cluster:
            return handler
        method = handler_call_details.method
        if method not in TENANT_METHODS:
            reason = f"tenant {principal.tenant} may not call {method}"
            return _aborting(handler, grpc.StatusCode.PERMISSION_DENIED, reason)
        if method in _TENANT_KEYED and handler.unary_unary is not None:
            return _in_tenant_space(handler, principal.tenant)
        return handler

    def _refusing(self, handler: Any, reason: str) -> Any:
        refusals = self._refusals

        def log(context: grpc.aio.ServicerContext) -> None:
            refusals.refuse(peer_host(context.peer()), reason)

        return _aborting(handler, grpc.StatusCode.UNAUTHENTICATED, reason, log)


def _in_tenant_space(handler: Any, tenant: str) -> Any:
    """``handler`` with the request's ``keys`` moved into ``tenant``'s key space first."""
    inner = handler.unary_unary

    async def behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
        keys = getattr(request, "keys", None)  # None: unparsable, refused by the inner handler
        if keys is not None:
            mapped = [tenant_key(tenant, k) for k in keys]
            del keys[:]
            keys.extend(mapped)
        return await inner(request, context)

    return grpc.unary_unary_rpc_method_handler(
        behavior, handler.request_deserializer, handler.response_serializer
    )


def _aborting(
    handler: Any,
    code: grpc.StatusCode,
    reason: str,
    on_call: Callable[[grpc.aio.ServicerContext], None] | None = None,
) -> Any:
    """A handler of ``handler``'s kind that aborts with ``code``, never parsing the request."""

    async def abort(context: grpc.aio.ServicerContext) -> None:
        if on_call is not None:
            on_call(context)
        await context.abort(code, f"kvdepot: {reason}")

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await abort(context)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await abort(context)
        yield  # pragma: no cover - abort raised

    serialize = handler.response_serializer
    if handler.response_streaming:
        if handler.request_streaming:
            return grpc.stream_stream_rpc_method_handler(streaming, _ignore_request, serialize)
        return grpc.unary_stream_rpc_method_handler(streaming, _ignore_request, serialize)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, _ignore_request, serialize)
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
    # Without SO_REUSEPORT a second daemon on a port in use fails to bind
    # instead of silently sharing the port (gRPC turns it on by default).
    opts = list(options)
    if not any(name == "grpc.so_reuseport" for name, _ in opts):
        opts.append(("grpc.so_reuseport", 0))
    return grpc.aio.server(interceptors=interceptors, options=opts)


def add_port(
    server: grpc.aio.Server, address: str, security: SecurityConfig | None, what: str = ""
) -> int:
    """Bind ``address`` (TLS when a certificate is configured); the port bound, 0 on failure.

    ``what`` names the listener in errors, e.g. ``"metadata gRPC"``.

    Raises:
        Unavailable: The port is in use (one line naming it).

    Warns when a daemon without a token listens beyond loopback: anyone who
    reaches the port could then read and write the cache.
    """
    security = security or NO_SECURITY
    if security.tls_enabled and not security.tls_cert:
        raise InvalidArgument("a daemon speaks TLS only with tls_cert and tls_key")
    host = split_endpoint(address)[0]
    if not security.auth and not is_loopback(host):
        logger.warning(
            "listening on %s without an auth token: anyone who can reach it can read and "
            "write the cache (set KVDEPOT_AUTH_TOKEN or --auth-token-file)",
            host,
        )
    check_port_free(address, what)
    try:
        if security.tls_cert:
            return server.add_secure_port(address, security.server_credentials())
        return server.add_insecure_port(address)
    except RuntimeError as exc:  # "Failed to bind to address …"
        label = f" ({what})" if what else ""
        raise Unavailable(f"cannot listen on {address}{label}: {exc}") from None


def check_port_free(address: str, what: str = "") -> None:
    """Raise a one-line error if nothing can listen on ``address`` (``host:port``).

    gRPC's own bind failure is a RuntimeError after C-core log lines; this
    tries the port first, as gRPC binds it (``SO_REUSEADDR``, no
    ``SO_REUSEPORT``), and says which port is taken. Port 0 always passes.

    Raises:
        Unavailable: The port is in use, or the address cannot be bound.
    """
    host, port = split_endpoint(address)
    if not port:
        return
    label = f" ({what})" if what else ""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return  # gRPC reports an address it cannot resolve
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise Unavailable(
                        f"cannot listen on {host}:{port}{label}: port {port} is already in use"
                    ) from None
                raise Unavailable(f"cannot listen on {host}:{port}{label}: {exc}") from None


# -- explaining a refused connection --------------------------------------------------
def explain_refusal(target: str, security: SecurityConfig | None, timeout_s: float = 2.0) -> str:
    """Why a daemon at ``target`` closes this process's connections, or ``""``.

    gRPC reports a TLS mismatch as ``Socket closed`` or a raw handshake
    error. This dials ``target`` once with Python's TLS, as the process's
    settings would, and says which side refused and why: one speaks TLS and
    the other plaintext, the daemon wants a client certificate, or one side
    does not know the CA of the other's certificate.
    """
    import ssl

    security = security or NO_SECURITY
    host, port = split_endpoint(target)
    if port is None:
        return ""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    if security.tls_ca:
        ctx.load_verify_locations(security.tls_ca)
    else:
        ctx.verify_mode = ssl.CERT_NONE  # the system's roots: gRPC says enough
    ctx.set_alpn_protocols(["h2"])
    try:
        if security.tls_cert:
            ctx.load_cert_chain(security.tls_cert, security.tls_key)
        raw = socket.create_connection((host, port), timeout=timeout_s)
    except (OSError, ValueError):
        return ""
    with raw:
        try:
            tls = ctx.wrap_socket(raw, server_hostname=security.tls_server_name or None)
        except ssl.SSLCertVerificationError:
            return (
                f"this client does not trust {target}'s certificate: it is not signed by "
                f"the CA in --tls-ca {security.tls_ca}"
            )
        except OSError:  # ssl.SSLError included: no TLS server answered
            if security.tls_enabled:
                return (
                    f"{target} speaks plaintext gRPC and this client TLS: start the daemon "
                    "with --tls-cert and --tls-key, or drop --tls/--tls-ca here"
                )
            return ""
        with tls:
            if not security.tls_enabled:
                return (
                    f"{target} speaks TLS and this client plaintext: pass --tls-ca "
                    "(the CA of the daemon's certificate) or --tls"
                )
            refused = _alert_after_handshake(tls, bool(security.tls_cert))
    return f"{target} refused this client: {refused}" if refused else ""


def _alert_after_handshake(tls: Any, sent_certificate: bool) -> str:
    """What the daemon did with our certificate. With TLS 1.3 it checks a
    client certificate after the handshake and, refusing it, closes the
    connection (with an alert, or without a word, as gRPC's does)."""
    import ssl

    tls.settimeout(1.0)
    try:
        # An HTTP/2 preface: a daemon that accepted us answers with a SETTINGS frame.
        tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes(9))
        if tls.recv(1):
            return ""
        reason = ""
    except ssl.SSLError as exc:
        reason = str(exc.reason or exc).upper()
    except OSError:
        return ""
    if not sent_certificate or "CERTIFICATE_REQUIRED" in reason:
        return (
            "it closed the connection after the handshake: it requires a client "
            "certificate (pass --tls-cert and --tls-key)"
        )
    return (
        "it closed the connection after the handshake: it does not accept this client's "
        "certificate (not signed by the CA it trusts, its --tls-ca)"
    )
