"""How the ``kvdepot`` command reads settings and reports what it refuses.

The flag of each setting (so an error names the flag the user typed), the
checks made before any command runs, and one-line errors: usage errors name
their command, and a daemon that closed a client's connection is explained.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

from kvdepot.config import FLAG, RULE, Choice, flags_of
from kvdepot.errors import KVDepotError

if TYPE_CHECKING:
    from kvdepot.rpc.security_config import SecurityConfig

EXIT_USAGE = 2
"""Exit status of a usage error (argparse's)."""

def add_setting_flags(
    parser: argparse.ArgumentParser, cls: type, descriptions: Mapping[str, str] | None = None
) -> None:
    """Add the command-line option of each setting of ``cls`` that has one.

    Options come from the fields' :class:`~kvdepot.config.Flag` metadata: a
    boolean setting's option takes no value, a :class:`~kvdepot.config.Choice`
    lists its words; an option several settings share is left to the command.
    Every option defaults to ``None`` (not given), so the environment and the
    file still apply (see :func:`setting_overrides`). ``descriptions`` gives
    a ``--help`` section's text by its title.
    """
    groups: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        flag = f.metadata.get(FLAG)
        if flag is None or flag.shared:
            continue
        target: Any = parser
        if flag.group:
            if flag.group not in groups:
                about = (descriptions or {}).get(flag.group)
                groups[flag.group] = parser.add_argument_group(flag.group, about)
            target = groups[flag.group]
        kwargs: dict[str, Any] = {"help": flag.help}
        if isinstance(f.default, bool):
            kwargs["action"] = "store_true"
        else:
            rule = f.metadata.get(RULE)
            if isinstance(rule, Choice):
                kwargs["choices"] = list(rule.values)
            if flag.metavar:
                kwargs["metavar"] = flag.metavar
        target.add_argument(flag.name, **kwargs)


def setting_overrides(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The value of each option :func:`add_setting_flags` added for ``cls``, by
    setting name (``None``: not given; a boolean's option: its default's opposite)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        flag = f.metadata.get(FLAG)
        if flag is None or flag.shared:
            continue
        value = getattr(args, flag.dest)
        if isinstance(f.default, bool):
            out[f.name] = (not f.default) if value else None
        else:
            out[f.name] = value
    return out


def flag_names(cls: type) -> dict[str, str]:
    """The option of each setting of ``cls`` that has one, as errors name it."""
    return {name: flag.name for name, flag in flags_of(cls).items()}


def watermark_overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in args.watermarks:
        tier, sep, value = item.partition("=")
        if not sep or tier not in ("gpu", "cpu", "ssd"):
            raise KVDepotError(f"--watermarks {item!r}: use TIER=HIGH:LOW, TIER gpu, cpu or ssd")
        out[f"{tier}_watermarks"] = value
    return out



def check_flag(value: str, flag: str) -> float:
    """A flag that sets no component's setting but a command's own number,
    checked by the same rule as settings (a finite number > 0)."""
    from kvdepot.config import InvalidSetting, positive

    try:
        number = float(value)
    except ValueError:
        message = f"{flag} {value}: must be a number"
        raise InvalidSetting(flag, "must be a number", message=message) from None
    problem = positive().check(number)
    if problem is not None:
        raise InvalidSetting(flag, problem, message=f"{flag} {value}: {problem}")
    return number


def check_environment() -> None:
    """Refuse ``KVDEPOT_*`` variables that name no setting before anything starts."""
    from kvdepot.config import check_environment as check
    from kvdepot.connector.client import ClientConfig
    from kvdepot.metadata.config import MetadataConfig
    from kvdepot.rpc.security_config import ENV_PREFIX, SecurityConfig
    from kvdepot.store.config import StoreConfig

    check(
        os.environ,
        {
            "KVDEPOT_METADATA_": MetadataConfig,
            "KVDEPOT_STORE_": StoreConfig,
            "KVDEPOT_CLIENT_": ClientConfig,
            ENV_PREFIX: SecurityConfig,
        },
    )


CLIENT_COMMANDS = ("stats", "health", "demo")
"""Commands that only call daemons (``demo`` with ``--metadata``)."""


def explained(
    exc: KVDepotError, args: argparse.Namespace, security: Callable[[], SecurityConfig]
) -> str:
    """``exc``'s message, or why the daemon a client command called refused it
    (gRPC says only ``Socket closed`` when TLS settings do not match)."""
    from kvdepot.errors import Unavailable

    if not isinstance(exc, Unavailable) or args.command not in CLIENT_COMMANDS:
        return str(exc)
    from kvdepot.rpc.security import explain_refusal

    targets = getattr(args, "target", None) or getattr(args, "metadata", None) or ""
    try:
        settings = security()
    except KVDepotError:
        return str(exc)
    for target in (t.strip() for t in targets.split(",")):
        why = explain_refusal(target, settings) if target else ""
        if why:
            return why
    return str(exc)


@contextlib.contextmanager
def native_stderr_muted(enabled: bool) -> Iterator[None]:
    """Python's stderr as before, but what C code writes to fd 2 goes nowhere.

    gRPC's C core writes each failed TLS handshake as raw absl lines on fd 2
    (GRPC_VERBOSITY is read when grpc is imported, before any of this runs);
    a client command's failure is its one line, explained by _explained.
    """
    if not enabled:
        yield
        return
    sys.stderr.flush()
    real = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    previous = sys.stderr
    # Left open: log handlers made meanwhile keep writing to the real stderr.
    sys.stderr = os.fdopen(real, "w", buffering=1, errors="backslashreplace")
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(real, 2)
        sys.stderr = previous


class OneLineParser(argparse.ArgumentParser):
    """Usage errors in one line that names the command, like every other error."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


