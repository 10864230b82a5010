"""The routing split on every index backend: the replicas ``lookup`` returns feed the score."""

from __future__ import annotations

import asyncio

from kvdepot.metadata.index import IndexBackend
from kvdepot.metadata.routing import Candidate, RoutingWeights, best, score_candidates
from tests.integration.test_index_backends import (  # noqa: F401 - fixtures
    MakeIndex,
    backend,
    index_url,
    key,
    make_index,
    node,
    now,
)


def test_route_split_on_each_backend(make_index: MakeIndex) -> None:  # noqa: F811
    async def body(index: IndexBackend) -> None:
        await index.register_node(node("a"), [], now())
        await index.register_node(node("b"), [], now())
        keys = [key(i) for i in range(5)]
        assert await index.put_end("a", keys[:3], [100] * 3) == 3
        assert await index.put_end("b", keys[1:2], [100]) == 1
        lookup = await index.lookup(keys, "", 0)
        assert lookup.hits == 3
        cands = [Candidate("ea", "a"), Candidate("eb", "b"), Candidate("ec", "c")]
        scores = score_candidates(lookup, len(keys), 16, cands, RoutingWeights())
        split = [(s.local_tokens, s.remote_tokens, s.none_tokens) for s in scores]
        assert split == [(48, 0, 32), (16, 32, 32), (0, 48, 32)]
        assert [s.remote_bytes for s in scores] == [0, 200, 300]
        assert best(scores) == 0

    async def main() -> None:
        index = make_index()
        try:
            await body(index)
        finally:
            await index.close()

    asyncio.run(main())
