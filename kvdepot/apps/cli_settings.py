"""How the ``kvdepot`` command reads settings and reports what it refuses.

The flag of each setting (so an error names the flag the user typed), the
checks made before any command runs, and one-line errors: usage errors name
their command, and a daemon that closed a client's connection is explained.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NoReturn

from kvdepot.errors import KVDepotError

if TYPE_CHECKING:
    from kvdepot.security import SecurityConfig

EXIT_USAGE = 2
"""Exit status of a usage error (argparse's)."""

# The flag of each setting a daemon's flags set: the overrides are read from
# them, and an error names the flag the user typed.
METADATA_FLAGS = {
    "host": "--host",
    "port": "--port",
    "index": "--index",
    "lease_ttl_s": "--lease-ttl",
    "heartbeat_interval_s": "--heartbeat-interval",
    "allocation_ttl_s": "--allocation-ttl",
    "kv_events": "--kv-events",
    "kv_events_replay": "--kv-events-replay",
    "kv_events_block_size": "--kv-events-block-size",
    "metrics_port": "--metrics-port",
}
STORE_FLAGS = {
    "node_id": "--node-id",
    "host": "--host",
    "port": "--port",
    "grpc_port": "--grpc-port",
    "advertise_host": "--advertise-host",
    "metadata": "--metadata",
    "capacity_bytes": "--capacity",
    "arena_path": "--arena-path",
    "max_chunk_bytes": "--max-chunk",
    "nixl": "--nixl",
    "metrics_port": "--metrics-port",
    "gpu_capacity_bytes": "--gpu-capacity",
    "gpu_device": "--gpu-device",
    "ssd_dir": "--ssd-dir",
    "ssd_capacity_bytes": "--ssd-capacity",
    "ssd_segment_bytes": "--ssd-segment",
    "ssd_fsync": "--ssd-fsync",
    "ssd_io_threads": "--ssd-io-threads",
    "ssd_compact_ratio": "--ssd-compact-ratio",
    "eviction_policy": "--eviction-policy",
    "promote_hits": "--promote-hits",
    "gpu_promote_hits": "--gpu-promote-hits",
    "pin_memory": "--pin-memory",
    "demotion_buffer_bytes": "--demotion-buffer",
    "cpu_watermarks": "--watermarks cpu=",
    "gpu_watermarks": "--watermarks gpu=",
    "ssd_watermarks": "--watermarks ssd=",
}
SECURITY_FLAGS = {
    "auth_token_file": "--auth-token-file",
    "tls": "--tls",
    "tls_cert": "--tls-cert",
    "tls_key": "--tls-key",
    "tls_ca": "--tls-ca",
    "tls_client_auth": "--tls-client-auth",
    "tls_server_name": "--tls-server-name",
}


def flag_values(args: argparse.Namespace, flags: dict[str, str]) -> dict[str, Any]:
    """The value of each flag in ``flags`` (``None``: not given) by setting name."""
    out = {}
    for name, flag in flags.items():
        if flag.startswith("--") and " " not in flag:
            out[name] = getattr(args, flag[2:].replace("-", "_"))
    return out


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
    from kvdepot.security import ENV_PREFIX, SecurityConfig
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
    from kvdepot.security import explain_refusal

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


