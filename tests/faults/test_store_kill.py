"""Store daemons SIGKILLed in the middle of a put and in the middle of a get.

A killed store can only lose what it alone held: the chunks in its DRAM (they
leave the index within its lease; what it had demoted to SSD comes back when
it restarts on the same directory). What must never happen: a chunk that was
not completely written becoming visible, a key left unpublishable, or a
reader handed bytes other than the ones published.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvdepot.apps.cluster import DaemonProcess, LocalCluster, wait_nodes
from kvdepot.connector.client import ClientConfig, KVDepotClient, PutResult
from kvdepot.keys import ChunkKey, Namespace, chunk_keys
from tests.faults.support import (
    SENTINEL,
    ReadTally,
    payload,
    sentinel_buffers,
    store_stats,
    wait_for,
)
from tests.procs import freeze

pytestmark = [pytest.mark.faults, pytest.mark.integration]

NS = Namespace("test/faults/store-kill", chunk_tokens=16)
MiB = 1 << 20
LEASE_S = 1.5
# The killed store's chunks must leave the index within its lease; the rest
# of the margin covers the reaper's period and a loaded 2-core machine.
VANISH_S = LEASE_S + 3.0


def data(key: bytes) -> np.ndarray:
    return payload(key, MiB)


def client_config(cl: LocalCluster, transport: str, node: str = "") -> ClientConfig:
    return ClientConfig(
        metadata=cl.metadata_address,
        node_id=node,
        transport=transport,
        rpc_timeout_s=5,
        connect_timeout_s=2,
        io_timeout_s=5,
    )


def read_exact(c: KVDepotClient, keys: list[ChunkKey], tally: ReadTally) -> int:
    """Pull ``keys`` into sentinel buffers, one get per key; chunks loaded (all checked)."""
    loaded = 0
    for k in keys:
        bufs = sentinel_buffers(1, MiB)
        loaded += tally.add([k], bufs, c.get_into([k], bufs), lambda k: payload(k, MiB))
    return loaded


def in_call(thread: threading.Thread, function: str) -> bool:
    """Whether ``thread`` is inside a call of a function named ``function``."""
    frame = sys._current_frames().get(thread.ident or 0)
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False


def listed_on(c: KVDepotClient, keys: list[ChunkKey], node: str) -> list[ChunkKey]:
    """The keys the index lists with a replica on ``node``."""
    out = []
    for k in keys:
        loc = c.lookup_locations([k])
        if loc.hits and any(r.node_id == node for r in loc.locations[0].replicas):
            out.append(k)
    return out


def kill_mid_put(
    cl: LocalCluster, victim: DaemonProcess, transport: str, keys: list[ChunkKey]
) -> tuple[list[PutResult], float]:
    """Publish ``keys`` into ``victim``, 4 per put, and SIGKILL it with a put in flight.

    Returns the puts' results and when the store was dead.
    """
    results: list[PutResult] = []
    errors: list[BaseException] = []
    # The writer pauses after a dozen chunks until the store is frozen: a fast
    # transport could otherwise finish all 48 before the SIGSTOP lands.
    frozen = threading.Event()
    with KVDepotClient(client_config(cl, transport, "victim")) as writer:

        def publish() -> None:
            try:
                for i in range(0, len(keys), 4):
                    if i == 12:
                        frozen.wait(30)
                    batch = keys[i : i + 4]
                    results.append(writer.put(batch, [data(k) for k in batch]))
            except BaseException as exc:  # reported by the assertions below
                errors.append(exc)

        t = threading.Thread(target=publish)
        t.start()
        grpc_address = victim.info["grpc_address"]
        wait_for(
            lambda: not t.is_alive() or store_stats(grpc_address).puts >= 12,
            30,
            "the victim store never received a dozen chunks",
        )
        # Frozen, the store holds the writer inside its next transfer: the
        # kill then lands in the middle of a put, never between two.
        freeze(victim.pid)
        frozen.set()
        # Inside a transfer to the store: its batch, or the own-node write
        # (or a put to a placed node) still setting up its connection.
        wait_for(
            lambda: any(in_call(t, f) for f in ("_put_batch", "_write_local", "_put_to")),
            4,
            "the writer never reached the store",
        )
        os.kill(victim.pid, signal.SIGKILL)
        victim.proc.wait()
        killed_at = time.monotonic()
        t.join(60)
        assert not t.is_alive() and not errors, errors
    return results, killed_at


def check_restart(
    cl: LocalCluster,
    reader: KVDepotClient,
    keys: list[ChunkKey],
    victim_args: tuple[str, ...],
    tally: ReadTally,
) -> None:
    """Restarted on its SSD, the victim announces only what it can serve intact."""
    info = cl.add_store("victim", *victim_args).info
    wait_for(
        lambda: any(n.node_id == "victim" for n in reader.stats().nodes),
        10,
        "the restarted store did not register",
    )
    recovered = store_stats(info["grpc_address"]).chunks_recovered
    back = listed_on(reader, keys, "victim")
    assert len(back) == recovered
    assert read_exact(reader, back, tally) == len(back)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_store_sigkill_mid_put_makes_nothing_half_written_visible(
    tmp_path: Path, transport: str
) -> None:
    """A writer publishes 48 chunks into its own store, 4 per put; a quarter
    of the way, with a put's transfer in flight (the store frozen by SIGSTOP
    to hold it there) and demotions to its SSD under way, the store is
    SIGKILLed.

    Lost: the chunks committed only to the killed store's DRAM (misses now,
    gone from the index within the lease); nothing committed on the surviving
    store; no key is left unpublishable. Served wrong: nothing, neither while
    the dead store was still listed, nor after it restarted on its SSD
    directory (it announces only chunks whose bytes verify).
    """
    ssd = tmp_path / "ssd"
    victim_args = (
        "--ssd-dir", str(ssd), "--ssd-capacity", "96MiB", "--ssd-fsync", "never",
        # Demote nearly everything in the background: SSD writes are in flight at the kill.
        "--watermarks", "cpu=0.3:0.1",
    )  # fmt: skip
    tally = ReadTally()
    with LocalCluster(
        nodes=0,
        capacity="64MiB",
        lease_ttl_s=LEASE_S,
        heartbeat_interval_s=0.3,
        log_dir=tmp_path / "logs",
    ) as cl:
        cl.add_store("survivor")
        victim = cl.add_store("victim", *victim_args)
        wait_nodes(cl.metadata_address, 2)
        safe = chunk_keys(NS, [1] * 16 * 4)
        keys = chunk_keys(NS, [2] * 16 * 48)
        with KVDepotClient(client_config(cl, transport, "survivor")) as c:
            assert c.put(safe, [data(k) for k in safe]).stored == 4

        results, killed_at = kill_mid_put(cl, victim, transport, keys)
        stored = sum(r.stored for r in results)
        failed = sum(r.failed for r in results)
        assert stored > 0 and failed > 0, "the kill did not land mid-put"
        assert stored + failed + sum(r.skipped for r in results) == len(keys)

        with KVDepotClient(client_config(cl, transport)) as reader:
            # While the dead store is still listed: every read is exact or a miss.
            while time.monotonic() - killed_at < LEASE_S:
                bufs = sentinel_buffers(len(keys), MiB)
                tally.add(keys, bufs, reader.get_into(keys, bufs), lambda k: payload(k, MiB))
            wait_for(
                lambda: not listed_on(reader, keys, "victim"),
                VANISH_S,
                "the killed store's chunks are still listed",
            )
            # Nothing committed elsewhere was lost.
            assert reader.lookup(safe) == 4
            assert read_exact(reader, safe, tally) == 4
            # Whatever the index lists now reads back exact.
            for k in keys:
                if reader.lookup([k]):
                    assert read_exact(reader, [k], tally) == 1
            check_restart(cl, reader, keys, victim_args, tally)

        # No key is left stuck behind an allocation of the dead store.
        with KVDepotClient(client_config(cl, transport, "survivor")) as c:
            again = c.put(keys, [data(k) for k in keys])
            assert again.failed == 0 and again.stored + again.skipped == len(keys)
            assert c.lookup(keys) == len(keys)
            assert read_exact(c, keys, tally) == len(keys)
    assert tally.wrong == 0, f"{tally.wrong} chunks served with wrong bytes"
    assert tally.exact >= 4 + len(keys)


class LoopedReader:
    """Pulls ``keys`` in a loop on a thread into sentinel buffers until stopped."""

    def __init__(self, reader: KVDepotClient, keys: list[ChunkKey], tally: ReadTally) -> None:
        self.reader = reader
        self.keys = keys
        self.tally = tally
        self.spans: list[tuple[float, float, int]] = []  # start, end, chunks loaded
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        self.current: list[list[np.ndarray]] = []  # the buffers of the get in flight
        self.thread = threading.Thread(target=self._pull)

    def _pull(self) -> None:
        try:
            while not self.stop.is_set():
                bufs = sentinel_buffers(len(self.keys), MiB)
                self.current[:] = [bufs]
                start = time.monotonic()
                result = self.reader.get_into(self.keys, bufs)
                end = time.monotonic()
                loaded = self.tally.add(self.keys, bufs, result, lambda k: payload(k, MiB))
                self.spans.append((start, end, loaded))
        except BaseException as exc:  # reported by the assertions below
            self.errors.append(exc)

    def mid_transfer(self) -> bool:
        # Bytes landed in the first buffer of a get, not yet in its last:
        # reads fill a batch front to back (tcp: each half of it).
        bufs = self.current[0]
        return bool((bufs[0][:64] != SENTINEL).any() and (bufs[-1][-64:] == SENTINEL).all())


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_store_sigkill_mid_get_is_a_miss_never_partial_data(tmp_path: Path, transport: str) -> None:
    """A reader pulls 32 MiB in a loop from one store, which is SIGKILLed while
    the reads run; every buffer is prefilled with a sentinel.

    Lost: the killed store's chunks (misses from the kill on; gone from the
    index within the lease). Served wrong: nothing: each chunk the client
    reports loaded holds exactly the published bytes, also in the get that
    the kill interrupted, and the reported byte count is the loaded chunks'.
    """
    keys = chunk_keys(NS, [3] * 16 * 32)
    tally = ReadTally()
    with LocalCluster(
        nodes=0,
        capacity="48MiB",
        lease_ttl_s=LEASE_S,
        heartbeat_interval_s=0.3,
        log_dir=tmp_path / "logs",
    ) as cl:
        victim = cl.add_store("victim")
        wait_nodes(cl.metadata_address, 1)
        with KVDepotClient(client_config(cl, transport, "victim")) as c:
            assert c.put(keys, [data(k) for k in keys]).stored == len(keys)

        with KVDepotClient(client_config(cl, transport)) as reader:
            loop = LoopedReader(reader, keys, tally)
            spans, errors = loop.spans, loop.errors
            loop.thread.start()
            wait_for(lambda: len(spans) >= 2 or errors, 30, "the reader made no progress")
            deadline = time.monotonic() + 20
            while not loop.mid_transfer() and not errors:
                assert time.monotonic() < deadline, "never caught a get mid-transfer"
                time.sleep(0.0002)
            kill_sent = time.monotonic()
            os.kill(victim.pid, signal.SIGKILL)
            victim.proc.wait()
            killed_at = time.monotonic()  # dead, its sockets closed
            try:
                wait_for(
                    lambda: reader.lookup(keys) == 0,
                    VANISH_S,
                    "the killed store's chunks are still listed",
                )
                vanished_at = time.monotonic()
                wait_for(
                    lambda: sum(s > vanished_at for s, _, _ in spans) >= 2 or errors,
                    10,
                    "the reader stalled after the kill",
                )
            finally:
                loop.stop.set()
                loop.thread.join(30)
        assert not loop.thread.is_alive() and not errors, errors
    before = [n for _, e, n in spans if e < kill_sent]
    assert before and all(n == len(keys) for n in before), "reads before the kill"
    # The kill was sent while a get was moving bytes.
    assert any(s <= killed_at and e >= kill_sent for s, e, _ in spans), "no get spanned the kill"
    # From a dead store nothing loads (a later get cannot reach it at all).
    assert all(n == 0 for s, _, n in spans if s > killed_at)
    assert tally.wrong == 0, f"{tally.wrong} chunks served with wrong bytes"
    assert tally.misses > 0
