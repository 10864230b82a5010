"""Host identity, arena file names, and reaping arena files of dead stores."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvdepot.wire import host


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_identity_is_stable_and_names_the_kernel() -> None:
    assert host.host_identity() == host.host_identity()
    assert host.host_identity().startswith(("boot:", "host:"))


def test_arena_names_are_unique_per_node_and_process(tmp_path: Path) -> None:
    a = host.default_arena_path("node/a", 11, str(tmp_path))
    b = host.default_arena_path("node/a", 12, str(tmp_path))
    assert a != b and os.path.dirname(a) == str(tmp_path) and "/" not in os.path.basename(a)[8:]
    assert host.default_arena_path("x", 1, str(tmp_path / "missing")) == ""


def test_only_arenas_of_dead_stores_of_this_namespace_are_reaped(tmp_path: Path) -> None:
    dead = Path(host.default_arena_path("n", dead_pid(), str(tmp_path)))
    alive = Path(host.default_arena_path("n", os.getpid(), str(tmp_path)))
    foreign = tmp_path / f"kvdepot-n-{host._pid_namespace() + 1}-{dead_pid()}"
    other = tmp_path / "kvdepot-test-123.tmp"
    for p in (dead, alive, foreign, other):
        p.write_bytes(b"x")
    assert host.reap_stale_arenas(str(tmp_path)) == [str(dead)]
    assert not dead.exists() and alive.exists() and foreign.exists() and other.exists()
