"""The DRAM arena: one preallocated buffer that holds every chunk of the store.

Allocating the whole tier once, up front, means a full store is a clear
refusal at put time rather than the process being killed by the OOM killer
later, and it lets other processes map the same memory: with a ``path`` (for
example under ``/dev/shm``) the arena is a ``MAP_SHARED`` mapping of a file
that the same-host shared-memory transport maps too.

Pages are faulted in at construction (``MAP_POPULATE`` where the platform has
it, touching every page otherwise), so the memory is really reserved and the
first put does not pay for page faults on the hot path.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import mmap
import os

from kvdepot.errors import CapacityExceeded, InvalidArgument, Unavailable

logger = logging.getLogger(__name__)

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class Arena:
    """A fixed-size, page-backed byte buffer.

    Args:
        capacity: Size of the buffer in bytes.
        path: If given, a file created (or truncated) there backs the arena
            and is mapped ``MAP_SHARED``; it is unlinked by :meth:`close`.
            Otherwise the arena is anonymous memory.

    Raises:
        InvalidArgument: If ``capacity`` is not positive.
        CapacityExceeded: If the backing file system cannot hold ``capacity``.
        Unavailable: If the file cannot be created or mapped.
    """

    def __init__(self, capacity: int, path: str | None = None) -> None:
        if capacity <= 0:
            raise InvalidArgument(f"arena capacity must be positive, got {capacity}")
        self._capacity = capacity
        self._path = path
        # Random id of this arena: a client that mapped another arena under
        # the same name (the store restarted) sees a different generation.
        self._generation = int.from_bytes(os.urandom(8), "little") | 1
        self._closed = False
        self._file_id: tuple[int, int] | None = None
        if path is None:
            self._mm = mmap.mmap(
                -1, capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE
            )
        else:
            self._mm, self._file_id = self._map_file(path, capacity)
        if not _POPULATE:
            self._touch_pages()
        self._view = memoryview(self._mm)
        # The temporary ctypes object's export of the buffer ends with it.
        self._address = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
        logger.debug("arena of %d bytes mapped%s", capacity, f" at {path}" if path else "")

    @staticmethod
    def _map_file(path: str, capacity: int) -> tuple[mmap.mmap, tuple[int, int]]:
        # A file left by a store that crashed is replaced, never reused: a
        # client may still map the old inode, and truncating it under that
        # mapping would turn the client's next read into SIGBUS. A new inode
        # also gives the new arena a new identity (st_dev, st_ino).
        _unlink_quietly(path)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise Unavailable(f"cannot create arena file {path}: {exc}") from exc
        try:
            # The umask cannot widen 0600, but a umask of 0177 would narrow
            # nothing either: set it explicitly.
            os.fchmod(fd, 0o600)
            st = os.fstat(fd)
            try:
                # Reserve the blocks now: on tmpfs a sparse file would let a
                # later page fault fail with SIGBUS instead of a clear error.
                os.posix_fallocate(fd, 0, capacity)
            except OSError as exc:
                raise CapacityExceeded(
                    f"cannot reserve {capacity} bytes for arena file {path}: {exc.strerror}"
                    f"{_room(path)}; lower the capacity or give that file system more room "
                    "(in a container: --shm-size, compose shm_size)"
                ) from exc
            try:
                mm = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED | _POPULATE)
            except OSError as exc:
                raise Unavailable(f"cannot map arena file {path}: {exc}") from exc
            return mm, (st.st_dev, st.st_ino)
        except BaseException:
            _unlink_quietly(path)
            raise
        finally:
            # The mapping holds its own reference to the file; the fd is not needed.
            os.close(fd)

    def _touch_pages(self) -> None:
        page = mmap.PAGESIZE
        zero = b"\0"
        for offset in range(0, self._capacity, page):
            self._mm[offset : offset + 1] = zero

    @property
    def capacity(self) -> int:
        """Size of the buffer in bytes."""
        return self._capacity

    @property
    def path(self) -> str | None:
        """The backing file, or ``None`` for anonymous memory."""
        return self._path

    @property
    def generation(self) -> int:
        """Random non-zero id of this arena, different for every arena created."""
        return self._generation

    @property
    def file_id(self) -> tuple[int, int] | None:
        """``(st_dev, st_ino)`` of the backing file, or ``None`` for anonymous memory.

        A same-host client that opens :attr:`path` compares it with its own
        ``fstat`` to make sure it maps this arena and not another file that
        happens to have the same name (another container's ``/dev/shm``).
        """
        return self._file_id

    @property
    def address(self) -> int:
        """Virtual address of the first byte of the mapping in this process.

        For registering the arena with RDMA libraries (NIXL); valid until
        :meth:`close`.

        Raises:
            Unavailable: If the arena is closed.
        """
        if self._closed:
            raise Unavailable("arena is closed")
        return self._address

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def view(self, offset: int, size: int) -> memoryview:
        """A writable view of ``size`` bytes at ``offset``; no bytes are copied.

        Raises:
            InvalidArgument: If the range is not inside the arena.
            Unavailable: If the arena is closed.
        """
        if self._closed:
            raise Unavailable("arena is closed")
        if offset < 0 or size < 0 or offset + size > self._capacity:
            raise InvalidArgument(
                f"range [{offset}, {offset + size}) outside arena of {self._capacity} bytes"
            )
        return self._view[offset : offset + size]

    def close(self) -> None:
        """Unmap the buffer and unlink the backing file, if this arena created one.

        Views still held by callers keep the mapping alive until they are
        released (the memory cannot be unmapped under them); that is logged,
        not raised, so shutdown always completes.
        """
        if self._closed:
            return
        self._closed = True
        self._view.release()
        try:
            self._mm.close()
        except BufferError:
            # Views often survive only in reference cycles (an exception's
            # traceback holding a frame that held a view): collect and retry.
            gc.collect()
            try:
                self._mm.close()
            except BufferError:
                logger.warning("arena closed while views of it are alive; unmapped when they go")
        if self._path is not None:
            _unlink_quietly(self._path)

    def __enter__(self) -> Arena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _room(path: str) -> str:
    """`` (DIR holds N bytes in all)`` for an error message, or nothing."""
    directory = os.path.dirname(path) or "."
    try:
        st = os.statvfs(directory)
    except OSError:
        return ""
    return f" ({directory} holds {st.f_blocks * st.f_frsize} bytes in all)"


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("cannot unlink arena file %s: %s", path, exc)
