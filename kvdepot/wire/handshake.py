"""The data-plane handshake: a connection proves it holds a token before anything else.

When a store has a token, the first exchange of every data-plane connection
(``tcp``, and the control connections of ``shm`` and ``nixl``) is::

    client -> AUTH        count 0: "challenge me"
    store  -> AUTH_REPLY  count 32: a fresh random nonce
    client -> AUTH        count 32: HMAC-SHA256(token, label || nonce)
    store  -> AUTH_REPLY  count 0: accepted
              or ERROR UNAUTHENTICATED, and the connection is closed

The token itself never crosses the data plane, which is not encrypted, and a
proof is good for one nonce only: a recorded handshake cannot be replayed. A
store without a token answers the first AUTH with count 0 (nothing to prove),
so a client configured with a token works with it too. Any other request
before an accepted proof is refused like a wrong proof.
"""

from __future__ import annotations

import secrets
import socket

from kvdepot.rpc.auth import CLUSTER, PROOF_BYTES, Authenticator, Principal, dataplane_proof
from kvdepot.wire.protocol import (
    AuthRefused,
    ErrorCode,
    Header,
    Opcode,
    ProtocolError,
    recv_exact,
    recv_reply_header,
    send_all,
)

NONCE_BYTES = 32


def authenticate(sock: socket.socket, token: str) -> None:
    """Run the client side of the handshake on a fresh connection.

    Raises:
        AuthRefused: The store refused the token (an :class:`Unauthenticated`).
        ProtocolError: The store answered something else.
        Unavailable: The connection failed.
    """
    send_all(sock, [Header(Opcode.AUTH).pack()])
    header = recv_reply_header(sock, Opcode.AUTH_REPLY, None)
    if header.count == 0:
        return  # the store needs no token
    if header.count != NONCE_BYTES:
        raise ProtocolError(ErrorCode.MALFORMED, f"AUTH_REPLY of {header.count} bytes")
    nonce = recv_exact(sock, NONCE_BYTES)
    send_all(sock, [Header(Opcode.AUTH, PROOF_BYTES).pack() + dataplane_proof(token, nonce)])
    recv_reply_header(sock, Opcode.AUTH_REPLY, 0)


class ServerHandshake:
    """The store's side of the handshake for one connection.

    Args:
        auth: Checks proofs; ``None`` (or one without tokens) requires none.
    """

    def __init__(self, auth: Authenticator | None) -> None:
        self._auth = auth if auth is not None and auth.required else None
        self._nonce = b""
        self.principal: Principal | None = CLUSTER if self._auth is None else None
        """Who the connection authenticated as; ``None`` until it did."""

    def admit(self, conn: socket.socket, header: Header) -> bool:
        """Whether to serve the request ``header`` starts; answers AUTH itself.

        Raises:
            AuthRefused: A request before an accepted proof, or a wrong proof.
            ProtocolError: A malformed AUTH.
        """
        if header.opcode is not Opcode.AUTH:
            if self.principal is None:
                raise AuthRefused(f"{header.opcode.name} before authenticating (no token?)")
            return True
        if header.count == 0:
            if self._auth is None:
                send_all(conn, [Header(Opcode.AUTH_REPLY).pack()])
                return False
            self._nonce = secrets.token_bytes(NONCE_BYTES)
            send_all(conn, [Header(Opcode.AUTH_REPLY, NONCE_BYTES).pack() + self._nonce])
            return False
        if header.count != PROOF_BYTES:
            raise ProtocolError(ErrorCode.MALFORMED, f"AUTH of {header.count} bytes")
        proof = recv_exact(conn, PROOF_BYTES)
        if self._auth is not None:
            nonce, self._nonce = self._nonce, b""  # one proof per challenge
            if not nonce:
                raise AuthRefused("AUTH proof without a challenge")
            principal = self._auth.verify_proof(nonce, proof)
            if principal is None:
                raise AuthRefused("wrong token")
            self.principal = principal
        send_all(conn, [Header(Opcode.AUTH_REPLY).pack()])
        return False
