"""Index backends of the metadata service, chosen by name."""

from __future__ import annotations

from collections.abc import Callable

from kvdepot.errors import InvalidArgument
from kvdepot.metadata.index.base import IndexBackend, IndexConfig

_REGISTRY: dict[str, Callable[[IndexConfig], IndexBackend]] = {}


def register_backend(scheme: str, factory: Callable[[IndexConfig], IndexBackend]) -> None:
    """Make an index backend available under ``scheme`` (e.g. ``"memory"``)."""
    _REGISTRY[scheme] = factory


def create_backend(config: IndexConfig) -> IndexBackend:
    """Create the backend named by ``config.url``'s scheme."""
    scheme = config.url.split("://", 1)[0]
    try:
        factory = _REGISTRY[scheme]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise InvalidArgument(f"unknown index backend {scheme!r} (known: {known})") from None
    return factory(config)


def _memory(config: IndexConfig) -> IndexBackend:
    from kvdepot.metadata.index.memory import MemoryIndex

    return MemoryIndex(config)


def _redis(config: IndexConfig) -> IndexBackend:
    # Imported on use: redis-py is an optional dependency (kvdepot[redis]).
    try:
        from kvdepot.metadata.index.redis import RedisIndex
    except ImportError as exc:
        raise InvalidArgument(
            f"index {config.url!r} needs redis-py: pip install 'kvdepot[redis]' ({exc})"
        ) from None
    return RedisIndex(config)


register_backend("memory", _memory)
for _scheme in ("redis", "rediss", "redis+cluster"):
    register_backend(_scheme, _redis)

__all__ = ["IndexBackend", "IndexConfig", "create_backend", "register_backend"]
