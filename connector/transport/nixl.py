"""The ``nixl`` transport: one-sided RDMA READ/WRITE against the store's arena.

NVIDIA NIXL moves the bytes (UCX inside: RDMA verbs on clusters with RDMA
NICs; TCP and shared memory elsewhere) between buffers this process
registered and the arena the store registered, without the store's CPU. The
store's agent metadata and arena address come from its gRPC
``Store.GetTransferInfo``; the store's gRPC address from the data plane's
ATTACH. Control stays on the data-plane connection, batched, as for ``shm``
(deletes and index syncs too):

* put: RESERVE the batch, one WRITE transfer of every chunk to its offset
  (the writer's checksums are computed while the transfer is in flight),
  COMMIT (asking the store to index what it commits, for an indexed put);
  the store verifies each chunk's checksum in its arena.
* get: LEASE the batch, one READ transfer, verify each checksum, RELEASE.

Registrations of caller buffers are cached (a buffer registered once is not
registered again) and hold a reference to the buffer's owner, so cached
registered memory is never freed and reused under the cache.

A store that restarted has a new arena generation: the next connection sees
it and the transport loads the new agent's metadata before any transfer.
Needs the ``kvdepot[rdma]`` extra (``nixl``, ``nixl-cu12``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from kvdepot.connector.transport.arena import (
    MISMATCH,
    ArenaTransport,
    ArenaUnusable,
    PutOutcome,
    check_lease,
)
from kvdepot.connector.transport.base import GetOutcome, GetStatus
from kvdepot.connector.transport.control import ControlConnection, ControlPool
from kvdepot.connector.transport.stall import Stalls
from kvdepot.connector.transport.stream import PUT_STATUS, GetWork, PutWork
from kvdepot.errors import InvalidArgument, Unavailable
from kvdepot.proto.gen import store_pb2, store_pb2_grpc
from kvdepot.rpc.errors import from_grpc
from kvdepot.rpc.security import channel as secure_channel
from kvdepot.rpc.security_config import SecurityConfig
from kvdepot.wire.nixl import create_agent, nixl_available
from kvdepot.wire.protocol import (
    AttachFlags,
    AttachInfo,
    AttachKind,
    CommitEntry,
    ErrorCode,
    GetCode,
    IndexCode,
    LeaseReplyEntry,
    ProtocolError,
    ProtocolLimits,
    PutCode,
    PutEntry,
    TimedOut,
)
from kvdepot.wire.xxh3 import xxh3_64

logger = logging.getLogger(__name__)

__all__ = ["NixlTransport", "nixl_available"]

_POLL_S = 0.00005


@dataclass(frozen=True, slots=True)
class _Peer:
    """A store's agent as loaded into ours, for one arena generation."""

    generation: int
    agent_name: str
    arena_address: int
    arena_size: int


