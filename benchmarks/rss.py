"""Resident memory of a process under load, sampled in the background."""

from __future__ import annotations

import contextlib
import threading

KiB = 1 << 10


class RssSampler:
    """Samples a process's resident memory in the background (max seen)."""

    def __init__(self, pid: int) -> None:
        self._pid = pid
        self.max_rss = self.max_anon = self.max_shmem = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _read(self) -> dict[str, int]:
        out: dict[str, int] = {}
        with contextlib.suppress(OSError), open(f"/proc/{self._pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssShmem"):
                    out[key] = int(value.split()[0]) * KiB
        return out

    def _loop(self) -> None:
        while not self._stop.wait(0.05):
            s = self._read()
            self.max_rss = max(self.max_rss, s.get("VmRSS", 0))
            self.max_anon = max(self.max_anon, s.get("RssAnon", 0))
            self.max_shmem = max(self.max_shmem, s.get("RssShmem", 0))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)
