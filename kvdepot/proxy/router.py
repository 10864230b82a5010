"""The proxy's KV-aware engine choice: ask the metadata service's ``Route``.

A request whose prompt is given as token ids is cut into chunk keys with the
engines' namespace; the metadata service scores each candidate engine by how
much of that prefix its own store node holds, how much it would pull and its
load (the proxy's in-flight requests to it). Text prompts, chat messages and
any failure of the query fall back to round-robin: routing is an optimisation,
never a reason to fail a request.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from kvdepot.errors import InvalidArgument
from kvdepot.keys import ChunkKey, Namespace, chunk_keys
from kvdepot.proto.gen import metadata_pb2, metadata_pb2_grpc
from kvdepot.rpc.security import aio_channel
from kvdepot.rpc.security_config import SecurityConfig

logger = logging.getLogger(__name__)

ROUTING_MODES = ("round-robin", "kv-aware")


def parse_node_map(items: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """``["URL=NODE", …]`` (also comma-separated) as ``((url, node), …)``."""
    out: list[tuple[str, str]] = []
    for item in items:
        for part in item.split(","):
            if not part:
                continue
            url, sep, node = part.rpartition("=")
            if not sep or not url or not node:
                raise InvalidArgument(f"engine node mapping {part!r} must look like URL=NODE_ID")
            out.append((url, node))
    return tuple(out)


def prompt_keys(body: Mapping[str, Any], namespace: Namespace) -> list[ChunkKey] | None:
    """Chunk keys of a completion request whose ``prompt`` is a list of token ids."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        return None
    if len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]  # a batch of one
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None
    try:
        return chunk_keys(namespace, prompt)
    except InvalidArgument:
        return None


@dataclass(frozen=True, slots=True)
class Choice:
    """The engine chosen and why."""

    url: str
    routed: bool  # False: round-robin
    local_tokens: int = 0
    remote_tokens: int = 0


class EnginePool:
    """One role's engines (prefill or decode): round-robin, loads, node mapping."""

    def __init__(self, urls: Sequence[str], nodes: Mapping[str, str]) -> None:
        self.urls = tuple(urls)
        self.nodes = dict(nodes)
        self.inflight = dict.fromkeys(self.urls, 0)
        self._turn = itertools.count()

    def next_round_robin(self) -> str:
        return self.urls[next(self._turn) % len(self.urls)]

    def rotation(self) -> list[str]:
        """The engines starting at the round-robin turn: ties go round-robin."""
        k = next(self._turn) % len(self.urls)
        return [*self.urls[k:], *self.urls[:k]]


class KVRouter:
    """Calls ``Route`` on the metadata service (``grpc.aio``)."""

    def __init__(
        self,
        metadata: str,
        tokens_per_key: int,
        timeout_s: float = 0.5,
        security: SecurityConfig | None = None,
    ) -> None:
        self._channel = aio_channel(metadata, security)
        self._stub = metadata_pb2_grpc.MetadataStub(self._channel)
        self._tokens_per_key = tokens_per_key
        self._timeout_s = timeout_s

    async def choose(self, pool: EnginePool, keys: Sequence[ChunkKey]) -> Choice:
        if not keys or len(pool.urls) == 1:
            return Choice(pool.next_round_robin(), routed=False)
        request = metadata_pb2.RouteRequest(
            keys=list(keys),
            tokens_per_key=self._tokens_per_key,
            candidates=[
                metadata_pb2.RouteCandidate(
                    id=url, node_id=pool.nodes.get(url, ""), load=pool.inflight[url]
                )
                for url in pool.rotation()
            ],
        )
        try:
            reply = await self._stub.Route(request, timeout=self._timeout_s)
        except grpc.RpcError as exc:
            logger.warning("Route failed (%s); falling back to round-robin", exc.code().name)
            return Choice(pool.next_round_robin(), routed=False)
        top = reply.scores[reply.best]
        return Choice(top.candidate_id, True, top.local_tokens, top.remote_tokens)

    async def close(self) -> None:
        await self._channel.close(None)
