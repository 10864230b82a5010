"""A daemon's shutdown runs to its end whatever signals arrive.

Ctrl-C sends SIGINT to the whole process group: the stores of ``kvdepot up``
get it while ``up`` sends them SIGTERM, and an impatient user presses it
twice. Each store must still free its arena (a file in /dev/shm: RAM until
unlinked), every daemon must stop its gRPC server before its event loop
closes (else ``Exception ignored in: Server.__del__``), and nothing may be
left running. It was intermittent, so each case runs a few times.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvdepot.apps.cluster import LocalCluster, wait_ready
from kvdepot.errors import Unavailable
from tests.conftest import free_port

pytestmark = pytest.mark.integration

RUNS = 2  # per case: a leak showed in 2 of 3 runs, or 3 of 3 with --metrics


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    out = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(Path(stat).parent.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def arenas_of(pids: list[int]) -> list[str]:
    """Arena files in /dev/shm of these store processes (named by pid)."""
    return [p for pid in pids for p in glob.glob(f"/dev/shm/kvdepot-*-{pid}")]


def where_it_hung(proc: subprocess.Popen[str]) -> str:
    """What ``up`` and its daemons write on SIGUSR1 (their threads and
    tasks), and the processes of its group, after which the group is killed."""
    ps = subprocess.run(
        ["ps", "-o", "pid,ppid,stat,etime,args", "-g", str(proc.pid)],
        capture_output=True,
        text=True,
    ).stdout
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGUSR1)
        time.sleep(2)
        os.killpg(proc.pid, signal.SIGKILL)
    _, stderr = proc.communicate()
    return f"{ps}\n{stderr[-12000:]}"


def assert_clean_stderr(stderr: str) -> None:
    assert "Exception ignored" not in stderr, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert "never awaited" not in stderr, stderr[-3000:]


def spawn_up(metrics: bool, stdout: int) -> subprocess.Popen[str]:
    """``kvdepot up`` of 2 stores in its own process group, as from a terminal."""
    cmd = [
        sys.executable, "-m", "kvdepot.apps.cli", "up",
        "--nodes", "2",
        "--metadata-port", str(free_port()),
        "--capacity", "16MiB",
        *(["--metrics"] if metrics else []),
    ]  # fmt: skip
    return subprocess.Popen(
        cmd,
        stdout=stdout,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
        # As a terminal starts it. A shell starts background jobs with SIGINT
        # ignored and children inherit that: a Ctrl-C before `up` installs
        # its handler would be lost (a hang seen in a make test run in the
        # background, never in the foreground).
        preexec_fn=default_sigint,
    )


def default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_up(metrics: bool) -> tuple[subprocess.Popen[str], list[int]]:
    """``kvdepot up`` and its daemons' pids, once it says they all run."""
    proc = spawn_up(metrics, subprocess.PIPE)
    assert proc.stdout is not None
    stores = []
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        if m := re.search(r"^  store \S+: .*, pid (\d+)$", line):
            stores.append(int(m.group(1)))
        if line.startswith("Ctrl-C stops all"):
            break
        assert time.monotonic() < deadline
    assert len(stores) == 2, "kvdepot up did not start its stores"
    assert len(arenas_of(stores)) == 2
    return proc, stores


@pytest.mark.parametrize("metrics", [False, True], ids=["plain", "metrics"])
@pytest.mark.parametrize("signals", [1, 2], ids=["ctrl-c", "ctrl-c-twice"])
def test_ctrl_c_on_up_frees_every_arena(metrics: bool, signals: int) -> None:
    for _ in range(RUNS):
        proc, stores = start_up(metrics)
        daemons = children(proc.pid)
        assert set(stores) <= set(daemons) and len(daemons) == 3, daemons
        try:
            for i in range(signals):
                if i:
                    time.sleep(0.05)  # the second lands mid-shutdown
                os.killpg(proc.pid, signal.SIGINT)
            _, stderr = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        assert proc.returncode == 0, stderr[-3000:]
        assert_clean_stderr(stderr)
        assert not arenas_of(stores), "a store left its arena in /dev/shm"
        assert not [p for p in daemons if alive(p)], "a daemon outlived kvdepot up"


