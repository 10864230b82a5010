"""What became of a writer's deferred chunks: the body of a SYNC_REPLY, and
what the client adds of its own (commits whose answer it read late)."""

from __future__ import annotations

import struct
from dataclasses import dataclass

INDEX_SETTLED = struct.Struct("<QQQQ")
"""The SYNC_REPLY body: new, elsewhere, not_indexed, pending (u64 each)."""


@dataclass(frozen=True, slots=True)
class IndexSettled:
    """What the index did with a writer's deferred chunks (SYNC_REPLY).

    Attributes:
        new: Committed, the first replica in the cluster.
        elsewhere: Committed as one more replica of a chunk another node
            had stored.
        not_indexed: Not committed within the store's bound (the index
            unreachable, the store not registered, or the chunk gone): in
            the store, readable there, named by no lookup until the store
            registers its inventory again.
        pending: Still on their way into the index when the wait ended
            (of two answers added, the later one's).
        skipped: Copied into the store's arena by a put that returned
            before the store's answer to its COMMIT (a pipelined commit),
            which said the store held them already (another put stored them
            first): nothing new, nothing indexed for this writer.
        lost: Copied so, and then not stored: the store refused the commit,
            or the connection failed before the answer came.

    ``skipped`` and ``lost`` are counted by the client, never on the wire.
    """

    new: int = 0
    elsewhere: int = 0
    not_indexed: int = 0
    pending: int = 0
    skipped: int = 0
    lost: int = 0

    def pack(self) -> bytes:
        """The SYNC_REPLY body (without the client's own counts)."""
        return INDEX_SETTLED.pack(self.new, self.elsewhere, self.not_indexed, self.pending)

    def __add__(self, other: IndexSettled) -> IndexSettled:
        # This answer, then a later one: outcomes add up; pending is a state.
        return IndexSettled(
            self.new + other.new,
            self.elsewhere + other.elsewhere,
            self.not_indexed + other.not_indexed,
            other.pending,
            self.skipped + other.skipped,
            self.lost + other.lost,
        )
