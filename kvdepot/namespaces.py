"""Namespaces as data: the fields a process registers with the metadata
service, and how two namespaces differ.

A namespace is named by its digest (hex). Its fields are what went into the
digest, as the process that uses it describes them; a cache salt, which may
be a tenant's secret, only by a digest of it. ``kvdepot namespaces`` and
``kvdepot explain`` compare them field by field.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping

from kvdepot.keys import Namespace

_LAYOUT_PARTS = {
    "bs": "block_size",
    "L": "layers",
    "H": "kv_heads",
    "D": "head_size",
    "sw": "sliding_window",
}
_LAYOUT_PART = re.compile(r"^(bs|L|H|D|sw)(\d+)$")

FIELD_ORDER = (
    "model",
    "model_source",
    "kv_dtype",
    "chunk_tokens",
    "block_size",
    "layers",
    "kv_heads",
    "head_size",
    "sliding_window",
    "layout",
    "tp_size",
    "tp_rank",
    "codec",
    "cache_salt",
    "extra",
)
"""Fields in the order they are shown (others follow, sorted)."""
INFO_FIELDS = frozenset({"model_source"})
"""Fields that describe a namespace without going into its digest: never
named as a difference."""


def salt_digest(salt: str) -> str:
    """How a cache salt is named outside the engine: a short digest of it."""
    return f"sha256:{hashlib.sha256(salt.encode()).hexdigest()[:8]}" if salt else ""


def namespace_fields(
    ns: Namespace,
    *,
    cache_salt: str = "",
    model_source: str = "",
    codec: str = "",
) -> dict[str, str]:
    """The fields of ``ns`` to register: its layout signature split into its
    parts (so a differing block size is named as such), ``cache_salt`` (an
    entry of ``ns.extra``) by its digest, ``codec`` named apart from the
    other extra entries."""
    fields = {
        "model": ns.model,
        "kv_dtype": ns.kv_dtype,
        "chunk_tokens": str(ns.chunk_tokens),
        "tp_size": str(ns.tp_size),
        "tp_rank": str(ns.tp_rank),
        "cache_salt": salt_digest(cache_salt),
    }
    if model_source:
        # Without the time it took to identify (it varies run to run).
        fields["model_source"] = re.sub(r"; [0-9.]+ m?s$", "", model_source)
    rest: list[str] = []
    for part in ns.kv_layout.split(":"):
        m = _LAYOUT_PART.match(part)
        if m:
            fields[_LAYOUT_PARTS[m.group(1)]] = m.group(2)
        else:
            rest.append(part)
    fields["layout"] = ":".join(rest)
    skip = {cache_salt} if cache_salt else set()
    if codec:
        fields["codec"] = codec
        skip.update(e for e in ns.extra if codec in e)
    fields["extra"] = ",".join(e for e in ns.extra if e not in skip)
    return fields


def ordered(names: set[str] | list[str]) -> list[str]:
    """Field names in display order."""
    known = [n for n in FIELD_ORDER if n in names]
    return known + sorted(n for n in names if n not in FIELD_ORDER)


def differing_fields(a: Mapping[str, str], b: Mapping[str, str]) -> list[str]:
    """The fields whose values differ between ``a`` and ``b`` (a field one
    lacks counts as empty), in display order."""
    names = (set(a) | set(b)) - INFO_FIELDS
    return ordered({n for n in names if a.get(n, "") != b.get(n, "")})
