"""The inventory digest (issue 37): order independence, incremental upkeep equal to a
recompute on both sides, the bucket diff, and the chunk table's per-bucket listing."""

from __future__ import annotations

import asyncio
import os
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdepot.keys import ChunkKey
from kvdepot.metadata.index import IndexConfig, create_backend
from kvdepot.metadata.index.base import InventoryPage
from kvdepot.metadata.index.chunk_table import ChunkTable, keys_array
from kvdepot.store.inventory import Inventory
from kvdepot.types import InventoryItem, NodeInfo
from kvdepot.wire import digest as d


def keys(n: int, seed: int = 0) -> list[ChunkKey]:
    rnd = random.Random(seed)
    return [ChunkKey(rnd.randbytes(16)) for _ in range(n)]


def recompute(ks: list[bytes]) -> d.Cells:
    c = d.Cells()
    for k in ks:
        c.add(k)
    return c


def same(a: d.Cells, b: d.Cells) -> bool:
    return bool((a.counts == b.counts).all() and (a.sums == b.sums).all()) and (
        a.count,
        a.total,
    ) == (b.count, b.total)


def test_scalar_and_vector_forms_agree() -> None:
    ks = keys(2000)
    w = d.words(b"".join(ks))
    assert d.hashes_of(w).tolist() == [d.key_hash(k) for k in ks]
    assert d.buckets_of(w).tolist() == [d.key_bucket(k) for k in ks]
    for k in ks[:200]:
        value, mask = d.bucket_k0(d.key_bucket(k))
        assert int.from_bytes(k[:8], "little") & mask == value
    assert d.key_bucket(b"\xab\xcd" + bytes(14)) == 0xABC  # the first 12 bits


@given(st.lists(st.binary(min_size=16, max_size=16), unique=True, max_size=60), st.randoms())
@settings(max_examples=50, deadline=None)
def test_the_digest_does_not_depend_on_order(ks: list[bytes], rnd: random.Random) -> None:
    shuffled = list(ks)
    rnd.shuffle(shuffled)
    batch = d.Cells()
    batch.add_words(d.words(b"".join(shuffled)))
    assert same(recompute(ks), batch)
    assert d.digest_of(b"".join(shuffled)) == (len(ks), recompute(ks).total)


def test_structured_keys_do_not_collide() -> None:
    # Sums of raw integers would: {1, 4} and {2, 3}.
    k = [i.to_bytes(16, "big") for i in range(5)]
    assert d.digest_of(k[1] + k[4]) != d.digest_of(k[2] + k[3])
    assert d.digest_of(k[1] + k[2]) != d.digest_of(k[3])


@given(st.lists(st.tuples(st.integers(0, 39), st.booleans()), max_size=200))
@settings(max_examples=60, deadline=None)
def test_incremental_upkeep_equals_a_recompute(ops: list[tuple[int, bool]]) -> None:
    pool = keys(40, seed=3)
    inv, cells, held = Inventory(), d.Cells(), set()
    for i, add in ops:
        k = pool[i]
        if add:
            inv.add(k)
            if k not in held:
                cells.add(k)
        else:
            inv.remove(k)
            if k in held:
                cells.add(k, -1)
        (held.add if add else held.discard)(k)
    want = recompute(sorted(held))
    assert same(cells, want)
    counts, sums = inv.cells()
    assert (counts == want.counts).all() and (sums == want.sums).all()
    assert (inv.count, inv.total) == (want.count, want.total)
    for b in {d.key_bucket(k) for k in pool}:
        assert set(inv.bucket(b)) == {k for k in held if d.key_bucket(k) == b}


def test_batch_removal_and_merge() -> None:
    ks = keys(500, seed=4)
    c = d.Cells()
    c.add_words(d.words(b"".join(ks)))
    c.add_words(d.words(b"".join(ks[:200])), -1)
    assert same(c, recompute(ks[200:]))
    other = recompute(ks[:200])
    c.merge(other)
    assert same(c, recompute(ks))


def test_cells_pack_and_the_group_diff() -> None:
    ks = keys(3000, seed=5)
    a, b = recompute(ks), recompute(ks[1:])
    counts, sums = d.unpack_cells(a.groups())
    assert counts.sum() == 3000 and len(sums) == d.GROUPS
    g = d.key_bucket(ks[0]) // d.GROUP_BUCKETS
    assert d.differing_groups(a.groups(), b.groups()) == [g]
    counts, sums = d.unpack_cells(b.buckets([g]))
    assert len(counts) == d.GROUP_BUCKETS
    mine = a.buckets([g])
    diff = [
        i for i in range(64) if mine[16 * i : 16 * i + 16] != b.buckets([g])[16 * i : 16 * i + 16]
    ]
    assert [g * 64 + i for i in diff] == [d.key_bucket(ks[0])]


