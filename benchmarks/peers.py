"""kvdepot next to the stores a user would pick instead: Mooncake Store and LMCache's ``lm://``.

Batches of chunks (256 KiB to 16 MiB, 8 per batch) put and got, in rounds,
each round timing every system in turn (round-robin within each trial, as
``benchmarks/dataplane.py`` does), so ratios compare runs under the same load:

* ``raw-tcp``, ``raw-shm``: the limits (see ``benchmarks/dataplane.py``);
* ``raw-tcp-xxh3``, ``raw-shm-xxh3``: the floors, the same with the checksums
  kvdepot computes while it moves bytes (see ``benchmarks/floors.py``);
* ``kvdepot-tcp``, ``kvdepot-shm``: ``KVDepotClient.put`` / ``get_into``
  against a local cluster (metadata service and a store), metadata calls
  included, checksums verified end to end;
* ``mooncake``: Mooncake Store over its TCP transport: its master (with the
  HTTP metadata server), a storage node in another process holding the
  segment, and this process as a client without a segment of its own,
  ``batch_put_from`` / ``batch_get_into`` of the batch on registered buffers
  (its zero-copy calls);
* ``lmcache-lm``: LMCache's ``lm://`` server (``python -m lmcache.v1.server``)
  and its wire protocol as LMCache's own connector speaks it: a PUT is the
  message and the bytes, unanswered (the batch ends with one HEALTH round
  trip, so the server has received it all), a GET is answered with the bytes.

Mooncake's transfer engine listens on every interface and wants a
non-loopback address: the whole benchmark re-runs itself in a network
namespace (``unshare -n``, root) holding only ``lo`` and a veth pair that
leads nowhere. Without it, or without the packages (``pip install -e
'.[bench]'``), the peers are skipped with a message.

Run: ``python benchmarks/peers.py --quick`` (``--json`` prints the rows).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from dataplane import SIZES, KiB, KVDepot, MiB, RawShm, RawTcp, Row, System, _cluster, _measure
from floors import RawShmXxh3, RawTcpXxh3

_VETH_ADDRESS = "10.213.0.1"
_NODE_SCRIPT = """
import sys, time
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
host, metadata, master, segment = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
rc = s.setup(host, metadata, segment, 16 << 20, "tcp", "", master)
print("ready" if rc == 0 else f"setup failed: {rc}", flush=True)
while rc == 0:
    time.sleep(3600)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on port {port} within {timeout_s:g} s")


class Mooncake(System):
    """Mooncake Store: master + storage node processes, this process a client."""

    name = "mooncake"

    def __init__(self, segment: int) -> None:
        from mooncake.store import MooncakeDistributedStore

        binary = shutil.which("mooncake_master", path=os.path.dirname(sys.executable))
        if binary is None:
            raise RuntimeError("mooncake_master not found beside this Python")
        self._dir = tempfile.mkdtemp(prefix="kvbench-mooncake-")
        self._procs: list[subprocess.Popen[bytes]] = []
        http, rpc = _free_port(), _free_port()
        self._procs.append(
            subprocess.Popen(
                [binary, "--enable_http_metadata_server=true",
                 "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={http}",
                 f"--rpc_port={rpc}"],
                stdout=subprocess.DEVNULL, stderr=open(Path(self._dir) / "master.log", "wb"),  # noqa: SIM115
            )
        )  # fmt: skip
        _wait_port(rpc, self._procs[0], "mooncake_master")
        _wait_port(http, self._procs[0], "mooncake metadata server")
        metadata, master = f"http://127.0.0.1:{http}/metadata", f"127.0.0.1:{rpc}"
        node = subprocess.Popen(
            [sys.executable, "-c", _NODE_SCRIPT, _VETH_ADDRESS, metadata, master, str(segment)],
            stdout=subprocess.PIPE, stderr=open(Path(self._dir) / "node.log", "wb"),  # noqa: SIM115
        )  # fmt: skip
        self._procs.append(node)
        line = node.stdout.readline().decode().strip() if node.stdout else ""
        if line != "ready":
            self.close()
            raise RuntimeError(f"mooncake storage node: {line or 'exited'}")
        self._store = MooncakeDistributedStore()
        if self._store.setup(_VETH_ADDRESS, metadata, 0, 16 << 20, "tcp", "", master) != 0:
            self.close()
            raise RuntimeError("mooncake client setup failed")
        self._registered: list[np.ndarray] = []
        self._n = 0

    def prepare(self, size: int, batch: int) -> None:
        for buf in self._registered:
            self._store.unregister_buffer(buf.ctypes.data)
        self._store.remove_all()
        self._size, self._batch = size, batch
        self._src = np.random.default_rng(size).integers(0, 255, size * batch, dtype=np.uint8)
        self._dst = np.zeros(size * batch, dtype=np.uint8)
        self._registered = [self._src, self._dst]
        for buf in self._registered:
            if self._store.register_buffer(buf.ctypes.data, buf.nbytes) != 0:
                raise RuntimeError("mooncake register_buffer failed")
        self._ptrs = [self._src.ctypes.data + i * size for i in range(batch)]
        self._dptrs = [self._dst.ctypes.data + i * size for i in range(batch)]
        self.before_get()

    def _keys(self) -> list[str]:
        self._n += 1
        return [f"b{self._n}-{i}" for i in range(self._batch)]

    def _put(self, keys: list[str]) -> None:
        codes = self._store.batch_put_from(keys, self._ptrs, [self._size] * self._batch)
        if any(c != 0 for c in codes):
            raise RuntimeError(f"mooncake batch_put_from: {codes}")

    def before_get(self) -> None:
        self._get_keys = self._keys()
        self._put(self._get_keys)

    def put(self) -> None:
        self._put(self._keys())

    def get(self) -> None:
        got = self._store.batch_get_into(self._get_keys, self._dptrs, [self._size] * self._batch)
        if any(g != self._size for g in got):
            raise RuntimeError(f"mooncake batch_get_into: {got}")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._store.close()
        for p in reversed(self._procs):
            p.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
        shutil.rmtree(self._dir, ignore_errors=True)


