"""Hashing while sending and receiving (kvdepot/wire/sockets.py) and the shm copy."""

from __future__ import annotations

import os
import random
import socket
import threading

import pytest

from kvdepot.connector.transport.shm import Copier, copy_hashed
from kvdepot.store.chunks import checksum
from kvdepot.wire.sockets import CHECKSUM_SIZE, recv_exact, recv_hashed_into, send_hashed
from kvdepot.wire.xxh3 import xxh3_64


def test_send_hashed_then_recv_hashed_agree_with_checksum() -> None:
    payloads = [os.urandom(n) for n in (1, 1000, 3 * 65536 + 5)]
    a, b = socket.socketpair()
    sums: list[int] = []
    sender = threading.Thread(
        target=lambda: sums.extend(
            send_hashed(a, [b"head"], [memoryview(x) for x in payloads], block=65536)
        )
    )
    sender.start()
    assert recv_exact(b, 4) == b"head"
    for data in payloads:
        buf = bytearray(len(data))
        got = recv_hashed_into(b, memoryview(buf), block=65536)
        trailer = int.from_bytes(recv_exact(b, CHECKSUM_SIZE), "little")
        assert buf == data and got == trailer == checksum(data)
    sender.join(5)
    assert sums == [checksum(d) for d in payloads]
    a.close()
    b.close()


def test_copy_hashed_copies_and_hashes_either_side() -> None:
    for n in (1, 4096, 5 * 65536 + 3):
        src = os.urandom(n)
        dst = bytearray(n)
        assert copy_hashed(
            memoryview(dst), memoryview(src), hash_dst=False, block=65536
        ) == checksum(src)
        assert dst == src
        dst2 = bytearray(n)
        assert copy_hashed(
            memoryview(dst2), memoryview(src), hash_dst=True, block=65536
        ) == checksum(src)


def test_xxh3_without_the_gil_matches_xxhash() -> None:
    import xxhash

    from kvdepot.wire.xxh3 import Xxh3Stream, xxh3_64

    for n in (0, 1, 1000, 64 << 10, (1 << 20) + 7):
        data = memoryview(os.urandom(n))
        stream = Xxh3Stream()
        stream.update(data[: n // 3])
        stream.update(data[n // 3 :])
        assert xxh3_64(data) == stream.digest() == xxhash.xxh3_64_intdigest(data)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_copier_copies_a_batch_on_several_threads_in_order(threads: int) -> None:
    rng = random.Random(threads)
    sizes = [rng.randrange(1, 3 << 20) for _ in range(9)] + [1 << 20, 1]
    srcs = [rng.randbytes(n) for n in sizes]
    dsts = [bytearray(n) for n in sizes]
    copier = Copier(threads, parallel_bytes=1)
    try:
        jobs = [
            (memoryview(d), memoryview(s), i % 2 == 0)
            for i, (d, s) in enumerate(zip(dsts, srcs, strict=True))
        ]
        assert list(copier.map(jobs)) == [checksum(s) for s in srcs]
        assert dsts == [bytearray(s) for s in srcs]
    finally:
        copier.close()


def test_copier_refuses_zero_threads() -> None:
    from kvdepot.errors import InvalidArgument

    with pytest.raises(InvalidArgument):
        Copier(0)


def test_closing_the_copier_early_waits_for_every_copy() -> None:
    # A put that fails halfway gives its reservations back: no copy may
    # still be writing into them then.
    import contextlib

    copier = Copier(2, parallel_bytes=1)
    try:
        srcs = [os.urandom(8 << 20) for _ in range(6)]
        dsts = [bytearray(len(s)) for s in srcs]
        jobs = [(memoryview(d), memoryview(s), False) for d, s in zip(dsts, srcs, strict=True)]
        with contextlib.closing(copier.map(jobs)) as sums:
            next(sums)
        # Closed after one answer: what started has finished, what had not
        # started never will.
        done = [d == bytearray(s) for d, s in zip(dsts, srcs, strict=True)]
        untouched = [d == bytearray(len(d)) for d in dsts]
        assert all(a or b for a, b in zip(done, untouched, strict=True))
        snapshot = [bytes(d) for d in dsts]
        threading.Event().wait(0.2)
        assert [bytes(d) for d in dsts] == snapshot
    finally:
        copier.close()


def test_a_copy_thread_that_stalls_leaves_the_rest_of_the_batch_to_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # On two cores the store's and the index's work takes a copy thread's
    # core now and then: the batch must not wait for that thread's share.
    from kvdepot.connector.transport import shm

    copied_here: list[int] = []
    others_done = threading.Event()
    main = threading.get_ident()
    real = shm.copy_hashed
    n = 6

    def copy(dst: memoryview, src: memoryview, *, hash_dst: bool) -> int:
        if threading.get_ident() == main:
            copied_here.append(src.nbytes)
            if len(copied_here) == n - 1:
                others_done.set()
        else:
            # The helper's first chunk waits until the caller copied the rest.
            assert others_done.wait(10), "the caller left chunks to a stalled helper"
        return real(dst, src, hash_dst=hash_dst)

    monkeypatch.setattr(shm, "copy_hashed", copy)
    copier = Copier(2, parallel_bytes=1)
    try:
        srcs = [os.urandom(4096 + k) for k in range(n)]
        dsts = [bytearray(len(s)) for s in srcs]
        jobs = [(memoryview(d), memoryview(s), False) for d, s in zip(dsts, srcs, strict=True)]
        sums = list(copier.map(jobs))
    finally:
        copier.close()
    assert sums == [xxh3_64(memoryview(s)) for s in srcs]  # in job order
    assert dsts == [bytearray(s) for s in srcs]
    assert len(copied_here) == n - 1
