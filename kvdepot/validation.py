"""Checks of the fields of metadata requests that the index stores or computes with.

Whatever a request carries ends up in the index (and in Redis), in logs, in
``GetStats`` answers and in routing arithmetic, so every field is bounded
and typed here before it gets there: a bad one is an :class:`InvalidArgument`
(gRPC ``INVALID_ARGUMENT`` with the reason), never an entry that breaks a
later reader. Keys, their counts and node ids are checked by the servicer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvdepot.endpoints import check_endpoint
from kvdepot.errors import InvalidArgument
from kvdepot.proto.gen import common_pb2
from kvdepot.types import TIER_RANK

MAX_TEXT = 256
"""Longest address or id accepted, in characters."""

MAX_SIZE = (1 << 40) - 1
"""Largest chunk size accepted (1 TiB less a byte): what the indexes' compact
records hold (40 bits in the memory index's, 48 in Redis's)."""

MAX_REQUEST_ID = 64
"""Longest ``PutStart`` request id accepted, in bytes (clients send 16)."""


def check_text(text: str, what: str, *, required: bool = True) -> str:
    """A short, printable, space-free name (node id, candidate id).

    Raises:
        InvalidArgument: Empty when required, too long, or with spaces or
            control characters.
    """
    if not text:
        if required:
            raise InvalidArgument(f"{what} is required")
        return text
    if len(text) > MAX_TEXT or not text.isprintable() or any(c.isspace() for c in text):
        raise InvalidArgument(
            f"{what} must be at most {MAX_TEXT} printable characters without spaces"
        )
    return text


def check_address(address: str, what: str, *, required: bool = True) -> str:
    """A ``host:port`` (``[v6]:port``) another process will connect to.

    Raises:
        InvalidArgument: Missing when required, or not a host and a port.
    """
    check_text(address, what, required=required)
    if not address:
        return address
    return check_endpoint(address, what)


def check_sizes(sizes: Sequence[int], count: int) -> list[int]:
    """One positive size per key, none beyond :data:`MAX_SIZE`.

    Raises:
        InvalidArgument: A count mismatch or a size out of range.
    """
    if len(sizes) != count:
        raise InvalidArgument(f"{count} keys but {len(sizes)} sizes")
    for s in sizes:
        if not 0 < s <= MAX_SIZE:
            raise InvalidArgument(f"chunk sizes must be between 1 and {MAX_SIZE}, got {s}")
    return list(sizes)


def check_request_id(request_id: bytes) -> bytes:
    """A put's request id: opaque bytes, empty for none, at most :data:`MAX_REQUEST_ID`.

    Raises:
        InvalidArgument: Longer than that.
    """
    if len(request_id) > MAX_REQUEST_ID:
        raise InvalidArgument(
            f"request_id must be at most {MAX_REQUEST_ID} bytes, got {len(request_id)}"
        )
    return bytes(request_id)


def check_tier(name: str) -> str:
    """A tier a store can hold chunks in.

    Raises:
        InvalidArgument: Any other name.
    """
    if name not in TIER_RANK:
        raise InvalidArgument(f"unknown tier {name[:MAX_TEXT]!r}; known: {', '.join(TIER_RANK)}")
    return name


def check_tier_stats(tiers: Sequence[common_pb2.TierStats]) -> None:
    """A node's tiers: known names, each at most once.

    Raises:
        InvalidArgument: An unknown or repeated tier.
    """
    names = [check_tier(t.name) for t in tiers]
    if len(set(names)) != len(names):
        raise InvalidArgument(f"tiers repeat: {', '.join(names)}")


def check_rate(value: float, what: str) -> float:
    """A finite, non-negative quantity (bytes per second, seconds, load).

    Raises:
        InvalidArgument: NaN, infinite or negative.
    """
    if not math.isfinite(value) or value < 0:
        raise InvalidArgument(f"{what} must be finite and not negative, got {value}")
    return value


def check_transfer(rate: common_pb2.TransferRate) -> None:
    """A node's reported transfer rates.

    Raises:
        InvalidArgument: A rate or window that is not a finite, non-negative number.
    """
    check_rate(rate.bytes_in_per_s, "bytes_in_per_s")
    check_rate(rate.bytes_out_per_s, "bytes_out_per_s")
    check_rate(rate.window_s, "window_s")
