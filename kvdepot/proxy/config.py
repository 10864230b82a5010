"""The proxy's settings: its engines, routing and the bounds on every call to an engine.

Free of aiohttp (an optional dependency), so the command builds and checks
them (``kvdepot proxy --check``) where the proxy itself could not run.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdepot.config import InvalidSetting, Port, positive, setting, validate
from kvdepot.errors import InvalidArgument
from kvdepot.keys import Namespace
from kvdepot.proxy.router import ROUTING_MODES

ENV_PREFIX = "KVDEPOT_PROXY_"
"""Environment prefix of :class:`UpstreamConfig`'s settings (``KVDEPOT_PROXY_TOTAL_TIMEOUT_S``)."""

_GROUP = "upstream timeouts"


@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    """How long the proxy waits on an engine: no client request hangs on a frozen one.

    Each failure is answered as an OpenAI-style error: 504 when an engine did
    not answer in time, 502 when it could not be reached or answered garbage;
    a stream that stalls after it started ends with an error event.

    Attributes:
        connect_timeout_s: Longest wait to open a connection to an engine
            (TCP and TLS). Engines sit on the cluster's own network: a
            connection that takes seconds is a host or network that is gone.
        first_byte_timeout_s: Longest an engine may stay silent, before the
            first byte of its answer or between two chunks of a stream, before
            the proxy checks that it is alive. An engine whose ``/health`` does
            not answer 200 within ``health_timeout_s`` then fails the request
            (504); a live one gets another period, up to ``total_timeout_s``.
            A fixed first-byte deadline would cut every long completion that
            is not streamed: vLLM sends nothing of it until it is done.
        total_timeout_s: Longest the proxy spends on one client request, the
            prefill call, the decode call and the whole stream included. The
            default fits a few thousand generated tokens on a loaded engine;
            raise it for longer generations.
        health_timeout_s: Bound on each call to an engine's ``/health``: the
            liveness check above, and the proxy's own ``/health``, which asks
            every engine at once and so answers within about this long (set a
            load balancer's probe timeout above it).

    Every wait also ends at the request's ``total_timeout_s``, so a bound set
    longer than it simply never applies.
    """

    connect_timeout_s: float = setting(
        5.0,
        positive(),
        flag="--connect-timeout",
        help="seconds to connect to an engine (default 5)",
        metavar="S",
        group=_GROUP,
    )
    first_byte_timeout_s: float = setting(
        60.0,
        positive(),
        flag="--first-byte-timeout",
        help="seconds an engine may stay silent before its /health is checked (default 60)",
        metavar="S",
        group=_GROUP,
    )
    total_timeout_s: float = setting(
        600.0,
        positive(),
        flag="--total-timeout",
        help="seconds one request may take, stream included (default 600)",
        metavar="S",
        group=_GROUP,
    )
    health_timeout_s: float = setting(
        2.0,
        positive(),
        flag="--health-timeout",
        help="seconds an engine's /health may take to answer (default 2)",
        metavar="S",
        group=_GROUP,
    )

    def __post_init__(self) -> None:
        validate(self)


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """Configuration of the proxy.

    Attributes:
        prefill: Base URLs of the prefill engines (``http://host:port``).
        decode: Base URLs of the decode engines.
        host: Address the proxy binds.
        port: Port the proxy listens on.
        routing: ``"round-robin"`` or ``"kv-aware"``.
        prefill_nodes: ``(url, store node id)`` of prefill engines (kv-aware).
        decode_nodes: ``(url, store node id)`` of decode engines (kv-aware).
        metadata: Metadata service ``host:port`` (kv-aware).
        namespace: The engines' key namespace, to key prompts (kv-aware).
        upstream: The bounds on every call to an engine.
    """

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = setting(8000, Port())
    routing: str = "round-robin"
    prefill_nodes: tuple[tuple[str, str], ...] = ()
    decode_nodes: tuple[tuple[str, str], ...] = ()
    metadata: str = ""
    namespace: Namespace | None = None
    upstream: UpstreamConfig = UpstreamConfig()

    def __post_init__(self) -> None:
        validate(self)
        if not isinstance(self.upstream, UpstreamConfig):
            raise InvalidSetting("upstream", "must be an UpstreamConfig", self.upstream)
        if not self.prefill or not self.decode:
            raise InvalidArgument("the proxy needs at least one prefill and one decode engine")
        for url in (*self.prefill, *self.decode):
            if not url.startswith(("http://", "https://")):
                raise InvalidArgument(f"engine URL {url!r} must start with http:// or https://")
        if self.routing not in ROUTING_MODES:
            raise InvalidArgument(f"routing must be one of {', '.join(ROUTING_MODES)}")
        if self.routing == "kv-aware":
            if not self.metadata or self.namespace is None:
                raise InvalidArgument("kv-aware routing needs --metadata and a model namespace")
            if not self.prefill_nodes:
                raise InvalidArgument("kv-aware routing needs --prefill-node URL=NODE_ID")
        for url, _ in (*self.prefill_nodes, *self.decode_nodes):
            if url not in (*self.prefill, *self.decode):
                raise InvalidArgument(f"{url!r} is mapped to a node but is not an engine")
