"""Loading of the typed component configs: CLI flags > ``KVDEPOT_*`` env > file.

Each component owns one frozen dataclass that documents and validates its own
fields. Only entry points (the CLI) call :func:`load_config`, passing the
environment in explicitly: core code never reads ``os.environ``.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from kvdepot.errors import InvalidArgument

T = TypeVar("T")

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
          "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
          "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


def parse_size(text: str | int) -> int:
    """Parse ``"512MiB"``, ``"2g"`` or ``1048576`` into bytes (binary units)."""
    if isinstance(text, int):
        return text
    s = text.strip().lower().replace("_", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz ")
    unit = s[len(num):].strip()
    if unit not in _UNITS or not num:
        raise InvalidArgument(f"bad size {text!r}: use e.g. 512MiB, 4GiB or a byte count")
    try:
        value = float(num)
    except ValueError:
        raise InvalidArgument(f"bad size {text!r}") from None
    return int(value * _UNITS[unit])


def _coerce(value: Any, typ: Any, name: str) -> Any:
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if value is None or value == "":
            return None
        return _coerce(value, args[0], name)
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in (p.strip() for p in value.split(",")) if v]
        return tuple(str(v) for v in value)
    try:
        if typ is bool:
            if isinstance(value, str):
                if value.lower() in ("1", "true", "yes", "on"):
                    return True
                if value.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(value)
            return bool(value)
        if typ is int:
            if name.endswith("_bytes"):
                return parse_size(value)
            return int(value)
        if typ is float:
            return float(value)
        if typ is str:
            return str(value)
    except (TypeError, ValueError):
        raise InvalidArgument(f"bad value for {name}: {value!r}") from None
    return value


def load_config(
    cls: type[T],
    *,
    prefix: str,
    env: Mapping[str, str] | None = None,
    file: str | Path | None = None,
    section: str | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> T:
    """Build a config dataclass from a file, the environment and CLI overrides.

    Args:
        cls: The config dataclass.
        prefix: Environment prefix, e.g. ``"KVDEPOT_STORE_"``.
        env: The environment to read (the caller passes ``os.environ``).
        file: Optional TOML or JSON file.
        section: Table of the file to read (e.g. ``"store"``); whole file if absent.
        overrides: Values from CLI flags; ``None`` values are ignored.

    Raises:
        InvalidArgument: unknown keys in the file or invalid values.
    """
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    values: dict[str, Any] = {}
    if file is not None:
        path = Path(file)
        try:
            raw = path.read_text()
        except OSError as exc:
            raise InvalidArgument(f"cannot read config file {path}: {exc.strerror}") from None
        try:
            data = json.loads(raw) if path.suffix == ".json" else tomllib.loads(raw)
        except (ValueError, tomllib.TOMLDecodeError) as exc:
            raise InvalidArgument(f"bad config file {path}: {exc}") from None
        if section is not None:
            data = data.get(section, {})
        unknown = set(data) - fields
        if unknown:
            raise InvalidArgument(f"unknown keys in {path}: {', '.join(sorted(unknown))}")
        values.update(data)
    for name in fields:
        key = prefix + name.upper()
        if env is not None and key in env:
            values[name] = env[key]
    for name, value in (overrides or {}).items():
        if value is not None and name in fields:
            values[name] = value
    coerced = {k: _coerce(v, hints[k], k) for k, v in values.items()}
    return cls(**coerced)


def split_address(address: str, default_port: int | None = None) -> tuple[str, int]:
    """Split ``"host:port"`` (or ``"[v6]:port"``) into host and port."""
    host, sep, port = address.rpartition(":")
    if not sep:
        if default_port is None:
            raise InvalidArgument(f"address {address!r} has no port")
        return address, default_port
    host = host.strip("[]")
    try:
        p = int(port)
    except ValueError:
        raise InvalidArgument(f"bad port in address {address!r}") from None
    if not host or not 0 < p < 65536:
        raise InvalidArgument(f"bad address {address!r}")
    return host, p
