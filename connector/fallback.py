"""What a client answers without the metadata service, from the stores it knows.

Two outages leave the stores serving while the metadata service cannot
answer: a service that does not answer at all (paused, a stalled host: each
call waits out its deadline) and one whose index backend is down (Redis
killed: every call is refused at once with ``Unavailable``). A chunk a store
holds is read from it, and verified against its writer's checksum, whether
or not the index names it; so where the client knows a store that can
answer, it answers from that store instead of failing:

- **A read one store just served whole.** A counted ``get_into`` (one that
  asks the index, which counts it and spreads hot chunks' readers over their
  replicas) by a client whose last read one store served whole waits for its
  lookup at most ``ClientConfig.fallback_wait_s``, then reads that store:
  if it holds every chunk, they are returned without the index; if not,
  the lookup is asked again, as before. (An uncounted read, ``count="none"``,
  reads that store first anyway.)
- **This node's store** (``ClientConfig.node_id``, once any reply named its
  address): ``lookup`` counts the leading keys that store holds (chunks on
  other nodes count as misses, as they could not be found); ``get_into``
  returns what it holds (the rest are misses); ``put`` stores the chunks
  there with the ``index`` protocol, so the store keeps them and owes their
  index commits, which it makes once the service answers again (see
  ``kvdepot.store.indexer``, "owed"); they count as ``PutResult.pending``.

Which keys a store holds is asked with the data plane's GET of the first byte
of each chunk (a chunk is never empty): OK where it holds the chunk,
NOT_FOUND where not. It costs one round trip and a byte per key, needs no
opcode of its own and works over every transport (tcp, shm, auto).

A client with neither (no node's store, no store that served it whole)
raises ``Unavailable`` as before, and so does one whose store does not answer
either. Each kind of fallback is logged once, then at most every 10 s with a
count (:class:`~kvdepot.repeat_log.RepeatLog`), and once when the metadata
service answers again (:data:`QUIET_S` after the last fallback: a service
whose answers come and go for a moment writes no line per change), with the totals.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from kvdepot.connector.results import GetResult, PutTally, whole
from kvdepot.connector.transport.base import (
    GetItem,
    GetOutcome,
    GetStatus,
    IndexingTransport,
    PutStatus,
    Transport,
)
from kvdepot.errors import Unavailable
from kvdepot.keys import ChunkKey
from kvdepot.repeat_log import RepeatLog
from kvdepot.types import LookupResult
from kvdepot.wire.protocol import IndexCode

logger = logging.getLogger(__name__)

KINDS = ("lookup", "read", "put")
"""The kinds of fallback, each logged on its own."""

QUIET_S = 1.0
"""How long after its last fallback an answer of the metadata service ends
the outage in the log (its line, with the totals)."""

_MESSAGES = {
    "lookup": "metadata service unavailable (%s): lookups answered by this node's store %s "
    "(chunks on other nodes count as misses)",
    "read": "metadata service unavailable (%s): reads served by %s without a lookup",
    "put": "metadata service unavailable (%s): puts stored in this node's store %s, "
    "which owes their index commits",
}


def _leading(flags: Sequence[bool]) -> int:
    n = 0
    for ok in flags:
        if not ok:
            break
        n += 1
    return n


class Fallback:
    """Answers a client's calls from the stores it knows while the metadata
    service cannot (see the module's docstring). Thread-safe.

    Args:
        transport: The client's data-plane transport.
    """

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self._repeats = RepeatLog(logger)
        self._failing = False  # a fallback was logged since the service last answered
        self._last = 0.0  # monotonic time of the last fallback

    # -- asking a store what it holds -------------------------------------------
    def held(self, address: str, keys: Sequence[ChunkKey]) -> list[GetOutcome]:
        """Per key, whether the store at ``address`` holds its chunk: a GET of
        its first byte (OK: held; NOT_FOUND: not; FAILED: the store did not answer)."""
        scratch = memoryview(bytearray(max(len(keys), 1)))
        items = [GetItem(k, scratch[i : i + 1], 0, 1) for i, k in enumerate(keys)]
        return self._transport.get_into(address, items)

    # -- the calls ----------------------------------------------------------------
    def lookup(self, exc: Unavailable, local: str | None, keys: Sequence[ChunkKey]) -> int:
        """A lookup the service did not answer: the leading keys this node's
        store holds.

        Raises:
            Unavailable: ``exc``, where there is no node's store or it did not answer.
        """
        if local is None or not keys:
            raise exc
        outcomes = self.held(local, keys)
        if _unanswered(outcomes):
            raise exc
        self._used("lookup", exc, local)
        return _leading([o.ok for o in outcomes])

    def lookup_or_read(
        self,
        lookup: Callable[[float], LookupResult],
        last: tuple[str, list[ChunkKey], list[memoryview]],
        wait_s: float,
        timeout_s: float,
    ) -> LookupResult | GetResult:
        """The lookup of a counted read by a client whose last read one store
        served whole (``last``: that store's address, the read's keys and
        buffers): waited for at most ``wait_s``. Without an answer by then
        that store is read, and if it holds every chunk the read is done;
        otherwise the lookup is asked again, for the rest of ``timeout_s``.

        Raises:
            Unavailable: The lookup failed again.
        """
        started = time.monotonic()
        try:
            return lookup(min(wait_s, timeout_s))
        except Unavailable as exc:
            address, keys, views = last
            outcomes = self._transport.get_whole(address, keys, views)
            if all(o.ok for o in outcomes):
                self._used("read", exc, address)
                return whole(outcomes)
            left = timeout_s - (time.monotonic() - started)
            if left <= 0:
                raise
            return lookup(left)

    def read(
        self,
        exc: Unavailable,
        keys: Sequence[ChunkKey],
        views: Sequence[memoryview],
        local: str | None,
        first: str | None,
        early: list[GetOutcome] | None,
    ) -> GetResult:
        """A read whose lookup the service did not answer: what this node's
        store (``local``) holds of the chunks, whether it was read first
        (``first``, its outcomes ``early``) or is read now; the rest are misses.

        Raises:
            Unavailable: ``exc``, where there is no node's store or it did not answer.
        """
        if local is None:
            raise exc
        got: list[GetOutcome] = list(early) if early is not None else []
        if first != local:
            # Only what the first store did not serve: its chunks are in their buffers.
            idx = [i for i in range(len(keys)) if not got or not got[i].ok]
            outcomes = self._transport.get_whole(
                local, [keys[i] for i in idx], [views[i] for i in idx]
            )
            if not got:
                got = [GetOutcome(GetStatus.FAILED)] * len(keys)
            for i, out in zip(idx, outcomes, strict=True):
                got[i] = out
        if _unanswered(got):
            raise exc
        self._used("read", exc, local)
        return GetResult(
            tuple(o.ok for o in got),
            sum(o.length for o in got if o.ok),
            tuple(o.length if o.ok else 0 for o in got),
            tuple("" if o.ok else f"{local}: {o.error or o.status.value}; {exc}" for o in got),
        )

    def put(
        self,
        exc: Unavailable,
        indexing: IndexingTransport | None,
        local: str | None,
        keys: list[ChunkKey],
        views: list[memoryview],
        written: list[bool],
        tally: PutTally,
    ) -> None:
        """A put whose ``PutStart`` the service did not answer: the chunks go
        into this node's store (those it took already, ``written``, stay), which
        owes their index commits (``pending``); held already: ``skipped``.

        Raises:
            Unavailable: ``exc``, where there is no node's store that indexes
                (the ``index`` protocol) or it took none of them.
        """
        if indexing is None or local is None:
            raise exc
        todo = [i for i in range(len(keys)) if not (written and written[i])]
        # Not sent again where the store holds them (a tcp put streams the bytes).
        held = self.held(local, [keys[i] for i in todo]) if todo else []
        send = [i for i, out in zip(todo, held, strict=True) if not out.ok]
        statuses: list[PutStatus] = []
        codes: list[IndexCode] = []
        if send:
            statuses, codes = indexing.put_whole_indexed(
                local, [keys[i] for i in send], [views[i] for i in send]
            )
        sent = dict(zip(send, zip(statuses, codes, strict=True), strict=True))
        settled = 0
        for i, view in enumerate(views):
            size = view.nbytes
            status, code = sent.get(i, (PutStatus.EXISTS, IndexCode.NOT_INDEXED))
            if written and written[i]:
                status = PutStatus.OK
            if status is PutStatus.OK and code in (IndexCode.NEW, IndexCode.ELSEWHERE):
                tally.add(size, code is IndexCode.NEW)  # the index answered meanwhile
            elif status is PutStatus.OK:
                tally.add_pending(size)  # owed by the store
            elif status is PutStatus.EXISTS:
                tally.skipped += 1
                tally.bytes_skipped += size
            else:
                tally.failed += 1
                continue
            settled += 1
        if not settled:
            raise exc
        self._used("put", exc, local)

    # -- logging --------------------------------------------------------------------
    def _used(self, kind: str, exc: Unavailable, address: str) -> None:
        self._failing = True
        self._last = time.monotonic()
        self._repeats.warn(
            kind,
            _MESSAGES[kind],
            exc,
            address,
            extra={"event": "metadata_fallback", "fallback": kind},
        )

    def answered(self) -> None:
        """The metadata service answered a call: one line with what was
        answered without it, if anything was, :data:`QUIET_S` after the last
        fallback. Cheap when nothing was."""
        if not self._failing or time.monotonic() - self._last < QUIET_S:
            return
        self._failing = False
        ended = {kind: self._repeats.ended(kind) for kind in KINDS}
        counts = {kind: e[0] if e else 0 for kind, e in ended.items()}
        over = max((e[1] for e in ended.values() if e), default=0.0)
        logger.info(
            "metadata service answers again; answered without it: %d lookups, %d reads, "
            "%d puts over %.1f s",
            counts["lookup"],
            counts["read"],
            counts["put"],
            over,
            extra={"event": "metadata_fallback_ended", **counts},
        )


def _unanswered(outcomes: Sequence[GetOutcome]) -> bool:
    """Whether no outcome came from a store that answered (every one FAILED)."""
    return all(o.status is GetStatus.FAILED for o in outcomes)
