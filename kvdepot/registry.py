"""Named plugins of one kind: the one registry behind every plugin point.

Tier kinds, eviction policies, index backends, data-plane transports and KV
codecs are each chosen by name from configuration. Each plugin point holds one
:class:`Registry`; an entry is the object itself (a class or a factory) or its
``"module:attr"`` path, imported on first use, so that naming and validating a
choice never loads an optional dependency (torch, redis-py, CUDA) that the
process does not use::

    TIERS: Registry[type[Tier]] = Registry("tier", base=Tier)
    TIERS.register("ssd", "kvdepot.store.tiers.ssd:SsdTier")
    TIERS.get("ssd")  # imports kvdepot.store.tiers.ssd now

A name is registered once: registering it again is an error instead of
silently replacing the first plugin (two plugins claiming one name is a
packaging mistake that should not depend on import order).
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from typing import Generic, TypeVar, cast

from kvdepot.errors import InvalidArgument, KVDepotError, Unavailable

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class _Entry:
    target: object
    """The object, or its ``"module:attr"`` path while not imported yet."""
    needs: str
    """What an import failure means to the user (e.g. which extra to install)."""


class Registry(Generic[T]):
    """Plugins of one kind, by name; thread-safe.

    Args:
        kind: What the plugins are, for messages (``"tier"``, ``"transport"``).
        base: Where given, a loaded entry must be a subclass of it.
        missing: The error raised when a lazy entry's module cannot be imported
            (a missing optional dependency).
    """

    def __init__(
        self,
        kind: str,
        *,
        base: type | None = None,
        missing: type[KVDepotError] = Unavailable,
    ) -> None:
        self.kind = kind
        self._base = base
        self._missing = missing
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()

    def register(self, name: str, target: T | str, *, needs: str = "") -> None:
        """Make ``target`` (an object, or its ``"module:attr"`` path) available as ``name``.

        Args:
            name: The name configuration uses.
            target: The plugin, or where to import it from on first use.
            needs: Added to the error when the import fails, e.g.
                ``"redis-py: pip install 'kvdepot[redis]'"``.

        Raises:
            InvalidArgument: An empty name, a malformed path, or a name that
                is registered already.
        """
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"a {self.kind} needs a non-empty name, got {name!r}")
        if isinstance(target, str):
            module, sep, attr = target.partition(":")
            if not (module and sep and attr):
                raise InvalidArgument(
                    f"{self.kind} {name!r}: {target!r} is not a 'module:attr' path"
                )
        else:
            self._check_base(target, _describe(target))
        with self._lock:
            existing = self._entries.get(name)
            if existing is not None:
                raise InvalidArgument(
                    f"{self.kind} {name!r} is registered already (as {_describe(existing.target)})"
                )
            self._entries[name] = _Entry(target, needs)

    def names(self) -> list[str]:
        """The registered names, sorted."""
        with self._lock:
            return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._entries

    def check(self, name: str) -> None:
        """Raise unless ``name`` is registered (imports nothing).

        Raises:
            InvalidArgument: Naming ``name`` and the registered names.
        """
        with self._lock:
            if name in self._entries:
                return
            known = sorted(self._entries)
        raise InvalidArgument(f"unknown {self.kind} {name!r}; known: {', '.join(known)}")

    def get(self, name: str) -> T:
        """The plugin registered as ``name``, importing its module on first use.

        Raises:
            InvalidArgument: ``name`` is not registered, or its target is not
                a subclass of the registry's base.
            KVDepotError: The registry's ``missing`` error where the target's
                module cannot be imported.
        """
        self.check(name)
        with self._lock:
            entry = self._entries[name]
        if not isinstance(entry.target, str):
            return cast(T, entry.target)
        # Imported outside the lock: a plugin module may register more
        # plugins of this kind while it loads.
        loaded = self._load(name, entry)
        with self._lock:
            self._entries[name] = _Entry(loaded, entry.needs)
        return cast(T, loaded)

    def copy(self) -> Registry[T]:
        """A registry with the same entries, to change without changing this one (tests)."""
        other: Registry[T] = Registry(self.kind, base=self._base, missing=self._missing)
        with self._lock:
            other._entries = dict(self._entries)
        return other

    def _load(self, name: str, entry: _Entry) -> object:
        module_name, _, attr = cast(str, entry.target).partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            hint = f" needs {entry.needs}" if entry.needs else " cannot be loaded"
            raise self._missing(f"{self.kind} {name!r}{hint} ({exc})") from None
        loaded = getattr(module, attr, None)
        if loaded is None:
            raise InvalidArgument(f"{self.kind} {name!r}: {module_name} has no {attr!r}")
        self._check_base(loaded, cast(str, entry.target))
        return loaded

    def _check_base(self, target: object, where: str) -> None:
        if self._base is not None and not (
            isinstance(target, type) and issubclass(target, self._base)
        ):
            raise InvalidArgument(f"{where} is not a {self._base.__name__}")


def _describe(target: object) -> str:
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", "")
    qualname = getattr(target, "__qualname__", repr(target))
    return f"{module}:{qualname}" if module else qualname


__all__ = ["Registry"]
