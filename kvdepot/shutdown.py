"""Running a daemon until a signal, with a shutdown that always runs to the end.

A daemon's cleanup frees what outlives the process: a store's arena is a
file in ``/dev/shm`` (RAM until unlinked), a gRPC server left running when
the event loop closes complains from its finaliser. Signals rarely come one
at a time: Ctrl-C sends SIGINT to the whole process group, so the stores of
``kvdepot up`` get it as ``up`` itself sends them SIGTERM; a supervisor may
repeat its SIGTERM. So the first SIGINT or SIGTERM starts the shutdown (it
cancels the daemon's main coroutine, whose ``finally`` cleans up) and any
later one is only noted: it can never cancel the cleanup half way. SIGKILL
still skips it; a store's next start removes the arena file such a kill
leaves behind.

A stop is bounded (``stop_timeout_s``): a cleanup or an interpreter exit that
hangs (a stalled dependency, a library's shutdown) would otherwise keep a
supervisor waiting until its own SIGKILL, and say nothing. Past the bound
the process writes every thread's stack to stderr (``Timeout (0:00:30)!``
and the tracebacks, from :mod:`faulthandler`'s watchdog, which needs no
GIL) and exits with status 1. A stop that hangs is mostly an event loop
waiting, idle, for a task that does not end: the threads' stacks then show
only the loop's ``select``. So at four fifths of the bound the process first
logs what each pending asyncio task awaits (:func:`report_tasks`), and
SIGUSR1 writes both, threads and tasks, at any time (a supervisor about to
SIGKILL a daemon that did not stop sends it first); a crash writes the
threads' stacks too.

A task may swallow its cancellation: Python 3.11's ``asyncio.wait_for``
returns the awaited result when the cancellation lands just as that
completes, so a loop built on it carries on and a stop that awaits it once
waits for ever (a metadata service's reaper did, under load). Cleanups stop
their tasks with :func:`cancel_and_wait`, which cancels again and is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Collection, Coroutine, Iterable
from typing import Any, TypeVar

from kvdepot.errors import KVDepotError

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)
REPORT_SIGNAL = signal.SIGUSR1
"""Writes every thread's stack and every pending asyncio task to stderr."""
REPORT_AT = 0.8
"""The share of the stop bound after which the pending tasks are logged."""
_RECANCEL_S = 0.25
_REPORT_TASKS = 40

T = TypeVar("T")


def _noted(signum: int, frame: object) -> None:
    # The wakeup fd carries the signal to the loop; this handler only keeps
    # Python's defaults (KeyboardInterrupt, death by SIGTERM) from running.
    pass


def run_until_signal(
    main: Callable[[], Coroutine[Any, Any, None]], stop_timeout_s: float | None = None
) -> int:
    """Run ``main()`` until it returns or a SIGINT/SIGTERM stops it; returns 0.

    Meant for a process's entry point: from the call on, SIGINT and SIGTERM
    never interrupt this process at a random point, during the cleanup nor
    after it (the process is about to exit then). Whatever ``main`` raises
    other than the cancellation a signal asked for propagates.

    Args:
        main: The daemon's main coroutine function.
        stop_timeout_s: Longest the process may take to exit after the first
            signal, its cleanup and the interpreter's exit included; past it
            the threads' stacks go to stderr and the process exits with
            status 1. ``None``: unbounded. The bound stays armed when this
            returns, so call it only where the process exits next.

    Raises:
        KVDepotError: ``main`` raised it, or was cancelled by no signal.
    """
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    os.set_blocking(write_fd, False)
    for sig in (*SIGNALS, REPORT_SIGNAL):
        signal.signal(sig, _noted)
    # The threads' stacks on a crash, and on SIGUSR1 from faulthandler's C
    # handler (it needs no GIL), which then chains to Python's: the tasks.
    faulthandler.enable()
    faulthandler.register(REPORT_SIGNAL, all_threads=True, chain=True)
    # The C-level handler writes the signal number to this fd from whichever
    # thread the kernel picked; the loop reads it (asyncio's own signal
    # handling closes its fd with the loop, while signals may still come).
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    # A parent may start us with them blocked until now (LocalCluster does).
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
    try:
        asyncio.run(_serve(main, read_fd, stop_timeout_s))
    finally:
        signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)
    return 0


async def _serve(
    main: Callable[[], Coroutine[Any, Any, None]], read_fd: int, stop_timeout_s: float | None
) -> None:
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(main())
    seen: list[int] = []

    def on_signal() -> None:
        with contextlib.suppress(BlockingIOError):
            data = os.read(read_fd, 64)
            for signum in data:
                if signum == REPORT_SIGNAL:
                    report_tasks("SIGUSR1")
                    continue
                if signum not in SIGNALS:
                    continue
                name = signal.Signals(signum).name
                if not seen:
                    logger.info("%s: stopping", name)
                    if stop_timeout_s is not None:
                        faulthandler.dump_traceback_later(stop_timeout_s, exit=True)
                        after = stop_timeout_s * REPORT_AT
                        loop.call_later(after, report_tasks, f"still stopping after {after:g} s")
                    task.cancel()
                elif len(seen) == 1:
                    logger.info(
                        "%s while stopping: the cleanup runs to its end first (SIGKILL skips it)",
                        name,
                    )
                seen.append(signum)

    loop.add_reader(read_fd, on_signal)
    try:
        await task
    except asyncio.CancelledError:
        if not seen:
            # Not stopped by us: a cancellation leaked out of the daemon.
            # Exiting 0 without a word would look like a clean stop.
            raise KVDepotError("the daemon stopped: cancelled without a signal") from None
    finally:
        loop.remove_reader(read_fd)


