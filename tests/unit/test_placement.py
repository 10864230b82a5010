"""Placement under churn (metadata/placement.py): warm-up share and backoff."""

from __future__ import annotations

from collections import Counter

import pytest

from kvdepot.errors import InvalidArgument
from kvdepot.metadata.placement import Placement, PlacementConfig
from kvdepot.records import TierStats
from kvdepot.types import NodeInfo

MiB = 1 << 20


def node(node_id: str, capacity: int = 64 * MiB, used: int = 0) -> NodeInfo:
    return NodeInfo(node_id, f"{node_id}:1", "", (TierStats("cpu", capacity, used),))


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def place(p: Placement, nodes: list[NodeInfo], count: int, clock: Clock) -> Counter[str]:
    got: Counter[str] = Counter()
    for _ in range(count):
        chosen = p.choose(nodes, "", MiB)
        assert chosen is not None
        p.placed(chosen.node_id, MiB)
        got[chosen.node_id] += 1
        clock.t += 0.01
    return got


def full_cluster_and_one_empty(p: Placement, clock: Clock) -> list[NodeInfo]:
    nodes = [node(f"n{i}", used=64 * MiB) for i in range(7)]
    for n in nodes:
        p.joined(n.node_id)
    clock.t += 3600  # long past their warm-up
    place(p, nodes, 200, clock)
    fresh = node("fresh")
    p.joined(fresh.node_id)
    return [*nodes, fresh]


def test_an_empty_node_joining_a_full_cluster_takes_a_bounded_share() -> None:
    clock = Clock()
    config = PlacementConfig(warmup_s=60, warmup_share=1.5)
    p = Placement(config, clock)
    nodes = full_cluster_and_one_empty(p, clock)
    got = place(p, nodes, 800, clock)
    share = got["fresh"] / 800
    # It has all the free space, yet takes at most 1.5x its fair share (1/8) ...
    assert 0.05 < share <= 1.5 / 8 + 0.02, got
    # ... and the full nodes share the rest.
    assert all(got[f"n{i}"] > 40 for i in range(7)), got
    # Warmed up, it takes what its free space earns.
    clock.t += 60
    later = place(p, nodes, 100, clock)
    assert later["fresh"] > 50, later


def test_without_the_rule_the_empty_node_would_take_every_write() -> None:
    # The same cluster with warm-up off: the counterfactual the bound prevents.
    clock = Clock()
    p = Placement(PlacementConfig(warmup_s=0), clock)
    nodes = full_cluster_and_one_empty(p, clock)
    got = place(p, nodes, 40, clock)
    assert got["fresh"] == 40


def test_a_failing_node_is_backed_off_until_its_backoff_ends() -> None:
    clock = Clock()
    p = Placement(PlacementConfig(warmup_s=0, backoff_s=10), clock)
    nodes = [node("a"), node("b", used=32 * MiB)]
    for n in nodes:
        p.joined(n.node_id)
    assert place(p, nodes, 1, clock) == {"a": 1}
    p.failed("a", 3)
    assert place(p, nodes, 20, clock) == {"b": 20}
    clock.t += 10
    assert "a" in place(p, nodes, 20, clock)


def test_a_backed_off_node_still_takes_writes_when_no_other_can() -> None:
    clock = Clock()
    p = Placement(PlacementConfig(warmup_s=0), clock)
    only = [node("a")]
    p.joined("a")
    p.failed("a")
    assert p.choose(only, "", MiB) == only[0]
    # A node too small for the chunk is never chosen.
    assert p.choose([node("tiny", capacity=1024)], "", MiB) is None


def test_the_writers_own_node_comes_first_even_while_warming() -> None:
    clock = Clock()
    p = Placement(PlacementConfig(warmup_s=60), clock)
    nodes = full_cluster_and_one_empty(p, clock)
    assert place(p, nodes, 50, clock)  # the fresh node is at its share now
    chosen = p.choose(nodes, "fresh", MiB)
    assert chosen is not None and chosen.node_id == "fresh"


def test_recent_placements_spread_a_burst_before_the_next_heartbeat() -> None:
    clock = Clock()
    p = Placement(PlacementConfig(warmup_s=0), clock)
    nodes = [node("a"), node("b"), node("c")]
    got = place(p, nodes, 30, clock)
    assert sorted(got.values()) == [10, 10, 10]


@pytest.mark.parametrize(
    "kwargs", [{"warmup_share": 0.5}, {"window_s": 0}, {"backoff_s": -1}, {"warmup_s": -1}]
)
def test_bad_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(InvalidArgument):
        PlacementConfig(**kwargs)
