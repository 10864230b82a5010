"""Reservations and leases held by one data-plane connection (store/session.py),
and the wire format of the messages that carry them."""

from __future__ import annotations

import pytest

from kvdepot.keys import ChunkKey
from kvdepot.store.chunks import ChunkStore, checksum
from kvdepot.store.session import GrantBudget, Session
from kvdepot.wire import protocol as p

PAGE = 4096


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


@pytest.fixture
def chunks() -> ChunkStore:
    return ChunkStore(16 * PAGE)


def write(chunks: ChunkStore, offset: int, data: bytes) -> None:
    chunks.arena.view(offset, len(data))[:] = data


def test_reserve_write_commit_then_lease_and_release(chunks: ChunkStore) -> None:
    s = Session(chunks, max_held=8)
    data = bytes(range(256)) * 16
    (r,) = s.reserve([p.PutEntry(key(1), len(data), 0)])
    assert r.status is p.PutCode.OK and s.held == 1
    write(chunks, r.offset, data)
    assert s.commit([p.CommitEntry(key(1), checksum(data))]) == [(p.PutCode.OK, len(data))]
    assert chunks.contains(key(1)) and s.held == 0
    whole, part, miss, bad = s.lease(
        [
            p.GetEntry(key(1)),
            p.GetEntry(key(1), 100, 50),
            p.GetEntry(key(2)),
            p.GetEntry(key(1), len(data), 1),
        ]
    )
    assert (whole.status, whole.offset, whole.length) == (p.GetCode.OK, r.offset, len(data))
    assert whole.checksum == checksum(data)
    assert (part.offset, part.length, part.checksum) == (
        r.offset + 100,
        50,
        checksum(data[100:150]),
    )
    assert miss.status is p.GetCode.NOT_FOUND and bad.status is p.GetCode.INVALID
    assert s.held == 2
    assert s.release([whole.lease_id, whole.lease_id, part.lease_id]) == [
        p.HeldCode.OK,
        p.HeldCode.NOT_HELD,
        p.HeldCode.OK,
    ]
    assert s.held == 0


def test_corrupt_commit_is_revoked_and_unknown_keys_are_invalid(chunks: ChunkStore) -> None:
    s = Session(chunks, max_held=8)
    (r,) = s.reserve([p.PutEntry(key(1), PAGE, 0)])
    write(chunks, r.offset, b"x" * PAGE)
    assert s.commit([p.CommitEntry(key(1), 12345), p.CommitEntry(key(9), 0)]) == [
        (p.PutCode.CORRUPT, PAGE),
        (p.PutCode.INVALID, 0),
    ]
    assert not chunks.contains(key(1)) and chunks.stats().used_bytes == 0


@pytest.mark.parametrize("verify", [False, True])
def test_shm_commits_are_rehashed_only_when_asked(chunks: ChunkStore, verify: bool) -> None:
    # A same-host client hashes the arena bytes itself while copying; the
    # store trusts that checksum unless told to verify, and readers always
    # check it: a wrong one is then a miss, never wrong data.
    s = Session(chunks, max_held=8, verify_shm_commits=verify)
    s.attach(p.AttachKind.SHM)
    (r,) = s.reserve([p.PutEntry(key(1), PAGE, 0)])
    write(chunks, r.offset, b"z" * PAGE)
    wrong = checksum(b"z" * PAGE) ^ 1
    ((code, _),) = s.commit([p.CommitEntry(key(1), wrong)])
    if verify:
        assert code is p.PutCode.CORRUPT and not chunks.contains(key(1))
        return
    assert code is p.PutCode.OK
    (lease,) = s.lease([p.GetEntry(key(1))])
    assert lease.checksum == wrong != checksum(chunks.arena.view(lease.offset, PAGE))


def test_nixl_commits_are_always_verified(chunks: ChunkStore) -> None:
    s = Session(chunks, max_held=8, verify_shm_commits=False)
    s.attach(p.AttachKind.NIXL)
    (r,) = s.reserve([p.PutEntry(key(1), PAGE, 0)])
    write(chunks, r.offset, b"n" * PAGE)
    assert s.commit([p.CommitEntry(key(1), 7)]) == [(p.PutCode.CORRUPT, PAGE)]


