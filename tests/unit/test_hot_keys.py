"""Hot chunks (metadata/hot_keys.py): counted remote reads, hints, readers in turn."""

from __future__ import annotations

import pytest

from kvdepot.errors import InvalidArgument
from kvdepot.keys import ChunkKey
from kvdepot.metadata.hot_keys import HotKeys, HotKeysConfig
from kvdepot.types import KeyLocation, LookupResult, Replica


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def rep(node: str, tier: str = "cpu") -> Replica:
    return Replica(node, f"{node}:1", tier)


def result(*locations: tuple[Replica, ...]) -> LookupResult:
    return LookupResult(len(locations), tuple(KeyLocation(10, r) for r in locations))


class Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_key_read_often_from_other_nodes_is_hinted_once_a_second() -> None:
    clock = Clock()
    hot = HotKeys(HotKeysConfig(hot_reads=3, max_replicas=2, window_s=10), clock)
    one = result((rep("a"),))
    assert [hot.observe([key(1)], one, f"r{i}").replicate for i in range(3)] == [(), (), (0,)]
    assert hot.observe([key(1)], one, "r9").replicate == ()  # a copy is under way
    clock.t += 1.0
    assert hot.observe([key(1)], one, "r9").replicate == (0,)
    # Enough replicas: no more hints.
    clock.t += 1.0
    assert hot.observe([key(1)], result((rep("a"), rep("b"))), "r9").replicate == ()


def test_reads_on_the_readers_own_node_or_without_a_node_are_not_counted() -> None:
    hot = HotKeys(HotKeysConfig(hot_reads=1))
    assert hot.observe([key(1)], result((rep("a"),)), "a").replicate == ()
    assert hot.observe([key(1)], result((rep("a"),)), "").replicate == ()
    assert len(hot) == 0


def test_counts_decay_and_the_table_is_bounded() -> None:
    clock = Clock()
    hot = HotKeys(HotKeysConfig(hot_reads=2, window_s=1, tracked=8), clock)
    one = result((rep("a"),))
    hot.observe([key(1)], one, "r")
    clock.t += 10  # ten half-lives: the first read is forgotten
    assert hot.observe([key(1)], one, "r").replicate == ()
    for i in range(100):
        hot.observe([key(i)], one, "r")
    assert len(hot) <= 8


def test_only_the_leading_keys_of_a_lookup_are_counted() -> None:
    hot = HotKeys(HotKeysConfig(hot_reads=1, leading=2))
    got = hot.observe([key(i) for i in range(4)], result(*[(rep("a"),)] * 4), "r")
    assert got.replicate == (0, 1) and len(hot) == 2


def test_readers_take_equally_fast_replicas_in_turn_slower_ones_last() -> None:
    hot = HotKeys(HotKeysConfig(hot_reads=0))
    loc = (rep("a"), rep("b"), rep("c"), rep("d", "ssd"))
    firsts = [hot.observe([key(1)], result(loc), "").locations[0].replicas for _ in range(6)]
    assert [r[0].node_id for r in firsts] == ["a", "b", "c", "a", "b", "c"]
    assert all(r[-1].node_id == "d" and len(r) == 4 for r in firsts)
    # The reader's own replica stays first.
    own = hot.observe([key(1)], result((rep("b"), rep("a"))), "b")
    assert own.locations[0].replicas[0].node_id == "b"


@pytest.mark.parametrize(
    "kwargs", [{"hot_reads": -1}, {"max_replicas": 0}, {"window_s": 0}, {"leading": 0}]
)
def test_bad_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(InvalidArgument):
        HotKeysConfig(**kwargs)  # type: ignore[arg-type]
