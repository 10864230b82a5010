"""Loading of the typed component configs: CLI flags > ``KVDEPOT_*`` env > file.

Each component owns one frozen dataclass that documents its fields and
declares what each accepts (:func:`setting` with a :class:`Rule`); its
``__post_init__`` calls :func:`validate` first, so a value meets the same
rules whether it came from a flag, the environment, a file or code. Only
entry points (the CLI) call :func:`load_config`, passing the environment in
explicitly: core code never reads ``os.environ``.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import tomllib
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

from kvdepot.errors import InvalidArgument

T = TypeVar("T")

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1 << 40,
    "tib": 1 << 40,
}

RULE = "kvdepot.rule"
"""Key of a field's :class:`Rule` in its ``dataclasses.field`` metadata."""

FLAG = "kvdepot.flag"
"""Key of a field's :class:`Flag` (its command-line option) in its metadata."""

FILE_TABLES = ("metadata", "store", "security")
"""The tables a ``--config`` file may hold; any other is a typo."""

ENV_NOT_SETTINGS = ("KVDEPOT_LOG_FORMAT", "KVDEPOT_IMAGE", "KVDEPOT_TOKEN_FILE")
"""``KVDEPOT_*`` variables that are no component setting but are read elsewhere:
the log format (the CLI itself) and the compose file's image and token file."""

ENV_NOT_SETTINGS_PREFIXES = ("KVDEPOT_TEST_", "KVDEPOT_FUZZ_")
"""Prefixes of variables that tune the test suite, never a daemon."""


_NO_VALUE: Any = object()


class InvalidSetting(InvalidArgument):
    """A setting has a value it cannot work with; fix that setting.

    Attributes:
        settings: The settings concerned, the one to fix first; a message
            names them by field, and :func:`load_config` says where each
            value came from (flag, environment variable, file).
        problem: What is wrong, without the setting's name.
    """

    def __init__(
        self,
        settings: str | tuple[str, ...],
        problem: str,
        value: Any = _NO_VALUE,
        *,
        message: str = "",
    ) -> None:
        self.settings = (settings,) if isinstance(settings, str) else settings
        self.problem = problem
        shown = "" if value is _NO_VALUE else f" {value!r}"
        super().__init__(message or f"{self.settings[0]}{shown}: {problem}")


# -- rules: what each setting accepts ---------------------------------------------
@dataclass(frozen=True, slots=True)
class Rule:
    """What values a setting accepts, beyond its type (see :func:`validate`)."""

    def check(self, value: Any) -> str | None:
        """Why ``value`` is refused, or ``None`` when it is fine."""
        return None


@dataclass(frozen=True, slots=True)
class Number(Rule):
    """A finite number within ``[low, high]`` (an end left open excludes it)."""

    low: float | None = 0
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def check(self, value: Any) -> str | None:
        if not math.isfinite(value) or not self._inside(value):
            return f"must be {self.describe()}"
        return None

    def _inside(self, value: float) -> bool:
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return not (
            self.high is not None and (value > self.high or (self.high_open and value == self.high))
        )

    def describe(self) -> str:
        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {self.low:g}")
        if self.high is not None:
            parts.append(f"{'<' if self.high_open else '<='} {self.high:g}")
        return "a finite number " + " and ".join(parts) if parts else "a finite number"


def positive() -> Number:
    return Number(low=0, low_open=True)


@dataclass(frozen=True, slots=True)
class Port(Rule):
    """A TCP port; 0 picks a free one."""

    def check(self, value: Any) -> str | None:
        return None if 0 <= value <= 65535 else "must be a port from 0 to 65535 (0 picks one)"


@dataclass(frozen=True, slots=True)
class Choice(Rule):
    """One of a few words."""

    values: tuple[str, ...] = ()

    def check(self, value: Any) -> str | None:
        return None if value in self.values else f"must be one of {', '.join(self.values)}"


