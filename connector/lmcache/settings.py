"""Where the LMCache plugin finds kvdepot: the ``kvdepot://`` URL.

A plugin instance is named in LMCache's ``remote_storage_plugins`` (``kvdepot``,
or ``kvdepot.<instance>`` for several) and configured under its name in
``extra_config``::

    remote_storage_plugin.kvdepot.url: "kvdepot://meta-a:7700,meta-b:7700?node_id=node-3"

The URL lists the metadata service replicas; its query may set the client
options below. Everything else (chunk size, dtype, shapes) comes from
LMCache's own configuration. A cluster that requires a token is reached with
``?auth_token_file=/path`` (or ``KVDEPOT_AUTH_TOKEN`` in the environment);
the token itself never goes in the URL, which LMCache logs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import parse_qs, urlsplit

from kvdepot.endpoints import parse_endpoints
from kvdepot.errors import InvalidArgument
from kvdepot.rpc.security_config import PluginSecurity

SCHEME = "kvdepot"
PLUGIN_TYPE = "kvdepot"
MODULE = "kvdepot.connector.lmcache"


def plugin_key(plugin_name: str, option: str) -> str:
    """The ``extra_config`` key of one option of a plugin instance."""
    return f"remote_storage_plugin.{plugin_name}.{option}"


@dataclass(frozen=True, slots=True, kw_only=True)
class PluginSettings(PluginSecurity):
    """How one LMCache remote backend reaches kvdepot: the fields below and the
    token and TLS settings of :class:`~kvdepot.rpc.security.PluginSecurity`.

    Attributes:
        metadata: Metadata service replicas, ``host:port[,host:port]``.
        node_id: The store node on this host, if any: puts go there first
            and reads of chunks it holds need no network.
        transport: Data-plane transport (``auto``, ``tcp``, ``shm``, ``nixl``).
        io_threads: Threads that run the blocking client calls, so LMCache's
            event loop never waits on the network.
        rpc_timeout_s: Deadline of each metadata call.
        io_timeout_s: Deadline for a stalled data-plane transfer.
    """

    metadata: str
    node_id: str = ""
    transport: str = "auto"
    io_threads: int = 4
    rpc_timeout_s: float = 5.0
    io_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        parse_endpoints(self.metadata)
        if self.io_threads < 1:
            raise InvalidArgument("io_threads must be at least 1")
        if min(self.rpc_timeout_s, self.io_timeout_s) <= 0:
            raise InvalidArgument("timeouts must be positive")

    @classmethod
    def from_url(cls, url: str) -> PluginSettings:
        """Parse ``kvdepot://host:port[,host:port][?option=value&...]``.

        Raises:
            InvalidArgument: another scheme, no address, or an unknown option.
        """
        parts = urlsplit(url)
        if parts.scheme != SCHEME or not parts.netloc:
            raise InvalidArgument(f"{url!r} is not a kvdepot://host:port[,host:port] URL")
        if parts.path not in ("", "/"):
            raise InvalidArgument(f"kvdepot URL {url!r} must not have a path")
        options: dict[str, Any] = {}
        # Every setting but the address is a URL option, parsed by its type.
        types = {"str": str, "int": int, "float": float}
        known = {f.name: types[str(f.type)] for f in fields(cls) if f.name != "metadata"}
        for name, values in parse_qs(parts.query, keep_blank_values=True).items():
            if name not in known:
                raise InvalidArgument(
                    f"unknown kvdepot URL option {name!r} (known: {', '.join(known)})"
                )
            try:
                options[name] = known[name](values[-1])
            except ValueError:
                raise InvalidArgument(f"bad value {values[-1]!r} for {name}") from None
        return cls(metadata=parts.netloc, **options)


def is_plugin_url(url: str) -> bool:
    """Whether LMCache's ``plugin://<name>`` URL names a kvdepot instance."""
    if not url.startswith("plugin://"):
        return False
    return url[len("plugin://") :].split(".", 1)[0] == PLUGIN_TYPE


def resolve(
    url: str,
    extra_config: Mapping[str, Any] | None,
    plugin_name: str | None = None,
    plugins: Sequence[str] = (),
) -> PluginSettings:
    """The settings of the backend LMCache is creating.

    Args:
        url: The URL LMCache resolves: ``kvdepot://…`` itself,
            ``plugin://<name>`` for a ``remote_storage_plugins`` entry, or ""
            when LMCache did not say.
        extra_config: LMCache's ``extra_config``.
        plugin_name: The plugin instance, when LMCache passes it.
        plugins: LMCache's ``remote_storage_plugins``: when the plugin name is
            unknown (LMCache built the connector class directly), the one of
            them configured with this module.

    Raises:
        InvalidArgument: no kvdepot URL configured, or an invalid one.
    """
    if url.startswith(f"{SCHEME}://"):
        return PluginSettings.from_url(url)
    extra = dict(extra_config or {})
    if plugin_name is None and url.startswith("plugin://"):
        plugin_name = url[len("plugin://") :] or None
    if plugin_name is None:
        mine = [
            p
            for p in plugins
            if str(extra.get(plugin_key(p, "module_path"), "")).startswith(MODULE)
        ]
        if len(mine) != 1:
            raise InvalidArgument(
                f"cannot tell which remote_storage_plugins entry is kvdepot ({len(mine)} "
                f"use {MODULE}); use class_name KVDepotConnectorAdapter"
            )
        plugin_name = mine[0]
    found = extra.get(plugin_key(plugin_name, "url"))
    if not found:
        raise InvalidArgument(
            f"extra_config has no {plugin_key(plugin_name, 'url')!r}: "
            "set it to kvdepot://host:port[,host:port]"
        )
    return PluginSettings.from_url(str(found))
