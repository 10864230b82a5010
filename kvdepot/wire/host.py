"""What a store and a client need to know about the host they run on.

Same-host shared memory is only safe when both ends really share a kernel and
a ``/dev/shm``: the kernel's boot id says the former, the arena file's
``(st_dev, st_ino)`` seen from both ends says the latter (two containers on
one host share a boot id but not their ``/dev/shm``). RDMA is worth trying
where the kernel lists RDMA devices.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import socket

logger = logging.getLogger(__name__)

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
RDMA_CLASS_PATH = "/sys/class/infiniband"
SHM_DIR = "/dev/shm"


@functools.cache
def host_identity() -> str:
    """An id of the running kernel: equal in two processes only on the same host.

    The kernel's boot id where Linux offers it, else the host name (weaker:
    a same-host transport also checks that both ends see the same file).
    """
    try:
        with open(BOOT_ID_PATH, encoding="ascii") as f:
            boot_id = f.read().strip()
        if boot_id:
            return f"boot:{boot_id}"
    except OSError:
        pass
    return f"host:{socket.gethostname()}"


def rdma_devices(path: str = RDMA_CLASS_PATH) -> list[str]:
    """Names of the RDMA devices the kernel lists (empty where there are none)."""
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


_ARENA_NAME = re.compile(r"^kvdepot-.+-(\d+)-(\d+)$")


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def default_arena_path(node_id: str, pid: int | None = None, directory: str = SHM_DIR) -> str:
    """A file for a store's arena, unique per node and process; empty if unusable.

    ``directory`` must exist and be writable (``/dev/shm`` on Linux); the name
    carries the node, the pid namespace and the process id
    (``kvdepot-<node>-<pidns>-<pid>``), so two stores on one host, or a store
    and its restarted successor, never share a file, and
    :func:`reap_stale_arenas` can tell whose file it is.
    """
    if not os.path.isdir(directory) or not os.access(directory, os.W_OK):
        logger.info("%s is not a writable directory: the arena is not shared", directory)
        return ""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", node_id)[:64] or "store"
    pid = pid if pid is not None else os.getpid()
    return os.path.join(directory, f"kvdepot-{safe}-{_pid_namespace()}-{pid}")


def reap_stale_arenas(directory: str = SHM_DIR) -> list[str]:
    """Unlink arena files left by stores of this pid namespace that no longer run.

    A store killed outright (SIGKILL, OOM) cannot unlink its arena file, and
    on tmpfs the file keeps its memory until it is unlinked. Only files named
    by :func:`default_arena_path` in this pid namespace whose process is gone
    are removed: a store in another container sharing ``/dev/shm`` has
    another namespace and is never touched.

    Returns:
        The paths removed.
    """
    ns = _pid_namespace()
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _ARENA_NAME.match(name)
        if m is None or int(m.group(1)) != ns or not ns:
            continue
        pid = int(m.group(2))
        try:
            os.kill(pid, 0)
            continue  # still running (or another live process reusing the pid)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        path = os.path.join(directory, name)
        try:
            os.unlink(path)
        except OSError as exc:
            logger.debug("cannot remove stale arena %s: %s", path, exc)
            continue
        logger.info("removed the arena file of a store that is gone: %s", path)
        removed.append(path)
    return removed
