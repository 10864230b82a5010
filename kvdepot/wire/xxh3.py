"""xxh3-64, the checksum of every chunk, computed without holding the GIL.

The data plane hashes while it moves bytes: one thread hashes a block while
another sends or receives the next. The ``xxhash`` module holds Python's GIL
while it hashes, which serialises those threads; the same C functions called
through :mod:`ctypes` release it. They are taken from the library the
``xxhash`` package itself loaded (its extension exports the XXH3 API), and
checked against :func:`xxhash.xxh3_64_intdigest` once at import: where they
cannot be found or disagree, the module's own functions are used. The digests
are the same either way.
"""

from __future__ import annotations

import ctypes
import logging

import numpy as np
import xxhash

logger = logging.getLogger(__name__)

_MIN_RELEASE = 64 << 10
"""Below this, the ctypes call overhead outweighs releasing the GIL."""


def _load() -> ctypes.CDLL | None:
    try:
        import importlib

        # The extension module exports the XXH3 C API.
        extension = importlib.import_module("xxhash._xxhash")
        lib = ctypes.CDLL(str(extension.__file__))
        one = lib.XXH3_64bits_dispatch
        lib.XXH3_createState.restype = ctypes.c_void_p
        lib.XXH3_freeState.argtypes = [ctypes.c_void_p]
        lib.XXH3_64bits_reset.argtypes = [ctypes.c_void_p]
        lib.XXH3_64bits_update_dispatch.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
        ]
        lib.XXH3_64bits_digest.argtypes = [ctypes.c_void_p]
        lib.XXH3_64bits_digest.restype = ctypes.c_uint64
        one.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        one.restype = ctypes.c_uint64
    except (ImportError, OSError, AttributeError) as exc:
        logger.debug("xxh3 through ctypes unavailable: %s", exc)
        return None
    probe = bytearray(np.arange(100_000, dtype=np.uint32).tobytes())
    address = ctypes.addressof(ctypes.c_char.from_buffer(probe))
    if one(address, len(probe)) != xxhash.xxh3_64_intdigest(bytes(probe)):
        logger.warning("xxh3 through ctypes disagrees with xxhash; not used")
        return None
    return lib


_LIB = _load()


def _address(view: memoryview) -> int:
    if not view.readonly:
        # A sixth of the cost of going through numpy (0.3 against 2 us).
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    # The array interface is cheaper to read than ``ndarray.ctypes.data``.
    return int(np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0])


def xxh3_64(data: memoryview) -> int:
    """xxh3-64 of a flat byte view (the GIL is released for large inputs)."""
    if _LIB is None or data.nbytes < _MIN_RELEASE:
        return int(xxhash.xxh3_64_intdigest(data))
    return int(_LIB.XXH3_64bits_dispatch(_address(data), data.nbytes))


def checksum(data: memoryview | bytes | bytearray) -> int:
    """The checksum every chunk carries: xxh3-64 of its bytes.

    Computed by the writer over the whole chunk and checked whenever the bytes
    cross the network or come off disk. Non-byte formats (a memoryview of
    float16 values, say) are hashed as their raw bytes. Large inputs are
    hashed without holding the GIL (see :func:`xxh3_64`).
    """
    view = data if isinstance(data, memoryview) else memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return xxh3_64(view)


class Xxh3Stream:
    """Streaming xxh3-64: :meth:`update` with consecutive parts, then :meth:`digest`."""

    __slots__ = ("_py", "_state")

    def __init__(self) -> None:
        self._state: int | None = None
        self._py: xxhash.xxh3_64 | None = None
        if _LIB is not None:
            state = _LIB.XXH3_createState()
            if state:
                _LIB.XXH3_64bits_reset(state)
                self._state = state
        if self._state is None:
            self._py = xxhash.xxh3_64()

    def update(self, data: memoryview) -> None:
        """Hash the next part (a flat byte view)."""
        if self._py is not None:
            self._py.update(data)
        elif data.nbytes:
            assert _LIB is not None
            _LIB.XXH3_64bits_update_dispatch(self._state, _address(data), data.nbytes)

    @property
    def native(self) -> bool:
        """Whether updates call libxxhash directly (so :meth:`update_at` may be used)."""
        return self._state is not None

    def update_at(self, address: int, nbytes: int) -> None:
        """Hash the next ``nbytes`` bytes at ``address`` (ctypes path only)."""
        assert _LIB is not None and self._state is not None
        if nbytes:
            _LIB.XXH3_64bits_update_dispatch(self._state, address, nbytes)

    def digest(self) -> int:
        """The xxh3-64 of every part so far."""
        if self._py is not None:
            return int(self._py.intdigest())
        assert _LIB is not None
        return int(_LIB.XXH3_64bits_digest(self._state))

    def __del__(self) -> None:
        if self._state is not None and _LIB is not None:
            _LIB.XXH3_freeState(self._state)
            self._state = None


class BlockHasher:
    """Streaming xxh3-64 of one buffer hashed block by block, in order.

    The buffer's address is taken once: per-block address lookups through
    numpy cost a tenth of the store's receive path.

    Args:
        view: The flat byte buffer whose consecutive ranges are hashed.
    """

    __slots__ = ("_base", "_stream", "_view")

    def __init__(self, view: memoryview) -> None:
        self._stream = Xxh3Stream()
        self._view = view
        self._base = _address(view) if self._stream.native and view.nbytes else None

    def update(self, start: int, end: int) -> None:
        """Hash ``view[start:end]``, the range right after the previous one."""
        if self._base is not None:
            self._stream.update_at(self._base + start, end - start)
        else:
            self._stream.update(self._view[start:end])

    def digest(self) -> int:
        """The xxh3-64 of every range so far."""
        return self._stream.digest()
