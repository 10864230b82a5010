"""The security settings of one process: its token and TLS files, loaded and handed on.

:class:`SecurityConfig` says what a process presents and accepts (see
:mod:`kvdepot.rpc.security` for what the services do with it); it imports no
gRPC until it builds TLS credentials, so a command's options and a plugin's
settings cost no gRPC import (:mod:`kvdepot.rpc.security` turns its TLS files
into gRPC credentials). :class:`PluginSecurity` is the same set of a
client inside another program, :func:`load_security` builds one at an entry
point, :func:`child_args` hands one to a ``kvdepot`` child process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvdepot.config import InvalidSetting, load_config, setting, validate
from kvdepot.errors import InvalidArgument
from kvdepot.rpc.auth import Authenticator, TokenSet, parse_token_file


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

    def server_tls(self) -> tuple[bytes, bytes, bytes | None]:
        """A daemon's TLS files, read: its private key, its certificate and
        the CA that client certificates must be signed by (or None).

        Raises:
            InvalidArgument: No certificate and key configured, or a file
                that cannot be read.
        """
        if not (self.tls_cert and self.tls_key):
            raise InvalidArgument("a TLS server needs tls_cert and tls_key")
        return (
            _read(self.tls_key, "tls_key"),
            _read(self.tls_cert, "tls_cert"),
            _read(self.tls_ca, "tls_ca") if self.tls_ca else None,
        )

    def client_tls(self) -> tuple[bytes | None, bytes | None, bytes | None]:
        """A client's TLS files, read: the CA (None: the system's roots), and
        its private key and certificate for mutual TLS (None when not set)."""
        return (
            _read(self.tls_ca, "tls_ca") if self.tls_ca else None,
            _read(self.tls_key, "tls_key") if self.tls_key else None,
            _read(self.tls_cert, "tls_cert") if self.tls_cert else None,
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


__all__ = [
    "ENV_PREFIX",
    "NO_SECURITY",
    "SECURITY_GROUP",
    "PluginSecurity",
    "SecurityConfig",
    "child_args",
    "load_security",
]
