"""The compact replica table: a model test against a dict, and focused cases."""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass, field
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvdepot.metadata.index import chunk_table
from kvdepot.metadata.index.chunk_table import (
    MAX_NODE,
    MAX_SIZE,
    MIGRATE_PER_ROW,
    ChunkTable,
    _probe,
    keys_array,
)

DEAD = 0xFFFF << 48


def key(k0: int, k1: int) -> bytes:
    return struct.pack("<QQ", k0, k1)


def _pool() -> list[bytes]:
    rnd = random.Random(7)
    keys = [key(rnd.getrandbits(64), rnd.getrandbits(64)) for _ in range(8)]
    # The same low 20 bits of k0: one home slot at every capacity the tests reach.
    keys += [key(rnd.getrandbits(44) << 20 | 0x5, rnd.getrandbits(64)) for _ in range(8)]
    # The same k0 as another key, another k1.
    keys += [key(struct.unpack("<QQ", keys[i])[0], rnd.getrandbits(64)) for i in (0, 8, 9)]
    # Neighbouring homes, so that chains run into each other.
    keys += [key(rnd.getrandbits(44) << 20 | 0x6 + i, rnd.getrandbits(64)) for i in range(3)]
    return keys


POOL = _pool()
NODES = (1, 2, 3, 4, MAX_NODE)


