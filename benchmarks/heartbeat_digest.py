"""What the inventory digest adds to a heartbeat: the metadata daemon's CPU per heartbeat,
with and without it, on the memory index and on Redis (issue 37).

``--nodes`` synthetic nodes (``benchmarks.scale_nodes.Node``) register
``--chunks`` chunks each with a real ``kvdepot metadata`` daemon, then
heartbeat every ``--interval`` seconds each, spread over the interval, from
this process. In windows of ``--window`` seconds, modes interleaved, the
heartbeats carry: no digest (``plain``, what a store before reconciliation
sent), the node's digest (``held``, equal to the index's) or a wrong one
(``mismatch``: the answer says reconcile; no round follows here). Per mode,
the median over ``--reps`` windows of the daemon's CPU (utime+stime) per
heartbeat, net of its idle CPU. Redis is a ``redis-server`` of this process's
own on a free port (skipped when there is none).

Usage::

    python benchmarks/heartbeat_digest.py [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repo root

from benchmarks.scale_nodes import Daemon, Heartbeater, Node, inventory, metadata_daemon
from kvdepot.proto.gen import metadata_pb2, metadata_pb2_grpc
from kvdepot.rpc.security import channel
from kvdepot.wire.digest import digest_of

MODES = ("plain", "held", "mismatch")


class DigestNode(Node):
    """A node whose heartbeats carry its digest as the current mode says."""

    mode = "plain"

    def __init__(self, stub: Any, node_id: str, keys: bytes) -> None:
        super().__init__(stub, node_id, keys)
        self.digest = digest_of(keys)

    def heartbeat_request(self) -> metadata_pb2.HeartbeatRequest:
        r = metadata_pb2.HeartbeatRequest(node_id=self.node_id, epoch=self.epoch)
        if DigestNode.mode != "plain":
            count, total = self.digest
            r.held.chunks = count
            r.held.digest = total if DigestNode.mode == "held" else total ^ 1
        return r


def _cpu_per_beat(d: Daemon, beats: Heartbeater, seconds: float, idle: float) -> float:
    c0, n0, t0 = d.cpu_s(), beats.sent, time.monotonic()
    time.sleep(seconds)
    busy = d.cpu_s() - c0 - idle * (time.monotonic() - t0)
    return busy * 1000 / max(1, beats.sent - n0)


def measure(index: str, args: argparse.Namespace, log: Path) -> dict[str, Any]:
    with metadata_daemon(index, log, 60.0, 1.0) as d, channel(d.address) as ch:
        stub = metadata_pb2_grpc.MetadataStub(ch)
        nodes = [DigestNode(stub, f"n{i}", inventory(args.chunks, i)) for i in range(args.nodes)]
        for n in nodes:
            n.register()
        time.sleep(1.0)
        c0, t0 = d.cpu_s(), time.monotonic()
        time.sleep(args.idle)
        idle = (d.cpu_s() - c0) / (time.monotonic() - t0)
        beats = Heartbeater(d.address, list(nodes), args.interval)
        beats.start()
        per: dict[str, list[float]] = {m: [] for m in MODES}
        try:
            for rep in range(args.reps):
                for mode in MODES[rep % 3 :] + MODES[: rep % 3]:
                    DigestNode.mode = mode
                    time.sleep(0.5)  # the heartbeats of the mode before have landed
                    per[mode].append(_cpu_per_beat(d, beats, args.window, idle))
        finally:
            beats.stop()
        answer = stub.Heartbeat(nodes[0].heartbeat_request(), timeout=5)
    row: dict[str, Any] = {m: round(statistics.median(v), 4) for m, v in per.items()}
    row.update(
        idle_cores=round(idle, 4),
        heartbeats_per_s=round(args.nodes / args.interval, 1),
        failures=dict(beats.failed),
        last_answer_reconcile=answer.reconcile,
    )
    return row


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=32)
    ap.add_argument("--chunks", type=int, default=10_000)
    ap.add_argument("--interval", type=float, default=0.1)
    ap.add_argument("--window", type=float, default=6.0)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--idle", type=float, default=4.0)
    ap.add_argument("--quick", action="store_true", help="8 nodes, 2 s windows, 2 reps")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.nodes, args.window, args.reps, args.idle = 8, 2.0, 2, 2.0
    tmp = Path(tempfile.mkdtemp(prefix="kvdepot-hb-"))
    out = {"memory": measure("memory://", args, tmp / "memory.log")}
    binary = shutil.which("redis-server")
    if binary is not None:
        port = _free_port()
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--save", "", "--appendonly", "no", "--dir", str(tmp)],
            stdout=subprocess.DEVNULL,
        )
        try:
            time.sleep(0.5)
            url = f"redis://127.0.0.1:{port}/0?prefix=hb"
            out["redis"] = measure(url, args, tmp / "redis.log")
        finally:
            proc.kill()
            proc.wait()
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for name, row in out.items():
            cells = ", ".join(f"{m} {row[m]:.3f}" for m in MODES)
            print(f"{name}: ms of CPU per heartbeat: {cells} ({row['heartbeats_per_s']}/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
