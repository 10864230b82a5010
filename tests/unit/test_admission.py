"""PutStart's per-key decision (metadata/admission.py), shared by both index backends."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvdepot.errors import CapacityExceeded, Unavailable
from kvdepot.keys import ChunkKey
from kvdepot.metadata.admission import ABSENT, KeyState, admit, settle_lost
from kvdepot.records import TierStats
from kvdepot.types import Action, Allocation, NodeInfo, Replica


def key(i: int) -> ChunkKey:
    return ChunkKey(bytes([i]) * 16)


def node(node_id: str, capacity: int = 1000, used: int = 0) -> NodeInfo:
    return NodeInfo(node_id, f"{node_id}:1", f"{node_id}:2", (TierStats("cpu", capacity, used),))


A, B = node("a"), node("b", used=500)
NODES = {"a": A, "b": B}


def write(n: NodeInfo) -> Allocation:
    return Allocation(Action.WRITE, Replica(n.node_id, n.address, "cpu"))


EXISTS = Allocation(Action.SKIP_EXISTS)
PENDING = Allocation(Action.SKIP_PENDING)


@dataclass
class Case:
    name: str
    states: list[KeyState]
    # One per key: an Allocation decided now, or the node id it is placed on.
    want: list[Allocation | str]
    keys: list[int] = field(default_factory=list)  # default: 1, 2, 3, …
    writer: str = "a"
    revoked: dict[str, list[int]] = field(default_factory=dict)
    dedup: int = 0


CASES = [
    Case("absent key is placed on the writer's node", [ABSENT], ["b"], writer="b"),
    Case("absent key, foreign writer: the node with most free bytes", [ABSENT], ["a"], writer="x"),
    Case("existing chunk is skipped", [KeyState(exists=True)], [EXISTS], dedup=1),
    Case(
        "exists wins over a pending allocation of this put",
        [KeyState(exists=True, pending=True, retried="b")],
        [EXISTS],
        dedup=1,
    ),
    Case("another put's live allocation", [KeyState(pending=True)], [PENDING], dedup=1),
    Case(
        "a retry of this put gets the same node again",
        [KeyState(pending=True, retried="b")],
        [write(B)],
    ),
    Case(
        "a retry whose node is gone: revoked, then placed anew",
        [KeyState(pending=True, retried="gone")],
        ["a"],
        revoked={"gone": [1]},
    ),
    Case(
        "a key repeated in the put: its later copies are pending",
        [ABSENT, ABSENT],
        ["a", PENDING],
        keys=[1, 1],
        dedup=1,
    ),
    Case(
        "a retried key repeated in the put: the first copy writes, the others are pending",
        [KeyState(pending=True, retried="b")] * 2,
        [write(B), PENDING],
        keys=[1, 1],
        dedup=1,
    ),
    Case(
        "a mix, in order",
        [
            KeyState(exists=True),
            KeyState(pending=True),
            ABSENT,
            KeyState(pending=True, retried="a"),
        ],
        [EXISTS, PENDING, "a", write(A)],
        dedup=2,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_outcome(case: Case) -> None:
    keys = [key(i) for i in case.keys or range(1, len(case.states) + 1)]
    sizes = [10] * len(keys)
    got = admit(keys, sizes, case.states, NODES, case.writer)
    placed = dict(got.placements)
    answers = [a if a is not None else placed[i].node_id for i, a in enumerate(got.allocations)]
    assert answers == case.want
    assert got.revoked == {n: [key(i) for i in ks] for n, ks in case.revoked.items()}
    assert (got.deduplicated, got.bytes_saved) == (case.dedup, 10 * case.dedup)


def test_placement_counts_what_the_put_already_placed() -> None:
    # Equal free bytes: the first chunk goes to the larger id, which then has
    # less room left, so the second goes to the other node.
    nodes = {"a": node("a"), "b": node("b")}
    got = admit([key(1), key(2)], [300, 300], [ABSENT, ABSENT], nodes, "writer")
    assert [n.node_id for _, n in got.placements] == ["b", "a"]


def test_a_retried_write_counts_towards_its_node() -> None:
    nodes = {"a": node("a"), "b": node("b")}
    states = [KeyState(pending=True, retried="b"), ABSENT]
    got = admit([key(1), key(2)], [300, 300], states, nodes, "writer")
    assert got.allocations[0] == write(nodes["b"])
    assert [n.node_id for _, n in got.placements] == ["a"]


def test_no_node_registered_is_unavailable() -> None:
    with pytest.raises(Unavailable, match="no store node"):
        admit([key(1)], [10], [ABSENT], {}, "a")


def test_a_chunk_larger_than_every_node_is_refused() -> None:
    with pytest.raises(CapacityExceeded, match="2000 bytes"):
        admit([key(1)], [2000], [ABSENT], NODES, "a")


def test_nothing_to_place_needs_no_node() -> None:
    got = admit([key(1)], [10], [KeyState(exists=True)], {}, "a")
    assert got.allocations == [EXISTS]


SETTLE = [
    ("another put won the key", None, PENDING),
    ("this put's own first attempt won it", "b", write(B)),
    ("this put's first attempt won it on a node now gone", "gone", PENDING),
]


@pytest.mark.parametrize(("retried", "want"), [s[1:] for s in SETTLE], ids=[s[0] for s in SETTLE])
def test_settle_lost(retried: str | None, want: Allocation) -> None:
    assert settle_lost(retried, NODES) == want