class LmcacheLm(System):
    """LMCache's ``lm://`` server and its own wire messages."""

    name = "lmcache-lm"

    def __init__(self) -> None:
        import torch
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.protocol import ClientCommand, ClientMetaMessage, ServerMetaMessage

        self._torch, self._key_type, self._fmt = torch, CacheEngineKey, MemoryFormat(1)
        self._cmd, self._msg, self._reply = ClientCommand, ClientMetaMessage, ServerMetaMessage
        port = _free_port()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        _wait_port(port, self._proc, "lmcache server", 60)
        self._sock = socket.create_connection(("127.0.0.1", port))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._n = 0

    def _meta(self, command: Any, key: Any, length: int) -> bytes:
        shape = self._torch.Size([length, 0, 0, 0])
        return bytes(
            self._msg(command, key, length, self._fmt, self._torch.uint8, shape).serialize()
        )

    def _keys(self) -> list[Any]:
        self._n += 1
        return [self._key_type("bench", 1, 0, self._n * 64 + i, self._torch.uint8)
                for i in range(self._batch)]  # fmt: skip

    def prepare(self, size: int, batch: int) -> None:
        self._size, self._batch = size, batch
        rng = np.random.default_rng(size)
        self._src = [memoryview(rng.integers(0, 255, size, dtype=np.uint8)) for _ in range(batch)]
        self._dst = [memoryview(np.zeros(size, dtype=np.uint8)) for _ in range(batch)]
        self.before_get()

    def _put(self, keys: list[Any]) -> None:
        for key, src in zip(keys, self._src, strict=True):
            self._sock.sendall(self._meta(self._cmd.PUT, key, self._size))
            self._sock.sendall(src)
        # PUTs go unanswered: one HEALTH round trip says the server read them all.
        self._sock.sendall(self._meta(self._cmd.HEALTH, keys[0], 0))
        self._recv_reply()

    def _recv_reply(self) -> Any:
        head = memoryview(bytearray(self._reply.packlength()))
        _recv_exact(self._sock, head)
        return self._reply.deserialize(bytes(head))

    def before_get(self) -> None:
        self._get_keys = self._keys()
        self._put(self._get_keys)

    def put(self) -> None:
        self._put(self._keys())

    def get(self) -> None:
        for key, dst in zip(self._get_keys, self._dst, strict=True):
            self._sock.sendall(self._meta(self._cmd.GET, key, 0))
            reply = self._recv_reply()
            if reply.length != self._size:
                raise RuntimeError(f"lmcache GET answered {reply.length} bytes")
            _recv_exact(self._sock, dst)

    def close(self) -> None:
        self._sock.close()
        self._proc.terminate()
        self._proc.wait(10)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < view.nbytes:
        n = sock.recv_into(view[got:], view.nbytes - got, socket.MSG_WAITALL)
        if n == 0:
            raise ConnectionError("peer closed")
        got += n


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0


