"""Network cuts between hosts for real: Linux network namespaces joined by
veth pairs and a bridge.

The metadata service runs in the root namespace on the bridge address; each
"host" is a namespace with its own address running one store daemon. Chunks
are published from one host and pulled on another over the virtual links;
then a host's link is cut, between transfers and in the middle of them: its
chunks become misses, nothing half-sent becomes visible, nothing else breaks.
Skipped, with the reason, where network namespaces cannot be created.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvdepot.apps.cluster import wait_nodes, wait_ready

pytestmark = [pytest.mark.faults, pytest.mark.integration]

SUBNET = "10.231.{}.{}"


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = ["ip", *(("-n", ns) if ns else ()), *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=20)


def _tc(*args: str, ns: str | None = None) -> None:
    cmd = ["tc", *(("-n", ns) if ns else ()), *args]
    subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=20)


def _namespaces_work() -> str:
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"kvdprobe{uuid.uuid4().hex[:6]}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"the kernel forbids network namespaces here: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return ""


@dataclass
class Host:
    ns: str
    veth: str
    address: str


@dataclass
class Net:
    bridge: str
    gateway: str
    hosts: list[Host]


@pytest.fixture()
def net() -> Iterator[Net]:
    reason = _namespaces_work()
    if reason:
        pytest.skip(reason)
    tag = uuid.uuid4().hex[:5]
    octet = int(tag, 16) % 200 + 20
    bridge = f"kvdbr{tag}"
    gateway = SUBNET.format(octet, 1)
    hosts: list[Host] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{gateway}/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i in range(3):
            ns, veth = f"kvd{tag}h{i}", f"kvd{tag}v{i}"
            addr = SUBNET.format(octet, 10 + i)
            _ip("netns", "add", ns)
            hosts.append(Host(ns, veth, addr))
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", bridge)
            _ip("link", "set", veth, "up")
            _ip("addr", "add", f"{addr}/24", "dev", "eth0", ns=ns)
            _ip("link", "set", "eth0", "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
            _ip("route", "add", "default", "via", gateway, ns=ns)
        yield Net(bridge, gateway, hosts)
    finally:
        for h in hosts:
            _ip("netns", "del", h.ns, check=False)
            _ip("link", "del", h.veth, check=False)
        _ip("link", "del", bridge, check=False)


CLIENT = r"""
import json, sys
import numpy as np
from kvdepot.connector.client import ClientConfig, KVDepotClient
from kvdepot.keys import Namespace, chunk_keys
role, metadata, node = sys.argv[1:4]
seed, n = int(sys.argv[4]), int(sys.argv[5])
keys = chunk_keys(Namespace("netns/model", chunk_tokens=16), [seed] * 16 * n)
def payload(k):
    rng = np.random.default_rng(int.from_bytes(k, "little"))
    return np.frombuffer(rng.bytes(1 << 20), np.uint8)
cfg = ClientConfig(metadata=metadata, node_id=node, transport="tcp", rpc_timeout_s=5,
                   connect_timeout_s=2, io_timeout_s=5)
with KVDepotClient(cfg) as c:
    if role == "put":
        r = c.put(keys, [payload(k) for k in keys])
        print(json.dumps({"stored": r.stored, "skipped": r.skipped, "failed": r.failed}))
    else:
        bufs = [np.zeros(1 << 20, np.uint8) for _ in keys]
        r = c.get_into(keys, bufs)
        ok = all(np.array_equal(b, payload(k)) for k, b in zip(keys[: r.leading], bufs))
        print(json.dumps({"hits": c.lookup(keys), "leading": r.leading, "verified": ok}))
"""


def client(ns: str, *args: str) -> dict[str, object]:
    out = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", CLIENT, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


class Daemons:
    """kvdepot daemons started by a test, in namespaces or not; all stopped at its end."""

    def __init__(self, log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.log_dir = log_dir
        self.env = env
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, args: list[str], name: str, ns: str | None = None) -> subprocess.Popen[bytes]:
        prefix = ["ip", "netns", "exec", ns] if ns else []
        p = subprocess.Popen(
            [*prefix, sys.executable, "-m", "kvdepot.apps.cli", *args],
            stdout=subprocess.PIPE,
            stderr=open(self.log_dir / f"{name}.log", "wb"),  # noqa: SIM115 - lives with p
            env=self.env,
        )
        self.procs.append(p)
        return p

    def start_metadata(self, net: Net) -> str:
        """The metadata service on the bridge, with a short lease; its address."""
        meta = self.spawn(
            ["metadata", "--host", net.gateway, "--port", "0", "--lease-ttl", "2",
             "--heartbeat-interval", "0.4"],
            "metadata",
        )  # fmt: skip
        return f"{net.gateway}:{wait_ready(meta, 'metadata', 30)['port']}"

    def start_store(self, host: Host, metadata: str, i: int) -> dict[str, Any]:
        """Store ``store{i}`` (node ``host{i}``) on ``host``'s address at fixed ports; its READY."""
        p = self.spawn(
            ["store", "--host", host.address, "--port", "7800", "--grpc-port", "7801",
             "--metadata", metadata, "--capacity", "64MiB", "--node-id", f"host{i}"],
            f"store{i}",
            ns=host.ns,
        )  # fmt: skip
        return wait_ready(p, f"store{i}", 30)

    def all_alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture()
