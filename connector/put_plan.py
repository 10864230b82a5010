"""How one put goes: decided once, before any byte moves (see docs/write-path.md).

A put has two choices of its own. Its **route**: into the writer's own node's
store, which commits what it stored into the index (``LOCAL``), or the
reference path, ``PutStart`` → bytes → ``PutEnd`` through the metadata service
(``REFERENCE``). And, on the local route, when the store **answers**: after the
index committed (``WAIT``), or right after its own commit, the index following
(``DEFER``, settled by ``sync_index``). How the bytes move (a stream, a copy
into granted room, a reservation first) is the transport's, one rule in each.

Chunks the local route leaves over (the store held them, refused them, or
could not index them) take the reference route in the same put; that is not
a second plan but the reference route's normal work.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass


class Route(enum.Enum):
    """Where a put's bytes go first."""

    LOCAL = "local"
    """This node's store: it stores them, then commits them into the index."""
    REFERENCE = "reference"
    """Where ``PutStart`` places them; the writer commits with ``PutEnd``."""


class Answer(enum.Enum):
    """When the own store answers a put on the local route."""

    WAIT = "wait"
    """Once the index committed the chunks: the put's result says what it did."""
    DEFER = "defer"
    """Once the store committed them; they are PENDING until ``sync_index``."""


LOCAL_FIRST_STREAM_BYTES = 8 << 20
"""Largest put that takes the local route over a transport that moves bytes
before the store can say it holds them (tcp): a republished larger prefix
would cross loopback only to be discarded."""


@dataclass(frozen=True, slots=True)
class PutPlan:
    """The decisions of one put.

    Attributes:
        route: Where the bytes go first.
        answer: When the own store answers (the local route only).
        address: The own store's data-plane address on the local route, else "".
        writer: The token the store counts this client's deferred commits by
            (nonzero with ``DEFER``, else 0: what the wire carries).
    """

    route: Route
    answer: Answer = Answer.WAIT
    address: str = ""
    writer: int = 0

    def __post_init__(self) -> None:
        if (self.route is Route.LOCAL) != bool(self.address):
            raise ValueError("the local route, and only it, names the own store")
        if (self.answer is Answer.DEFER) != bool(self.writer):
            raise ValueError("a deferred answer, and only it, carries a writer token")


REFERENCE = PutPlan(Route.REFERENCE)


def plan_put(
    local: str | None,
    nbytes: int,
    reserves_first: Callable[[str], bool],
    defer: bool,
    writer: int,
) -> PutPlan:
    """The plan of a put of ``nbytes`` for a client whose own store is at
    ``local`` (``None`` until a reply named it).

    Args:
        local: The own store's data-plane address, if known.
        nbytes: The put's total size.
        reserves_first: Whether the transport to an address learns what the
            store holds before it moves any byte.
        defer: Whether the client defers index commits.
        writer: The client's writer token (nonzero).
    """
    if local is None:
        return REFERENCE
    if nbytes > LOCAL_FIRST_STREAM_BYTES and not reserves_first(local):
        return REFERENCE
    if defer:
        return PutPlan(Route.LOCAL, Answer.DEFER, local, writer)
    return PutPlan(Route.LOCAL, Answer.WAIT, local)
