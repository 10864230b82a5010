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

EXIT_BROKEN_PIPE = 141
"""Exit status once stdout's reader went away (``| head -1``): a filter's
killed by SIGPIPE, as a shell reports it (128 + 13)."""


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


# -- room: whether what a command will allocate fits where it goes --------------------
@dataclasses.dataclass(frozen=True, slots=True)
class Room:
    """The file system that holds (or would hold) a path."""

    path: str  # the path itself, or its nearest existing parent
    total: int  # bytes in all
    free: int  # bytes an unprivileged writer can still take


def file_system_room(path: str) -> Room | None:
    """The file system ``path`` is on, or would be once created; ``None``
    where it cannot be examined."""
    from pathlib import Path

    absolute = Path(path).absolute()
    probe = next((p for p in (absolute, *absolute.parents) if p.exists()), None)
    if probe is None:
        return None
    try:
        st = os.statvfs(probe)
    except OSError:
        return None
    return Room(str(probe), st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize)


def memory_available() -> int | None:
    """Bytes of memory the machine can still give (MemAvailable), or ``None``."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def arena_directory(config: Any) -> str:
    """Where a store with ``config`` (a StoreConfig) puts its arena file, as
    its daemon picks it; empty for anonymous memory."""
    from kvdepot.wire.host import SHM_DIR

    if config.arena_path:
        return os.path.dirname(os.path.abspath(config.arena_path))
    if config.shm and os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK):
        return SHM_DIR
    return ""


def _size(n: int) -> str:
    from kvdepot.apps.stats import human_bytes

    return human_bytes(n)


def _unusable_directory(directory: str) -> str | None:
    """Why the store could not create or write ``directory``, found by doing
    so (permissions, read-only mounts and pseudo file systems all show then);
    ``None`` if it can. Leaves nothing behind."""
    import tempfile
    from pathlib import Path

    path = Path(directory)
    exists = path.is_dir()
    try:
        if exists:
            fd, name = tempfile.mkstemp(dir=path, prefix=".kvdepot-check-")
            os.close(fd)
            os.unlink(name)
        else:
            path.mkdir()
            path.rmdir()
    except OSError as exc:
        return f"{'cannot be written' if exists else 'cannot be created'}: {exc.strerror}"
    return None


def check_store_room(config: Any, origin: Callable[[str], str]) -> None:
    """What ``store --check`` refuses beyond each setting's own rule: an SSD
    directory the store could not create or write, and an arena or SSD tier
    larger than the whole file system that must hold it.

    ``origin(setting)`` names how the user gave that setting.
    """
    from kvdepot.config import InvalidSetting

    if config.ssd_dir:
        problem = _unusable_directory(config.ssd_dir)
        if problem is not None:
            raise InvalidSetting("ssd_dir", problem, message=f"{origin('ssd_dir')}: {problem}")
    checks = [("capacity_bytes", config.capacity_bytes, arena_directory(config), "arena")]
    if config.ssd_dir:
        checks.append(("ssd_capacity_bytes", config.ssd_capacity_bytes, config.ssd_dir, "SSD tier"))
    for setting, size, where, what in checks:
        room = file_system_room(where) if where and size else None
        if room is not None and size > room.total:
            problem = (
                f"the {what} is larger than the whole file system of {room.path} "
                f"({_size(room.total)}) that must hold it"
            )
            raise InvalidSetting(setting, problem, message=f"{origin(setting)}: {problem}")


def check_up_room(nodes: int, config: Any, capacity: str) -> None:
    """Refuse ``up --nodes N --capacity C`` whose N arenas of C do not fit
    where the arenas go (``/dev/shm``) or in the memory the machine has
    available, before any store starts. ``config`` is a store's StoreConfig."""
    from kvdepot.config import InvalidSetting

    total = nodes * config.capacity_bytes
    need = f"--nodes {nodes} x --capacity {capacity} = {_size(total)} of arenas"
    where = arena_directory(config)
    room = file_system_room(where) if where else None
    if room is not None and total > room.free:
        problem = f"only {_size(room.free)} free in {where}, which holds the arenas"
        hint = "lower --nodes or --capacity (in a container: --shm-size)"
        raise InvalidSetting("--capacity", problem, message=f"{need}, but {problem}: {hint}")
    available = memory_available()
    if available is not None and total > available:
        problem = f"this machine has only {_size(available)} of memory available"
        hint = "lower --nodes or --capacity"
        raise InvalidSetting("--capacity", problem, message=f"{need}, but {problem}: {hint}")


def setting_origin(args: argparse.Namespace, cls: type, prefix: str, name: str, value: Any) -> str:
    """How the user gave setting ``name`` of ``cls`` (now ``value``), as an
    error names it: the flag, the ``KVDEPOT_*`` variable or the file's key."""
    given = setting_overrides(args, cls).get(name)
    if given is not None:
        return f"{flag_names(cls).get(name, name)} {given}"
    key = prefix + name.upper()
    if key in os.environ:
        return f"{key}={os.environ[key]}"
    config = getattr(args, "config", None)
    return f"{name} = {value!r} in {config}" if config else f"{name} {value!r}"


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
    from kvdepot.proxy import config as proxy_config
    from kvdepot.rpc.security_config import ENV_PREFIX, SecurityConfig
    from kvdepot.store.config import StoreConfig

    check(
        os.environ,
        {
            "KVDEPOT_METADATA_": MetadataConfig,
            "KVDEPOT_STORE_": StoreConfig,
            "KVDEPOT_CLIENT_": ClientConfig,
            proxy_config.ENV_PREFIX: proxy_config.UpstreamConfig,
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


def stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader closed it (then a write to it
    fails with BrokenPipeError, and any other BrokenPipeError is not ours)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        events = poller.poll(0)
    except (OSError, ValueError, AttributeError):
        return False
    return any(ev & select.POLLERR for _, ev in events)


def discard_stdout() -> None:
    """Send what is still to be written to stdout to /dev/null: the
    interpreter flushes it at exit, and a closed pipe would fail again there,
    with an "Exception ignored" message."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


class OneLineParser(argparse.ArgumentParser):
    """Usage errors in one line that names the command, like every other error."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