def _isolated_network() -> str:
    """Bring ``lo`` up and add a veth pair (Mooncake wants a non-loopback address).

    Returns why Mooncake cannot run here, or "" when it can.
    """
    ip = shutil.which("ip")
    if ip is None:
        return "no ip command"
    subprocess.run([ip, "link", "set", "lo", "up"], check=True)
    veth = subprocess.run(
        [ip, "link", "add", "kvb0", "type", "veth", "peer", "name", "kvb1"], capture_output=True
    )
    if veth.returncode != 0:
        return f"no veth pair in the namespace: {veth.stderr.decode().strip()}"
    for cmd in (["addr", "add", f"{_VETH_ADDRESS}/24", "dev", "kvb0"],
                ["link", "set", "kvb0", "up"], ["link", "set", "kvb1", "up"]):  # fmt: skip
        subprocess.run([ip, *cmd], check=True)
    return ""


def _peers(isolated: bool, why: str, segment: int, log: Any) -> list[System]:
    out: list[System] = []
    if not isolated:
        log("mooncake: skipped (needs a network namespace: run as root, unshare -n)")
    else:
        try:
            if why:
                raise RuntimeError(why)
            out.append(Mooncake(segment))
        except ImportError:
            log(
                "mooncake: skipped (pip install mooncake-transfer-engine-non-cuda; apt libibverbs1)"
            )
        except Exception as exc:
            log(f"mooncake: skipped ({exc})")
    try:
        out.append(LmcacheLm())
    except ImportError:
        log("lmcache-lm: skipped (pip install lmcache)")
    except Exception as exc:
        log(f"lmcache-lm: skipped ({exc})")
    return out


def _over_rounds(per_round: list[list[Row]]) -> list[Row]:
    """Medians over rounds of each system/op/size."""
    keyed: dict[tuple[str, str, int], list[Row]] = {}
    for rows in per_round:
        for r in rows:
            keyed.setdefault((r.system, r.op, r.size), []).append(r)
    return [
        Row(s, op, size, statistics.median(r.gbps for r in rs),
            statistics.median(r.p50_ms for r in rs), statistics.median(r.p99_ms for r in rs))
        for (s, op, size), rs in keyed.items()
    ]  # fmt: skip


_LMCACHE_FLOOR = (
    "reported; floor: LMCache's unverified reads against raw tcp with kvdepot's"
    " verification; above 1.0 no verified reader can reach the target"
)
_TARGETS: list[tuple[Any, ...]] = [
    # (a, b, op, sizes, target[, note]): issue 19's targets; 0 means reported.
    ("kvdepot-tcp", "mooncake", "put", (256 * KiB, MiB), 1.0),
    ("kvdepot-tcp", "mooncake", "put", (4 * MiB, 16 * MiB), 1.3),
    ("kvdepot-tcp", "mooncake", "get", SIZES, 1.3),
    ("kvdepot-tcp", "lmcache-lm", "get", SIZES, 1.0),
    ("kvdepot-tcp", "lmcache-lm", "put", SIZES, 0.0),
    ("kvdepot-shm", "mooncake", "put", SIZES, 0.0),
    ("kvdepot-shm", "mooncake", "get", SIZES, 0.0),
    ("kvdepot-shm", "raw-shm", "put", (MiB, 4 * MiB, 16 * MiB), 0.9),
    ("kvdepot-tcp", "raw-tcp", "put", SIZES, 0.0),
    ("kvdepot-tcp", "raw-tcp", "get", SIZES, 0.0),
    # The floors: the raw transports with kvdepot's checksums.
    ("lmcache-lm", "raw-tcp-xxh3", "get", SIZES, 0.0, _LMCACHE_FLOOR),
    ("kvdepot-tcp", "raw-tcp-xxh3", "get", SIZES, 0.0),
    ("kvdepot-shm", "raw-shm-xxh3", "put", SIZES, 0.0),
    ("raw-shm-xxh3", "raw-shm", "put", SIZES, 0.0, "reported; checksummed, on one thread"),
]


