"""Floors: the raw references plus the checksums kvdepot's invariant requires.

Every chunk kvdepot moves carries its xxh3-64, computed by the writer and
checked by the reader. These rows show what that costs a transport with
nothing else in it, in the same rounds as the rest:

* ``raw-tcp-xxh3``: ``raw-tcp`` whose get receives each block of
  ``HASH_BLOCK`` bytes into the destination with ``recv_into`` and hashes it
  right away (as the ``tcp`` transport's reader does, see
  :func:`kvdepot.wire.sockets.recv_hashed_into`), and whose put hashes each
  block of the source right after ``sendall`` handed it to the kernel (as a
  PUT_TRAILED writer does). The server is raw-tcp's: it does not hash what
  it receives (a store checks a put's checksum as it receives it); a
  visible put is raw-tcp's with these sends;
* ``raw-shm-xxh3``: ``raw-shm`` whose put copies with the writer's checksums
  through the ``shm`` transport's own :class:`~kvdepot.connector.transport.shm.Copier`
  (``hash_dst=False``; several threads from 4 MiB a batch, as kvdepot-shm's
  puts) and whose get copies and hashes what it copied (``hash_dst=True``),
  on one thread, as raw-shm copies; a visible put is raw-shm's with this copy.

Every digest is compared with one computed in ``prepare``, so the hashing
cannot be skipped; a mismatch raises.

Used by ``benchmarks/dataplane.py`` (``--systems raw-tcp-xxh3,raw-shm-xxh3``)
and ``benchmarks/peers.py`` (run by default).
"""

from __future__ import annotations

import socket

import numpy as np

from benchmarks.systems import RawShm, RawTcp
from kvdepot.connector.transport.shm import DEFAULT_COPY_THREADS, Copier, copy_hashed
from kvdepot.wire.protocol import HASH_BLOCK
from kvdepot.wire.sockets import recv_hashed_into
from kvdepot.wire.xxh3 import BlockHasher, xxh3_64


def _send_hashed(sock: socket.socket, view: memoryview) -> int:
    """Send ``view`` block by block, hashing each block right after it was sent."""
    total = view.nbytes
    hasher = BlockHasher(view)
    for start in range(0, total, HASH_BLOCK):
        end = min(start + HASH_BLOCK, total)
        sock.sendall(view[start:end])
        hasher.update(start, end)
    return hasher.digest()


class RawTcpXxh3(RawTcp):
    """raw-tcp, its get hashing what arrives and its put hashing what it sends."""

    name = "raw-tcp-xxh3"

    def prepare(self, size: int, batch: int) -> None:
        super().prepare(size, batch)
        self._put_sums = [xxh3_64(b) for b in self._src]
        # raw-tcp's server answers a get with its own buffers of ones.
        self._get_sum = xxh3_64(memoryview(np.ones(size, dtype=np.uint8)))

    def _send(self, k: int) -> None:
        sums = [_send_hashed(self._sock, b) for b in self._src[:k]]
        if sums != self._put_sums[:k]:
            raise RuntimeError(f"{self.name}: put checksums differ from the source's")

    def get(self) -> None:
        self._sock.sendall(b"g")
        for b in self._dst:
            if recv_hashed_into(self._sock, b) != self._get_sum:
                raise RuntimeError(f"{self.name}: get checksum mismatch")


class RawShmXxh3(RawShm):
    """raw-shm, copying with checksums as the ``shm`` transport does."""

    name = "raw-shm-xxh3"

    def prepare(self, size: int, batch: int) -> None:
        super().prepare(size, batch)
        self._src_views = [memoryview(s) for s in self._src]
        self._dst_views = [memoryview(d) for d in self._dst]
        self._slot_views = [[memoryview(d) for d in slot] for slot in self._slots]
        self._sums = [xxh3_64(v) for v in self._src_views]  # slot 0 holds the source
        self._copier = Copier(DEFAULT_COPY_THREADS)

    def _copy_in(self, k: int) -> None:
        self._next = self._next % (len(self._slot_views) - 1) + 1  # slot 0 is what gets read
        dst = self._slot_views[self._next]
        jobs = [(d, s, False) for s, d in zip(self._src_views[:k], dst[:k], strict=True)]
        sums = list(self._copier.map(jobs))
        if sums != self._sums[:k]:
            raise RuntimeError(f"{self.name}: put checksums differ from the source's")

    def get(self) -> None:
        self._sock.sendall(b"g")
        self._sock.recv(1)
        src = self._slot_views[0]
        sums = [copy_hashed(d, s, hash_dst=True) for s, d in zip(src, self._dst_views, strict=True)]
        if sums != self._sums:
            raise RuntimeError(f"{self.name}: get checksum mismatch")

    def close(self) -> None:
        # The views hold the segment's mapping: drop them before raw-shm unmaps it.
        self._src_views, self._dst_views, self._slot_views = [], [], []
        if getattr(self, "_copier", None) is not None:
            self._copier.close()
            self._copier = None
        super().close()
