"""A Ctrl-C while the ``kvdepot`` command still imports ends it quietly.

Imported first by :mod:`kvdepot.apps.cli`: until ``main()`` runs, SIGINT
exits with status 130 as one after does (``main()`` catches
KeyboardInterrupt), instead of printing the traceback of whatever import it
landed in. Where SIGINT was ignored when the process started (a background
job of a shell), it stays so, as Python leaves it.
"""

from __future__ import annotations

import signal


def _exit(signum: int, frame: object) -> None:
    raise SystemExit(130)


def restore() -> None:
    """Python's own SIGINT handling again, where this module replaced it."""
    if signal.getsignal(signal.SIGINT) is _exit:
        signal.signal(signal.SIGINT, signal.default_int_handler)


if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _exit)
