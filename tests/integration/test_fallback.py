"""What a client answers from a store while the metadata service cannot
(``kvdepot.connector.fallback``), against a real data-plane server: which
keys the store holds (a GET of each chunk's first byte), the leading ones
for a lookup, a read of what it holds, a put into it; and ``Unavailable``
where there is no store to ask or it does not answer either."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest

from kvdepot.connector.fallback import Fallback
from kvdepot.connector.results import PutTally
from kvdepot.connector.transport import (
    GetStatus,
    IndexingTransport,
    PutItem,
    PutStatus,
    create_transport,
)
from kvdepot.errors import Unavailable
from kvdepot.keys import ChunkKey
from kvdepot.store.chunks import ChunkStore
from kvdepot.store.dataplane import DataPlaneServer

pytestmark = pytest.mark.integration

SIZE = 4096
DOWN = Unavailable("metadata 127.0.0.1:1 unavailable: redis index unavailable (retry later)")


@pytest.fixture()
def store() -> Iterator[tuple[DataPlaneServer, str]]:
    chunks = ChunkStore(8 << 20)
    server = DataPlaneServer(chunks)
    server.start()
    host, port = server.address
    try:
        yield server, f"{host}:{port}"
    finally:
        server.stop()
        chunks.close()


def _data(key: bytes) -> np.ndarray:
    return np.full(SIZE, key[0], dtype=np.uint8)


@pytest.mark.parametrize("name", ["tcp", "auto"])
def test_the_store_answers_for_what_it_holds(name: str, store: tuple[DataPlaneServer, str]) -> None:
    server, address = store
    keys = [ChunkKey(os.urandom(16)) for _ in range(4)]
    with create_transport(name) as t:
        assert isinstance(t, IndexingTransport)
        items = [PutItem(k, memoryview(_data(k))) for k in keys[:2]]
        assert t.put(address, items) == [PutStatus.OK] * 2
        fallback = Fallback(t)
        statuses = [o.status for o in fallback.held(address, keys)]
        assert statuses == [GetStatus.OK] * 2 + [GetStatus.NOT_FOUND] * 2
        assert fallback.lookup(DOWN, address, keys) == 2
        assert fallback.lookup(DOWN, address, [keys[2], keys[0]]) == 0  # leading keys only
        with pytest.raises(Unavailable):
            fallback.lookup(DOWN, None, keys)  # no store of its own: as before

        # A read: what it holds is loaded, the rest are misses with a reason.
        bufs = [np.zeros(SIZE, dtype=np.uint8) for _ in keys]
        got = fallback.read(DOWN, keys, [memoryview(b) for b in bufs], address, None, None)
        assert got.loaded == (True, True, False, False) and got.leading == 2
        assert got.bytes_received == 2 * SIZE and "redis index unavailable" in got.reasons[2]
        assert all(np.array_equal(b, _data(k)) for b, k in zip(bufs[:2], keys[:2], strict=True))

        # A put: what it holds is skipped (not sent again), the rest stored
        # there and owed to the index (this store indexes nothing: pending).
        tally = PutTally()
        views = [memoryview(_data(k)) for k in keys]
        fallback.put(DOWN, t, address, keys, views, [], tally)
        assert (tally.skipped, tally.pending, tally.failed, tally.stored) == (2, 2, 0, 0)
        assert fallback.lookup(DOWN, address, keys) == 4

        server.stop()  # the store does not answer either: Unavailable
        with pytest.raises(Unavailable):
            fallback.lookup(DOWN, address, keys)
        with pytest.raises(Unavailable):
            fallback.put(DOWN, t, address, keys, views, [], PutTally())