def daemons(net: Net, tmp_path: Path) -> Iterator[Daemons]:
    """Stopped before ``net``'s namespaces go (a fixture set up after it is torn down first)."""
    started = Daemons(tmp_path)
    try:
        yield started
    finally:
        started.stop()


def test_publish_on_one_host_pull_on_another_and_survive_a_cut_link(
    net: Net, daemons: Daemons
) -> None:
    """Three hosts publish and pull across the virtual links; host1's link is
    cut between transfers, then healed.

    Lost: host1's chunks while it is cut off (misses, then gone from the index
    within its lease); nothing committed: once the link is back host1
    registers again with all of them. Served wrong: nothing: every pull is a
    miss or verified, and the other hosts keep publishing and pulling.
    """
    metadata = daemons.start_metadata(net)
    for i, h in enumerate(net.hosts):
        info = daemons.start_store(h, metadata, i)
        assert info["address"] == f"{h.address}:7800"
    wait_nodes(metadata, 3)

    # Publish on host0 (into its own store), pull on host2 over the links.
    assert client(net.hosts[0].ns, "put", metadata, "host0", "1", "4")["stored"] == 4
    # Publish on host1 too: these chunks live on host1's store.
    assert client(net.hosts[1].ns, "put", metadata, "host1", "2", "4")["stored"] == 4
    got = client(net.hosts[2].ns, "get", metadata, "host2", "1", "4")
    assert got == {"hits": 4, "leading": 4, "verified": True}
    got = client(net.hosts[2].ns, "get", metadata, "host2", "2", "4")
    assert got == {"hits": 4, "leading": 4, "verified": True}
    # The same prefix published from another host is not sent again.
    assert client(net.hosts[2].ns, "put", metadata, "host2", "1", "4")["skipped"] == 4

    # Cut host1's link mid-run.
    _ip("link", "set", net.hosts[1].veth, "down")
    cut_at = time.monotonic()
    got = client(net.hosts[2].ns, "get", metadata, "host2", "2", "4")
    assert got["verified"] is True  # a miss or verified data, never wrong bytes
    deadline = cut_at + 10
    while client(net.hosts[2].ns, "get", metadata, "host2", "2", "4")["hits"] != 0:
        assert time.monotonic() < deadline, "the cut host's chunks are still listed"
        time.sleep(0.5)
    # Everything else keeps working.
    got = client(net.hosts[2].ns, "get", metadata, "host2", "1", "4")
    assert got == {"hits": 4, "leading": 4, "verified": True}
    assert client(net.hosts[0].ns, "put", metadata, "host0", "3", "2")["stored"] == 2
    # Heal the link: the store re-registers with what it still holds.
    _ip("link", "set", net.hosts[1].veth, "up")
    deadline = time.monotonic() + 15
    while client(net.hosts[2].ns, "get", metadata, "host2", "2", "4")["leading"] != 4:
        assert time.monotonic() < deadline, "the healed host did not come back"
        time.sleep(0.5)
    assert daemons.all_alive(), "a daemon died"


