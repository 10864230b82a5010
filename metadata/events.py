"""KV events over ZeroMQ, in the wire shape of vLLM's ``ZmqEventPublisher``.

External routers (llm-d's KV cache indexer, NVIDIA Dynamo's KV router)
subscribe to engines' KV events to learn who holds which blocks. The metadata
service sees every commit and removal of every store node, so it publishes the
same events for the whole cluster:

- a PUB socket sends multipart messages ``(topic, seq, payload)``: ``seq`` is an
  8-byte big-endian sequence number, consecutive across all topics, and
  ``payload`` a msgpack ``EventBatch`` array ``[ts, events, dp_rank]`` whose
  events are maps tagged by ``"type"``: ``BlockStored``, ``BlockRemoved`` and
  ``AllBlocksCleared``;
- the topic names the store node: ``kv@{node}`` by default (a subscriber
  filters by prefix, as it does for engines);
- a ROUTER socket answers replay requests: a client sends
  ``(b"", start_seq as 8 bytes big-endian)`` and gets every buffered batch from
  ``start_seq`` on as ``(b"", topic, seq, payload)``, then an end marker
  ``(b"", b"", seq=-1, b"")``. A subscriber that sees a gap in sequence numbers
  asks for it; if the buffer no longer reaches back that far, the first replayed
  sequence number tells it what was lost.

Block hashes are the 16-byte chunk keys, ``medium`` the tier (``"CPU"``,
``"GPU"``, ``"STORAGE"``). The metadata service does not see token ids, so
``token_ids`` is empty and ``block_size`` is the configured tokens per chunk.

pyzmq and msgpack are the optional extra ``kvdepot[events]`` (in a vLLM
environment, msgspec stands in for msgpack).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvdepot.errors import InvalidArgument
from kvdepot.keys import ChunkKey
from kvdepot.types import NodeId

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_MEDIUM = {"gpu": "GPU", "cpu": "CPU", "ssd": "STORAGE"}


@dataclass(frozen=True, slots=True)
class EventsConfig:
    """Configuration of the KV event publisher.

    Attributes:
        endpoint: ZeroMQ endpoint the PUB socket binds, e.g. ``tcp://127.0.0.1:5557``.
        replay_endpoint: Endpoint the replay ROUTER binds; empty: the PUB port
            plus one (port 0 stays 0: the OS picks).
        block_size: Tokens per chunk, reported as each event's ``block_size``.
        topic: Topic template; ``{node}`` is replaced by the store node id.
        buffer_batches: Batches kept for replay.
        hwm: High-water mark of the PUB socket.
    """

    endpoint: str
    replay_endpoint: str = ""
    block_size: int = 256
    topic: str = "kv@{node}"
    buffer_batches: int = 10_000
    hwm: int = 100_000

    def __post_init__(self) -> None:
        for ep in (self.endpoint, self.replay_endpoint):
            if ep and "://" not in ep:
                raise InvalidArgument(f"ZeroMQ endpoint {ep!r} must look like tcp://host:port")
        if self.block_size < 1 or self.buffer_batches < 1 or self.hwm < 1:
            raise InvalidArgument("block_size, buffer_batches and hwm must be positive")

    def replay(self) -> str:
        if self.replay_endpoint:
            return self.replay_endpoint
        base, sep, port = self.endpoint.rpartition(":")
        if not sep or not port.isdigit():
            raise InvalidArgument(f"cannot derive a replay endpoint from {self.endpoint!r}")
        return f"{base}:{int(port) + 1 if int(port) else 0}"


# -- encoding -------------------------------------------------------------------
def block_stored(keys: Sequence[bytes], block_size: int, medium: str | None) -> dict[str, Any]:
    """A ``BlockStored`` event of ``keys`` (no parent, no token ids)."""
    return {
        "type": "BlockStored",
        "block_hashes": [bytes(k) for k in keys],
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
    }


def block_removed(keys: Sequence[bytes], medium: str | None) -> dict[str, Any]:
    """A ``BlockRemoved`` event of ``keys``."""
    return {"type": "BlockRemoved", "block_hashes": [bytes(k) for k in keys], "medium": medium}


def all_blocks_cleared() -> dict[str, Any]:
    """An ``AllBlocksCleared`` event."""
    return {"type": "AllBlocksCleared"}


def encode_batch(events: Sequence[dict[str, Any]], ts: float) -> bytes:
    """The msgpack payload of one ``EventBatch``: ``[ts, events, dp_rank]``."""
    batch = [float(ts), list(events), None]
    try:
        import msgpack
    except ImportError:  # inside a vLLM environment: msgspec writes the same bytes
        import msgspec

        return bytes(msgspec.msgpack.encode(batch))
    payload: bytes = msgpack.packb(batch, use_bin_type=True)
    return payload


def decode_batch(payload: bytes) -> tuple[float, list[dict[str, Any]]]:
    """Inverse of :func:`encode_batch` (for tests and simple subscribers)."""
    import msgpack

    ts, events, *_ = msgpack.unpackb(payload, raw=False)
    return float(ts), list(events)


def medium_of(tier: str) -> str:
    return _MEDIUM.get(tier, tier.upper())


# -- publisher ------------------------------------------------------------------
class KVEventPublisher:
    """PUB + replay ROUTER sockets on the caller's event loop.

    Publishing never blocks: the PUB socket drops at its high-water mark (as
    in vLLM) and the replay buffer keeps the last ``buffer_batches`` batches.
    """

    def __init__(self, config: EventsConfig) -> None:
        self.config = config
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=config.buffer_batches)
        self._seq = 0
        self._nodes: set[NodeId] = set()
        self._ctx: Any = None
        self._pub: Any = None
        self._replay: Any = None
        self._task: asyncio.Task[None] | None = None
        self.endpoint = ""
        self.replay_endpoint = ""

    async def start(self) -> None:
        """Bind the sockets and start answering replay requests."""
        try:
            import zmq
            import zmq.asyncio
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise InvalidArgument("KV events need pyzmq: pip install 'kvdepot[events]'") from exc
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(self.config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = self._ctx.socket(zmq.ROUTER)
        self._replay.setsockopt(zmq.LINGER, 0)
        try:
            self._pub.bind(self.config.endpoint)
            self._replay.bind(self.config.replay())
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise InvalidArgument(f"cannot bind KV event sockets: {exc}") from exc
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._task = asyncio.create_task(self._serve_replay())
        logger.info("KV events on %s (replay %s)", self.endpoint, self.replay_endpoint)

    def _topic(self, node_id: NodeId) -> bytes:
        return self.config.topic.replace("{node}", node_id).encode()

    def publish(self, node_id: NodeId, events: Sequence[dict[str, Any]]) -> int:
        """Send one batch on ``node_id``'s topic; returns its sequence number."""
        if self._pub is None or not events:
            return -1
        import zmq

        seq = self._seq
        self._seq += 1
        topic = self._topic(node_id)
        payload = encode_batch(events, time.time())
        self._buffer.append((seq, topic, payload))
        self._nodes.add(node_id)
        try:
            self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # at the high-water mark; replay still has it
            logger.warning("KV event batch %d not sent: %s", seq, exc)
        return seq

    # -- what the metadata service reports ---------------------------------
    def stored(self, node_id: NodeId, keys: Sequence[ChunkKey], tier: str = "cpu") -> None:
        if keys:
            self.publish(node_id, [block_stored(keys, self.config.block_size, medium_of(tier))])

    def removed(self, node_id: NodeId, keys: Sequence[ChunkKey], tier: str = "cpu") -> None:
        if keys:
            self.publish(node_id, [block_removed(keys, medium_of(tier))])

    def registered(self, node_id: NodeId, inventory: Iterable[tuple[ChunkKey, str]]) -> None:
        """A node (re)joined: it holds exactly ``inventory`` now."""
        by_tier: dict[str, list[ChunkKey]] = {}
        for key, tier in inventory:
            by_tier.setdefault(tier, []).append(key)
        events = [all_blocks_cleared()]
        events += [
            block_stored(keys, self.config.block_size, medium_of(tier))
            for tier, keys in by_tier.items()
        ]
        self.publish(node_id, events)

    def nodes_gone(self, live: Iterable[NodeId]) -> list[NodeId]:
        """``AllBlocksCleared`` for each node published before but not in ``live``."""
        gone = sorted(self._nodes - set(live))
        for node_id in gone:
            self.publish(node_id, [all_blocks_cleared()])
            self._nodes.discard(node_id)
        return gone

    # -- replay -------------------------------------------------------------
    async def _serve_replay(self) -> None:
        while True:
            try:
                frames = await self._replay.recv_multipart()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("replay socket failed")
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("ignored a malformed KV event replay request")
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, topic, payload in list(self._buffer):
                if seq >= first:
                    await self._replay.send_multipart(
                        (client, b"", topic, seq.to_bytes(8, "big"), payload)
                    )
            await self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._close_sockets()
