"""A benchmark's processes die with it (``benchmarks/procs.py``), even on SIGKILL.

A killed benchmark used to leave its daemons running, with their memory
(a store's arena is a file in /dev/shm: RAM until unlinked). Here a
process does what a benchmark does (a kvdepot cluster through
``procs.Cluster``, a program through ``procs.popen``, a multiprocessing
child through ``procs.process``), then is killed; every child must be gone
within a few seconds, and the store must have freed its arena.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BENCHMARK = f"""
import json, multiprocessing as mp, subprocess, sys, time
sys.path.insert(0, {str(ROOT)!r})
from benchmarks import procs

if __name__ == "__main__":
    procs.stop_on_sigterm()
    cluster = procs.Cluster(nodes=1, capacity="16MiB", stderr=subprocess.DEVNULL)
    cluster.start()
    try:
        sleeper = procs.popen([sys.executable, "-c", "import time; time.sleep(600)"])
        child = procs.process(mp.get_context("spawn"), time.sleep, (600,), daemon=True)
        child.start()
        pids = {{"metadata": cluster.metadata.pid, "store": cluster.stores[0].pid,
                 "popen": sleeper.pid, "process": child.pid}}
        print(json.dumps(pids), flush=True)
        time.sleep(600)
    finally:
        cluster.stop()
"""


def _alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by its new parent, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _arena_files(store_pid: int) -> list[str]:
    # default_arena_path: kvdepot-<node>-<pid namespace>-<pid>
    return glob.glob(f"/dev/shm/kvdepot-*-{store_pid}")


def _start(tmp_path: Path) -> tuple[subprocess.Popen[str], dict[str, int]]:
    script = tmp_path / "bench.py"
    script.write_text(BENCHMARK)
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        _, err = proc.communicate(timeout=30)
        pytest.fail(f"the benchmark did not start: {err[-2000:]}")
    pids: dict[str, int] = json.loads(line)
    assert all(_alive(p) for p in pids.values()), pids
    return proc, pids


def _gone_within(pids: dict[str, int], timeout_s: float) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        left = {name: pid for name, pid in pids.items() if _alive(pid)}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _kill_leftovers(pids: dict[str, int]) -> None:
    for pid in pids.values():
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_children_die_with_the_benchmark(tmp_path: Path, sig: signal.Signals) -> None:
    proc, pids = _start(tmp_path)
    has_arena = bool(_arena_files(pids["store"]))
    try:
        proc.send_signal(sig)
        rc = proc.wait(timeout=30)
        left = _gone_within(pids, 15)
        assert not left, f"still running after {sig.name} of the benchmark: {left}"
        if sig == signal.SIGTERM:  # unwound: the cluster was stopped in its finally
            assert rc == 128 + signal.SIGTERM, proc.stderr.read() if proc.stderr else ""
        # The store was stopped by SIGTERM (its parent-death signal): it freed its arena.
        assert not has_arena or not _arena_files(pids["store"])
    finally:
        _kill_leftovers(pids)
        proc.kill()
        proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def test_children_are_refused_from_another_thread() -> None:
    """Their parent-death signal would fire when that thread ends."""
    import threading

    sys.path.insert(0, str(ROOT))
    from benchmarks import procs

    errors: list[BaseException] = []

    def start() -> None:
        try:
            procs.popen([sys.executable, "-c", "pass"]).wait()
        except RuntimeError as exc:
            errors.append(exc)

    t = threading.Thread(target=start)
    t.start()
    t.join()
    assert errors and "main thread" in str(errors[0])
