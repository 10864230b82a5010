"""``kvdepot explain``: why each chunk of a prompt hits or misses.

The prompt's chunk keys are computed in the engine's namespace (named by
its digest, or computed from its settings) and the metadata service's
``Explain`` says, per key, where it is or why it left. A chunk it knows
nothing of is looked for under every other registered namespace: found
there, the miss is a settings mismatch, and the fields that differ say
which setting.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvdepot.errors import InvalidArgument
from kvdepot.keys import ChunkKey, seeded_chunk_keys
from kvdepot.namespaces import differing_fields
from kvdepot.proto.gen import metadata_pb2

REASONS = {
    metadata_pb2.Departure.REASON_UNSPECIFIED: "removed",
    metadata_pb2.Departure.EVICTED: "evicted",
    metadata_pb2.Departure.NODE_LOST: "node_lost",
    metadata_pb2.Departure.CORRUPT: "corrupt",
    metadata_pb2.Departure.TIER_FAILED: "tier_failed",
    metadata_pb2.Departure.REVOKED: "revoked",
    metadata_pb2.Departure.EXPIRED: "expired",
}


class Explainer(Protocol):
    """What explaining needs of a client (``KVDepotClient`` has it)."""

    def namespaces(self) -> metadata_pb2.ListNamespacesResponse: ...

    def explain(self, keys: Sequence[bytes]) -> metadata_pb2.ExplainResponse: ...


@dataclass(frozen=True, slots=True)
class ChunkAnswer:
    """One chunk's answer (``kvdepot explain --json``: one object each)."""

    index: int
    status: str  # "hit" or "miss"
    reason: str = ""  # a miss's, or "not_leading" for a hit after a miss
    node: str = ""
    tier: str = ""
    at: float | None = None  # when it left (wall clock)
    namespace: str = ""  # another namespace that holds it
    differs_in: tuple[str, ...] = ()
    key: bytes = b""  # its key in the namespace explained
    committed_at: float | None = None  # a hit's commit on its node (wall clock)

    def to_dict(self, now: float | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index, "status": self.status, "reason": self.reason}
        for name in ("node", "tier", "namespace"):
            if getattr(self, name):
                out[name] = getattr(self, name)
        if self.at is not None:
            out["at"] = self.at
        if self.committed_at is not None:
            now = time.time() if now is None else now
            out["committed_at"] = self.committed_at
            out["age_s"] = round(max(0.0, now - self.committed_at), 3)
        if self.key:
            out["key"] = self.key.hex()
        if self.namespace:
            out["differs_in"] = list(self.differs_in)
        return out


@dataclass(frozen=True, slots=True)
class Explanation:
    """A prompt's chunks in one namespace."""

    namespace: str
    chunk_tokens: int
    chunks: tuple[ChunkAnswer, ...]
    leading_hits: int  # chunks an engine with these settings would load
    # Other namespaces' leading hits for this prompt (name -> chunks, tokens).
    elsewhere: Mapping[str, tuple[int, int]] = field(default_factory=dict)


def _leading(present: Sequence[bool]) -> int:
    n = 0
    for p in present:
        if not p:
            break
        n += 1
    return n


def _registered(client: Explainer) -> dict[str, dict[str, str]]:
    return {n.name: {f.name: f.value for f in n.fields} for n in client.namespaces().namespaces}


def _other_holders(
    client: Explainer, tokens: Sequence[int], target: str, known: Mapping[str, Mapping[str, str]]
) -> dict[str, tuple[int, int]]:
    """Per other namespace that holds a leading part of the prompt: (chunks, tokens)."""
    found: dict[str, tuple[int, int]] = {}
    for name, fields in known.items():
        c = int(fields.get("chunk_tokens") or 0)
        if name == target or c < 1 or fields.get("key_scheme"):
            continue  # (keys not chained from the namespace: LMCache's)
        keys = seeded_chunk_keys(bytes.fromhex(name), c, tokens)
        if not keys:
            continue
        reply = client.explain(keys)
        lead = _leading([bool(k.replicas) for k in reply.keys])
        if lead:
            found[name] = (lead, lead * c)
    return found


def _miss(
    i: int,
    k: metadata_pb2.KeyExplanation,
    end: int,
    held_before: int,
    elsewhere: Mapping[str, tuple[int, int]],
    differs: Mapping[str, tuple[str, ...]],
) -> ChunkAnswer:
    if k.HasField("departure"):
        d = k.departure
        return ChunkAnswer(i, "miss", REASONS.get(d.reason, "removed"), d.node_id, d.tier, d.at)
    # Chunk i ends at token `end`: another namespace covering it holds it.
    for name, (_, covered) in sorted(elsewhere.items(), key=lambda x: -x[1][1]):
        if covered >= end:
            return ChunkAnswer(
                i, "miss", "other_namespace", namespace=name, differs_in=differs[name]
            )
    if held_before:
        return ChunkAnswer(i, "miss", "shorter_prompt")
    return ChunkAnswer(i, "miss", "never_published")


