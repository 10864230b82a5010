"""KV-aware routing: score candidate engines by where a prompt's prefix lives.

A router asks "which of these engines should run this prompt?". Each candidate
engine is tied to one store node. For the prompt's chunk keys, the index knows
the leading run of keys that exist anywhere and, per key, the nodes holding it.
For one candidate, each of those leading keys is either *local* (a replica on
its own node: a shared-memory copy), *remote* (only on other nodes: pulled over
the network) or, past the leading run, *nowhere* (recomputed by prefill).

The score is the negated estimate of seconds until the candidate can start on
the prompt's new tokens::

    cost = remote_bytes / link_bytes_per_s
         + local_bytes / local_bytes_per_s
         + none_tokens / prefill_tokens_per_s
         + load * load_penalty_s

so a higher score is better, and scores of different prompts are comparable.
Everything here is a pure function of its inputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvdepot.errors import InvalidArgument
from kvdepot.types import LookupResult, NodeId

_MAX_CANDIDATES = 1024
_MAX_CANDIDATE_ID = 2048  # engine URLs


@dataclass(frozen=True, slots=True)
class RoutingWeights:
    """The constants of the cost model.

    Attributes:
        link_bytes_per_s: Network bandwidth of a pull from another node.
        local_bytes_per_s: Bandwidth of a load from the candidate's own node.
        prefill_tokens_per_s: Prefill throughput of one engine on uncached tokens.
        load_penalty_s: Seconds of queueing per unit of reported load
            (e.g. per in-flight request).
    """

    link_bytes_per_s: float = 12.5e9  # 100 Gb/s
    local_bytes_per_s: float = 50e9
    prefill_tokens_per_s: float = 10_000.0
    load_penalty_s: float = 0.05

    def __post_init__(self) -> None:
        speeds = (self.link_bytes_per_s, self.local_bytes_per_s, self.prefill_tokens_per_s)
        if not all(math.isfinite(v) for v in (*speeds, self.load_penalty_s)):
            raise InvalidArgument("routing weights must be finite numbers")
        if min(speeds) <= 0:
            raise InvalidArgument("link speed, local speed and prefill rate must be positive")
        if self.load_penalty_s < 0:
            raise InvalidArgument("load_penalty_s must not be negative")


@dataclass(frozen=True, slots=True)
class Candidate:
    """An engine a request may be routed to."""

    id: str
    node_id: NodeId
    load: float = 0.0


@dataclass(frozen=True, slots=True)
class RouteScore:
    """How much of the prompt one candidate finds where, and its score."""

    candidate_id: str
    local_tokens: int
    remote_tokens: int
    none_tokens: int
    remote_bytes: int
    estimated_s: float

    @property
    def score(self) -> float:
        """Higher is better: the negated estimated seconds."""
        return -self.estimated_s


def validate_candidates(candidates: Sequence[Candidate]) -> None:
    """Reject empty, oversized or duplicated candidate lists."""
    if not candidates:
        raise InvalidArgument("at least one candidate is required")
    if len(candidates) > _MAX_CANDIDATES:
        raise InvalidArgument(f"at most {_MAX_CANDIDATES} candidates per request")
    ids = [c.id for c in candidates]
    if any(not i for i in ids):
        raise InvalidArgument("every candidate needs an id")
    if any(len(i) > _MAX_CANDIDATE_ID for i in ids):
        raise InvalidArgument(f"candidate ids must be at most {_MAX_CANDIDATE_ID} characters")
    if len(set(ids)) != len(ids):
        raise InvalidArgument("candidate ids must be unique")
    if any(not math.isfinite(c.load) or c.load < 0 for c in candidates):
        raise InvalidArgument("candidate load must be a finite number, not negative")


def score_candidate(
    lookup: LookupResult,
    total_keys: int,
    tokens_per_key: int,
    candidate: Candidate,
    weights: RoutingWeights,
) -> RouteScore:
    """The split of the prompt into local, remote and missing tokens for one candidate."""
    local_keys = 0
    local_bytes = 0
    remote_bytes = 0
    for loc in lookup.locations[: lookup.hits]:
        if any(r.node_id == candidate.node_id for r in loc.replicas):
            local_keys += 1
            local_bytes += loc.size
        else:
            remote_bytes += loc.size
    remote_keys = lookup.hits - local_keys
    none_keys = max(0, total_keys - lookup.hits)
    estimated = (
        remote_bytes / weights.link_bytes_per_s
        + local_bytes / weights.local_bytes_per_s
        + none_keys * tokens_per_key / weights.prefill_tokens_per_s
        + candidate.load * weights.load_penalty_s
    )
    return RouteScore(
        candidate_id=candidate.id,
        local_tokens=local_keys * tokens_per_key,
        remote_tokens=remote_keys * tokens_per_key,
        none_tokens=none_keys * tokens_per_key,
        remote_bytes=remote_bytes,
        estimated_s=estimated,
    )


def score_candidates(
    lookup: LookupResult,
    total_keys: int,
    tokens_per_key: int,
    candidates: Sequence[Candidate],
    weights: RoutingWeights,
) -> list[RouteScore]:
    """One :class:`RouteScore` per candidate, in the candidates' order."""
    validate_candidates(candidates)
    if tokens_per_key < 0:
        raise InvalidArgument("tokens_per_key must not be negative")
    return [score_candidate(lookup, total_keys, tokens_per_key, c, weights) for c in candidates]


def best(scores: Sequence[RouteScore]) -> int:
    """Index of the best score; ties go to the earliest candidate."""
    if not scores:
        raise InvalidArgument("no scores to choose from")
    top = 0
    for i, s in enumerate(scores):
        if s.estimated_s < scores[top].estimated_s:
            top = i
    return top
