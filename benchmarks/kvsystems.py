"""kvdepot as a benchmarked :class:`~benchmarks.systems.System`, and its local cluster.

* ``kvdepot-tcp``, ``kvdepot-shm``, ``kvdepot-nixl``: ``KVDepotClient.put`` /
  ``get_into`` against a real local cluster (metadata service and store
  daemon processes), metadata calls included, checksums verified end to
  end. Puts defer the index commit as the vLLM connector's do: a put returns
  once its bytes are handed over, the store receives, verifies and commits
  right after; :meth:`KVDepot.settle` (``sync_index``) waits for that, and
  ends every timed throughput run.
* ``-sync``, ``-2rt``, ``-remote``, ``-lookup``, ``-probe``: variants for
  comparison in the same run (see each class).

A put is visible when another process's ``lookup`` names its chunks (a
watcher, :mod:`benchmarks.visible`).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from typing import Any

import numpy as np

from benchmarks import procs
from benchmarks.systems import System, sources
from benchmarks.visible import timed_put, watcher

# Loopback only, and no RDMA modules (see README "Data plane": they crash at exit here).
UCX_NO_RDMA = {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib,ib_mlx5,ib_efa,rdmacm"}
READ_FIRST = {"kvdepot-tcp-remote": None, "kvdepot-tcp-lookup": True, "kvdepot-tcp-probe": False}


@contextlib.contextmanager
def cluster(capacity: str, env: dict[str, str] | None, nodes: int = 1) -> Iterator[Any]:
    """A local cluster whose daemons end with this process (:class:`benchmarks.procs.Cluster`)."""
    c = procs.Cluster(nodes=nodes, capacity=capacity, env=env, stderr=subprocess.DEVNULL)
    c.start()
    try:
        yield c
    finally:
        c.stop()


class KVDepot(System):
    """KVDepotClient.put / get_into against a local cluster, one transport."""

    defer = True
    """As the vLLM connector publishes: the index commit right behind the answer."""
    suffix = ""

    def __init__(self, transport: str, cluster: Any, node_id: str) -> None:
        from kvdepot.connector.client import ClientConfig, KVDepotClient

        self.name = f"kvdepot-{transport}{self.suffix}"
        self._metadata = cluster.metadata_address
        self._pids = [d.proc.pid for d in cluster.daemons()]
        self._client = KVDepotClient(
            ClientConfig(
                metadata=cluster.metadata_address,
                node_id=node_id,
                transport=transport,
                defer_index_commit=self.defer,
            )
        )
        self._n = 0

    def _fresh_keys(self, batch: int) -> list[bytes]:
        self._n += 1
        return [os.urandom(16) for _ in range(batch)]

    def prepare(self, size: int, batch: int) -> None:
        self._src = sources(size, batch, 1)[0]
        self._dst = [np.ones(size, dtype=np.uint8) for _ in range(batch)]
        self.before_get()

    def _put(self, keys: list[bytes], what: str = "put") -> None:
        result = self._put_client().put(keys, self._src[: len(keys)])
        # Pending: in the node's store, its index commit right behind the answer.
        if result.stored + result.pending != len(keys):
            raise RuntimeError(f"{self.name}: {what} stored {result.stored} of {len(keys)}")

    def _put_client(self) -> Any:
        return self._client

    def before_get(self) -> None:
        self._keys = self._fresh_keys(len(self._src))
        self._put(self._keys, "setup put")

    def put(self) -> None:
        self._put(self._fresh_keys(len(self._src)))

    def settle(self) -> None:
        # The store's answers to the puts and its index commits.
        self._put_client().sync_index()

    def visible(self, k: int) -> float:
        keys = self._fresh_keys(k)
        w = watcher("kvdepot", metadata=self._metadata)
        return timed_put(w, [key.hex() for key in keys], lambda: self._put(keys))

    def get(self) -> None:
        result = self._client.get_into(self._keys, self._dst)
        if result.leading != len(self._keys):
            raise RuntimeError(f"{self.name}: get loaded {result.leading} of {len(self._keys)}")

    def server_pids(self) -> list[int]:
        # The metadata service and the stores: a put's index commit is their work.
        return self._pids

    def close(self) -> None:
        self._client.close()


class KVDepotSyncIndex(KVDepot):
    """A put whose store answers only once the index committed the chunks
    (``defer_index_commit`` off), for comparison in the same run."""

    defer = False
    suffix = "-sync"


class KVDepotTwoTrips(KVDepot):
    """The reference put path, for comparison in the same run: PutStart, the
    bytes, PutEnd (a client that forgets its node's store before each put;
    gets as :class:`KVDepot`)."""

    def __init__(self, transport: str, cluster: Any, node_id: str) -> None:
        super().__init__(transport, cluster, node_id)
        self.name = f"kvdepot-{transport}-2rt"

    def _put(self, keys: list[bytes], what: str = "put") -> None:
        if what == "put":
            self._client._local_address = None
        super()._put(keys, what)


class KVDepotRemote(KVDepot):
    """Chunks node 1 holds, over tcp: puts from a client with no store (PutStart,
    bytes, PutEnd), gets by a client of node 0. ``-remote``: node 1 served its
    last get whole, so it is read first, no lookup (a decode node reading one
    prefill node); ``-lookup``: a Lookup first (as after a get no one store
    served whole); ``-probe``: node 0's store first (a miss, a Lookup, node 1)."""

    def __init__(self, cluster: Any, name: str = "kvdepot-tcp-remote") -> None:
        from kvdepot.connector.client import ClientConfig, KVDepotClient

        self.name = name
        self._first = READ_FIRST[name]
        self._pids = [d.proc.pid for d in cluster.daemons()]
        nodes = [s.info["node_id"] for s in cluster.stores]
        address = self._metadata = cluster.metadata_address
        self._writer = KVDepotClient(ClientConfig(metadata=address, transport="tcp"))
        self._holder = KVDepotClient(ClientConfig(metadata=address, node_id=nodes[1]))
        self._client = KVDepotClient(
            ClientConfig(metadata=address, node_id=nodes[0], transport="tcp")
        )
        self._client.put([os.urandom(16)], [np.ones(4096, dtype=np.uint8)])  # learns node 0
        self._n = 0

    def _put_client(self) -> Any:
        return self._writer

    def before_get(self) -> None:
        self._keys = self._fresh_keys(len(self._src))
        result = self._holder.put(self._keys, self._src)
        if result.stored != len(self._src):
            raise RuntimeError(f"{self.name}: setup put stored {result.stored} of {len(self._src)}")

    def get(self) -> None:
        if self._first is not None:
            self._client._sticky, self._client._lookup_first = None, self._first
        super().get()

    def close(self) -> None:
        for c in (self._writer, self._holder, self._client):
            c.close()
