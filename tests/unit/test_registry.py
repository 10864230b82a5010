"""The one registry helper behind every plugin point."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdepot.connector.codec import CODECS
from kvdepot.connector.transport import TRANSPORTS
from kvdepot.errors import InvalidArgument, Unavailable
from kvdepot.metadata.index import BACKENDS
from kvdepot.registry import Registry
from kvdepot.store.tiers.base import TIERS
from kvdepot.store.tiers.policy import POLICIES


class Base:
    pass


class Impl(Base):
    pass


@pytest.fixture
def plugin_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module on the path that nothing has imported yet; yields its name."""
    name = f"kvdepot_test_plugin_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            """
            from tests.unit.test_registry import Base

            class Plugin(Base):
                pass

            NOT_A_CLASS = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_a_lazy_entry_is_imported_on_first_use_only(plugin_module: str) -> None:
    reg: Registry[type[Base]] = Registry("widget", base=Base)
    reg.register("lazy", f"{plugin_module}:Plugin")
    # Registering, listing and checking the name import nothing.
    assert reg.names() == ["lazy"] and "lazy" in reg
    reg.check("lazy")
    assert plugin_module not in sys.modules
    cls = reg.get("lazy")
    assert plugin_module in sys.modules
    assert cls.__name__ == "Plugin" and issubclass(cls, Base)
    assert reg.get("lazy") is cls


def test_a_duplicate_name_is_refused_and_the_first_entry_kept() -> None:
    reg: Registry[type[Base]] = Registry("widget", base=Base)
    reg.register("a", Impl)
    with pytest.raises(InvalidArgument, match=r"widget 'a' is registered already \(as .*Impl\)"):
        reg.register("a", "somewhere.else:Other")
    assert reg.get("a") is Impl


def test_an_unknown_name_lists_the_known_ones() -> None:
    reg: Registry[type[Base]] = Registry("widget")
    reg.register("b", Impl)
    reg.register("a", Impl)
    with pytest.raises(InvalidArgument, match=r"^unknown widget 'c'; known: a, b$"):
        reg.get("c")
    with pytest.raises(InvalidArgument, match="unknown widget 'c'"):
        reg.check("c")


def test_bad_entries_are_clear_errors(plugin_module: str) -> None:
    reg: Registry[type[Base]] = Registry("widget", base=Base)
    for name, target in (("", "m:C"), ("x", "no_colon"), ("y", ":C"), ("z", "m:")):
        with pytest.raises(InvalidArgument):
            reg.register(name, target)
    with pytest.raises(InvalidArgument, match="is not a Base"):
        reg.register("plain", int)  # type: ignore[arg-type]
    reg.register("number", f"{plugin_module}:NOT_A_CLASS")
    with pytest.raises(InvalidArgument, match="is not a Base"):
        reg.get("number")
    reg.register("absent", f"{plugin_module}:Nothing")
    with pytest.raises(InvalidArgument, match="has no 'Nothing'"):
        reg.get("absent")


def test_a_missing_dependency_names_what_to_install() -> None:
    reg: Registry[object] = Registry("widget")
    reg.register("gone", "kvdepot_no_such_module:X", needs="gizmo: pip install gizmo")
    with pytest.raises(Unavailable, match=r"widget 'gone' needs gizmo: pip install gizmo \("):
        reg.get("gone")
    strict: Registry[object] = Registry("widget", missing=InvalidArgument)
    strict.register("gone", "kvdepot_no_such_module:X")
    with pytest.raises(InvalidArgument, match="widget 'gone' cannot be loaded"):
        strict.get("gone")


def test_a_copy_changes_apart_from_its_original() -> None:
    reg: Registry[type[Base]] = Registry("widget")
    reg.register("a", Impl)
    other = reg.copy()
    other.register("b", Impl)
    assert reg.names() == ["a"] and other.names() == ["a", "b"]


def test_every_plugin_point_uses_it_and_refuses_duplicates() -> None:
    points: list[tuple[Registry[object], str]] = [
        (TIERS, "cpu"),  # type: ignore[list-item]
        (POLICIES, "lru"),  # type: ignore[list-item]
        (BACKENDS, "memory"),  # type: ignore[list-item]
        (TRANSPORTS, "tcp"),  # type: ignore[list-item]
        (CODECS, "none"),  # type: ignore[list-item]
    ]
    for registry, builtin in points:
        assert isinstance(registry, Registry)
        with pytest.raises(InvalidArgument, match="registered already"):
            registry.register(builtin, "kvdepot.registry:Registry")
