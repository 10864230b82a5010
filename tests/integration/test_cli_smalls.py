"""Small things of the ``kvdepot`` command as users run it: its version, stats
into a closed pipe, ``up`` refusing arenas that cannot fit, and what
``store --check`` refuses beyond each setting's own rule."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pytest

from kvdepot.apps.cluster import LocalCluster
from kvdepot.wire.host import SHM_DIR
from tests.conftest import free_port

pytestmark = pytest.mark.integration

KVDEPOT = [sys.executable, "-m", "kvdepot.apps.cli"]
ENV = {k: v for k, v in os.environ.items() if not k.startswith("KVDEPOT_")}


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KVDEPOT, *args], capture_output=True, text=True, timeout=timeout, check=False, env=ENV
    )


def one_line(out: subprocess.CompletedProcess[str]) -> str:
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


def test_version_is_the_installed_one() -> None:
    out = run("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"kvdepot {version('kvdepot')}"


# -- stats into a pipe whose reader went away ----------------------------------------------
def _stats_into_closed_pipe(*args: str, lines_read: int) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen(
        [*KVDEPOT, "stats", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=ENV,
    )
    assert proc.stdout is not None and proc.stderr is not None
    for _ in range(lines_read):
        assert proc.stdout.readline()
    proc.stdout.close()  # as `| head -1` exits (or `| true`, having read nothing)
    try:
        err = proc.stderr.read()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", err)


def test_stats_into_a_closed_pipe_exits_quietly(cluster: LocalCluster) -> None:
    target = ["--metadata", cluster.metadata_address]
    for out in (
        _stats_into_closed_pipe("--json", *target, lines_read=0),
        _stats_into_closed_pipe("--watch", "--interval", "0.1", *target, lines_read=1),
        _stats_into_closed_pipe("--watch", "--json", "--interval", "0.1", *target, lines_read=1),
    ):
        # 141: as a filter killed by SIGPIPE, which is how a shell reports `yes | head -1`.
        assert out.returncode == 141, out.stderr
        assert out.stderr == "", out.stderr


# -- up: the arenas must fit -----------------------------------------------------------------
def test_up_refuses_arenas_that_cannot_fit_before_starting_anything() -> None:
    port = free_port()
    started = time.monotonic()
    out = run("up", "--nodes", "500", "--capacity", "512GiB", "--metadata-port", str(port))
    assert time.monotonic() - started < 20
    assert out.returncode == 1, out.stderr
    line = one_line(out)
    assert line.startswith("kvdepot: error: --nodes 500 x --capacity 512GiB = 250.0 TiB"), line
    assert "lower --nodes or --capacity" in line
    assert out.stdout == ""
    # --check refuses it the same way, and accepts what fits.
    check = run("up", "--nodes", "500", "--capacity", "512GiB", "--check")
    assert check.returncode == 1 and one_line(check) == line
    ok = run("up", "--nodes", "2", "--capacity", "16MiB", "--check")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["up"]["store"]["capacity_bytes"] == 16 << 20


def test_up_refuses_more_than_the_machine_has_available() -> None:
    from kvdepot.apps.cli_settings import memory_available

    available = memory_available()
    if available is None:
        pytest.skip("no MemAvailable on this machine")
    # Arenas in anonymous memory: no file system to fill, only the memory.
    env = dict(ENV, KVDEPOT_STORE_SHM="false")
    capacity = str(available // 2 + (1 << 30))
    out = subprocess.run(
        [*KVDEPOT, "up", "--nodes", "2", "--capacity", capacity, "--check"],
        capture_output=True, text=True, env=env, check=False, timeout=60,
    )  # fmt: skip
    assert out.returncode == 1
    line = one_line(out)
    assert line.startswith(f"kvdepot: error: --nodes 2 x --capacity {capacity} = "), line
    assert "of memory available" in line, line


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--nodes", "0"], "--nodes 0: must be at least 1"),
     (["--max-restarts", "-1"], "--max-restarts -1: must be 0 or more"),
     (["--restart-window", "0"], "--restart-window 0:")],
)  # fmt: skip
def test_up_refuses_bad_supervision_settings(flags: list[str], message: str) -> None:
    out = run("up", *flags, "--check")
    assert out.returncode == 1
    assert one_line(out).startswith(f"kvdepot: error: {message}")


# -- store --check -----------------------------------------------------------------------------
def _store_check(*args: str) -> subprocess.CompletedProcess[str]:
    return run("store", "--metadata", "127.0.0.1:1", *args, "--check")


def test_store_check_refuses_an_ssd_dir_it_cannot_create_or_write() -> None:
    # /sys refuses a new directory even to root (a permission bit would not).
    out = _store_check("--ssd-dir", "/sys/kvdepot-ssd", "--ssd-capacity", "64MiB")
    assert out.returncode == 1
    line = one_line(out)
    assert line.startswith("kvdepot: error: --ssd-dir /sys/kvdepot-ssd: cannot be created:"), line
    out = _store_check("--ssd-dir", "/sys/kernel", "--ssd-capacity", "64MiB")
    assert out.returncode == 1
    assert one_line(out).startswith("kvdepot: error: --ssd-dir /sys/kernel: cannot be written:")


def test_store_check_leaves_a_usable_ssd_dir_as_it_was(tmp_path: Path) -> None:
    ssd = tmp_path / "ssd"
    out = _store_check("--ssd-dir", str(ssd), "--ssd-capacity", "64MiB")
    assert out.returncode == 0, out.stderr
    assert not ssd.exists()  # checked by creating it, and removed again
    ssd.mkdir()
    assert _store_check("--ssd-dir", str(ssd), "--ssd-capacity", "64MiB").returncode == 0
    assert list(ssd.iterdir()) == []


def _total(path: str) -> int:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


def test_store_check_refuses_an_arena_larger_than_its_file_system(tmp_path: Path) -> None:
    too_big = str(_total(SHM_DIR) + (1 << 30))
    out = _store_check("--capacity", too_big)
    assert out.returncode == 1
    line = one_line(out)
    assert line.startswith(f"kvdepot: error: --capacity {too_big}: the arena is larger"), line
    assert SHM_DIR in line
    # The variable that set it is named as the flag would be.
    env = dict(ENV, KVDEPOT_STORE_CAPACITY_BYTES=too_big)
    out = subprocess.run(
        [*KVDEPOT, "store", "--check"], capture_output=True, text=True, env=env, check=False
    )
    assert out.returncode == 1
    assert one_line(out).startswith(f"kvdepot: error: KVDEPOT_STORE_CAPACITY_BYTES={too_big}:")
    # An arena file elsewhere is held by that file system.
    arena = tmp_path / "arena"
    too_big = str(_total(str(tmp_path)) + (1 << 30))
    out = _store_check("--capacity", too_big, "--arena-path", str(arena))
    assert out.returncode == 1 and str(tmp_path) in one_line(out)
    assert not arena.exists()
    # An SSD tier the same.
    out = _store_check("--ssd-dir", str(tmp_path / "ssd"), "--ssd-capacity", too_big)
    assert out.returncode == 1
    assert one_line(out).startswith(f"kvdepot: error: --ssd-capacity {too_big}: the SSD tier")
