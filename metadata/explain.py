"""The ``Explain`` RPC: per key, where it is, or why it left.

Read only by operators' tools (``kvdepot explain``): it probes the index a
key at a time and reads the whole departure history, none of which a lookup
ever does.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from kvdepot.errors import KVDepotError
from kvdepot.keys import ChunkKey, validate_keys
from kvdepot.metadata.index import IndexBackend
from kvdepot.metadata.index.departures import Departure
from kvdepot.metadata.namespaces import Guard
from kvdepot.proto.gen import common_pb2, metadata_pb2
from kvdepot.types import KeyLocation
from kvdepot.validation import check_text

MAX_EXPLAIN_KEYS = 8192
"""Keys one ``Explain`` may ask about (a prompt of 2 M tokens in 256-token chunks)."""


_WIRE = {"removed": "REASON_UNSPECIFIED"}


def _departure_pb(d: Departure) -> metadata_pb2.Departure:
    return metadata_pb2.Departure(
        # The wire's names are the reasons', in capitals ("removed": unspecified).
        reason=_WIRE.get(d.reason, d.reason.upper()),
        node_id=d.node_id,
        tier=d.tier,
        at=d.at,
    )


def _explained(where: KeyLocation | None, gone: Departure | None) -> metadata_pb2.KeyExplanation:
    out = metadata_pb2.KeyExplanation()
    if where is not None:
        out.replicas.extend(
            common_pb2.Replica(node_id=r.node_id, address=r.address, tier=r.tier)
            for r in where.replicas
        )
    elif gone is not None:
        out.departure.CopyFrom(_departure_pb(gone))
    return out


async def explain(
    index: IndexBackend, keys: Sequence[ChunkKey], client: str
) -> list[metadata_pb2.KeyExplanation]:
    """Per key: its replicas, else its newest departure, if the index knows one."""
    where = await index.probe(keys, client)
    missing = [k for k, w in zip(keys, where, strict=True) if w is None]
    # In this order: a sweep records a lost replica's departure before it
    # deletes the replica, so one of the two reads finds it.
    lost = await index.lost_with_node(missing)
    gone = dict(zip(missing, await index.departures.find(missing), strict=True))
    for key, (node_id, at) in lost.items():
        known = gone.get(key)
        if known is None or known.at < at:
            gone[key] = Departure(key, node_id, "node_lost", "", at)
    return [_explained(w, gone.get(k)) for k, w in zip(keys, where, strict=True)]


class ExplainRPCs:
    """``Explain``; the servicer answers it through this, giving it the index
    and its error mapping."""

    def __init__(self, index: IndexBackend, guard: Guard) -> None:
        self._index = index
        self._guard = guard

    async def Explain(
        self, request: metadata_pb2.ExplainRequest, context: grpc.aio.ServicerContext
    ) -> metadata_pb2.ExplainResponse:
        try:
            keys = validate_keys(request.keys, MAX_EXPLAIN_KEYS, "explain")
            client = check_text(request.client_node_id, "client_node_id", required=False)
            found = await explain(self._index, keys, client)
        except KVDepotError as exc:
            await self._guard(context, exc)
        return metadata_pb2.ExplainResponse(
            keys=found, history_per_node=self._index.departures.config.per_node
        )
