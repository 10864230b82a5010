"""Tests of the arena's offset allocator."""

from __future__ import annotations

import itertools
import random

import pytest

from kvdepot.errors import InvalidArgument
from kvdepot.store.allocator import Allocator

PAGE = 4096


def _alloc(alloc: Allocator, size: int) -> int:
    off = alloc.alloc(size)
    assert off is not None
    return off


def test_sizes_round_up_to_alignment() -> None:
    alloc = Allocator(16 * PAGE)
    a = alloc.alloc(1)
    b = alloc.alloc(PAGE + 1)
    assert (a, b) == (0, PAGE)
    assert alloc.used_bytes == 3 * PAGE
    assert alloc.free_bytes == 13 * PAGE
    assert alloc.size_of(b) == 2 * PAGE
    assert alloc.rounded(PAGE) == PAGE


def test_capacity_rounds_down_and_validates() -> None:
    assert Allocator(10 * PAGE + 100).capacity == 10 * PAGE
    with pytest.raises(InvalidArgument):
        Allocator(PAGE - 1)
    with pytest.raises(InvalidArgument):
        Allocator(10 * PAGE, alignment=3000)
    assert Allocator(100, alignment=1).capacity == 100


def test_returns_none_when_nothing_fits() -> None:
    alloc = Allocator(4 * PAGE)
    assert alloc.alloc(5 * PAGE) is None
    assert alloc.alloc(4 * PAGE) == 0
    assert alloc.alloc(1) is None
    assert alloc.largest_free == 0


def test_rejects_non_positive_sizes() -> None:
    alloc = Allocator(4 * PAGE)
    with pytest.raises(InvalidArgument):
        alloc.alloc(0)
    with pytest.raises(InvalidArgument):
        alloc.alloc(-1)


def test_double_free_and_wild_free_are_rejected() -> None:
    alloc = Allocator(4 * PAGE)
    off = _alloc(alloc, PAGE)
    alloc.free(off)
    with pytest.raises(InvalidArgument):
        alloc.free(off)
    with pytest.raises(InvalidArgument):
        alloc.free(123)


def test_free_coalesces_both_neighbours() -> None:
    alloc = Allocator(8 * PAGE)
    a, b, c, _ = (_alloc(alloc, 2 * PAGE) for _ in range(4))
    assert alloc.largest_free == 0
    alloc.free(a)
    alloc.free(c)
    assert alloc.free_extents == 2
    assert alloc.largest_free == 2 * PAGE
    # Freeing b joins a (before) and c (after) into one extent.
    alloc.free(b)
    assert alloc.free_extents == 1
    assert alloc.largest_free == 6 * PAGE
    assert alloc.alloc(6 * PAGE) == 0


def test_best_fit_keeps_large_extents_intact() -> None:
    alloc = Allocator(16 * PAGE)
    offs = [_alloc(alloc, PAGE) for _ in range(16)]
    # Holes: 3 pages at 0..2 and 1 page at 10; the rest allocated.
    for i in (0, 1, 2, 10):
        alloc.free(offs[i])
    assert alloc.alloc(PAGE) == 10 * PAGE
    assert alloc.largest_free == 3 * PAGE
    assert alloc.alloc(3 * PAGE) == 0


def test_random_churn_never_overlaps_and_returns_to_one_extent() -> None:
    rng = random.Random(7)
    cap = 1024 * PAGE
    alloc = Allocator(cap)
    live: dict[int, int] = {}
    for _ in range(5000):
        if live and (rng.random() < 0.45 or alloc.free_bytes < 64 * PAGE):
            off = rng.choice(list(live))
            alloc.free(off)
            del live[off]
        else:
            size = rng.choice([PAGE, 3 * PAGE, 16 * PAGE, 5000, 64 * PAGE])
            off = alloc.alloc(size)
            if off is None:
                assert alloc.largest_free < alloc.rounded(size)
                continue
            assert off % PAGE == 0
            live[off] = alloc.rounded(size)
        extents = sorted(live.items())
        for (o1, s1), (o2, _) in itertools.pairwise(extents):
            assert o1 + s1 <= o2
        assert alloc.used_bytes == sum(live.values())
        assert all(o + s <= cap for o, s in extents)
    for off in list(live):
        alloc.free(off)
    assert alloc.used_bytes == 0
    assert alloc.free_extents == 1
    assert alloc.largest_free == cap