def test_a_store_signalled_again_while_stopping_frees_its_arena(tmp_path: Path) -> None:
    meta = subprocess.Popen(
        [sys.executable, "-m", "kvdepot.apps.cli", "metadata", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
    )
    try:
        port = wait_ready(meta, "metadata", 60)["port"]
        for sig in (signal.SIGTERM, signal.SIGINT):
            log = tmp_path / f"store-{sig.name}.log"
            cmd = [
                sys.executable, "-m", "kvdepot.apps.cli", "store",
                "--node-id", f"twice-{sig.name}",
                "--port", "0",
                "--metadata", f"127.0.0.1:{port}",
                "--capacity", "16MiB",
                "--metrics-port", "0",
            ]  # fmt: skip
            with open(log, "wb") as err:
                store = subprocess.Popen(
                    cmd,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    stdin=subprocess.DEVNULL,
                )
            try:
                info = wait_ready(store, "store", 60)
                assert os.path.exists(info["arena_path"])
                # A supervisor's SIGTERM, then more while it stops (closing
                # /metrics alone takes a moment). Signals sent at once merge.
                for s in (signal.SIGTERM, sig, sig):
                    store.send_signal(s)
                    time.sleep(0.05)
                assert store.wait(timeout=30) == 0
            finally:
                if store.poll() is None:
                    store.kill()
                    store.wait()
                assert store.stdout is not None
                store.stdout.close()
            assert not os.path.exists(info["arena_path"])
            text = log.read_text()
            assert_clean_stderr(text)
    finally:
        meta.terminate()
        meta.wait(timeout=30)
        assert meta.stdout is not None
        meta.stdout.close()


def test_ctrl_c_while_up_starts_stops_everything_quietly() -> None:
    # At various points of the start: daemons importing, binding, registering.
    for delay in (0.3, 0.8, 1.3, 2.0):
        proc = spawn_up(True, subprocess.DEVNULL)
        daemons: set[int] = set()
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline:
            daemons.update(children(proc.pid))
            time.sleep(0.02)
        try:
            daemons.update(children(proc.pid))
            os.killpg(proc.pid, signal.SIGINT)
            try:
                _, stderr = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                pytest.fail(f"kvdepot up did not stop (at {delay} s): {where_it_hung(proc)}")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        # Interrupted while starting (130), or once it had started (0); on a
        # loaded machine the signal may even come while the interpreter
        # itself starts, before any of kvdepot runs: killed by it (-2), or
        # Python's own KeyboardInterrupt from its start-up imports.
        python_start = not stderr or stderr.rstrip().endswith("\nKeyboardInterrupt")
        if proc.returncode in (-signal.SIGINT, 1) and not daemons and python_start:
            assert "kvdepot/apps" not in stderr, stderr[-3000:]
            continue
        assert proc.returncode in (0, 130), (delay, proc.returncode, stderr[-3000:])
        assert "kvdepot: error" not in stderr, stderr[-3000:]
        assert_clean_stderr(stderr)
        assert "ERROR" not in stderr, stderr[-3000:]
        assert not arenas_of(sorted(daemons)), f"an arena was left behind (at {delay} s)"
        assert not [p for p in daemons if alive(p)], "a daemon outlived kvdepot up"


def test_a_start_interrupted_between_two_stores_ends_at_once(tmp_path: Path) -> None:
    # As when Ctrl-C reaches `kvdepot up` after its first store registered:
    # the signal stopped the metadata service and that store, and the next
    # store, started after it, would wait for a registration that never
    # comes. The start ends at once instead, and stops what it started.
    cluster = LocalCluster(nodes=2, capacity="16MiB", log_dir=tmp_path, ready_timeout_s=60)
    interrupted = False

    def abort() -> bool:
        nonlocal interrupted
        if not interrupted and cluster.stores and cluster.stores[0].info:
            assert cluster.metadata is not None
            for d in (cluster.metadata, cluster.stores[0]):
                os.kill(d.pid, signal.SIGINT)
            interrupted = True
        return interrupted

    t0 = time.monotonic()
    with pytest.raises(Unavailable, match="interrupted"):
        cluster.start(abort=abort)
    assert time.monotonic() - t0 < 20, "the start waited for a store that could not register"
    daemons = cluster.daemons()
    assert daemons and all(d.proc.poll() is not None for d in daemons)
    assert not arenas_of([d.pid for d in daemons]), "an arena was left behind"


HANGING_CLEANUP = """
import asyncio, sys, time
from kvdepot.shutdown import run_until_signal

def stuck_in_cleanup():
    time.sleep(float(sys.argv[2]))  # a cleanup that never returns in time

async def main():
    try:
        print("up", flush=True)
        await asyncio.sleep(3600)
    finally:
        stuck_in_cleanup()

timeout = float(sys.argv[1])
sys.exit(run_until_signal(main, timeout if timeout > 0 else None))
"""


@pytest.mark.parametrize(("cleanup_s", "bound_s"), [(600, 2.0), (0.2, 2.0), (3, 0)])
def test_a_stop_is_bounded_and_a_hang_names_where_it_hung(cleanup_s: float, bound_s: float) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", HANGING_CLEANUP, str(bound_s), str(cleanup_s)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "up\n"
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if cleanup_s > bound_s > 0:
        # Past the bound: the stacks on stderr, then exit status 1, long
        # before the cleanup would have ended.
        assert proc.returncode == 1, err
        assert took < 30, took
        assert "Timeout (0:00:02)!" in err, err
        assert "stuck_in_cleanup" in err, err
    else:
        # Within the bound, or unbounded: a clean stop after the whole cleanup.
        assert proc.returncode == 0, err
        assert took >= cleanup_s * 0.9, took
        assert "Timeout" not in err, err


@pytest.mark.parametrize("daemon", ["metadata", "store"])
def test_a_daemons_stop_bound_is_a_setting(daemon: str) -> None:
    kvdepot = [sys.executable, "-m", "kvdepot.apps.cli", daemon]
    out = subprocess.run(
        [*kvdepot, "--check", "--stop-timeout", "5"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert '"stop_timeout_s": 5.0' in out.stdout
    bad = subprocess.run(
        [*kvdepot, "--check", "--stop-timeout", "0"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode != 0
    assert bad.stderr.strip().count("\n") == 0 and "--stop-timeout" in bad.stderr, bad.stderr
