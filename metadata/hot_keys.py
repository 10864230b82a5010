"""Hot chunks: more replicas for what many nodes read, and readers spread over them.

A shared system prompt's chunks are read by every engine of a cluster; with
one replica, every read crosses the network to the same store, which becomes
the bottleneck. The service watches which hit keys are read from nodes that
hold no replica of them (a bounded table of decaying counts, never one entry
per chunk of the index). A key read that way ``hot_reads`` times within
about a half-life ``window_s`` and held by fewer than ``max_replicas`` nodes
is marked in the lookup answer (``LookupResponse.replicate``); a reader with
a store of its own copies it there after reading it, and commits the copy
like any put: one more replica, on a reader's node. Meanwhile the replicas of
a key that are equally fast (same tier) are handed out in turn, so that
readers without a local copy spread over them.

The state is per metadata process (several replicas over one Redis each
count the lookups they answer): a hint is a suggestion, and a copy too many
is one more replica, never an error.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvdepot.errors import InvalidArgument
from kvdepot.keys import ChunkKey
from kvdepot.types import KeyLocation, LookupResult, NodeId


@dataclass(frozen=True, slots=True)
class HotKeysConfig:
    """When a chunk counts as hot, and what is done about it.

    Attributes:
        hot_reads: Reads from nodes without a replica, within about
            ``window_s``, that make a key hot; 0 turns replication hints off.
        max_replicas: A hot key is hinted for replication while it has fewer
            replicas than this.
        window_s: Half-life of the read counts.
        tracked: Keys counted at most (the least recently read are forgotten).
        leading: Keys counted per lookup, from the prompt's start: a prefix
            that many engines share leads their prompts, and counting a
            bounded number keeps a long prompt's lookup cheap.
    """

    hot_reads: int = 8
    max_replicas: int = 3
    window_s: float = 10.0
    tracked: int = 65536
    leading: int = 16

    def __post_init__(self) -> None:
        if self.hot_reads < 0 or self.max_replicas < 1 or min(self.tracked, self.leading) < 1:
            raise InvalidArgument(
                "hot_reads >= 0, and max_replicas, tracked and leading >= 1 are needed"
            )
        if self.window_s <= 0:
            raise InvalidArgument("hot key window_s must be positive")


@dataclass(slots=True)
class _Count:
    reads: float
    at: float
    hinted_until: float = 0.0  # a copy was asked for; not again before


class HotKeys:
    """Counts remote reads of hit keys; marks hot ones and spreads their readers.

    Args:
        config: Thresholds and bounds.
        clock: Monotonic seconds (injected for tests).
    """

    def __init__(
        self, config: HotKeysConfig | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config or HotKeysConfig()
        self._clock = clock
        self._counts: dict[ChunkKey, _Count] = {}
        self._turn = itertools.count()

    def __len__(self) -> int:
        return len(self._counts)

    def observe(
        self, keys: Sequence[ChunkKey], result: LookupResult, client_node_id: NodeId
    ) -> LookupResult:
        """``result`` with the replicas of multi-replica keys in turn and the
        hot keys marked (for a reader that has a node); counts this read."""
        locations = result.locations
        counted = self.config.leading if client_node_id and self.config.hot_reads else 0
        if not counted and all(len(loc.replicas) == 1 for loc in locations):
            return result  # one replica each, nothing to count: the common case
        now = self._clock()
        turn = next(self._turn)
        spread: list[KeyLocation] = []
        replicate: list[int] = []
        for i, loc in enumerate(locations):
            replicas = loc.replicas
            if replicas[0].node_id == client_node_id:
                spread.append(loc)  # the reader's own copy
                continue
            if len(replicas) > 1:
                loc = _in_turn(loc, turn)
            spread.append(loc)
            if i < counted and self._hot(keys[i], len(replicas), now):
                replicate.append(i)
        return LookupResult(result.hits, tuple(spread), tuple(replicate))

    def _hot(self, key: ChunkKey, replicas: int, now: float) -> bool:
        cfg = self.config
        if not cfg.hot_reads:
            return False
        c = self._counts.pop(key, None)  # re-inserted last: the most recently read
        if c is None:
            if len(self._counts) >= cfg.tracked:
                self._forget(cfg.tracked // 4)
            c = _Count(0.0, now)
        c.reads = c.reads * 0.5 ** ((now - c.at) / cfg.window_s) + 1
        c.at = now
        self._counts[key] = c
        if c.reads < cfg.hot_reads or replicas >= cfg.max_replicas or now < c.hinted_until:
            return False
        # One copy asked for at a time: the next hint waits until that copy
        # could have been committed and shown up in lookups.
        c.hinted_until = now + 1.0
        return True

    def _forget(self, count: int) -> None:
        for key in list(itertools.islice(self._counts, count)):
            del self._counts[key]


def _in_turn(loc: KeyLocation, turn: int) -> KeyLocation:
    """The location with its leading replicas of the same tier rotated by ``turn``."""
    replicas = loc.replicas
    tier = replicas[0].tier
    same = 1
    while same < len(replicas) and replicas[same].tier == tier:
        same += 1
    if same < 2:
        return loc
    k = turn % same
    return KeyLocation(loc.size, replicas[k:same] + replicas[:k] + replicas[same:])