@dataclass(frozen=True, slots=True)
class Directory(Rule):
    """A directory a daemon creates if missing, but only its last component:
    a missing parent is a mistyped path, not a tree to make."""

    def check(self, value: Any) -> str | None:
        if not value:
            return None
        path = Path(value)
        if path.exists():
            return None if path.is_dir() else "is not a directory"
        parent = path.absolute().parent
        if not parent.is_dir():
            return f"cannot be created: its parent {parent} is not a directory"
        return None


@dataclass(frozen=True, slots=True)
class FilePath(Rule):
    """A file a daemon creates: its directory must exist."""

    def check(self, value: Any) -> str | None:
        if not value:
            return None
        path = Path(value)
        if path.is_dir():
            return "is a directory, not a file"
        parent = path.absolute().parent
        return None if parent.is_dir() else f"cannot be created: {parent} is not a directory"


@dataclass(frozen=True, slots=True)
class Parsed(Rule):
    """A value that ``parse`` accepts (it raises :class:`InvalidArgument` otherwise)."""

    parse: Callable[[Any], object] | None = None

    def check(self, value: Any) -> str | None:
        if self.parse is None:
            return None
        try:
            self.parse(value)
        except InvalidArgument as exc:
            return str(exc)
        return None


@dataclass(frozen=True, slots=True)
class Flag:
    """The command-line option of a setting (see :func:`setting`).

    Attributes:
        name: The option, e.g. ``--lease-ttl``. A boolean setting's option
            takes no value and sets the opposite of the default (``--no-shm``).
            A name with a space or ending in ``=`` is one form of an option
            several settings share (``--watermarks cpu=``), which its command
            declares and parses itself.
        help: The line ``--help`` shows.
        metavar: The value's name in ``--help``; empty: argparse's.
        group: The ``--help`` section it is listed under; empty: the command's own.
    """

    name: str
    help: str = ""
    metavar: str = ""
    group: str = ""

    @property
    def shared(self) -> bool:
        """Whether this is one form of an option several settings share."""
        return " " in self.name or self.name.endswith("=")

    @property
    def dest(self) -> str:
        """The attribute argparse stores the option's value under."""
        return self.name[2:].replace("-", "_")


def setting(
    default: T,
    rule: Rule | None = None,
    *,
    flag: str = "",
    help: str = "",
    metavar: str = "",
    group: str = "",
) -> T:
    """A config dataclass field: its default, the :class:`Rule` it obeys and,
    when ``flag`` is given, its command-line option (a :class:`Flag`)."""
    metadata: dict[str, Any] = {}
    if rule is not None:
        metadata[RULE] = rule
    if flag:
        metadata[FLAG] = Flag(flag, help, metavar, group)
    out: Any = dataclasses.field(default=default, metadata=metadata)
    return cast(T, out)


def flags_of(cls: type) -> dict[str, Flag]:
    """The command-line option of each setting of ``cls`` that has one, in field order."""
    return {f.name: f.metadata[FLAG] for f in dataclasses.fields(cls) if FLAG in f.metadata}


_SCALARS = (bool, int, float, str)


