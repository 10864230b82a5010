"""Process helpers shared by the tests that freeze daemons."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def freeze(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it is stopped.

    ``kill`` returns before the stop lands: the kernel wakes one thread,
    which then stops the others. On a loaded host the process answers
    requests meanwhile, for milliseconds, so a test that expects silence
    waits here first.
    """
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = set()
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                states.add((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
            except OSError:
                continue  # a thread that just ended
        if states <= {"T", "t"}:
            return
        time.sleep(0.002)
    raise AssertionError(f"process {pid} did not stop within {timeout_s} s")
