"""When another process sees a put: the watchers of the benchmarks' ``visible`` rows.

A put is visible once ANOTHER process's lookup names its chunks, the moment
a reader elsewhere (a decode engine) could use them. A watcher is a
long-lived process, one per kind of system, started by the benchmark and
driven over a pipe:

1. the benchmark sends the names of the chunks it is about to put (one JSON
   line); the watcher prepares its probe and answers ``armed``, then probes
   in a loop (a pause of ``POLL_S`` between two probes);
2. the benchmark reads its clock and starts the put;
3. once a probe names every chunk, the watcher answers with its clock at
   that probe's return (``time.monotonic_ns()``: on Linux one clock for every
   process of a host). The latency is that minus the put's start.

The probes, each system's own "is it there" call from another process:

* ``kvdepot``: ``KVDepotClient.lookup(keys, count="none")`` (a client of its
  own, no node) equals the number of keys;
* ``mooncake``: ``batch_is_exist`` of a Mooncake client of its own (no segment);
* ``lmcache``: one ``EXIST`` message per key on a connection of its own to
  the ``lm://`` server (the messages come serialized from the benchmark, so
  the watcher needs neither torch nor LMCache);
* ``redis``: ``EXISTS`` of every key.

Run by :class:`Watcher` as ``python benchmarks/visible.py KIND CONFIG``.
"""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a file by Watcher: the repository root first
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import procs

POLL_S = 0.0001  # between two probes: the latency's resolution is a probe plus this
TIMEOUT_S = 30.0
_TAG = "WATCHER "  # the protocol's lines (a library may print on stdout too)


class Watcher:
    """A watcher process of one kind (see the module's docstring)."""

    def __init__(self, kind: str, config: dict[str, Any]) -> None:
        self.kind = kind
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()
        self._proc = procs.popen(
            [sys.executable, str(Path(__file__).resolve()), kind, json.dumps(config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
        )  # fmt: skip
        try:
            self._expect("ready")
        except BaseException:
            self.close()
            raise

    def _line(self) -> str:
        assert self._proc.stdout is not None
        while line := self._proc.stdout.readline():
            if line.startswith(_TAG):
                return line[len(_TAG) :].strip()
        self._log.seek(0)
        tail = self._log.read().decode(errors="replace").strip().splitlines()[-5:]
        raise RuntimeError(f"{self.kind} watcher exited: {' | '.join(tail)}")

    def _expect(self, word: str) -> None:
        line = self._line()
        if line != word:
            raise RuntimeError(f"{self.kind} watcher: {line}")

    def arm(self, names: list[str]) -> None:
        """Have it probe for ``names`` (returns once it does)."""
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(names) + "\n")
        self._proc.stdin.flush()
        self._expect("armed")

    def seen(self) -> int:
        """Its clock (ns) when a probe first named every chunk."""
        line = self._line()
        if not line.isdigit():
            raise RuntimeError(f"{self.kind} watcher: {line}")
        return int(line)

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        procs.terminate(self._proc, 5)
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._log.close()


_WATCHERS: dict[str, Watcher] = {}


def watcher(kind: str, **config: Any) -> Watcher:
    """The watcher of ``kind`` with ``config``, started on first use and shared."""
    key = json.dumps([kind, config], sort_keys=True)
    if key not in _WATCHERS:
        _WATCHERS[key] = Watcher(kind, config)
    return _WATCHERS[key]


def close_watchers() -> None:
    while _WATCHERS:
        _WATCHERS.popitem()[1].close()


def timed_put(w: Watcher, names: list[str], put: Callable[[], Any]) -> float:
    """Seconds from the start of ``put()`` until ``w`` names every one of ``names``."""
    w.arm(names)
    t0 = time.monotonic_ns()
    put()
    return (w.seen() - t0) / 1e9


# -- in the watcher process ------------------------------------------------------
Probe = Callable[[list[str]], Callable[[], bool]]


def _kvdepot(config: dict[str, Any]) -> Probe:
    from kvdepot.connector.client import ClientConfig, KVDepotClient

    client = KVDepotClient(ClientConfig(metadata=config["metadata"], transport="tcp"))

    def arm(names: list[str]) -> Callable[[], bool]:
        keys = [bytes.fromhex(n) for n in names]
        return lambda: client.lookup(keys, count="none") == len(keys)

    return arm


def _mooncake(config: dict[str, Any]) -> Probe:
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(config["host"], config["metadata"], 0, 16 << 20, "tcp", "", config["master"])
    if rc != 0:
        raise RuntimeError(f"mooncake client setup failed: {rc}")

    def arm(names: list[str]) -> Callable[[], bool]:
        return lambda: all(r == 1 for r in store.batch_is_exist(names))

    return arm


def _lmcache(config: dict[str, Any]) -> Probe:
    sock = socket.create_connection(("127.0.0.1", config["port"]))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    reply = bytearray(config["reply_bytes"])
    success = config["success"]

    def exists(message: bytes) -> bool:
        sock.sendall(message)
        view, got = memoryview(reply), 0
        while got < len(reply):
            n = sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError("lmcache server closed the connection")
            got += n
        return bool(struct.unpack_from("i", reply)[0] == success)

    def arm(names: list[str]) -> Callable[[], bool]:
        messages = [bytes.fromhex(n) for n in names]
        return lambda: all(exists(m) for m in messages)

    return arm


def _redis(config: dict[str, Any]) -> Probe:
    import redis

    r = redis.Redis(port=config["port"])
    r.ping()

    def arm(names: list[str]) -> Callable[[], bool]:
        return lambda: int(r.exists(*names)) == len(names)

    return arm


_PROBES: dict[str, Callable[[dict[str, Any]], Probe]] = {
    "kvdepot": _kvdepot,
    "mooncake": _mooncake,
    "lmcache": _lmcache,
    "redis": _redis,
}


def _say(word: str) -> None:
    sys.stdout.write(_TAG + word + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    kind, config = argv[0], json.loads(argv[1])
    arm = _PROBES[kind](config)
    _say("ready")
    for line in sys.stdin:
        check = arm(json.loads(line))
        _say("armed")
        deadline = time.monotonic() + TIMEOUT_S
        while not check():
            if time.monotonic() > deadline:
                _say(f"not visible within {TIMEOUT_S:g} s")
                break
            time.sleep(POLL_S)
        else:
            _say(str(time.monotonic_ns()))
    return 0


if __name__ == "__main__":
    procs.stop_on_sigterm()
    raise SystemExit(main(sys.argv[1:]))
