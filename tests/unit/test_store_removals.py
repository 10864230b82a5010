"""Removals the store's data-plane threads report wait for the reporter
whole, waking the event loop once per report (a full store evicts a chunk
for most reservations: a wakeup each cost the evicting thread a syscall and
the data plane the GIL)."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from typing import Any

from kvdepot.keys import ChunkKey
from kvdepot.store.config import StoreConfig
from kvdepot.store.daemon import StoreDaemon


def test_removals_wake_the_loop_once_until_the_reporter_takes_them() -> None:
    daemon = StoreDaemon(StoreConfig(capacity_bytes=8 << 20, shm=False))
    loop = asyncio.new_event_loop()
    try:
        wakeups: list[Callable[..., Any]] = []
        real = loop.call_soon_threadsafe

        def counting(callback: Callable[..., Any], *args: Any) -> Any:
            wakeups.append(callback)
            return real(callback, *args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        daemon._loop = loop
        keys = [ChunkKey(os.urandom(16)) for _ in range(40)]

        def remove(part: list[ChunkKey]) -> None:
            for k in part:  # one eviction at a time, as reservations evict
                daemon._on_removed([k])

        parts = [keys[i : i + 10] for i in range(0, 40, 10)]
        threads = [threading.Thread(target=remove, args=(part,)) for part in parts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(wakeups) == 1
        # The loop ran: the reporter is awake, and nothing more woke it.
        loop.run_until_complete(asyncio.sleep(0))
        assert daemon._removed_event.is_set()
        daemon._on_removed([ChunkKey(os.urandom(16))])
        assert len(wakeups) == 1

        # The reporter takes them all, and the next removal wakes it again.
        daemon._removed_event.clear()
        daemon._take_removed()
        assert set(keys) <= daemon._removed and daemon._removed_count == 41
        later = ChunkKey(os.urandom(16))
        daemon._on_removed([later])
        assert len(wakeups) == 2
        loop.run_until_complete(asyncio.sleep(0))
        assert daemon._removed_event.is_set()
        daemon._take_removed()
        assert later in daemon._removed
    finally:
        loop.close()
        daemon.chunks.close()
