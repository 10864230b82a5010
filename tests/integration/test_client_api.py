"""The client API as a user meets it, against real metadata and store daemons.

(The README's example runs as written: tests/integration/test_readme.py.) A
buffer too small for its chunk is a miss that says why; wrong arguments, a closed
client and a metadata service that stops mid-call raise kvdepot's own errors
(``InvalidArgument``, ``ClientClosed``, ``Unavailable``), never grpc's
``ValueError``/``TypeError``/``AttributeError`` or a bare ``CANCELLED``; an
error keeps its class across gRPC.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvdepot.apps.cluster import LocalCluster
from kvdepot.connector.client import ClientConfig, KVDepotClient
from kvdepot.errors import (
    ClientClosed,
    InvalidArgument,
    KVDepotError,
    StaleRegistration,
    Unavailable,
)
from kvdepot.keys import Namespace, chunk_keys
from kvdepot.metadata_client import MetadataClient
from kvdepot.proto.gen import metadata_pb2

pytestmark = pytest.mark.integration

NS = Namespace("test/client-api", chunk_tokens=16)
CHUNK = 4096


def kv_of_chunk(i: int) -> np.ndarray:
    return np.full(CHUNK, i + 1, dtype=np.uint8)


def test_buffer_smaller_than_its_chunk_is_a_miss_that_says_why(
    cluster: LocalCluster, caplog: pytest.LogCaptureFixture
) -> None:
    keys = chunk_keys(NS, [3] * 16 * 3)
    # No node_id: every read goes through the lookup.
    with KVDepotClient(ClientConfig(metadata=cluster.metadata_address)) as client:
        assert client.put(keys, [kv_of_chunk(i) for i in range(3)]).stored == 3
        with caplog.at_level(logging.WARNING, "kvdepot.connector.client"):
            for _ in range(3):
                out = [bytearray(CHUNK), bytearray(CHUNK - 1), bytearray(CHUNK)]
                result = client.get_into(keys, out)
                assert result.loaded == (True, False, True)
                assert result.leading == 1
                assert result.reasons[0] == result.reasons[2] == ""
                assert result.reasons[1] == (
                    f"buffer too small: the chunk is {CHUNK} bytes, the buffer {CHUNK - 1}"
                )
        warned = [r for r in caplog.records if "buffer" in r.getMessage()]
        assert len(warned) == 1, "the small buffer is logged once per client, not per call"
        assert f"the chunk is {CHUNK} bytes, the buffer {CHUNK - 1}" in warned[0].getMessage()
        # Keys after the leading hits say so too.
        missing = chunk_keys(NS, [4] * 16)
        result = client.get_into(keys[:1] + missing, [bytearray(CHUNK)] * 2)
        assert result.loaded == (True, False)
        assert result.reasons == ("", "not cached")


def test_calls_on_a_closed_client_raise_client_closed(cluster: LocalCluster) -> None:
    client = KVDepotClient(ClientConfig(metadata=cluster.metadata_address))
    keys = chunk_keys(NS, [5] * 16)
    assert client.lookup(keys) == 0
    client.close()
    client.close()  # twice is fine
    calls = {
        "put": lambda: client.put(keys, [b"x" * 8]),
        "lookup": lambda: client.lookup(keys),
        "lookup_locations": lambda: client.lookup_locations(keys),
        "get_into": lambda: client.get_into(keys, [bytearray(8)]),
        "get_ranges_into": lambda: client.get_ranges_into(keys, [(0, 8)], [bytearray(8)], [[]]),
        "stats": client.stats,
        "connect": lambda: client.connect(1.0),
    }
    for name, call in calls.items():
        with pytest.raises(ClientClosed, match="closed"):
            call()
        assert issubclass(ClientClosed, KVDepotError), name


def test_keys_and_buffers_of_the_wrong_type_raise_invalid_argument(
    client: KVDepotClient,
) -> None:
    key = bytes(16)
    bad_keys: list[Any] = [None, "0123456789abcdef", ["0123456789abcdef"], [None], 5, key]
    for keys in bad_keys:
        with pytest.raises(InvalidArgument):
            client.put(keys, [b"x"])
        with pytest.raises(InvalidArgument):
            client.lookup(keys)
        with pytest.raises(InvalidArgument):
            client.lookup_locations(keys)
        with pytest.raises(InvalidArgument):
            client.get_into(keys, [bytearray(8)])
    for buffers in (None, "text", [None], ["text"], [7]):
        with pytest.raises(InvalidArgument):
            client.put([key], buffers)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument):
            client.get_into([key], buffers)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        client.lookup([key], count="some")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        client.lookup([key], key_tokens=[-1])
    # Still a working client afterwards.
    assert client.lookup([key]) == 0


@pytest.mark.parametrize("metadata", [None, 7700, b"127.0.0.1:7700", ""])
def test_client_config_without_a_metadata_address_string_is_invalid(metadata: Any) -> None:
    with pytest.raises(InvalidArgument, match="metadata"):
        ClientConfig(metadata=metadata)


def test_errors_keep_their_class_across_grpc(cluster: LocalCluster) -> None:
    # A heartbeat of a replaced registration: FAILED_PRECONDITION, which an
    # invalid argument shares, comes back as StaleRegistration.
    node = cluster.stores[0].info["node_id"]
    conn = MetadataClient(cluster.metadata_address, 5.0)
    try:
        with pytest.raises(StaleRegistration) as info:
            conn.call("Heartbeat", metadata_pb2.HeartbeatRequest(node_id=node, epoch=1))
        assert node in str(info.value)
        with pytest.raises(InvalidArgument) as bad:
            conn.call("Lookup", metadata_pb2.LookupRequest(keys=[b"short"]))
        assert type(bad.value) is InvalidArgument
    finally:
        conn.close()


def test_metadata_service_stopped_mid_call_is_unavailable(tmp_path: Path) -> None:
    """SIGTERM to the metadata service with calls in flight: its shutdown
    cancels them (gRPC's CANCELLED), which the client raises as Unavailable."""
    keys = [os.urandom(16) for _ in range(20_000)]  # calls long enough to be caught
    errors: list[BaseException] = []
    for attempt in range(6):
        with LocalCluster(nodes=0, log_dir=tmp_path / f"logs-{attempt}") as cl:
            config = ClientConfig(metadata=cl.metadata_address, rpc_timeout_s=10)
            with KVDepotClient(config) as client:
                client.lookup(keys[:1])
                stop = threading.Event()

                def lookups(client: KVDepotClient = client, stop: threading.Event = stop) -> None:
                    while not stop.is_set():
                        try:
                            client.lookup(keys, count="none")
                        except Exception as exc:
                            errors.append(exc)
                            return

                threads = [threading.Thread(target=lookups) for _ in range(4)]
                for t in threads:
                    t.start()
                time.sleep(0.5)
                assert cl.metadata is not None
                cl.metadata.proc.terminate()
                # Each thread calls until a call fails: one in flight when
                # the service stops (CANCELLED) or one sent after (UNAVAILABLE).
                for t in threads:
                    t.join(timeout=30)
                stop.set()
                assert not any(t.is_alive() for t in threads)
        assert len(errors) >= 4 * (attempt + 1), errors
        not_unavailable = [e for e in errors if not isinstance(e, Unavailable)]
        assert not not_unavailable, f"raised as {not_unavailable!r}"
        if any("CANCELLED" in str(e) for e in errors):
            break
    # On a busy machine the graceful stop may let every call in flight end:
    # the mapping of CANCELLED itself is checked in tests/unit/test_errors_grpc.py.