def explain_prompt(
    client: Explainer,
    tokens: Sequence[int],
    namespace: str,
    *,
    chunk_tokens: int = 0,
    fields: Mapping[str, str] | None = None,
) -> Explanation:
    """Explain the chunks of ``tokens`` in ``namespace`` (a digest in hex).

    Args:
        client: The metadata service's client.
        tokens: The prompt's token ids.
        namespace: The engine's namespace.
        chunk_tokens: Its tokens per chunk; 0: as registered.
        fields: Its fields, where it is not registered (computed from an
            engine's settings); else as registered.

    Raises:
        InvalidArgument: An unknown namespace whose chunk size is not given.
    """
    known = _registered(client)
    mine = dict(fields or known.get(namespace) or {})
    c = chunk_tokens or int(mine.get("chunk_tokens") or 0)
    if c < 1:
        raise InvalidArgument(
            f"namespace {namespace} is not registered: give its settings "
            "(--kv-transfer-config and --model) or --chunk-tokens"
        )
    try:
        seed = bytes.fromhex(namespace)
    except ValueError:
        raise InvalidArgument(f"--namespace {namespace!r} is not a digest in hex") from None
    keys: list[ChunkKey] = seeded_chunk_keys(seed, c, tokens)
    reply = client.explain(keys) if keys else metadata_pb2.ExplainResponse()
    present = [bool(k.replicas) for k in reply.keys]
    lead = _leading(present)
    elsewhere: dict[str, tuple[int, int]] = {}
    if lead < len(keys):
        elsewhere = _other_holders(client, tokens, namespace, known)
    differs = {n: tuple(differing_fields(mine, known.get(n, {}))) for n in elsewhere}
    answers = []
    for i, k in enumerate(reply.keys):
        if k.replicas:
            r = k.replicas[0]
            answers.append(
                ChunkAnswer(i, "hit", "" if i < lead else "not_leading", r.node_id, r.tier)
            )
        else:
            answers.append(_miss(i, k, (i + 1) * c, sum(present[:i]), elsewhere, differs))
    answers = [dataclasses.replace(a, key=bytes(k)) for a, k in zip(answers, keys, strict=True)]
    return Explanation(namespace, c, tuple(answers), lead, elsewhere)


Describe = Callable[[str, Sequence[bytes]], Sequence[tuple[str, float] | None]]
"""Asks node ``node_id`` about keys: per key (tier, commit time; 0 if not
known) where it holds it, else None (``Store.DescribeChunks``)."""


def with_ages(e: Explanation, describe: Describe) -> Explanation:
    """The hits of ``e`` with when their node committed them (their age), and
    the tier they are in now; a node that cannot say leaves them as they are."""
    by_node: dict[str, list[int]] = {}
    for i, a in enumerate(e.chunks):
        if a.status == "hit" and a.key:
            by_node.setdefault(a.node, []).append(i)
    chunks = list(e.chunks)
    for node, idx in by_node.items():
        found = describe(node, [chunks[i].key for i in idx])
        if len(found) != len(idx):
            continue
        for i, d in zip(idx, found, strict=True):
            if d is not None:
                tier, at = d
                chunks[i] = dataclasses.replace(
                    chunks[i], tier=tier or chunks[i].tier, committed_at=at or None
                )
    return dataclasses.replace(e, chunks=tuple(chunks))


def _age(at: float | None, now: float) -> str:
    if at is None:
        return ""
    stamp = time.strftime("%H:%M:%S", time.gmtime(at))
    return f" at {stamp} UTC ({max(0.0, now - at):.0f} s ago)"


def _line(a: ChunkAnswer, now: float) -> str:
    if a.status == "hit":
        tail = "  (after a miss: not loaded)" if a.reason else ""
        age = _age(a.committed_at, now).replace(" at ", ", committed at ", 1)
        return f"chunk {a.index:>4}  hit   node {a.node}, tier {a.tier}{age}{tail}"
    why = {
        "evicted": f"evicted from {a.tier or 'a tier'} of node {a.node}{_age(a.at, now)}",
        "node_lost": f"lost with node {a.node}{_age(a.at, now)}",
        "corrupt": f"corrupt on node {a.node} ({a.tier or 'a tier'}), dropped{_age(a.at, now)}",
        "tier_failed": f"lost with a failed {a.tier or ''} tier of node {a.node}{_age(a.at, now)}",
        "revoked": f"its put to node {a.node} was revoked{_age(a.at, now)}",
        "expired": f"its put to node {a.node} was never committed{_age(a.at, now)}",
        "removed": f"removed from node {a.node}{_age(a.at, now)}",
        "other_namespace": (
            f"published under namespace {a.namespace[:12]}, which differs in "
            f"{', '.join(a.differs_in) or 'fields not registered'}"
        ),
        "shorter_prompt": "only a shorter prompt was published",
        "never_published": "never published in this namespace",
    }[a.reason]
    return f"chunk {a.index:>4}  miss  {why}"


def render_explanation(e: Explanation, now: float | None = None) -> str:
    now = time.time() if now is None else now
    lines = [f"namespace {e.namespace}, {e.chunk_tokens}-token chunks, {len(e.chunks)} chunks"]
    lines.extend(_line(a, now) for a in e.chunks)
    lines.append(
        f"an engine with these settings would load {e.leading_hits} leading chunks "
        f"({e.leading_hits * e.chunk_tokens} tokens)"
    )
    for name, (chunks, tokens) in sorted(e.elsewhere.items(), key=lambda x: -x[1][1]):
        lines.append(
            f"an engine with namespace {name[:12]}'s settings would load {chunks} leading "
            f"chunks ({tokens} tokens)"
        )
    return "\n".join(lines)


def explanation_to_json(e: Explanation, now: float | None = None) -> list[dict[str, Any]]:
    """``--json``: one object per chunk."""
    now = time.time() if now is None else now
    return [a.to_dict(now) for a in e.chunks]