def _ratios(rows: list[Row]) -> list[str]:
    index = {(r.system, r.op, r.size): r for r in rows}
    lines = []
    for a, b, op, sizes, target, *note in _TARGETS:
        for size in sizes:
            ra, rb = index.get((a, op, size)), index.get((b, op, size))
            if ra is None or rb is None:
                continue
            label = f"{a}/{b} {op} {size // KiB} KiB"
            goal = f"target >= {target}" if target else "".join(note) or "reported"
            lines.append(f"  {label:42s} {ra.gbps / rb.gbps:5.2f}  ({goal})")
    ra, rb = index.get(("kvdepot-tcp", "put", 256 * KiB)), index.get(("raw-tcp", "put", 256 * KiB))
    if ra and rb:
        lines.append(
            f"  {'kvdepot-tcp put 256 KiB p50 / raw-tcp p50':42s} "
            f"{ra.p50_ms / rb.p50_ms:5.2f}  (target <= 2)"
        )
    shm = index.get(("kvdepot-shm", "put", 256 * KiB))
    if shm:
        lines.append(f"  {'kvdepot-shm put 256 KiB GB/s':42s} {shm.gbps:5.2f}  (target >= 2)")
    return lines


def _run(args: argparse.Namespace, log: Any) -> list[Row]:
    sizes = tuple(int(k) * KiB for k in args.sizes.split(",")) if args.sizes else SIZES
    trials = args.trials or (4 if args.quick else 10)
    rounds = args.rounds or (2 if args.quick else 4)
    batch_of = lambda size: args.batch  # noqa: E731 - one batch size for every system
    per_round: list[list[Row]] = []
    # Inside the namespace nothing works before lo is up.
    why = _isolated_network() if args.inside else ""
    with contextlib.ExitStack() as stack:
        systems: list[System] = [RawTcp(), RawTcpXxh3(), RawShm(), RawShmXxh3()]
        cluster = stack.enter_context(_cluster(args.capacity, None))
        node = cluster.stores[0].info["node_id"]
        systems += [KVDepot("tcp", cluster, node), KVDepot("shm", cluster, node)]
        systems += _peers(
            args.inside, why, max(sizes) * args.batch * (trials + 4) + (256 << 20), log
        )
        for s in systems:
            stack.callback(s.close)
        log(f"{rounds} rounds x {trials} trials, batches of {args.batch}: "
            + ", ".join(s.name for s in systems))  # fmt: skip
        for k in range(rounds):
            log(f"round {k + 1}")
            per_round.append(_measure(systems, sizes, batch_of, trials, log))
    return _over_rounds(per_round)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 rounds of 4 trials")
    ap.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    ap.add_argument("--trials", type=int, help="batches timed per system, op, size and round")
    ap.add_argument("--rounds", type=int, help="rounds (medians over them are reported)")
    ap.add_argument("--batch", type=int, default=8, help="chunks per put/get (default 8)")
    ap.add_argument("--sizes", help="chunk sizes in KiB, comma-separated")
    ap.add_argument("--capacity", default="1GiB", help="arena of the kvdepot store")
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out = sys.stderr if args.json else sys.stdout

    def log(msg: str) -> None:
        print(msg, file=out, flush=True)

    if not args.inside and _can_unshare():
        argv = list(sys.argv[1:] if argv is None else argv)
        cmd = ["unshare", "-n", sys.executable, os.path.abspath(__file__), "--inside", *argv]
        return subprocess.run(cmd).returncode
    rows = _run(args, log)
    log(f"\n{'system':12s} {'op':3s} {'size':>8s} {'GB/s':>6s} {'p50 ms':>8s} {'p99 ms':>8s}")
    for r in sorted(rows, key=lambda r: (r.op, r.size, r.system)):
        log(f"{r.system:12s} {r.op:3s} {r.size // KiB:>6d}Ki {r.gbps:6.2f} "
            f"{r.p50_ms:8.2f} {r.p99_ms:8.2f}")  # fmt: skip
    log("\nratios (medians over the rounds of one run):")
    for line in _ratios(rows):
        log(line)
    if args.json:
        print(json.dumps([asdict(r) for r in rows]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
