"""Tokens: who a caller is, and how a daemon checks it.

A process's token file (or ``KVDEPOT_AUTH_TOKEN``) holds the **cluster
token** and, on daemons, **tenant tokens** bound to tenant names
(:func:`parse_token_file`). An :class:`Authenticator` maps a presented token
(gRPC) or a data-plane proof (an HMAC of a store's nonce, so the token never
crosses the unencrypted data plane) to a :class:`Principal`, comparing in
constant time against every accepted token. A tenant's chunk keys are moved
into its own key space (:func:`tenant_key`) by every daemon alike.
:class:`RefusalLog` logs refused peers once per peer and minute.

How these reach gRPC and the CLI is :mod:`kvdepot.rpc.security`.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import re
import threading
import time
from dataclasses import dataclass, field

from kvdepot.endpoints import split_endpoint
from kvdepot.errors import InvalidArgument

logger = logging.getLogger(__name__)

TOKEN_MIN_CHARS = 16
"""Shortest token accepted: anything shorter is guessable."""
TOKEN_MAX_CHARS = 4096
_TOKEN_RE = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no spaces: valid gRPC metadata
_TENANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_PROOF_LABEL = b"kvdepot data plane v1\x00"
_REFUSAL_LOG_S = 60.0


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


_TENANT_PERSON = b"kvdepot-tenant"
_KEY_BYTES = 16


def tenant_key(tenant: str, key: bytes) -> bytes:
    """The key ``tenant``'s chunk ``key`` is stored under (the same on every daemon).

    A keyed BLAKE2b, so no tenant can aim at another's key space. Keys of
    the wrong length pass unchanged, to be refused as malformed.
    """
    if len(key) != _KEY_BYTES:
        return key
    return hashlib.blake2b(
        key, digest_size=_KEY_BYTES, key=tenant.encode(), person=_TENANT_PERSON
    ).digest()


def dataplane_proof(token: str, nonce: bytes) -> bytes:
    """What a data-plane client answers a store's challenge ``nonce`` with.

    An HMAC of the nonce: the token never crosses the (unencrypted) data
    plane, and a recorded answer is worthless for any other nonce.
    """
    return _proof(token.encode(), nonce)


def _proof(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, _PROOF_LABEL + nonce, hashlib.sha256).digest()


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
            if hmac.compare_digest(proof, _proof(secret, nonce)):
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
    host, port = split_endpoint(peer)
    return host if port is not None else peer.strip("[]")


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
