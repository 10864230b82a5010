"""Placement of new chunks on store nodes, under churn.

A chunk goes to the writer's own node when it has one (publishing locally is
the cheapest path, and its store makes room by LRU eviction). Otherwise to
the node with the most room left, where room is the free bytes it reported
minus what this put and recent puts already placed there, so that a burst of
puts spreads instead of filling one node before its next heartbeat.

Two rules keep churn from hurting (in Mooncake an empty node that rejoins a
full cluster takes every new write, since it has the most free space, and
times out under it):

- a node *warming up* (registered less than ``warmup_s`` ago) takes at most
  ``warmup_share`` times its fair share (1 / number of nodes) of recent
  placements, never all of them;
- a node whose allocations failed recently (revoked by the writer, or never
  committed before they expired) is *backed off*: placed on only when no
  healthy node can take the chunk, until ``backoff_s`` after its last failure.

"Recent" decays with a half-life of ``window_s``. The state is per metadata
process: with several replicas over one Redis each applies the rules to the
puts it answers.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvdepot.errors import InvalidArgument
from kvdepot.types import NodeId, NodeInfo


@dataclass(frozen=True, slots=True)
class PlacementConfig:
    """How new chunks are spread over nodes.

    Attributes:
        warmup_s: A node registered less than this long ago is warming up.
        warmup_share: A warming node takes at most this multiple of its fair
            share (1 / nodes) of recent placements (at most all of them).
        backoff_s: A node is avoided this long after its last failed allocation.
        window_s: Half-life of "recent" placements and failures.
    """

    warmup_s: float = 30.0
    warmup_share: float = 1.5
    backoff_s: float = 10.0
    window_s: float = 5.0

    def __post_init__(self) -> None:
        if self.warmup_s < 0 or self.backoff_s < 0 or self.window_s <= 0:
            raise InvalidArgument("placement warmup_s and backoff_s must be >= 0, window_s > 0")
        if self.warmup_share < 1:
            raise InvalidArgument("placement warmup_share must be at least 1 (the fair share)")


@dataclass(slots=True)
class _Recent:
    """Decaying counts of one node's recent placements."""

    chunks: float = 0.0
    nbytes: float = 0.0
    # All nodes' placements counted when it joined: placements since then are
    # the total less this (both decay alike).
    base: float = 0.0
    at: float = 0.0  # when last decayed
    joined: float = field(default=-math.inf)  # when it registered (monotonic)
    failed_at: float = -math.inf


class Placement:
    """Chooses nodes for new chunks; fed with what happens to its choices.

    Args:
        config: The rules' settings.
        clock: Monotonic seconds (injected for tests).
    """

    def __init__(
        self, config: PlacementConfig | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config or PlacementConfig()
        self._clock = clock
        self._nodes: dict[NodeId, _Recent] = {}
        self._total = _Recent()

    def _recent(self, node_id: NodeId, now: float) -> _Recent:
        r = self._nodes.get(node_id)
        if r is None:
            r = self._nodes[node_id] = _Recent(at=now)
        self._decay(r, now)
        return r

    def _decay(self, r: _Recent, now: float) -> None:
        if now > r.at:
            f = 0.5 ** ((now - r.at) / self.config.window_s)
            r.chunks *= f
            r.nbytes *= f
            r.base *= f
            r.at = now

    # -- what happened ----------------------------------------------------------
    def joined(self, node_id: NodeId) -> None:
        """The node (re)registered: it warms up from now, with no history."""
        now = self._clock()
        self._decay(self._total, now)
        self._nodes[node_id] = _Recent(at=now, joined=now, base=self._total.chunks)

    def left(self, node_id: NodeId) -> None:
        self._nodes.pop(node_id, None)

    def placed(self, node_id: NodeId, size: int) -> None:
        now = self._clock()
        r = self._recent(node_id, now)
        r.chunks += 1
        r.nbytes += size
        self._decay(self._total, now)
        self._total.chunks += 1

    def failed(self, node_id: NodeId, count: int = 1) -> None:
        """``count`` allocations on the node were revoked or expired uncommitted."""
        if count > 0 and node_id in self._nodes:
            self._nodes[node_id].failed_at = self._clock()

    # -- choosing -----------------------------------------------------------------
    def choose(
        self,
        nodes: Sequence[NodeInfo],
        writer_node_id: NodeId,
        size: int,
    ) -> NodeInfo | None:
        """The node a new chunk of ``size`` bytes is written to (None: none fits).

        Nodes whose total capacity is below ``size`` can never hold the chunk.
        """
        fitting = [n for n in nodes if n.capacity_bytes == 0 or n.capacity_bytes >= size]
        for n in fitting:
            if n.node_id == writer_node_id:
                return n
        if not fitting:
            return None
        now = self._clock()
        healthy = [n for n in fitting if not self._backed_off(n.node_id, now)]
        candidates = [n for n in healthy or fitting if self._may_take(n.node_id, len(nodes), now)]
        return max(candidates or healthy or fitting, key=lambda n: self._room(n, now))

    def _room(self, n: NodeInfo, now: float) -> tuple[float, str]:
        """Free bytes it reported, less what was placed there since (about)."""
        r = self._nodes.get(n.node_id)
        recent = 0.0
        if r is not None:
            self._decay(r, now)
            recent = r.nbytes
        return n.free_bytes - recent, n.node_id

    def _backed_off(self, node_id: NodeId, now: float) -> bool:
        r = self._nodes.get(node_id)
        return r is not None and now - r.failed_at < self.config.backoff_s

    def _may_take(self, node_id: NodeId, node_count: int, now: float) -> bool:
        """Whether a warming node is still under its share of the placements
        made since it joined."""
        r = self._nodes.get(node_id)
        if r is None or now - r.joined >= self.config.warmup_s:
            return True
        self._decay(r, now)
        self._decay(self._total, now)
        share = min(1.0, self.config.warmup_share / max(1, node_count))
        return r.chunks < share * (self._total.chunks - r.base + 1)
