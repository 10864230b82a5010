"""Index backends of the metadata service, chosen by the scheme of the index URL."""

from __future__ import annotations

from collections.abc import Callable

from kvdepot.errors import InvalidArgument
from kvdepot.metadata.index.base import IndexBackend, IndexConfig
from kvdepot.registry import Registry

BACKENDS: Registry[Callable[[IndexConfig], IndexBackend]] = Registry(
    "index backend", missing=InvalidArgument
)
"""The index backends, by URL scheme; each entry builds one from its config."""
BACKENDS.register("memory", "kvdepot.metadata.index.memory:MemoryIndex")
# redis-py is an optional dependency (kvdepot[redis]): imported on use.
for _scheme in ("redis", "rediss", "redis+cluster"):
    BACKENDS.register(
        _scheme,
        "kvdepot.metadata.index.redis:RedisIndex",
        needs="redis-py: pip install 'kvdepot[redis]'",
    )


def register_backend(scheme: str, factory: Callable[[IndexConfig], IndexBackend] | str) -> None:
    """Make an index backend (a factory, or its ``"module:attr"`` path) available under ``scheme``.

    Raises:
        InvalidArgument: If ``scheme`` is registered already.
    """
    BACKENDS.register(scheme, factory)


def create_backend(config: IndexConfig) -> IndexBackend:
    """Create the backend named by ``config.url``'s scheme.

    Raises:
        InvalidArgument: An unknown scheme, or one whose backend's dependency
            is not installed.
    """
    return BACKENDS.get(config.url.split("://", 1)[0])(config)


__all__ = ["BACKENDS", "IndexBackend", "IndexConfig", "create_backend", "register_backend"]
