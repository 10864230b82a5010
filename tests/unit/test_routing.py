"""The routing score on hand-built cluster states (pure functions)."""

from __future__ import annotations

import pytest

from kvdepot.errors import InvalidArgument
from kvdepot.keys import Namespace, chunk_keys
from kvdepot.metadata.routing import (
    Candidate,
    RoutingWeights,
    best,
    score_candidate,
    score_candidates,
)
from kvdepot.proxy.router import EnginePool, parse_node_map, prompt_keys
from kvdepot.types import KeyLocation, LookupResult, Replica

MiB = 1 << 20
W = RoutingWeights(
    link_bytes_per_s=1000 * MiB, local_bytes_per_s=10_000 * MiB, prefill_tokens_per_s=1000
)


def located(*nodes_per_key: tuple[str, ...], size: int = MiB) -> LookupResult:
    locs = tuple(KeyLocation(size, tuple(Replica(n, f"{n}:1") for n in ns)) for ns in nodes_per_key)
    return LookupResult(len(locs), locs)


def test_local_remote_none_split() -> None:
    lookup = located(("a",), ("a", "b"), ("b",))
    s = score_candidate(lookup, 5, 16, Candidate("e", "a"), W)
    assert (s.local_tokens, s.remote_tokens, s.none_tokens) == (32, 16, 32)
    assert s.remote_bytes == MiB
    t = score_candidate(lookup, 5, 16, Candidate("f", "b"), W)
    assert (t.local_tokens, t.remote_tokens, t.none_tokens) == (32, 16, 32)
    u = score_candidate(lookup, 5, 16, Candidate("g", "c"), W)
    assert (u.local_tokens, u.remote_tokens, u.none_tokens) == (0, 48, 32)
    assert u.remote_bytes == 3 * MiB
    assert u.score == -u.estimated_s < s.score


def test_cost_model_arithmetic() -> None:
    lookup = located(("a",), ("b",))
    s = score_candidate(lookup, 4, 100, Candidate("e", "a", load=2), W)
    expected = MiB / (1000 * MiB) + MiB / (10_000 * MiB) + 200 / 1000 + 2 * W.load_penalty_s
    assert s.estimated_s == pytest.approx(expected)


def test_the_node_holding_the_prefix_wins() -> None:
    lookup = located(("b",), ("b",), ("b",))
    scores = score_candidates(lookup, 3, 256, [Candidate("x", "a"), Candidate("y", "b")], W)
    assert best(scores) == 1


def test_load_can_outweigh_locality() -> None:
    lookup = located(("b",))
    light = RoutingWeights(link_bytes_per_s=1e12, load_penalty_s=1.0)
    cands = [Candidate("x", "a", load=0), Candidate("y", "b", load=5)]
    assert best(score_candidates(lookup, 1, 256, cands, light)) == 0
    no_load = RoutingWeights(link_bytes_per_s=1e6, load_penalty_s=0.0)
    assert best(score_candidates(lookup, 1, 256, cands, no_load)) == 1


def test_slow_link_favours_local_more() -> None:
    lookup = located(("b",), ("b",), size=64 * MiB)
    cands = [Candidate("x", "a", load=1), Candidate("y", "b", load=2)]
    fast = RoutingWeights(link_bytes_per_s=1e13, load_penalty_s=0.01)
    slow = RoutingWeights(link_bytes_per_s=1e8, load_penalty_s=0.01)
    assert best(score_candidates(lookup, 2, 256, cands, fast)) == 0
    assert best(score_candidates(lookup, 2, 256, cands, slow)) == 1


def test_nothing_cached_ties_go_to_the_first() -> None:
    scores = score_candidates(LookupResult(0), 4, 16, [Candidate("x", "a"), Candidate("y", "b")], W)
    assert [s.none_tokens for s in scores] == [64, 64]
    assert best(scores) == 0


@pytest.mark.parametrize(
    "cands",
    [
        [],
        [Candidate("x", "a"), Candidate("x", "b")],
        [Candidate("", "a")],
        [Candidate("x", "a", -1)],
    ],
)
def test_bad_candidates(cands: list[Candidate]) -> None:
    with pytest.raises(InvalidArgument):
        score_candidates(LookupResult(0), 1, 16, cands, W)


def test_bad_weights() -> None:
    with pytest.raises(InvalidArgument):
        RoutingWeights(link_bytes_per_s=0)
    with pytest.raises(InvalidArgument):
        RoutingWeights(load_penalty_s=-1)


def test_prompt_keys_only_for_token_ids() -> None:
    ns = Namespace("m", chunk_tokens=4)
    tokens = list(range(10))
    assert prompt_keys({"prompt": tokens}, ns) == chunk_keys(ns, tokens)
    assert prompt_keys({"prompt": [tokens]}, ns) == chunk_keys(ns, tokens)
    assert prompt_keys({"prompt": "hello"}, ns) is None
    assert prompt_keys({"messages": []}, ns) is None
    assert prompt_keys({"prompt": [1, "a"]}, ns) is None
    assert prompt_keys({"prompt": [[1], [2]]}, ns) is None
    assert prompt_keys({"prompt": [-1, 2]}, ns) is None


def test_parse_node_map_and_rotation() -> None:
    assert parse_node_map(["http://a:1=n0,http://b:2=n1"]) == (
        ("http://a:1", "n0"),
        ("http://b:2", "n1"),
    )
    with pytest.raises(InvalidArgument):
        parse_node_map(["http://a:1"])
    pool = EnginePool(["a", "b", "c"], {})
    assert pool.rotation() == ["a", "b", "c"]
    assert pool.rotation() == ["b", "c", "a"]
    assert pool.next_round_robin() == "c"
