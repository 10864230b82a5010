"""A store's registration by pages (store/lease.py) against a real metadata
gRPC service: pages go out in turn, a failed page is sent again and the
registration goes on, a registration the service forgot starts over."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvdepot.errors import NotFound, Unavailable
from kvdepot.metadata.config import MetadataConfig
from kvdepot.metadata.service import MetadataServer
from kvdepot.proto.gen import metadata_pb2
from kvdepot.rpc.security import aio_channel
from kvdepot.store.lease import InventoryColumns, MetadataLease

pytestmark = [pytest.mark.integration]

PAGE = 100
CHUNKS = 1050  # 11 pages


class Health:
    def __init__(self) -> None:
        self.serving = False

    async def set(self, serving: bool, reason: str = "") -> None:
        self.serving = serving


def pages(keys: bytes, page_chunks: int) -> Iterator[InventoryColumns]:
    count = len(keys) // 16
    for start in range(0, count, page_chunks):
        n = min(page_chunks, count - start)
        yield keys[16 * start : 16 * (start + n)], [4096] * n, b""


async def registered(faults: list[BaseException]) -> tuple[MetadataLease, int, list[int]]:
    """A lease registering CHUNKS chunks while the index raises ``faults``, one
    per page call in turn; returns the lease, how many epochs its pages
    carried and the page sizes the index saw."""
    server = MetadataServer(MetadataConfig(port=0, max_page_chunks=PAGE))
    port = await server.start()
    index = server.index
    real = index.register_page
    seen: list[int] = []
    epochs: list[int] = []

    async def faulty(*args: Any, **kwargs: Any) -> tuple[int, int]:
        seen.append(len(args[2]))
        epochs.append(args[1])
        if faults:
            raise faults.pop(0)
        return await real(*args, **kwargs)

    index.register_page = faulty  # type: ignore[method-assign]
    keys = np.random.default_rng(1).bytes(16 * CHUNKS)
    channel = aio_channel(f"127.0.0.1:{port}")
    lease = MetadataLease(
        node_id="n1",
        endpoints=[f"127.0.0.1:{port}"],
        channels=[channel],
        health=Health(),  # type: ignore[arg-type]
        registration=lambda: metadata_pb2.RegisterNodeRequest(
            node_id="n1", address="127.0.0.1:1", instance_id="i1"
        ),
        inventory=lambda n: pages(keys, n),
        heartbeat=lambda: metadata_pb2.HeartbeatRequest(node_id="n1"),
        retry_s=0.01,
    )
    task = asyncio.create_task(lease.run())
    try:
        await asyncio.wait_for(lease.settled.wait(), 20)
        stats = await index.stats(0.0)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await channel.close()
        await server.stop(0)
    assert [(n.info.node_id, n.chunks_indexed) for n in stats.nodes] == [("n1", CHUNKS)]
    assert epochs[-1] == lease.epoch
    return lease, len(set(epochs)), seen


def test_pages_go_out_in_turn_with_the_last_one_marked() -> None:
    lease, epochs, seen = asyncio.run(registered([]))
    assert seen == [PAGE] * 10 + [50, 0]  # the last (empty) page completes it
    assert lease.holds and epochs == 1


def test_a_failed_page_is_sent_again_and_the_registration_goes_on() -> None:
    faults: list[BaseException] = [Unavailable("index backend down")]
    lease, epochs, seen = asyncio.run(registered(faults))
    # The first page failed and was sent again, under the same epoch.
    assert seen[:2] == [PAGE, PAGE] and len(seen) == 13
    assert lease.holds and epochs == 1


def test_a_registration_the_service_forgot_starts_over() -> None:
    faults: list[BaseException] = [NotFound("node n1 is not registered (register again)")]
    lease, epochs, seen = asyncio.run(registered(faults))
    # A new registration (epoch), its inventory from the first page again.
    assert seen[0] == PAGE and len(seen) == 13 and lease.holds and epochs == 2


class OldService:
    """A metadata client whose service predates paging: it ignores ``paged``
    and answers no page size."""

    endpoint = "old:1"

    def __init__(self) -> None:
        self.registrations: list[metadata_pb2.RegisterNodeRequest] = []

    async def register_node(
        self, request: metadata_pb2.RegisterNodeRequest, timeout_s: float
    ) -> metadata_pb2.RegisterNodeResponse:
        self.registrations.append(
            metadata_pb2.RegisterNodeRequest.FromString(request.SerializeToString())
        )
        return metadata_pb2.RegisterNodeResponse(lease_ttl_ms=5000, epoch=len(self.registrations))

    async def register_inventory(self, *args: Any) -> Any:
        raise AssertionError("an old service has no RegisterInventory")


def test_a_service_that_predates_paging_gets_the_inventory_in_the_message() -> None:
    keys = np.random.default_rng(2).bytes(16 * 300)

    async def go() -> OldService:
        old = OldService()
        lease = MetadataLease(
            node_id="n1",
            endpoints=["old:1"],
            channels=[],
            health=Health(),  # type: ignore[arg-type]
            registration=lambda: metadata_pb2.RegisterNodeRequest(node_id="n1", address="a:1"),
            inventory=lambda n: pages(keys, n),
            heartbeat=lambda: metadata_pb2.HeartbeatRequest(node_id="n1"),
            retry_s=0.01,
        )
        lease.client = old  # type: ignore[assignment]
        await lease._renew()
        assert lease.holds and lease.epoch == 2
        return old

    old = asyncio.run(go())
    first, second = old.registrations
    assert first.paged and not first.inventory
    assert not second.paged and len(second.inventory) == 300
    assert b"".join(c.key for c in second.inventory) == keys
    assert {c.tier for c in second.inventory} == {"cpu"}
