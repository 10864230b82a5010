"""Removals the store's data-plane threads report reach its event loop whole,
waking it once for all that came before it ran (a full store evicts a chunk
for most reservations: one wakeup each took the GIL from the data plane)."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from typing import Any

from kvdepot.keys import ChunkKey
from kvdepot.store.config import StoreConfig
from kvdepot.store.daemon import StoreDaemon


def test_removals_before_the_loop_runs_wake_it_once_and_none_is_lost() -> None:
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
        threads = [
            threading.Thread(target=daemon._on_removed, args=(keys[i : i + 10],))
            for i in range(0, 40, 10)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(wakeups) == 1
        loop.run_until_complete(asyncio.sleep(0))
        assert daemon._removed == set(keys)

        # Once the loop took them, the next removal wakes it again.
        later = ChunkKey(os.urandom(16))
        daemon._on_removed([later])
        assert len(wakeups) == 2
        loop.run_until_complete(asyncio.sleep(0))
        assert later in daemon._removed
    finally:
        loop.close()
        daemon.chunks.close()
