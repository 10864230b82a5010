"""Slow processes down: each runs ``--run-ms`` of every ``--run-ms + --stop-ms``.

A store made slow without touching its code (SIGSTOP, then SIGCONT), for the
benchmarks where loading cannot pay. Runs as a process of its own, started
with a death signal: when it ends, however the benchmark that started it
ends, it continues every process it stopped first (a stopped process would
otherwise keep its own death signal pending, and live on stopped).

    python benchmarks/throttle.py [--run-ms 2] [--stop-ms 250] PID [PID ...]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repo root

from benchmarks.procs import popen, terminate


def cycle(pids: Sequence[int], run_s: float, stop_s: float, done: threading.Event) -> None:
    """Stop and continue ``pids`` until ``done``; they are left running."""
    try:
        while not done.is_set():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
            done.wait(stop_s)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            done.wait(run_s)
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def throttled(pids: Sequence[int], run_ms: float = 2.0, stop_ms: float = 250.0) -> Iterator[None]:
    """``pids`` slowed down meanwhile, by a throttle process of their own."""
    cmd = [sys.executable, str(Path(__file__).resolve())]
    cmd += ["--run-ms", str(run_ms), "--stop-ms", str(stop_ms), *map(str, pids)]
    proc = popen(cmd, death_signal=signal.SIGTERM, stdin=subprocess.DEVNULL)
    try:
        yield
    finally:
        terminate(proc)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--run-ms", type=float, default=2.0)
    p.add_argument("--stop-ms", type=float, default=250.0)
    p.add_argument("pids", type=int, nargs="+")
    args = p.parse_args(argv)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    cycle(args.pids, args.run_ms / 1000, args.stop_ms / 1000, done)
    return 0


if __name__ == "__main__":
    sys.exit(main())
