"""``kvdepot namespaces``: the namespaces in use, side by side.

Namespaces over the same model that differ in some field never share a
chunk: those fields are highlighted (``*`` in the table, ``differs_in`` in
JSON), since one of them is usually why a consumer sees no hits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvdepot.namespaces import differing_fields, ordered


def namespace_to_dict(n: Any) -> dict[str, Any]:
    """One ``NamespaceStats`` as JSON."""
    looked = n.hit_chunks + n.miss_chunks
    return {
        "name": n.name,
        "fields": {f.name: f.value for f in n.fields},
        "clients": list(n.clients),
        "chunks_stored": n.chunks_stored,
        "lookups": n.lookups,
        "hit_chunks": n.hit_chunks,
        "miss_chunks": n.miss_chunks,
        "hit_rate": n.hit_chunks / looked if looked else 0.0,
        "hit_tokens": n.hit_tokens,
        "served_tokens": n.served_tokens,
        "first_seen": n.first_seen,
        "last_seen": n.last_seen,
    }


def with_differences(namespaces: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each namespace with ``differs_in``: the fields in which it differs from
    another namespace over the same model (none: it is alone with its model)."""
    out = []
    for n in namespaces:
        model = n["fields"].get("model")
        differ: set[str] = set()
        for other in namespaces:
            if other is not n and model and other["fields"].get("model") == model:
                differ.update(differing_fields(n["fields"], other["fields"]))
        out.append({**n, "differs_in": ordered(differ)})
    return out


def render_namespaces(namespaces: Sequence[dict[str, Any]]) -> str:
    """The namespaces as columns, a field a row; ``*`` marks a field in which
    namespaces over the same model differ."""
    if not namespaces:
        return "(no namespaces registered)"
    names = ordered({f for n in namespaces for f in n["fields"]})
    header = ["", *(n["name"][:12] for n in namespaces)]
    rows = [header]
    for field in names:
        mark = "*" if any(field in n["differs_in"] for n in namespaces) else " "
        rows.append([f"{mark}{field}", *(n["fields"].get(field, "-") or "-" for n in namespaces)])
    rows.append([" clients", *(",".join(n["clients"]) or "-" for n in namespaces)])
    rows.append([" chunks stored", *(str(n["chunks_stored"]) for n in namespaces)])
    rows.append([" lookups", *(str(n["lookups"]) for n in namespaces)])
    rows.append([" hit rate", *(_rate(n) for n in namespaces)])
    rows.append([" tokens held/served", *(_tokens(n) for n in namespaces)])
    widths = [min(48, max(len(r[i]) for r in rows)) for i in range(len(header))]
    lines = [
        "  ".join(c[:w].ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    ]
    if any(n["differs_in"] for n in namespaces):
        lines.append("* namespaces over the same model differ here: their chunks are never shared")
    return "\n".join(lines)


def _rate(n: dict[str, Any]) -> str:
    looked = n["hit_chunks"] + n["miss_chunks"]
    return f"{100 * n['hit_rate']:.1f}% of {looked}" if looked else "-"


def _tokens(n: dict[str, Any]) -> str:
    return f"{n['hit_tokens']}/{n['served_tokens']}"


def namespace_lines(namespaces: Sequence[dict[str, Any]]) -> list[str]:
    """Per namespace, one line of ``kvdepot stats``: its hit rate."""
    lines = []
    for n in namespaces:
        f = n["fields"]
        what = ", ".join(v for v in (f.get("model"), f.get("kv_dtype")) if v)
        lines.append(
            f"namespace {n['name'][:12]} ({what or 'no fields registered'}): hit rate {_rate(n)} "
            f"chunks, tokens held {n['hit_tokens']} / served {n['served_tokens']}"
        )
    return lines
