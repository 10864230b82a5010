"""Rendering of cluster statistics for ``kvdepot stats``."""

from __future__ import annotations

from typing import Any

from kvdepot.apps.namespaces import namespace_lines, namespace_to_dict, with_differences
from kvdepot.proto.gen import metadata_pb2


def _tier(t: Any) -> dict[str, Any]:
    return {
        "name": t.name,
        "capacity_bytes": t.capacity_bytes,
        "used_bytes": t.used_bytes,
        "chunks": t.chunks,
        "hits": t.hits,
        "misses": t.misses,
        "evictions": t.evictions,
        "promotions": t.promotions,
        "demotions": t.demotions,
    }


def _transfer(r: Any) -> dict[str, float]:
    return {
        "bytes_in_per_s": r.bytes_in_per_s,
        "bytes_out_per_s": r.bytes_out_per_s,
        "window_s": round(r.window_s, 3),
    }


def stats_to_dict(s: metadata_pb2.ClusterStats) -> dict[str, Any]:
    """The JSON shape of ``kvdepot stats --json``."""
    looked = s.hit_keys + s.miss_keys
    tokens = s.hit_tokens + s.miss_tokens
    return {
        "nodes": [
            {
                "node_id": n.node_id,
                "address": n.address,
                "grpc_address": n.grpc_address,
                # What the node holds (its last heartbeat's count, else its
                # tiers' report) next to what the index names it for: a gap
                # shows chunks lookups cannot reach, or name in vain, until
                # reconciliation closes it; in_sync: the digests were equal.
                "chunks_held": (
                    n.chunks_held if n.HasField("chunks_held") else sum(t.chunks for t in n.tiers)
                ),
                "chunks_indexed": n.chunks_indexed,
                "in_sync": n.in_sync if n.HasField("chunks_held") else None,
                "lease_remaining_s": round(n.lease_remaining_s, 3),
                "tiers": [_tier(t) for t in n.tiers],
                "transfer": _transfer(n.transfer),
            }
            for n in s.nodes
        ],
        "chunks": s.chunks,
        "lookups": s.lookups,
        "hit_keys": s.hit_keys,
        "miss_keys": s.miss_keys,
        # Held when asked: the leading tokens the index had when engines
        # looked them up; served: the tokens engines reported loading.
        "hit_tokens": s.hit_tokens,
        "miss_tokens": s.miss_tokens,
        "served_tokens": s.served_tokens,
        "hit_rate": (s.hit_keys / looked) if looked else 0.0,
        "token_hit_rate": (s.hit_tokens / tokens) if tokens else 0.0,
        "puts_committed": s.puts_committed,
        "bytes_committed": s.bytes_committed,
        "chunks_deduplicated": s.chunks_deduplicated,
        "bytes_saved": s.bytes_saved,
        "nodes_expired": s.nodes_expired,
        "allocations_expired": s.allocations_expired,
        # Recent data-plane throughput of all nodes (each over its last ~10 s).
        "transfer_bytes_in_per_s": sum(n.transfer.bytes_in_per_s for n in s.nodes),
        "transfer_bytes_out_per_s": sum(n.transfer.bytes_out_per_s for n in s.nodes),
        "namespaces": with_differences([namespace_to_dict(n) for n in s.namespaces]),
    }


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def gb_per_s(bytes_per_s: float) -> str:
    """Bytes per second as decimal GB/s, e.g. ``"1.250"``."""
    return f"{bytes_per_s / 1e9:.3f}"


_NO_TIER = {
    "name": "-",
    "capacity_bytes": 0,
    "used_bytes": 0,
    "chunks": 0,
    "hits": 0,
    "misses": 0,
    "evictions": 0,
}


def render_table(d: dict[str, Any]) -> str:
    """A fixed-width table of the nodes and the cluster counters."""
    rows = [
        (
            "node",
            "address",
            "tier",
            "capacity",
            "used",
            "use%",
            "chunks",
            "indexed",
            "sync",
            "hits",
            "misses",
            "evict",
            "promo",
            "demote",
            "in GB/s",
            "out GB/s",
        )
    ]
    for n in d["nodes"]:
        for i, t in enumerate(n["tiers"] or [_NO_TIER]):
            cap = t["capacity_bytes"]
            # Transfer rates and the chunks the index names the node for are
            # the node's, shown on its first tier's row.
            xfer = n.get("transfer") if i == 0 else None
            indexed = str(n.get("chunks_indexed", "")) if i == 0 else ""
            sync = "" if i or n.get("in_sync") is None else ("yes" if n["in_sync"] else "no")
            rows.append(
                (
                    n["node_id"],
                    n["address"],
                    t["name"],
                    human_bytes(cap),
                    human_bytes(t["used_bytes"]),
                    f"{100 * t['used_bytes'] / cap:.0f}%" if cap else "-",
                    str(t["chunks"]),
                    indexed,
                    sync,
                    str(t["hits"]),
                    str(t["misses"]),
                    str(t["evictions"]),
                    str(t.get("promotions", 0)),
                    str(t.get("demotions", 0)),
                    gb_per_s(xfer["bytes_in_per_s"]) if xfer else "",
                    gb_per_s(xfer["bytes_out_per_s"]) if xfer else "",
                )
            )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.append("")
    lines.append(
        f"chunks {d['chunks']}  lookups {d['lookups']}  "
        f"hit rate {100 * d['hit_rate']:.1f}% ({d['hit_keys']} hit / {d['miss_keys']} miss chunks)"
    )
    lines.append(
        f"committed {d['puts_committed']} chunks ({human_bytes(d['bytes_committed'])})  "
        f"deduplicated {d['chunks_deduplicated']} chunks, saved {human_bytes(d['bytes_saved'])}"
    )
    if "transfer_bytes_in_per_s" in d:
        lines.append(
            f"transfer (last ~10 s) in {gb_per_s(d['transfer_bytes_in_per_s'])} GB/s, "
            f"out {gb_per_s(d['transfer_bytes_out_per_s'])} GB/s"
        )
    if "served_tokens" in d:
        lines.append(
            f"tokens held when asked {d['hit_tokens']}, served to engines {d['served_tokens']}"
        )
    lines.extend(namespace_lines(d.get("namespaces", [])))
    if not d["nodes"]:
        lines.insert(0, "(no store nodes registered)")
    return "\n".join(lines)
