"""What a put and a get did: the results :class:`~kvdepot.connector.client.KVDepotClient`
returns, and the tallies that build them."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kvdepot.connector.transport.base import GetOutcome
from kvdepot.types import LookupResult
from kvdepot.wire.settled import IndexSettled


@dataclass(frozen=True, slots=True)
class PutResult:
    """What a put did, key by key summed up.

    Attributes:
        stored: Chunks the index committed as new in the cluster.
        skipped: Chunks stored in the cluster already (not sent again).
        failed: Chunks not stored.
        bytes_sent: Bytes of ``stored``.
        bytes_skipped: Bytes of ``skipped``.
        pending: Chunks written into this node's store whose index commit
            follows the store's answer (``ClientConfig.defer_index_commit``);
            :meth:`KVDepotClient.sync_index` says what became of them. Also
            chunks this node's store took while ``PutStart`` failed (the
            metadata service or its index down): the store owes their index
            commits and makes them once the service answers again
            (:mod:`kvdepot.connector.fallback`); ``sync_index`` does not count those.
        bytes_pending: Bytes of ``pending``.
    """

    stored: int
    skipped: int
    failed: int
    bytes_sent: int
    bytes_skipped: int
    pending: int = 0
    bytes_pending: int = 0


@dataclass(frozen=True, slots=True)
class GetResult:
    """Which keys were loaded into their buffers (verified) and which missed.

    Attributes:
        loaded: Per key, whether its chunk is in its buffer.
        bytes_received: Bytes of all loaded chunks.
        sizes: Per key, the size of the chunk loaded (0 for a miss).
        reasons: Per key, why it missed ("" where loaded): ``not cached``
            (after the leading hits), ``buffer too small: …`` (the chunk is
            bigger than its buffer), or what the last store tried answered.
    """

    loaded: tuple[bool, ...]
    bytes_received: int
    sizes: tuple[int, ...] = ()
    reasons: tuple[str, ...] = ()

    @property
    def leading(self) -> int:
        """Number of leading keys loaded: the usable prefix."""
        n = 0
        for ok in self.loaded:
            if not ok:
                break
            n += 1
        return n


@dataclass(slots=True)
class PutTally:
    """What one ``put`` did so far."""

    stored: int = 0
    skipped: int = 0
    failed: int = 0
    bytes_sent: int = 0
    bytes_skipped: int = 0
    pending: int = 0
    bytes_pending: int = 0

    def add(self, size: int, new: bool) -> None:
        """A chunk this put wrote: new in the cluster, or stored there already."""
        if new:
            self.stored += 1
            self.bytes_sent += size
        else:
            self.skipped += 1
            self.bytes_skipped += size

    def add_pending(self, size: int) -> None:
        """A chunk this put wrote into its node's store, its index commit to follow."""
        self.pending += 1
        self.bytes_pending += size

    def result(self) -> PutResult:
        return PutResult(
            self.stored,
            self.skipped,
            self.failed,
            self.bytes_sent,
            self.bytes_skipped,
            self.pending,
            self.bytes_pending,
        )


class DeferredCommits:
    """Whether this client has deferred index commits its store has not
    reported settled: the one record the client keeps of them (what became of
    each is counted by the store, per writer, and told by ``sync_index``).

    A sync that finds nothing pending settles every put made before it was
    asked; a put made meanwhile stays open until the next one.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._made = 0  # deferring puts made
        self._settled = 0  # of those, the ones a sync reported settled

    def made(self) -> None:
        """A put returned with chunks pending."""
        with self._lock:
            self._made += 1

    def open(self) -> bool:
        """Whether a put may have chunks not yet in the index."""
        with self._lock:
            return self._settled != self._made

    def mark(self) -> int:
        """Before asking the store: the puts the answer will cover."""
        with self._lock:
            return self._made

    def answered(self, mark: int, settled: IndexSettled) -> None:
        """The store's answer to the question asked at ``mark``."""
        if settled.pending:
            return
        with self._lock:
            self._settled = max(self._settled, mark)


class Pull:
    """What one ``get_into`` loaded so far, and why the rest missed."""

    def __init__(self, n: int, reply: LookupResult) -> None:
        self.reply = reply
        self.loaded = [False] * n
        self.sources = [""] * n  # the store each loaded chunk came from
        self.reasons = ["not cached"] * n
        for i in range(reply.hits):
            self.reasons[i] = "no replica could be read"
        self.sizes = [0] * n

    def loaded_from(self, i: int, address: str, size: int = -1) -> None:
        self.loaded[i] = True
        self.sources[i] = address
        self.reasons[i] = ""
        self.sizes[i] = self.reply.locations[i].size if size < 0 else size

    def fits(self, i: int, view: memoryview) -> bool:
        """Whether chunk ``i`` fits ``view``; a miss with its reason if not."""
        size, have = self.reply.locations[i].size, view.nbytes
        if have < size:
            self.reasons[i] = f"buffer too small: the chunk is {size} bytes, the buffer {have}"
        return have >= size

    def extend(self, idx: list[int], outcomes: list[GetOutcome], address: str) -> None:
        """Chunks the lookup did not name, read from ``address`` anyway."""
        for i, out in zip(idx, outcomes, strict=True):
            self.loaded_from(i, address, out.length)

    def result(self) -> GetResult:
        return GetResult(
            tuple(self.loaded), sum(self.sizes), tuple(self.sizes), tuple(self.reasons)
        )


def whole(outcomes: list[GetOutcome]) -> GetResult:
    """Every chunk read (from this node's store, without a lookup)."""
    sizes = tuple(o.length for o in outcomes)
    return GetResult((True,) * len(sizes), sum(sizes), sizes, ("",) * len(sizes))