def batch(items: list[tuple[int, int, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    keys = keys_array(b"".join(POOL[i] for i, _, _ in items))
    sizes = np.array([s for _, s, _ in items], np.uint64)
    tiers = np.array([t for _, _, t in items], np.uint8)
    return keys, sizes, tiers


def check_structure(table: ChunkTable) -> None:
    """Counts agree with the arrays, and the table taking writes is within its load."""
    t = table._t
    live = (t.meta != 0) & (t.meta < DEAD)
    assert t.live == int(np.count_nonzero(live))
    assert t.tomb == int(np.count_nonzero(t.meta >= DEAD))
    assert t.used <= table._limit(t.cap)
    old = table._old
    if old is not None:
        rest = old.meta[table._cursor :]
        assert old.live == int(np.count_nonzero((rest != 0) & (rest < DEAD)))
        assert old.tomb == int(np.count_nonzero(rest >= DEAD))
        done = old.meta[: table._cursor]
        assert not np.any((done != 0) & (done < DEAD))
    nxt = table._next
    if nxt is not None:
        # A table being prepared holds no row before its migration starts.
        assert not table.migrating and not nxt.meta.any()
        assert 0 <= table._touched <= nxt.rec.nbytes


@dataclass
class Model:
    rows: dict[tuple[bytes, int], tuple[int, int]] = field(default_factory=dict)
    # Rows of nodes being purged: the table may or may not hold them still.
    limbo: dict[tuple[bytes, int], tuple[int, int]] = field(default_factory=dict)
    expected: dict[int, int] = field(default_factory=dict)  # rows a purge must report
    reported: dict[int, int] = field(default_factory=dict)

    def begin_purge(self, node: int) -> None:
        if node in self.expected:
            return
        mine = [k for k in self.rows if k[1] == node]
        for k in mine:
            self.limbo[k] = self.rows.pop(k)
        self.expected[node] = len(mine)
        self.reported[node] = 0

    def purged(self, removed: dict[int, int], done: list[int]) -> None:
        for node, count in removed.items():
            assert node in self.expected
            self.reported[node] += count
        for node in done:
            assert self.reported.pop(node) == self.expected.pop(node)
            for k in [k for k in self.limbo if k[1] == node]:
                del self.limbo[k]

    def check(self, table: ChunkTable) -> None:
        total = 0
        for k in POOL:
            want = {n: t for (kk, n), (_, t) in self.rows.items() if kk == k}
            found = table.find(k)
            if found is None:
                assert not want
                continue
            size, reps = found
            got = dict(reps)
            assert len(got) == len(reps), "one row per node"
            assert {n: t for n, t in got.items() if n not in self.expected} == want
            sizes = set()
            for n, t in got.items():
                row = self.rows.get((k, n)) or self.limbo.get((k, n))
                assert row is not None and row[1] == t
                sizes.add(row[0])
            assert size in sizes
            total += len(reps)
        assert len(table) == total
        check_structure(table)


def apply(table: ChunkTable, model: Model, op: tuple) -> None:
    kind = op[0]
    if kind in ("many", "one") and op[1] in model.expected:
        with pytest.raises(ValueError, match="purged"):
            table.upsert_many(*batch([(0, 1, 0)]), op[1])
        with pytest.raises(ValueError, match="purged"):
            table.upsert(POOL[0], 1, op[1], 0)
        return
    if kind == "many":
        _, node, items = op
        new = len({POOL[i] for i, _, _ in items} - {k for k, n in model.rows if n == node})
        assert table.upsert_many(*batch(items), node) == new
        for i, s, t in items:
            model.rows[(POOL[i], node)] = (s, t)
    elif kind == "one":
        _, node, i, s, t = op
        assert table.upsert(POOL[i], s, node, t) == ((POOL[i], node) not in model.rows)
        model.rows[(POOL[i], node)] = (s, t)
    elif kind == "remove":
        _, node, i = op
        k = (POOL[i], node)
        if node in model.expected:
            if table.remove(*k):
                del model.limbo[k]
                model.expected[node] -= 1
            else:
                model.limbo.pop(k, None)
        else:
            assert table.remove(*k) == (model.rows.pop(k, None) is not None)
    elif kind == "tier":
        _, node, i, t = op
        k = (POOL[i], node)
        rows = model.limbo if node in model.expected else model.rows
        if table.set_tier(*k, t):
            rows[k] = (rows[k][0], t)
        else:
            assert node in model.expected or k not in rows
    elif kind == "purge":
        table.begin_purge(op[1])
        model.begin_purge(op[1])
    elif kind == "pstep":
        model.purged(*table.purge_step(op[1]))
    else:
        table.maintain_step(op[1])


nodes = st.sampled_from(NODES)
idx = st.integers(0, len(POOL) - 1)
sizes_st = st.sampled_from([0, 1, 4096, MAX_SIZE])
tiers_st = st.integers(0, 3)
steps = st.integers(1, 40)
writes = st.one_of(
    st.tuples(st.just("many"), nodes, st.lists(st.tuples(idx, sizes_st, tiers_st), max_size=12)),
    st.tuples(st.just("one"), nodes, idx, sizes_st, tiers_st),
)
ops = st.one_of(
    writes,
    writes,
    writes,
    st.tuples(st.just("remove"), nodes, idx),
    st.tuples(st.just("tier"), nodes, idx, tiers_st),
    st.tuples(st.just("purge"), nodes),
    st.tuples(st.just("pstep"), steps),
    st.tuples(st.just("mstep"), steps),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(ops, min_size=10, max_size=120),
    st.sampled_from([1, 2, MIGRATE_PER_ROW]),
    st.sampled_from([0, 1, 16, 256]),
)
def test_the_table_behaves_like_a_dict(program: list[tuple], per_row: int, prepare: int) -> None:
    # Fewer slots migrated per row written make migrations last over more
    # operations of a short program (the table sizes itself for the ratio).
    with mock.patch.object(chunk_table, "MIGRATE_PER_ROW", per_row):
        if not prepare:  # tables this small are never prepared
            run_program(program)
            return
        # Every table prepared (and mapped), in pieces of two slots: with one
        # slot pre-touched per row written, migrations mostly start before
        # their table is ready; with 256, once it is.
        with (
            mock.patch.object(chunk_table, "PREPARE_PER_ROW", prepare),
            mock.patch.object(chunk_table, "_PREPARE_MIN_BYTES", 0),
            mock.patch.object(chunk_table, "_PIECE", 48),
            mock.patch.object(chunk_table, "_FREE_PIECE", 4096),
        ):
            run_program(program)


def run_program(program: list[tuple]) -> None:
    table = ChunkTable(initial_capacity=8)
    model = Model()
    for op in program:
        apply(table, model, op)
        model.check(table)
    # Every purge completes in bounded steps, reporting every row it removed.
    for _ in range(1000):
        if not table.purging:
            break
        model.purged(*table.purge_step(7))
    assert not table.purging and not model.expected
    model.check(table)


def random_keys(n: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**64, size=(n, 2), dtype=np.uint64)


def fill_until_migrating(table: ChunkTable, node: int, seed: int = 1) -> np.ndarray:
    """Upsert batches of new keys under ``node`` until a migration starts; all its keys."""
    keys = random_keys(1 << 16, seed)
    at = 0
    while not table.migrating:
        table.upsert_many(keys[at : at + 64], np.full(64, 100, np.uint64), np.uint8(1), node)
        at += 64
    return keys[:at]


def test_a_resent_batch_adds_no_rows() -> None:
    table = ChunkTable(initial_capacity=64)
    keys = random_keys(5000)
    sizes = np.arange(5000, dtype=np.uint64)
    assert table.upsert_many(keys, sizes, np.uint8(1), 7) == 5000
    assert table.upsert_many(keys, sizes, np.uint8(2), 7) == 0
    assert len(table) == 5000
    assert table.find(keys[10].tobytes()) == (10, [(7, 2)])
    # Repeats inside a batch make one row; the last one given wins.
    dup = np.concatenate([keys[:3], keys[:3]])
    assert table.upsert_many(dup, np.arange(6, dtype=np.uint64), np.uint8(3), 8) == 3
    assert table.remove(keys[1].tobytes(), 7)
    assert table.find(keys[1].tobytes()) == (4, [(8, 3)])
    assert len(table) == 5002


def test_a_purge_completes_after_a_full_cycle_and_removes_only_its_node() -> None:
    table = ChunkTable(initial_capacity=1024)
    keys = random_keys(200)
    for node in (1, 2, 3):
        table.upsert_many(keys, np.full(200, 5, np.uint64), np.uint8(node), node)
    assert table.capacity == 1024
    table.begin_purge(1)
    removed: dict[int, int] = {}
    done_at: dict[int, int] = {}
    for step in range(1, 100):
        if step == 4:
            table.begin_purge(3)  # at slot 300 of the sweep: completes a full cycle later
        got, done = table.purge_step(100)
        for n, c in got.items():
            removed[n] = removed.get(n, 0) + c
        done_at.update(dict.fromkeys(done, step))
        if not table.purging:
            break
    # Node 1: slots 0..1023 in steps of 100 (the last one 24). Node 3: from 300
    # to the end and round again to 300.
    assert done_at == {1: 11, 3: 14}
    assert removed == {1: 200, 3: 200}
    assert len(table) == 200
    assert all(table.find(k.tobytes()) == (5, [(2, 2)]) for k in keys)
    assert table.upsert(keys[0].tobytes(), 5, 1, 1)  # the slot may be used again


def still_in_old(table: ChunkTable, keys: np.ndarray, node: int) -> list[np.ndarray]:
    """Keys whose row of ``node`` is in the old table, the last migrated first."""
    assert table._old is not None
    views = table._old.views
    slots = [(_probe(views, int(k[0]), int(k[1]), node)[0], i) for i, k in enumerate(keys)]
    return [keys[i] for slot, i in sorted(slots, reverse=True) if slot >= 0]


def test_find_during_a_migration_sees_rows_in_both_tables() -> None:
    table = ChunkTable(initial_capacity=1024)
    keys = fill_until_migrating(table, 1)
    some = still_in_old(table, keys, 1)[:20]
    assert len(some) == 20
    for k in some:
        assert table.upsert(k.tobytes(), 100, 2, 0)  # into the new table
    assert table.migrating and len(still_in_old(table, np.array(some), 1)) == 20
    for k in some:
        size, reps = table.find(k.tobytes())  # type: ignore[misc]
        assert size == 100 and sorted(reps) == [(1, 1), (2, 0)]
    # Updates and removals reach rows still in the old table.
    assert table.set_tier(some[0].tobytes(), 1, 3)
    assert sorted(table.find(some[0].tobytes())[1]) == [(1, 3), (2, 0)]  # type: ignore[index]
    assert table.upsert_many(np.array(some[1:3]), np.full(2, 9, np.uint64), np.uint8(4), 1) == 0
    assert sorted(table.find(some[1].tobytes())[1]) == [(1, 4), (2, 0)]  # type: ignore[index]
    assert table.remove(some[3].tobytes(), 1)
    assert table.find(some[3].tobytes()) == (100, [(2, 0)])
    assert table.migrating
    while table.maintain_step(50):
        check_structure(table)
    assert len(table) == len(keys) + 20 - 1 and table.tombstones == 0


def test_a_purge_during_a_migration_removes_rows_from_both_tables() -> None:
    table = ChunkTable(initial_capacity=1024)
    keys = fill_until_migrating(table, 1)
    some = still_in_old(table, keys, 1)[:20]
    for k in some:
        table.upsert(k.tobytes(), 100, 2, 0)
    assert table.migrating
    table.begin_purge(1)
    removed = 0
    for _ in range(10_000):
        got, done = table.purge_step(16)
        removed += got.get(1, 0)
        assert set(got) <= {1}
        check_structure(table)
        if done:
            break
    assert done == [1] and removed == len(keys) and len(table) == 20
    assert not table.migrating
    assert all(table.find(k.tobytes()) == (100, [(2, 0)]) for k in some)


def test_writes_migrate_a_bounded_number_of_slots() -> None:
    table = ChunkTable(initial_capacity=4096)
    keys = fill_until_migrating(table, 1)
    extra = random_keys(200, seed=2)
    for i in range(0, 200, 8):
        before = table._cursor
        table.upsert_many(extra[i : i + 8], np.full(8, 1, np.uint64), np.uint8(0), 3)
        assert table._cursor - before <= MIGRATE_PER_ROW * 8
        check_structure(table)
    assert table.migrating and len(table) == len(keys) + 200


def test_tombstones_are_cleaned_and_the_table_shrinks() -> None:
    table = ChunkTable(initial_capacity=64)
    keys = random_keys(20_000)
    table.upsert_many(keys, np.full(20_000, 1, np.uint64), np.uint8(0), 1)
    while table.maintain_step():
        pass
    big = table.capacity
    for k in keys[:19_000]:
        assert table.remove(k.tobytes(), 1)
    assert table.tombstones == 19_000
    steps = 0
    while table.maintain_step(1024):
        steps += 1
    assert steps > 1 and table.tombstones == 0 and table.capacity < big
    assert len(table) == 1000 and all(table.find(k.tobytes()) for k in keys[19_000:])


def test_bad_arguments_are_refused() -> None:
    table = ChunkTable()
    k = key(1, 2)
    for node in (0, 0xFFFF):
        with pytest.raises(ValueError):
            table.upsert(k, 1, node, 0)
    with pytest.raises(ValueError):
        table.upsert(k, MAX_SIZE + 1, 1, 0)
    with pytest.raises(ValueError):
        table.set_tier(k, 1, 256)
    with pytest.raises(ValueError):
        table.upsert_many(random_keys(2), np.array([1, MAX_SIZE + 1]), np.uint8(0), 1)
    with pytest.raises(ValueError):
        table.upsert_many(random_keys(2).astype(np.int64), np.ones(2), np.uint8(0), 1)
    assert table.upsert(k, MAX_SIZE, np.uint16(MAX_NODE), np.uint8(255))  # type: ignore[arg-type]
    assert table.find(k) == (MAX_SIZE, [(MAX_NODE, 255)])
    assert table.find(key(1, 3)) is None


def test_memory_per_row_at_a_million_rows() -> None:
    table = ChunkTable()
    keys = random_keys(1_000_000)
    sizes = np.full(8192, 1 << 20, np.uint64)
    for at in range(0, len(keys), 8192):
        part = keys[at : at + 8192]
        table.upsert_many(part, sizes[: len(part)], np.uint8(1), 1 + at % 7)
    while table.maintain_step():
        pass
    assert len(table) == 1_000_000
    assert table.nbytes / len(table) < 80


def grow_in_batches(table: ChunkTable, keys: np.ndarray, at: int, until: object) -> int:
    """Upsert 4096-key batches of ``keys`` from ``at`` until ``until()``; where it stopped."""
    sizes = np.full(4096, 7, np.uint64)
    while not until():  # type: ignore[operator]
        part = keys[at : at + 4096]
        table.upsert_many(part, sizes[: len(part)], np.uint8(1), 1)
        at += len(part)
    return at


def spy_on_starts(table: ChunkTable) -> list[tuple[object, int]]:
    """Record (the table prepared, bytes of it touched) as each migration starts."""
    starts: list[tuple[object, int]] = []
    start = table._start_migration

    def spy(n: int) -> None:
        starts.append((table._next, table._touched))
        start(n)

    table._start_migration = spy  # type: ignore[method-assign]
    return starts


@pytest.mark.parametrize("populate", [True, False])
def test_a_growth_migrates_into_a_table_faulted_in_beforehand(populate: bool) -> None:
    table = ChunkTable(initial_capacity=1 << 16)
    starts = spy_on_starts(table)
    keys = random_keys(120_000)
    with mock.patch.object(chunk_table, "_populate", [populate]):
        at = grow_in_batches(table, keys, 0, lambda: table.preparing)
        assert not table.migrating and table._t.used <= table._limit(1 << 16) - 4096
        prepared = table._next
        assert prepared is not None and prepared.buf is not None
        touched = table._touched
        assert 0 < touched < prepared.rec.nbytes
        # Each write pre-touches what its rows owe, a bounded piece.
        while not table.migrating:
            part = keys[at : at + 4096]
            before = table._touched
            table.upsert_many(part, np.full(len(part), 7, np.uint64), np.uint8(1), 1)
            at += len(part)
            if not table.migrating:
                assert table._touched - before <= chunk_table.PREPARE_PER_ROW * 24 * 4096 + (
                    256 << 10
                )
    # The migration started on the prepared table, all of it touched, and not sooner.
    assert starts == [(prepared, prepared.rec.nbytes)]
    assert table._t is prepared and table.capacity == 1 << 17
    assert not table.preparing
    while table.maintain_step(65536):
        check_structure(table)
    # The old table is given back a piece at a time.
    assert table._dead is not None
    before = table.nbytes
    table.maintain_step()
    assert table.nbytes < before
    while table._dead is not None:
        table.maintain_step()
    assert table.nbytes == prepared.rec.nbytes
    assert len(table) == at
    assert all(table.find(k.tobytes()) == (7, [(1, 1)]) for k in keys[:at:97])


def test_a_write_that_overfills_the_old_table_starts_the_migration_at_once() -> None:
    table = ChunkTable(initial_capacity=1 << 16)
    starts = spy_on_starts(table)
    keys = random_keys(200_000)
    at = grow_in_batches(table, keys, 0, lambda: table.preparing)
    prepared = table._next
    assert prepared is not None
    # Writes that pre-touch less than their due: the load reaches the limit first.
    with mock.patch.object(chunk_table, "PREPARE_PER_ROW", 1):
        at = grow_in_batches(table, keys, at, lambda: table.migrating)
    assert starts == [(prepared, starts[0][1])] and starts[0][1] < prepared.rec.nbytes
    assert table._t is prepared
    check_structure(table)
    # A batch too large for the table prepared: a table of its size is made.
    table = ChunkTable(initial_capacity=1 << 16)
    starts = spy_on_starts(table)
    at = grow_in_batches(table, keys, 0, lambda: table.preparing)
    prepared = table._next
    big = keys[at:]
    assert table.upsert_many(big, np.full(len(big), 7, np.uint64), np.uint8(1), 1) == len(big)
    assert starts[0][0] is prepared and table._t is not prepared and not table.preparing
    assert table.capacity > 1 << 17
    while table.maintain_step(65536):
        check_structure(table)
    assert len(table) == len(keys)
    assert all(table.find(k.tobytes()) == (7, [(1, 1)]) for k in keys[::97])


def test_a_cleaning_migration_is_prepared_by_maintain_step() -> None:
    table = ChunkTable(initial_capacity=1 << 17)
    keys = random_keys(40_000)
    table.upsert_many(keys, np.full(40_000, 3, np.uint64), np.uint8(0), 1)
    for k in keys[:30_000]:
        assert table.remove(k.tobytes(), 1)
    assert not table.preparing
    # The migration waits for its table (3 MiB), pre-touched by the steps.
    assert table.maintain_step(1024)
    assert table.preparing and not table.migrating
    steps = 1
    while not table.migrating:
        assert table.maintain_step(1024)
        check_structure(table)
        steps += 1
    assert not table.preparing and steps == 3 * 2**20 // (1024 * 24)
    while table.maintain_step(1024):
        pass
    assert table.tombstones == 0 and len(table) == 10_000
    assert all(table.find(k.tobytes()) == (3, [(1, 0)]) for k in keys[30_000:])