def test_close_drops_everything_the_connection_held(chunks: ChunkStore) -> None:
    s = Session(chunks, max_held=8)
    (r,) = s.reserve([p.PutEntry(key(1), PAGE, 0)])
    write(chunks, r.offset, b"y" * PAGE)
    s.commit([p.CommitEntry(key(1), checksum(b"y" * PAGE))])
    s.lease([p.GetEntry(key(1))])
    s.reserve([p.PutEntry(key(2), 2 * PAGE, 0)])
    assert chunks.stats().used_bytes == 3 * PAGE
    assert s.abort([key(3)]) == [p.HeldCode.NOT_HELD]
    s.close()
    assert chunks.stats().used_bytes == PAGE  # the committed chunk stays, unleased
    assert chunks.delete(key(1)) and chunks.stats().used_bytes == 0


def test_limits_and_nixl_accounting(chunks: ChunkStore) -> None:
    seen: list[int] = []
    s = Session(chunks, max_held=2, on_held=seen.append)
    s.reserve([p.PutEntry(key(1), PAGE, 0)])
    assert seen == []  # not a NIXL session yet
    s.attach(p.AttachKind.NIXL)
    assert seen == [1]
    with pytest.raises(p.ProtocolError) as info:
        s.reserve([p.PutEntry(key(2), PAGE, 0), p.PutEntry(key(3), PAGE, 0)])
    assert info.value.code is p.ErrorCode.LIMIT_EXCEEDED
    assert s.abort([key(1)]) == [p.HeldCode.OK]
    assert sum(seen) == 0


def test_session_messages_round_trip() -> None:
    info = p.AttachInfo(
        7, 1 << 30, 5, 6, p.AttachFlags.SHM | p.AttachFlags.NIXL, "/dev/shm/a", "boot:x", "h:1"
    )
    assert p.unpack_attach_info(info.pack()) == info
    with pytest.raises(p.ProtocolError):
        p.unpack_attach_info(info.pack()[:-1])
    leases = [
        p.LeaseReplyEntry(p.GetCode.OK, 3, 4096, 100, 99),
        p.LeaseReplyEntry(p.GetCode.NOT_FOUND),
    ]
    assert p.unpack_lease_reply_entries(p.pack_lease_reply_entries(leases)) == leases
    reserved = [p.ReserveReplyEntry(p.PutCode.OK, 8192), p.ReserveReplyEntry(p.PutCode.NO_SPACE)]
    assert p.unpack_reserve_reply_entries(p.pack_reserve_reply_entries(reserved)) == reserved
    commits = [p.CommitEntry(key(1), 2**64 - 1)]
    assert p.unpack_commit_entries(p.pack_commit_entries(commits)) == commits
    assert p.unpack_lease_ids(p.pack_lease_ids([1, 2**63])) == [1, 2**63]
    with pytest.raises(p.ProtocolError):
        p.unpack_statuses(bytes([0, 77]), p.PutCode)
    sizes = (p.RESERVE_REPLY_ENTRY.size, p.COMMIT_ENTRY.size, p.LEASE_REPLY_ENTRY.size)
    assert sizes == (16, 24, 40) and p.ATTACH_INFO.size == 48


def shm_session(chunks: ChunkStore, **kw: bool) -> Session:
    s = Session(chunks, max_held=8, **kw)
    s.attach(p.AttachKind.SHM)
    return s


def test_grants_become_chunks_under_the_key_committed(chunks: ChunkStore) -> None:
    s = shm_session(chunks)
    a, b = s.grant([PAGE, 2 * PAGE])
    assert a.status is b.status is p.PutCode.OK and s.granted
    # Room ahead of any key: no reader sees it, no reservation is held.
    assert s.held == 0 and chunks.stats().chunks == 0
    assert chunks.stats().used_bytes == 3 * PAGE
    write(chunks, a.offset, b"a" * PAGE)
    write(chunks, b.offset, b"b" * 2 * PAGE)
    got = s.commit_granted(
        [
            p.CommitEntry(key(1), checksum(b"a" * PAGE), a.offset),
            p.CommitEntry(key(2), checksum(b"b" * 2 * PAGE), b.offset),
            p.CommitEntry(key(3), 0, a.offset),  # used already
        ]
    )
    assert got == [(p.PutCode.OK, PAGE), (p.PutCode.OK, 2 * PAGE), (p.PutCode.INVALID, 0)]
    assert not s.granted
    (lease,) = s.lease([p.GetEntry(key(2))])
    assert lease.offset == b.offset and lease.checksum == checksum(b"b" * 2 * PAGE)
    s.release([lease.lease_id])
    # A key stored already: the grant is freed, the stored chunk untouched.
    (c,) = s.grant([PAGE])
    write(chunks, c.offset, b"c" * PAGE)
    assert s.commit_granted([p.CommitEntry(key(1), 5, c.offset)]) == [(p.PutCode.EXISTS, PAGE)]
    assert chunks.stats().used_bytes == 3 * PAGE and chunks.stats().chunks == 2
    (lease,) = s.lease([p.GetEntry(key(1))])
    assert lease.checksum == checksum(b"a" * PAGE)


