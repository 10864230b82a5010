"""Child processes that die with the benchmark that started them.

A benchmark stopped by SIGKILL runs no cleanup, and one stopped by SIGTERM
runs none unless it handles the signal: without care its daemons (a kvdepot
cluster, Mooncake's master and storage node, LMCache's server, redis, vLLM)
outlive it, with their memory. So every process a benchmark starts comes
from here:

* :func:`popen` / :func:`run`: :class:`subprocess.Popen` whose child has a
  parent-death signal (Linux ``prctl(PR_SET_PDEATHSIG)``): the kernel sends it
  the signal when the benchmark's thread that started it ends, which for the
  main thread is when the benchmark process ends, however it ends. Children
  are started from the main thread only (refused from another: they would
  die with that thread).
* :class:`Cluster`: a :class:`~kvdepot.apps.cluster.LocalCluster` whose
  daemons get SIGTERM when the benchmark dies: a store's own shutdown then
  unlinks its arena file in ``/dev/shm`` (a SIGKILL would leave it, RAM
  until a later store removes it).
* :func:`process` / :func:`die_with_parent`: the same for ``multiprocessing``
  children (spawn start method): the target, or a pool's initializer, arms
  the signal first thing, and exits at once if the benchmark is already gone.
* :func:`stop_on_sigterm`: a SIGTERM unwinds the benchmark like Ctrl-C
  (``finally`` blocks and context managers stop the children cleanly); the
  parent-death signal covers whatever is left when the process ends.

Processes that run other programs' shutdowns (kvdepot daemons, ``vllm serve``,
a benchmark re-run inside a namespace) get SIGTERM; the rest SIGKILL.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

from kvdepot.apps.cluster import LocalCluster

PR_SET_PDEATHSIG = 1
# Loaded here, not in a child between fork and exec (no dynamic loading there).
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def die_with_parent(parent_pid: int, death_signal: int = signal.SIGKILL) -> None:
    """In a child of ``parent_pid``: have the kernel send it ``death_signal``
    when that parent ends; exit at once if it ended already."""
    if _LIBC is None:
        return
    _LIBC.prctl(PR_SET_PDEATHSIG, int(death_signal), 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)


def _main_thread_only(what: str) -> None:
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            f"{what}: start benchmark children from the main thread (their parent-death "
            "signal fires when the thread that started them ends)"
        )


def _preexec(death_signal: int, then: Callable[[], Any] | None) -> Callable[[], None]:
    parent = os.getpid()

    def arm() -> None:
        die_with_parent(parent, death_signal)
        if then is not None:
            then()

    return arm


def popen(args: Any, *, death_signal: int = signal.SIGKILL, **kwargs: Any) -> subprocess.Popen[Any]:
    """:class:`subprocess.Popen` whose child gets ``death_signal`` when this process ends."""
    _main_thread_only(f"starting {args!r}")
    kwargs["preexec_fn"] = _preexec(death_signal, kwargs.get("preexec_fn"))
    return subprocess.Popen(args, **kwargs)


def run(
    args: Any,
    *,
    death_signal: int = signal.SIGKILL,
    timeout: float | None = None,
    check: bool = False,
    capture_output: bool = False,
    **kwargs: Any,
) -> subprocess.CompletedProcess[Any]:
    """:func:`subprocess.run` through :func:`popen`; the child is stopped
    (SIGTERM, then SIGKILL after 10 s) if this process is interrupted meanwhile
    or ``timeout`` passes (then :class:`subprocess.TimeoutExpired` is raised)."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    with popen(args, death_signal=death_signal, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            terminate(proc)
            raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def terminate(proc: subprocess.Popen[Any], timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout_s``; waits for it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _guarded(parent: int, death_signal: int, target: Callable[..., Any], *args: Any) -> Any:
    die_with_parent(parent, death_signal)
    return target(*args)


def process(ctx: Any, target: Callable[..., Any], args: tuple[Any, ...] = (), **kwargs: Any) -> Any:
    """A ``multiprocessing`` process of ``ctx`` (spawn) running ``target(*args)``
    that dies with this process (SIGKILL). Start it from the main thread."""
    _main_thread_only(f"starting {getattr(target, '__name__', target)}")
    return ctx.Process(target=_guarded, args=(os.getpid(), signal.SIGKILL, target, *args), **kwargs)


def pool(ctx: Any, processes: int) -> Any:
    """A ``multiprocessing`` pool of ``ctx`` whose workers die with this process.

    Workers the pool starts later, to replace one, start from its handler
    thread: those die with the pool instead."""
    _main_thread_only("starting a pool")
    return ctx.Pool(processes, initializer=die_with_parent, initargs=(os.getpid(),))


def _interrupted(signum: int, frame: object) -> None:
    # Once: a second SIGTERM must not cut the cleanup short.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def stop_on_sigterm() -> None:
    """A SIGTERM to this (main) process unwinds it as an exit with status 143:
    ``finally`` blocks and context managers stop its children."""
    signal.signal(signal.SIGTERM, _interrupted)


# -- kvdepot daemons -----------------------------------------------------------
class Cluster(LocalCluster):
    """A :class:`LocalCluster` whose daemons get SIGTERM when this process ends."""

    def _popen(self, cmd: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        # SIGTERM, not SIGKILL: a store then removes its /dev/shm arena file.
        return popen(cmd, death_signal=signal.SIGTERM, **kwargs)
