"""Authentication and TLS of kvdepot's gRPC services and data plane.

One :class:`SecurityConfig` per process (:mod:`kvdepot.rpc.security_config`)
says what it presents and what it accepts:

* a **cluster token**, a shared secret every daemon and client of the cluster
  holds. It comes from a token file or the ``KVDEPOT_AUTH_TOKEN`` environment
  variable, never from a command line (``ps`` would show it to every user of
  the host). When a daemon has one, every gRPC call must carry it
  (``authorization: Bearer <token>``) and every data-plane connection must
  prove it holds it (see :mod:`kvdepot.wire.handshake`); anything else is
  refused with ``UNAUTHENTICATED`` or a closed connection, and logged once per
  peer and minute, not once per request;
* optional **tenant tokens**, bound to a tenant name in a daemon's token file
  (see :func:`kvdepot.rpc.auth.parse_token_file`): a client that presents one is
  that tenant. Its keys are moved into the tenant's own key space on arrival,
  by the metadata service and the stores alike (:func:`kvdepot.rpc.auth.tenant_key`), so it finds
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
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, NamedTuple

import grpc

from kvdepot.endpoints import split_endpoint
from kvdepot.errors import InvalidArgument, Unavailable
from kvdepot.rpc.auth import (
    Authenticator,
    RefusalLog,
    is_loopback,
    peer_host,
    tenant_key,
)
from kvdepot.rpc.request_guard import MalformedRequestGuard
from kvdepot.rpc.security_config import (
    NO_SECURITY,
    SecurityConfig,
)

logger = logging.getLogger(__name__)

AUTH_METADATA_KEY = "authorization"
_BEARER = "Bearer "

ChannelOptions = Sequence[tuple[str, Any]]


# -- credentials ---------------------------------------------------------------------
def server_credentials(security: SecurityConfig) -> grpc.ServerCredentials:
    """TLS credentials of a daemon's gRPC server.

    Raises:
        InvalidArgument: No certificate and key configured.
    """
    key, cert, ca = security.server_tls()
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=security.tls_client_auth
    )


def channel_credentials(security: SecurityConfig) -> grpc.ChannelCredentials:
    """TLS credentials of a client's channel (its certificate, if any, for mutual TLS)."""
    ca, key, cert = security.client_tls()
    return grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=cert
    )


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


def channel(
    target: str, security: SecurityConfig | None = None, options: ChannelOptions = ()
) -> grpc.Channel:
    """A synchronous gRPC channel to ``target`` with this process's token and TLS."""
    security = security or NO_SECURITY
    opts = [*options, *security.channel_options()]
    if security.tls_enabled:
        ch = grpc.secure_channel(target, channel_credentials(security), options=opts)
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
            target, channel_credentials(security), options=opts, interceptors=interceptors
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
            return server.add_secure_port(address, server_credentials(security))
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