def test_flat_deltas_build_the_flat_layout() -> None:
    ks = keys(700, seed=6)
    c = recompute(ks)
    flat = [0] * d.FLAT_CELLS
    pairs = d.flat_deltas(c)
    for i in range(0, len(pairs), 2):
        flat[pairs[i]] += pairs[i + 1]
    assert flat[0] == 700 and flat[1] & d.MASK == c.total
    gc, gs = d.group_cells(c.counts, c.sums)
    assert flat[d.GROUP_CELL : d.BUCKET_CELL : 2] == gc.tolist()
    assert [v & d.MASK for v in flat[d.GROUP_CELL + 1 : d.BUCKET_CELL : 2]] == gs.tolist()
    assert flat[d.BUCKET_CELL :: 2] == c.counts.tolist()
    assert d.flat_deltas(None) == [] and d.flat_deltas(d.Cells()) == []


def _lists_right(table: ChunkTable, rows: dict[int, set[bytes]]) -> None:
    for node, held in rows.items():
        for b in {d.key_bucket(k) for k in held} | {0, 4095}:
            got = table.node_keys(node, *d.bucket_k0(b))
            assert d.key_set(got) == {k for k in held if d.key_bucket(k) == b}


@pytest.mark.parametrize("initial", [8, 1 << 16])
def test_the_table_lists_a_nodes_keys_of_a_bucket(initial: int) -> None:
    table = ChunkTable(initial_capacity=initial)
    rnd = random.Random(9)
    rows: dict[int, set[bytes]] = {1: set(), 2: set()}
    migrated = False
    for _ in range(30):  # a small table grows (migrates) on the way
        node = rnd.choice((1, 2))
        ks = [os.urandom(16) for _ in range(64)]
        # Keys that share a bucket, for buckets with several keys.
        ks += [b"\x12\x30" + os.urandom(14) for _ in range(4)]
        table.upsert_many(keys_array(b"".join(ks)), np.full(len(ks), 7, np.uint64), 1, node)
        rows[node].update(ks)
        for k in rnd.sample(sorted(rows[node]), 8):
            assert table.remove(k, node)
            rows[node].discard(k)
        if table.migrating:  # rows in both tables
            migrated = True
            _lists_right(table, rows)
    assert migrated or initial > 4096
    _lists_right(table, rows)


def test_upsert_new_names_only_new_rows() -> None:
    table = ChunkTable(initial_capacity=8)
    ks = keys(50, seed=11)
    first = table.upsert_new(keys_array(b"".join(ks[:30])), np.full(30, 1, np.uint64), 1, 3)
    assert d.key_set(first) == set(ks[:30])
    again = table.upsert_new(keys_array(b"".join(ks)), np.full(50, 1, np.uint64), 1, 3)
    assert d.key_set(again) == set(ks[30:])


def test_memory_index_bucket_diff() -> None:
    async def go() -> None:
        index = create_backend(IndexConfig())
        held = keys(1500, seed=12)
        epoch = await index.register_node(
            NodeInfo("a", "a:1"), [InventoryItem(k, 10) for k in held[:1200]], 0.0
        )
        store = Inventory()
        for k in held:
            store.add(k)
        digest = (store.count, store.total)
        known, indexed = await index.heartbeat_held("a", [], 0.0, None, epoch, digest)
        assert known and indexed == (1200, recompute(held[:1200]).total)
        await index.remove_replicas("a", held[:7])  # (a) dropped from the index
        stale = keys(5, seed=13)
        await index.put_end("a", stale, [10] * 5)  # (c) indexed, not held
        # The groups, then the buckets, that differ.
        counts, sums = store.cells()
        groups, cells = await index.reconcile_digests(
            "a", epoch, d.pack_cells(*d.group_cells(counts, sums))
        )
        ic, isums = d.unpack_cells(cells)
        differ = {
            g * 64 + j
            for i, g in enumerate(groups)
            for j in range(64)
            if (ic[i * 64 + j], isums[i * 64 + j]) != (counts[g * 64 + j], sums[g * 64 + j])
        }
        want = {d.key_bucket(k) for k in held[:7] + held[1200:] + stale}
        assert differ == want
        pages = [
            (b, InventoryPage.from_items([InventoryItem(k, 10) for k in store.bucket(b)]))
            for b in sorted(differ)
        ]
        added, extra = await index.reconcile_buckets("a", epoch, pages)
        assert {added[i : i + 16] for i in range(0, len(added), 16)} == set(held[:7] + held[1200:])
        assert {extra[i : i + 16] for i in range(0, len(extra), 16)} == set(stale)
        await index.remove_replicas("a", stale)  # the store reports them
        known, indexed = await index.heartbeat_held("a", [], 0.0, None, epoch, digest)
        assert indexed == digest
        (node,) = (await index.stats(0.0)).nodes
        assert (node.chunks_indexed, node.chunks_held, node.in_sync) == (1500, 1500, True)
        assert (await index.lookup(held, "", 0)).hits == 1500
        await index.close()

    asyncio.run(go())