# A transfer that reports when it starts ("GO") and checks every byte it got.
TRANSFER = r"""
import json, sys, time
import numpy as np
from kvdepot.connector.client import ClientConfig, KVDepotClient
from kvdepot.keys import Namespace, chunk_keys
role, metadata, node = sys.argv[1:4]
seed, n, io_timeout = int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
ns = Namespace("netns/model", chunk_tokens=16)
keys = chunk_keys(ns, [seed] * 16 * n)
def payload(k):
    rng = np.random.default_rng(int.from_bytes(k, "little"))
    return np.frombuffer(rng.bytes(1 << 20), np.uint8)
def pull(c, keys):
    bufs = [np.full(1 << 20, 0xA5, np.uint8) for _ in keys]
    r = c.get_into(keys, bufs)
    exact = sum(ok and np.array_equal(b, payload(k)) for k, b, ok in zip(keys, bufs, r.loaded))
    return {"loaded": sum(r.loaded), "exact": int(exact), "wrong": sum(r.loaded) - int(exact)}
cfg = ClientConfig(metadata=metadata, node_id=node, transport="tcp", rpc_timeout_s=5,
                   connect_timeout_s=2, io_timeout_s=io_timeout)
with KVDepotClient(cfg) as c:
    data = [payload(k) for k in keys]
    print("GO", flush=True)
    if role == "put":
        r = c.put(keys, data)
        print(json.dumps({"stored": r.stored, "skipped": r.skipped, "failed": r.failed}))
    elif role == "get":
        print(json.dumps(pull(c, keys)))
    else:  # check, once the link is back: the chunks of seed argv[7] all read back
        # again; what the index lists of `keys` reads back exact; they publish again.
        back = chunk_keys(ns, [int(sys.argv[7])] * 16 * n)
        deadline, wrong = time.monotonic() + 15, 0
        while True:
            healed = pull(c, back)
            wrong += healed["wrong"]
            if healed["loaded"] == n or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        listed = [k for k in keys if c.lookup([k])]
        before = pull(c, listed)
        r = c.put(keys, data)
        after = pull(c, keys)
        print(json.dumps({"healed": healed, "healed_wrong": wrong, "listed": len(listed),
                          "before": before, "failed": r.failed, "hits": c.lookup(keys),
                          "after": after}))
"""


def start(ns: str, *args: str) -> subprocess.Popen[str]:
    """A TRANSFER process in namespace ``ns``."""
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-c", TRANSFER, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def going(p: subprocess.Popen[str]) -> subprocess.Popen[str]:
    """``p`` once it is about to move its bytes."""
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "GO", p.communicate(timeout=60)[1][-2000:]
    return p


def transfer(ns: str, *args: str) -> subprocess.Popen[str]:
    return going(start(ns, *args))


def result(p: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err[-2000:]
    parsed: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return parsed


def test_a_cut_in_the_middle_of_transfers_serves_nothing_half_sent(
    net: Net, daemons: Daemons
) -> None:
    """host1's links are shaped to 20 Mbit/s; a reader on host2 pulls 16 MiB
    from host1's store while a writer on host0 publishes 16 MiB into it, and
    the link is cut in the middle of both.

    Lost: the chunks not yet received when the link went (the reader's
    misses; the writer's failed puts, revoked); nothing host1's store
    committed (it serves it all again once the link is back). Served wrong:
    nothing: every chunk the reader reports loaded is exact, no half-sent
    chunk is ever listed, and each one can be published again.
    """
    host0, host1, host2 = net.hosts
    # The store gives up on a stalled request as soon as the client does.
    daemons.env = {**os.environ, "KVDEPOT_STORE_IO_TIMEOUT_S": "2"}
    metadata = daemons.start_metadata(net)
    daemons.start_store(host1, metadata, 1)
    wait_nodes(metadata, 1)
    # 16 chunks on host1's store, published before the links are shaped.
    assert result(transfer(host2.ns, "put", metadata, "host1", "7", "16", "2"))["stored"] == 16

    for dev, ns in ((host1.veth, None), ("eth0", host1.ns)):  # both directions
        _tc("qdisc", "add", "dev", dev, "root", "tbf", "rate", "20mbit", "burst", "32kbit",
            "latency", "400ms", ns=ns)  # fmt: skip
    reader = start(host2.ns, "get", metadata, "", "7", "16", "2")
    writer = start(host0.ns, "put", metadata, "host1", "8", "16", "2")
    going(reader), going(writer)
    time.sleep(1.0)  # 16 MiB take 6.7 s at 20 Mbit/s: both are mid-transfer
    _ip("link", "set", host1.veth, "down")
    got, put = result(reader), result(writer)
    assert got["wrong"] == 0, got
    assert got["loaded"] == got["exact"] < 16, got  # cut short, what arrived is exact
    assert put["failed"] > 0 and put["stored"] + put["failed"] + put["skipped"] == 16, put

    _tc("qdisc", "del", "dev", "eth0", "root", ns=host1.ns)
    _tc("qdisc", "del", "dev", host1.veth, "root")
    _ip("link", "set", host1.veth, "up")
    # Healed: host1 serves all it committed, and nothing half-sent is listed.
    check = result(transfer(host2.ns, "check", metadata, "host1", "8", "16", "5", "7"))
    assert check["healed"] == {"loaded": 16, "exact": 16, "wrong": 0}, check
    assert check["healed_wrong"] == 0, check
    assert check["before"] == {"loaded": check["listed"], "exact": check["listed"], "wrong": 0}
    assert check["failed"] == 0 and check["hits"] == 16, check
    assert check["after"] == {"loaded": 16, "exact": 16, "wrong": 0}, check
    assert daemons.all_alive(), "a daemon died"