def _address_of(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class NixlTransport(ArenaTransport[_Peer]):
    """The ``nixl`` data plane client.

    Args:
        connect_timeout_s: Time allowed to connect to a store.
        io_timeout_s: Time a control exchange or a transfer may take.
        max_idle_per_peer: Idle control connections kept per store.
        limits: The stores' protocol limits; batches are split to fit.
        max_registrations: Caller buffers kept registered (least recently
            used ones are deregistered beyond it).
        security: The token control connections prove and the gRPC
            settings (token, TLS) of ``GetTransferInfo`` calls.
        stalls: The record of stores that stopped answering, shared with the
            other transports of a client (``auto``); by default its own.

    Raises:
        Unavailable: NIXL is not installed or its agent does not start.
        InvalidArgument: If a timeout is not positive.
    """

    name = "nixl"

    def __init__(
        self,
        connect_timeout_s: float = 5.0,
        io_timeout_s: float = 30.0,
        max_idle_per_peer: int = 4,
        *,
        limits: ProtocolLimits | None = None,
        max_registrations: int = 256,
        security: SecurityConfig | None = None,
        stalls: Stalls | None = None,
    ) -> None:
        if connect_timeout_s <= 0 or io_timeout_s <= 0:
            raise InvalidArgument("transport timeouts must be positive")
        self._io_timeout_s = io_timeout_s
        self._limits = limits or ProtocolLimits()
        self._agent = create_agent(f"kvdepot-client-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self._security = security
        token = security.tokens().token if security is not None else ""
        self._pool = ControlPool(
            AttachKind.NIXL, connect_timeout_s, io_timeout_s, max_idle_per_peer, token, stalls
        )
        # One lock around the agent: transfers of concurrent callers are
        # serialised through it (NIXL agents are not thread-safe by default).
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._registrations: OrderedDict[tuple[int, int], tuple[Any, object]] = OrderedDict()
        self._max_registrations = max_registrations
        self._closed = False

    # -- peers ----------------------------------------------------------------
    def _arena(self, address: str, conn: ControlConnection) -> _Peer:
        return self._peer(address, conn.info)

    def _peer(self, address: str, info: AttachInfo) -> _Peer:
        with self._lock:
            peer = self._peers.get(address)
        if peer is not None and peer.generation == info.generation:
            return peer
        if not info.flags & AttachFlags.NIXL or not info.control_address:
            raise ArenaUnusable(f"store {address} runs no NIXL agent")
        reply = self._transfer_info(info.control_address)
        if reply.generation != info.generation or not reply.HasField("nixl"):
            raise Unavailable(f"store {address} changed while attaching; try again")
        with self._lock:
            if peer is not None:
                self._pool.drop(address)
                try:
                    self._agent.remove_remote_agent(peer.agent_name)
                except Exception as exc:
                    logger.debug("removing agent %s: %s", peer.agent_name, exc)
            try:
                name = self._agent.add_remote_agent(reply.nixl.agent_metadata)
            except Exception as exc:
                raise Unavailable(f"cannot load the NIXL agent of {address}: {exc}") from exc
            name = name.decode() if isinstance(name, bytes) else str(name)
            new = _Peer(reply.generation, name, reply.nixl.arena_address, reply.nixl.arena_size)
            self._peers[address] = new
        return new

    def _transfer_info(self, control_address: str) -> store_pb2.TransferInfo:
        try:
            with secure_channel(control_address, self._security) as channel:
                stub = store_pb2_grpc.StoreStub(channel)
                reply: store_pb2.TransferInfo = stub.GetTransferInfo(
                    store_pb2.TransferInfoRequest(), timeout=self._io_timeout_s
                )
                return reply
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise from_grpc(exc, f"GetTransferInfo at {control_address}") from None
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TimedOut(f"GetTransferInfo at {control_address} timed out") from exc
            raise Unavailable(f"GetTransferInfo at {control_address} failed: {exc}") from exc

    # -- memory -----------------------------------------------------------------
    def _register(self, view: memoryview) -> int:
        # Called under the lock. Registers the buffer's whole extent once.
        addr = _address_of(view)
        key = (addr, view.nbytes)
        if key in self._registrations:
            self._registrations.move_to_end(key)
            return addr
        try:
            descs = self._agent.register_memory([(addr, view.nbytes, 0, "")], "DRAM")
        except Exception as exc:
            raise Unavailable(f"cannot register a buffer with NIXL: {exc}") from exc
        # The owner is kept alive while registered: its memory cannot be freed.
        self._registrations[key] = (descs, view.obj)
        while len(self._registrations) > self._max_registrations:
            _, (old, _) = self._registrations.popitem(last=False)
            try:
                self._agent.deregister_memory(old)
            except Exception as exc:
                logger.debug("deregistration failed: %s", exc)
        return addr

    def _transfer(
        self, op: str, peer: _Peer, pairs: list[tuple[memoryview, int]], on_wait: Any = None
    ) -> None:
        """One READ or WRITE of every (local view, arena offset) pair.

        ``on_wait`` runs once the transfer is posted (CPU work that overlaps it).

        Raises:
            Unavailable: The transfer failed or did not finish in time.
        """
        with self._lock:
            local = [(self._register(v), v.nbytes, 0) for v, _ in pairs]
            remote = [(peer.arena_address + off, v.nbytes, 0) for v, off in pairs]
            try:
                src = self._agent.get_xfer_descs(local, "DRAM")
                dst = self._agent.get_xfer_descs(remote, "DRAM")
                handle = self._agent.initialize_xfer(op, src, dst, peer.agent_name, b"")
                state = self._agent.transfer(handle)
            except Exception as exc:
                raise Unavailable(f"NIXL {op} could not start: {exc}") from exc
            try:
                if on_wait is not None:
                    on_wait()
                deadline = time.monotonic() + self._io_timeout_s
                while state == "PROC":
                    if time.monotonic() > deadline:
                        raise TimedOut(f"NIXL {op} did not finish in {self._io_timeout_s} s")
                    time.sleep(_POLL_S)
                    state = self._agent.check_xfer_state(handle)
                if state != "DONE":
                    raise Unavailable(f"NIXL {op} failed ({state})")
            finally:
                try:
                    self._agent.release_xfer_handle(handle)
                except Exception as exc:
                    logger.debug("releasing a transfer handle: %s", exc)

    # -- data -----------------------------------------------------------------------
    def _put_batch(
        self,
        conn: ControlConnection,
        peer: _Peer,
        batch: list[PutWork],
        index: bool,
        writer: int = 0,
    ) -> list[PutOutcome]:
        replies = conn.reserve([PutEntry(e.key, e.size, 0) for _, e, _, _ in batch])
        out: list[PutOutcome] = []
        pairs: list[tuple[memoryview, int]] = []
        writes: list[tuple[int, PutEntry, memoryview, bool]] = []
        for (i, entry, view, trailed), reply in zip(batch, replies, strict=True):
            if reply.status is not PutCode.OK:
                out.append((i, PUT_STATUS[reply.status], IndexCode.NOT_INDEXED))
                continue
            if reply.offset + entry.size > peer.arena_size:
                raise ProtocolError(ErrorCode.MALFORMED, "reservation outside the arena")
            pairs.append((view, reply.offset))
            writes.append((i, entry, view, trailed))
        if not writes:
            return out
        sums: list[int] = []

        def hash_sources() -> None:
            # The writer's checksums, computed while the WRITE is in flight.
            for _, entry, view, trailed in writes:
                sums.append(xxh3_64(view) if trailed else entry.checksum)

        self._transfer("WRITE", peer, pairs, hash_sources)
        commits = [CommitEntry(w[1].key, ck) for w, ck in zip(writes, sums, strict=True)]
        conn.send_commit(commits, index, writer)
        statuses, codes = conn.finish_commits([len(commits)])
        return out + [
            (w[0], PUT_STATUS[s], c) for w, s, c in zip(writes, statuses, codes, strict=True)
        ]

    def _get_batch(
        self, conn: ControlConnection, peer: _Peer, batch: list[GetWork]
    ) -> list[tuple[int, GetOutcome]]:
        replies = conn.lease([e for _, e, _ in batch])
        lease_ids = [r.lease_id for r in replies if r.status is GetCode.OK]
        out: list[tuple[int, GetOutcome]] = []
        reads: list[tuple[int, memoryview, LeaseReplyEntry]] = []
        try:
            for (i, entry, buf), reply in zip(batch, replies, strict=True):
                refused = check_lease(peer.arena_size, entry, buf, reply)
                if refused is not None:
                    out.append((i, refused))
                    continue
                reads.append((i, buf[: reply.length], reply))
            if reads:
                self._transfer("READ", peer, [(dest, r.offset) for _, dest, r in reads])
                for i, dest, r in reads:
                    ok = xxh3_64(dest) == r.checksum
                    out.append((i, GetOutcome(GetStatus.OK, r.length) if ok else MISMATCH))
        finally:
            conn.release(lease_ids)
        return out

    def _release(self) -> None:
        # Deregister every cached buffer.
        with self._lock:
            regs, self._registrations = self._registrations, OrderedDict()
            for descs, _ in regs.values():
                try:
                    self._agent.deregister_memory(descs)
                except Exception as exc:
                    logger.debug("deregistration failed: %s", exc)