def test_grants_are_bounded_replaced_and_freed_with_the_connection(
    chunks: ChunkStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvdepot.store import session

    monkeypatch.setattr(session, "MAX_GRANTED_BYTES", 3 * PAGE)
    s = shm_session(chunks)
    codes = [r.status for r in s.grant([PAGE, PAGE, PAGE, PAGE, 0])]
    assert codes == [p.PutCode.OK] * 3 + [p.PutCode.NO_SPACE, p.PutCode.INVALID]
    # Asking again drops the unused grants first.
    (r,) = s.grant([2 * PAGE], replace=True)
    assert r.status is p.PutCode.OK and chunks.stats().used_bytes == 2 * PAGE
    s.close()
    assert chunks.stats().used_bytes == 0 and not s.granted


def test_the_grant_budget_scales_with_dram_and_bounds_every_connection_together(
    chunks: ChunkStore,
) -> None:
    MiB = 1 << 20
    assert GrantBudget(64 * MiB).per_connection == 8 * MiB  # never below 8 MiB
    assert GrantBudget(512 * MiB).per_connection == 16 * MiB  # 1/32 of DRAM
    assert GrantBudget(4096 * MiB).per_connection == p.MAX_GRANTED_BYTES
    # All connections of a store share a quarter of its DRAM (4 pages here).
    budget = GrantBudget(chunks.capacity)
    first = Session(chunks, max_held=8, grants=budget)
    second = Session(chunks, max_held=8, grants=budget)
    for s in (first, second):
        s.attach(p.AttachKind.SHM)
    assert [r.status for r in first.grant([2 * PAGE, 2 * PAGE])] == [p.PutCode.OK] * 2
    assert [r.status for r in second.grant([PAGE])] == [p.PutCode.NO_SPACE]
    # Used grants come back to the budget as their chunks are committed.
    a = [r.offset for r in first.grant([PAGE, PAGE], replace=True)]
    assert [r.status for r in second.grant([2 * PAGE])] == [p.PutCode.OK]
    assert [r.status for r in second.grant([PAGE])] == [p.PutCode.NO_SPACE]
    write(chunks, a[0], b"g" * PAGE)
    committed = first.commit_granted([p.CommitEntry(key(1), checksum(b"g" * PAGE), a[0])])
    assert committed == [(p.PutCode.OK, PAGE)]
    assert [r.status for r in second.grant([PAGE])] == [p.PutCode.OK]
    first.close()  # its last grant goes back too
    assert [r.status for r in second.grant([PAGE])] == [p.PutCode.OK]
    second.close()
    assert chunks.stats().used_bytes == PAGE  # the committed chunk


def test_only_shm_connections_are_granted_and_verified_when_asked(chunks: ChunkStore) -> None:
    nixl = Session(chunks, max_held=8)
    nixl.attach(p.AttachKind.NIXL)
    assert [r.status for r in nixl.grant([PAGE])] == [p.PutCode.INVALID]
    s = shm_session(chunks, verify_shm_commits=True)
    (r,) = s.grant([PAGE])
    write(chunks, r.offset, b"v" * PAGE)
    wrong = checksum(b"v" * PAGE) ^ 1
    assert s.commit_granted([p.CommitEntry(key(1), wrong, r.offset)]) == [(p.PutCode.CORRUPT, PAGE)]
    assert not chunks.contains(key(1)) and chunks.stats().used_bytes == 0


def test_granted_commit_entries_round_trip() -> None:
    commits = [p.CommitEntry(key(1), 2**64 - 1, 4096), p.CommitEntry(key(2), 3, 0)]
    packed = p.pack_commit_entries(commits, granted=True)
    assert len(packed) == 2 * p.GRANTED_COMMIT_ENTRY.size == 64
    assert p.unpack_commit_entries(packed, granted=True) == commits
    with pytest.raises(p.ProtocolError):
        p.unpack_commit_entries(packed[:-1], granted=True)
