"""An LMCache engine on kvdepot registers its namespace, and its lookups count in it."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvdepot.apps.cluster import LocalCluster
from kvdepot.connector.client import ClientConfig, KVDepotClient
from tests.faults.support import wait_for
from tests.integration.test_lmcache import CHUNK, Engine, make_engine  # noqa: F401 (a fixture)

pytestmark = pytest.mark.integration


def test_lmcache_engine_registers_its_namespace(
    cluster: LocalCluster,
    make_engine: Callable[..., Engine],  # noqa: F811 (the imported fixture)
) -> None:
    e = make_engine(f"kvdepot://{cluster.metadata_address}", "test/lmcache-ns")
    keys = [e.key(i) for i in range(2)]
    e.put(keys, [e.chunk(i) for i in range(2)])
    assert e.remote.batched_contains([*keys, e.key(99)]) == 2
    with KVDepotClient(ClientConfig(metadata=cluster.metadata_address)) as c:
        mine = [n for n in c.namespaces().namespaces if "lmcache" in n.clients]
        assert len(mine) == 1
        fields = {f.name: f.value for f in mine[0].fields}
        assert fields["model"] == "test/lmcache-ns" and fields["key_scheme"] == "lmcache-v1"
        assert fields["chunk_tokens"] == str(CHUNK)
        assert (mine[0].lookups, mine[0].hit_chunks, mine[0].miss_chunks) == (1, 2, 1)
        # Published chunks are reported within a few seconds (or at close).
        wait_for(
            lambda: (
                [n.chunks_stored for n in c.namespaces().namespaces if n.name == mine[0].name]
                == [2]
            ),
            10,
            "stored chunks not reported",
        )