async def finish(cleanup: Coroutine[Any, Any, None]) -> None:
    """Await ``cleanup`` to its end even if the awaiting task is cancelled meanwhile.

    For a daemon's ``finally``: its main task may be cancelled there (a
    signal while it stops on an error of its own), and a cleanup cut short
    leaks what it had yet to free. A cancellation that arrives meanwhile is
    absorbed: the task is stopping already.
    """
    task = asyncio.ensure_future(cleanup)
    current = asyncio.current_task()
    while True:
        try:
            await asyncio.shield(task)
            return
        except asyncio.CancelledError:
            if task.done():
                # The cleanup itself was cancelled (from inside): say so.
                task.result()
                return
            if current is not None:
                current.uncancel()


async def uninterrupted(step: Awaitable[T]) -> T:
    """Await ``step`` to its end, then deliver a cancellation that came meanwhile.

    For a daemon's start: a gRPC server cancelled half way through its start
    fails its own shutdown later (``InvalidStateError``, from its finaliser
    once the loop is gone); started, it stops cleanly.
    """
    task = asyncio.ensure_future(step)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result


async def cancel_and_wait(
    tasks: Iterable[asyncio.Task[Any]], what: str, timeout_s: float = 5.0
) -> None:
    """Cancel ``tasks`` and wait until they end, at most ``timeout_s``.

    One that is still running is cancelled again every 0.25 s: it may have
    swallowed the cancellation (see the module's docstring). Those still
    running at ``timeout_s`` are left running, logged with where each one
    is, and the caller's cleanup goes on. A task that ends by raising
    anything but its cancellation is logged; one that had ended before is
    its owner's business (its exception is retrieved quietly).

    Args:
        tasks: The tasks to end.
        what: Whose tasks, for the log, e.g. ``"the metadata reaper"``.
        timeout_s: The longest wait.
    """
    pending: set[asyncio.Task[Any]] = set()
    for t in tasks:
        if not t.done():
            pending.add(t)
        elif not t.cancelled():
            t.exception()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    running = set(pending)
    while running:
        for t in running:
            t.cancel()
        left = deadline - loop.time()
        if left <= 0:
            break
        _, running = await asyncio.wait(running, timeout=min(_RECANCEL_S, left))
    if running:
        report_tasks(f"{what}: still running {timeout_s:g} s after being cancelled", running)
    for t in pending - running:
        if not t.cancelled() and (exc := t.exception()) is not None:
            logger.error("%s: a task ended with an error while stopping", what, exc_info=exc)


def report_tasks(why: str, tasks: Collection[asyncio.Task[Any]] | None = None) -> None:
    """Log what each pending asyncio task (of ``tasks``, or of the running
    loop) awaits: its chain of coroutines down to the future it waits on.

    Tasks awaiting alike (a gRPC server's calls) are counted in one line.
    """
    if tasks is None:
        tasks = asyncio.all_tasks()
    chains: dict[str, int] = {}
    for t in tasks:
        if t.done():
            continue
        cancelling = " (cancelled, still running)" if t.cancelling() else ""
        steps = _awaits(t.get_coro())
        # The future it waits on (not public: a task's repr says it too).
        waiter = getattr(t, "_fut_waiter", None)
        if waiter is not None:
            steps.append(repr(waiter)[:160])
        chain = f"{t.get_name()}{cancelling}: {' -> '.join(steps)}"
        chains[chain] = chains.get(chain, 0) + 1
    lines = [f"{why}: {sum(chains.values())} asyncio tasks pending"]
    ranked = sorted(chains.items(), key=lambda kv: -kv[1])
    for chain, count in ranked[:_REPORT_TASKS]:
        lines.append(f"  {count} x {chain}" if count > 1 else f"  {chain}")
    if len(ranked) > _REPORT_TASKS:
        lines.append(f"  ... and {len(ranked) - _REPORT_TASKS} more kinds")
    logger.warning("\n".join(lines))


def _awaits(coro: Any) -> list[str]:
    """Where ``coro`` is, then what it awaits, down to a future (or a C/Cython awaitable)."""
    out: list[str] = []
    while coro is not None and len(out) < 32:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        name = getattr(coro, "__qualname__", None) or type(coro).__name__
        if frame is not None:
            out.append(f"{name} ({frame.f_code.co_filename}:{frame.f_lineno})")
        elif name != "FutureIter":  # a future's own iterator: the waiter says more
            out.append(str(name))
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return out