def _base_type(hint: Any) -> tuple[Any, bool]:
    """The type of a field's values and whether it may be ``None``."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return (args[0] if len(args) == 1 else None), True
    return hint, False


def _type_problem(value: Any, typ: Any) -> str | None:
    if typ is bool:
        return None if isinstance(value, bool) else "must be true or false"
    if typ is int:
        return (
            None
            if isinstance(value, int) and not isinstance(value, bool)
            else ("must be an integer")
        )
    if typ is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else "must be a number"
    if typ is str:
        return None if isinstance(value, str) else "must be a string"
    return None


def validate(config: object) -> None:
    """Check every field of a config dataclass against its type and rule.

    Called first in each config's ``__post_init__``, so flags, environment,
    file and code that builds a config all meet the same rules.

    Raises:
        InvalidSetting: The first field whose value does not do, named.
    """
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):  # type: ignore[arg-type]
        value = getattr(config, f.name)
        typ, optional = _base_type(hints[f.name])
        if value is None and optional:
            continue
        problem = _type_problem(value, typ)
        rule = f.metadata.get(RULE)
        if problem is None and rule is not None:
            problem = rule.check(value)
        if problem is None and typ is float and not math.isfinite(value):
            problem = "must be a finite number"
        if problem is not None:
            raise InvalidSetting(f.name, problem, value)


def settings_of(cls: type) -> dict[str, tuple[Any, Rule | None]]:
    """The settings of a config dataclass that flags, environment and files set:
    name -> (value type, rule). Fields of other types (a nested config) are left out."""
    hints = typing.get_type_hints(cls)
    out: dict[str, tuple[Any, Rule | None]] = {}
    for f in dataclasses.fields(cls):
        typ, _ = _base_type(hints[f.name])
        if typ in _SCALARS or typing.get_origin(typ) is tuple:
            out[f.name] = (typ, f.metadata.get(RULE))
    return out


# -- parsing the text of a setting ----------------------------------------------------
def parse_size(text: str | int | float) -> int:
    """Parse ``"512MiB"``, ``"2g"`` or ``1048576`` into bytes (binary units)."""
    if isinstance(text, bool):
        raise InvalidArgument(f"bad size {text!r}: use e.g. 512MiB, 4GiB or a byte count")
    if isinstance(text, int):
        return text
    if isinstance(text, float):
        if not text.is_integer():
            raise InvalidArgument(f"bad size {text!r}: a byte count is a whole number")
        return int(text)
    if not isinstance(text, str):
        raise InvalidArgument(f"bad size {text!r}: use e.g. 512MiB, 4GiB or a byte count")
    s = text.strip().lower().replace("_", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz ")
    unit = s[len(num) :].strip()
    if unit not in _UNITS or not num:
        raise InvalidArgument(f"bad size {text!r}: use e.g. 512MiB, 4GiB or a byte count")
    try:
        value = float(num)
    except ValueError:
        raise InvalidArgument(f"bad size {text!r}") from None
    if not math.isfinite(value):
        raise InvalidArgument(f"bad size {text!r}: use e.g. 512MiB, 4GiB or a byte count")
    return int(value * _UNITS[unit])


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _coerce(value: Any, typ: Any, name: str) -> Any:
    """``value`` (text from a flag or the environment, or a file's value) as ``typ``.

    Raises:
        InvalidSetting: It is not a value of that type.
    """
    base, optional = _base_type(typ)
    if optional and (value is None or value == ""):
        return None
    if typing.get_origin(base) is tuple:
        if isinstance(value, str):
            value = [v for v in (p.strip() for p in value.split(",")) if v]
        if not isinstance(value, (list, tuple)):
            raise InvalidSetting(name, "must be a list", value)
        return tuple(str(v) for v in value)
    if isinstance(value, (dict, list, tuple)):
        raise InvalidSetting(name, "must be a single value, not a table or list", value)
    if base is bool:
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        if not isinstance(value, bool):
            raise InvalidSetting(name, "must be true or false", value)
        return value
    if base in (int, float) and isinstance(value, bool):
        raise InvalidSetting(name, "must be a number, not true or false", value)
    if base is int:
        if name.endswith("_bytes"):
            try:
                return parse_size(value)
            except InvalidArgument as exc:
                raise InvalidSetting(name, str(exc), value) from None
        if isinstance(value, float) and value.is_integer():
            return int(value)
        try:
            if isinstance(value, (int, str)):
                return int(value)
        except ValueError:
            pass
        raise InvalidSetting(name, "must be an integer", value)
    if base is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise InvalidSetting(name, "must be a number", value) from None
    if base is str:
        return value if isinstance(value, str) else str(value)
    return value


# -- loading ------------------------------------------------------------------------
def _read_file(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_text()
    except OSError as exc:
        raise InvalidArgument(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        data = json.loads(raw) if path.suffix == ".json" else tomllib.loads(raw)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise InvalidArgument(f"bad config file {path}: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidArgument(f"bad config file {path}: it must hold tables")
    return data


def _file_section(path: Path, section: str | None, fields: Mapping[str, Any]) -> dict[str, Any]:
    data = _read_file(path)
    if section is None:
        unknown = set(data) - set(fields)
        if unknown:
            raise InvalidArgument(f"unknown keys in {path}: {', '.join(sorted(unknown))}")
        return data
    tables = set(data) - set(FILE_TABLES)
    if tables:
        raise InvalidArgument(
            f"unknown table [{sorted(tables)[0]}] in {path}: the tables are "
            + ", ".join(f"[{t}]" for t in FILE_TABLES)
        )
    table = data.get(section, {})
    if not isinstance(table, dict):
        raise InvalidArgument(f"[{section}] in {path} must be a table")
    unknown = set(table) - set(fields)
    if unknown:
        raise InvalidArgument(
            f"unknown keys in [{section}] of {path}: {', '.join(sorted(unknown))}"
        )
    return dict(table)


def load_config(
    cls: type[T],
    *,
    prefix: str,
    env: Mapping[str, str] | None = None,
    file: str | Path | None = None,
    section: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    flags: Mapping[str, str] | None = None,
) -> T:
    """Build a config dataclass from a file, the environment and CLI overrides.

    Args:
        cls: The config dataclass.
        prefix: Environment prefix, e.g. ``"KVDEPOT_STORE_"``.
        env: The environment to read (the caller passes ``os.environ``).
        file: Optional TOML or JSON file.
        section: Table of the file to read (e.g. ``"store"``); whole file if absent.
        overrides: Values from CLI flags; ``None`` values are ignored.
        flags: The flag of each setting in ``overrides`` (``lease_ttl_s`` ->
            ``--lease-ttl``), to name it in errors as the user wrote it.

    Raises:
        InvalidSetting: A value that does not do, named by where it came from
            (the flag, the variable or the file's key).
        InvalidArgument: An unreadable file, or unknown tables or keys in it.
    """
    hints = typing.get_type_hints(cls)
    fields = settings_of(cls)
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    if file is not None:
        path = Path(file)
        for name, value in _file_section(path, section, fields).items():
            values[name] = value
            where = f"[{section}] of {path}" if section else str(path)
            origin[name] = f"{name} = {value!r} in {where}"
    for name in fields:
        key = prefix + name.upper()
        if env is not None and key in env:
            values[name] = env[key]
            origin[name] = f"{key}={env[key]}"
    for name, value in (overrides or {}).items():
        if value is not None and name in hints:
            values[name] = value
            flag = (flags or {}).get(name)
            if flag:
                origin[name] = f"{flag}{value}" if flag.endswith("=") else f"{flag} {value}"
            else:
                origin[name] = f"{name} {value!r}"
    try:
        coerced = {k: _coerce(v, hints[k], k) for k, v in values.items()}
        return cls(**coerced)
    except InvalidSetting as exc:
        named = next((origin[s] for s in exc.settings if s in origin), None)
        if named is None:
            raise
        raise InvalidSetting(exc.settings, exc.problem, message=f"{named}: {exc.problem}") from None


def check_environment(env: Mapping[str, str], scopes: Mapping[str, type]) -> None:
    """Refuse a ``KVDEPOT_*`` variable that names no setting (a typo would be ignored).

    Args:
        env: The environment (the entry point passes ``os.environ``).
        scopes: Each environment prefix and the config dataclass it sets,
            e.g. ``{"KVDEPOT_STORE_": StoreConfig, "KVDEPOT_": SecurityConfig}``.

    Raises:
        InvalidSetting: The first such variable, with the closest setting's name.
    """
    known = set(ENV_NOT_SETTINGS)
    for prefix, cls in scopes.items():
        known.update(prefix + name.upper() for name in settings_of(cls))
    for key in sorted(env):
        if not key.startswith("KVDEPOT_") or key in known:
            continue
        if key.startswith(ENV_NOT_SETTINGS_PREFIXES):
            continue
        close = difflib.get_close_matches(key, sorted(known), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise InvalidSetting(key, f"names no kvdepot setting{hint}; unset it or fix its name")
