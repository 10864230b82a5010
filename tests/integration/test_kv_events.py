"""KV events: a metadata service publishing, a ZeroMQ subscriber decoding.

The service runs in-process on the test's event loop; store daemons are
played by gRPC calls (RegisterNode, PutEnd, ReportRemoved, then silence until
the lease runs out). One test decodes with plain msgpack and checks every
field, one with vLLM's own event classes (run it with vLLM's interpreter).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import Any

import grpc
import pytest

from kvdepot.apps.cluster import wait_ready
from kvdepot.keys import Namespace, chunk_keys
from kvdepot.metadata.config import MetadataConfig
from kvdepot.metadata.events import END_SEQ, EventsConfig, block_stored, decode_batch, encode_batch
from kvdepot.metadata.service import MetadataServer
from kvdepot.proto.gen import common_pb2, metadata_pb2, metadata_pb2_grpc

zmq = pytest.importorskip("zmq")

pytestmark = pytest.mark.integration

NS = Namespace("test/model", chunk_tokens=16)
KEYS = chunk_keys(NS, list(range(16 * 6)))
Frames = list[tuple[bytes, int, bytes]]


async def _drive() -> tuple[Frames, Frames, Frames]:
    """Run the scenario; return (subscribed, replayed from 0, replayed from 3)."""
    import zmq.asyncio

    server = MetadataServer(
        MetadataConfig(
            port=0,
            lease_ttl_s=0.6,
            heartbeat_interval_s=0.2,
            reap_interval_s=0.05,
            kv_events="tcp://127.0.0.1:0",
            kv_events_block_size=16,
        )
    )
    await server.start()
    assert server.events is not None
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(server.events.endpoint)
    await asyncio.sleep(0.3)  # ZeroMQ's slow joiner
    got: Frames = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub = metadata_pb2_grpc.MetadataStub(ch)
            await stub.RegisterNode(
                metadata_pb2.RegisterNodeRequest(
                    node_id="n0",
                    address="127.0.0.1:1",
                    inventory=[common_pb2.ChunkRef(key=k, size=100, tier="cpu") for k in KEYS[:2]],
                )
            )
            await stub.PutEnd(
                metadata_pb2.PutEndRequest(node_id="n0", keys=KEYS[2:5], sizes=[100] * 3)
            )
            # Nothing new: no event.
            await stub.PutEnd(
                metadata_pb2.PutEndRequest(node_id="n0", keys=KEYS[2:5], sizes=[100] * 3)
            )
            await stub.ReportRemoved(
                metadata_pb2.ReportRemovedRequest(node_id="n0", keys=KEYS[4:5])
            )
        deadline = asyncio.get_running_loop().time() + 5
        while len(got) < 4 and asyncio.get_running_loop().time() < deadline:
            if await sub.poll(200):
                topic, seq, payload = await sub.recv_multipart()
                got.append((topic, int.from_bytes(seq, "big"), payload))
        replay0 = await _replay(ctx, server.events.replay_endpoint, 0)
        replay3 = await _replay(ctx, server.events.replay_endpoint, 3)
    finally:
        sub.close(linger=0)
        ctx.term()
        await server.stop(0)
    return got, replay0, replay3


async def _replay(ctx: Any, endpoint: str, start: int) -> Frames:
    req = ctx.socket(zmq.DEALER)
    req.connect(endpoint)
    out: Frames = []
    try:
        await req.send_multipart((b"", start.to_bytes(8, "big")))
        while True:
            _, topic, seq, payload = await asyncio.wait_for(req.recv_multipart(), 5)
            if seq == END_SEQ:
                return out
            out.append((topic, int.from_bytes(seq, "big"), payload))
    finally:
        req.close(linger=0)


def _scenario() -> tuple[Frames, Frames, Frames]:
    return asyncio.run(_drive())


def test_events_decode_with_msgpack_and_replay() -> None:
    pytest.importorskip("msgpack")
    got, replay0, replay3 = _scenario()
    assert [s for _, s, _ in got] == [0, 1, 2, 3]
    assert {t for t, _, _ in got} == {b"kv@n0"}
    batches = [decode_batch(p) for _, _, p in got]
    (e0a, e0b), (e1,), (e2,), (e3,) = (b[1] for b in batches)
    assert e0a == {"type": "AllBlocksCleared"}
    assert e0b == {
        "type": "BlockStored",
        "block_hashes": KEYS[:2],
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": 16,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
    }
    assert e1["type"] == "BlockStored" and e1["block_hashes"] == KEYS[2:5]
    assert e2 == {"type": "BlockRemoved", "block_hashes": KEYS[4:5], "medium": "CPU"}
    assert e3 == {"type": "AllBlocksCleared"}  # the lease ran out
    assert all(b[0] > 1e9 for b in batches)  # wall-clock timestamps
    # Replay returns the very same messages, from the requested sequence number on.
    assert replay0 == got
    assert replay3 == got[3:]


def test_events_decode_with_vllm_classes() -> None:
    pytest.importorskip("vllm")
    import msgspec
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
    )

    got, replay0, _ = _scenario()
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    batches = [decoder.decode(p) for _, _, p in got]
    kinds = [[type(e) for e in b.events] for b in batches]
    assert kinds == [
        [AllBlocksCleared, BlockStored],
        [BlockStored],
        [BlockRemoved],
        [AllBlocksCleared],
    ]
    stored = batches[1].events[0]
    assert stored.block_hashes == KEYS[2:5] and stored.block_size == 16
    assert stored.medium == "CPU" and stored.parent_block_hash is None
    assert batches[2].events[0].block_hashes == KEYS[4:5]
    assert [decoder.decode(p).events for _, _, p in replay0] == [b.events for b in batches]


def test_encoder_round_trip() -> None:
    pytest.importorskip("msgpack")
    payload = encode_batch([block_stored([b"k" * 16], 256, "GPU")], 12.5)
    ts, events = decode_batch(payload)
    assert ts == 12.5 and events[0]["medium"] == "GPU" and events[0]["block_size"] == 256


def test_replay_endpoint_default_is_next_port() -> None:
    assert EventsConfig("tcp://127.0.0.1:5557").replay() == "tcp://127.0.0.1:5558"
    assert EventsConfig("tcp://127.0.0.1:0").replay() == "tcp://127.0.0.1:0"


def test_cli_flag_announces_the_endpoints() -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvdepot.apps.cli",
            "metadata",
            "--port",
            "0",
            "--kv-events",
            "tcp://127.0.0.1:0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        info = wait_ready(proc, "metadata", 30)
        assert info["kv_events"].startswith("tcp://127.0.0.1:")
        assert info["kv_events_replay"].startswith("tcp://127.0.0.1:")
        assert info["kv_events"] != info["kv_events_replay"]
        json.dumps(info)
    finally:
        proc.terminate()
        proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()
