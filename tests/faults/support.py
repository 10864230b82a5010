"""Helpers shared by the fault tests: payloads, sentinel buffers and the
check that a read handed back exactly the published bytes or a miss."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from kvdepot.connector.client import GetResult
from kvdepot.proto.gen import store_pb2, store_pb2_grpc

SENTINEL = 0xA5
"""Fill of every read buffer before a get: shows which misses the reader touched."""


def payload(key: bytes, size: int) -> np.ndarray:
    """The bytes published under ``key``: derived from the key, so any reader can check them."""
    rng = np.random.default_rng(int.from_bytes(key, "little"))
    return np.frombuffer(rng.bytes(size), dtype=np.uint8)


def sentinel_buffers(count: int, size: int) -> list[np.ndarray]:
    return [np.full(size, SENTINEL, dtype=np.uint8) for _ in range(count)]


@dataclass(slots=True)
class ReadTally:
    """What a series of reads handed back, chunk by chunk.

    Attributes:
        exact: Chunks reported loaded whose bytes are the published ones.
        wrong: Chunks reported loaded whose bytes differ: served wrong.
        misses: Chunks reported as misses.
        touched_misses: Misses whose buffer is no longer all sentinel (the
            client documents a miss's buffer as undefined; counted, not an error).
    """

    exact: int = 0
    wrong: int = 0
    misses: int = 0
    touched_misses: int = 0

    def add(
        self,
        keys: Sequence[bytes],
        buffers: Sequence[np.ndarray],
        result: GetResult,
        expected: Callable[[bytes], np.ndarray],
    ) -> int:
        """Check one ``get_into`` result; returns the chunks it loaded."""
        loaded = 0
        received = 0
        for key, buf, ok in zip(keys, buffers, result.loaded, strict=True):
            if ok:
                want = expected(key)
                if np.array_equal(buf[: want.size], want):
                    self.exact += 1
                else:
                    self.wrong += 1
                loaded += 1
                received += want.size
            else:
                self.misses += 1
                if not (buf == SENTINEL).all():
                    self.touched_misses += 1
        # The byte count the client reports is the loaded chunks', no more.
        assert result.bytes_received == received, (result.bytes_received, received)
        return loaded


def store_stats(grpc_address: str) -> store_pb2.StoreStats:
    with grpc.insecure_channel(grpc_address) as ch:
        return store_pb2_grpc.StoreStub(ch).GetStats(store_pb2.StoreStatsRequest(), timeout=5)


def wait_for(cond: Callable[[], object], timeout_s: float, what: str) -> None:
    """Poll ``cond`` until it is truthy; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.1f} s"
        time.sleep(0.05)
