"""A Docker engine of the tests' own, and the local images the compose file needs.

No image registry is reachable where the tests run, so the base image is made
with debootstrap from the Debian mirror apt already uses (cached between runs
in the engine's data root, under :data:`CACHE`), and every other image is
built on it. The engine runs with ``--iptables=false --ip-forward=false
--bridge=none``: it never touches the host's firewall rules or its forwarding
policy (other tests rely on both); a user-defined bridge network and published
loopback ports work without them.

Only one engine runs per machine at a time: :func:`engine` holds a lock file
for as long as it runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

CACHE = Path(os.environ.get("KVDEPOT_TEST_DOCKER_CACHE", "/var/cache/kvdepot-test"))
"""Kept between runs: the engine's data root (images, build cache) and its lock."""

DEBIAN_MIRROR = os.environ.get("KVDEPOT_TEST_DEBIAN_MIRROR", "http://deb.debian.org/debian")
BASE_PACKAGES = "python3,python3-venv,python3-pip,ca-certificates,redis-server"
HOST_CAS = Path("/usr/local/share/ca-certificates")
LOCK_WAIT_S = 900.0
TOOLS = ("dockerd", "docker-compose", "debootstrap")


def missing_tools() -> list[str]:
    """The programs the compose tests need that are not installed."""
    return [t for t in TOOLS if shutil.which(t) is None] + ([] if docker_client() else ["docker"])


def docker_client() -> str:
    """The docker CLI that speaks the engine's API: Debian's (20.10) before a newer one."""
    if os.access("/usr/bin/docker", os.X_OK):
        return "/usr/bin/docker"
    return shutil.which("docker") or ""


@dataclass
class Engine:
    """A running dockerd: ``env`` points docker and docker-compose at it."""

    env: dict[str, str]
    root: Path
    log: Path

    def docker(self, *args: str, timeout: float = 120, check: bool = True) -> str:
        r = subprocess.run(
            [docker_client(), *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and r.returncode != 0:
            raise RuntimeError(
                f"docker {' '.join(args)} failed ({r.returncode}): {r.stderr[-3000:]}"
            )
        return r.stdout

    def docker_input(self, data: str, *args: str, timeout: float = 120) -> str:
        """``docker ARGS`` with ``data`` on its stdin; its stdout."""
        r = subprocess.run(
            [docker_client(), *args],
            env=self.env,
            input=data,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if r.returncode != 0:
            raise RuntimeError(f"docker {args[0]} failed ({r.returncode}): {r.stderr[-3000:]}")
        return r.stdout


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop_pid(pid: int, timeout_s: float = 30) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _pid_alive(pid) and time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.2)
    if _pid_alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _stale_dockerd(pidfile: Path) -> None:
    """Stop a dockerd a killed earlier run left behind (we hold the lock: it is not in use)."""
    try:
        pid = int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return
    if b"dockerd" in cmdline and str(CACHE).encode() in cmdline:
        _stop_pid(pid)


@contextlib.contextmanager
def engine(startup_timeout_s: float = 60) -> Iterator[Engine]:
    """Start a dockerd of our own; stop it (and everything it ran) at the end."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "lock", "w") as lock:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"another run holds {CACHE / 'lock'}") from None
                time.sleep(2)
        _stale_dockerd(CACHE / "dockerd.pid")
        for stale in Path(tempfile.gettempdir()).glob("kvd-docker-*"):
            remove_tree(stale)  # the run folders of earlier engines
        # Exec root and socket: short paths (unix sockets are limited to 108 bytes).
        run = Path(tempfile.mkdtemp(prefix="kvd-docker-"))
        sock = run / "docker.sock"
        log = run / "dockerd.log"
        cmd = [
            "dockerd",
            "--iptables=false",
            "--ip6tables=false",
            "--ip-forward=false",
            "--ip-masq=false",
            "--bridge=none",
            f"--data-root={CACHE / 'docker'}",
            f"--exec-root={run / 'exec'}",
            f"--pidfile={CACHE / 'dockerd.pid'}",
            f"--host=unix://{sock}",
            "--log-level=warn",
        ]
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        env = dict(os.environ)
        env.update(
            DOCKER_HOST=f"unix://{sock}",
            DOCKER_BUILDKIT="0",
            COMPOSE_DOCKER_CLI_BUILD="0",
            COMPOSE_INTERACTIVE_NO_CLI="1",
        )
        eng = Engine(env=env, root=run, log=log)
        try:
            until = time.monotonic() + startup_timeout_s
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"dockerd exited: {log.read_text()[-3000:]}")
                r = subprocess.run(
                    [docker_client(), "version", "--format", "{{.Server.Version}}"],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=30,
                    check=False,
                )
                if r.returncode == 0:
                    break
                if time.monotonic() > until:
                    raise RuntimeError(f"dockerd not ready: {log.read_text()[-3000:]}")
                time.sleep(0.3)
            clean(eng)
            yield eng
        finally:
            with contextlib.suppress(Exception):
                clean(eng)
                # Images replaced by newer builds (the build cache stays).
                eng.docker("image", "prune", "-f", timeout=300)
            _stop_pid(proc.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
            remove_tree(run)


def clean(eng: Engine) -> None:
    """Remove every container, network and volume (images stay: they are the cache).

    Containers left by a run that was killed would otherwise come back with
    their restart policies and hold the ports.
    """
    ids = eng.docker("ps", "-aq").split()
    if ids:
        eng.docker("rm", "-f", "-v", *ids, timeout=120)
    eng.docker("network", "prune", "-f")
    eng.docker("volume", "prune", "-f")


def base_key() -> str:
    """What the base image is made from: packages, mirror and the host's CA certificates."""
    h = hashlib.sha256(f"bookworm {BASE_PACKAGES} {DEBIAN_MIRROR}".encode())
    if HOST_CAS.is_dir():
        for crt in sorted(HOST_CAS.rglob("*.crt")):
            h.update(crt.name.encode() + crt.read_bytes())
    return h.hexdigest()[:12]


def base_image(eng: Engine, timeout_s: float = 600) -> str:
    """A Debian bookworm image with Python, its venv module and redis-server.

    Made once per machine (about 2 minutes) with debootstrap; the host's CA
    certificates go into it (builds reach PyPI through a TLS-intercepting
    proxy) and nowhere else. Later runs find it in the engine's data root.
    """
    tag = f"kvdepot-test/debian:bookworm-{base_key()}"
    if eng.docker("images", "-q", tag).strip():
        return tag
    for stale in CACHE.glob("kvd-rootfs-*"):  # left by a run that was killed
        _remove_rootfs(stale)
    rootfs = Path(tempfile.mkdtemp(prefix="kvd-rootfs-", dir=CACHE))
    try:
        subprocess.run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={BASE_PACKAGES}",
                "bookworm",
                str(rootfs),
                DEBIAN_MIRROR,
            ],
            capture_output=True,
            timeout=timeout_s,
            check=True,
        )
        if HOST_CAS.is_dir():
            target = rootfs / "usr/local/share/ca-certificates"
            target.mkdir(parents=True, exist_ok=True)
            for crt in sorted(HOST_CAS.rglob("*.crt")):
                shutil.copy(crt, target / crt.name)
            subprocess.run(
                ["chroot", str(rootfs), "update-ca-certificates"],
                capture_output=True,
                timeout=120,
                check=True,
            )
        # apt lists and caches are not needed in the image.
        for sub in ("var/lib/apt/lists", "var/cache/apt/archives"):
            for p in (rootfs / sub).glob("*"):
                if p.is_file():
                    p.unlink()
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        imp = subprocess.run(
            [docker_client(), "import", "-c", "ENV LANG=C.UTF-8", "-", tag],
            stdin=tar.stdout,
            env=eng.env,
            capture_output=True,
            timeout=300,
            check=False,
        )
        assert tar.stdout is not None
        tar.stdout.close()
        tar.wait(timeout=60)
        if imp.returncode != 0 or tar.returncode != 0:
            raise RuntimeError(f"docker import failed: {imp.stderr.decode()[-2000:]}")
    except subprocess.CalledProcessError as exc:
        out = (exc.stderr or b"").decode(errors="replace")[-2000:]
        raise RuntimeError(f"{exc.cmd[0]} failed ({exc.returncode}): {out}") from None
    finally:
        _remove_rootfs(rootfs)
    return tag


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path) + "/"
    return [
        line.split()[1]
        for line in Path("/proc/mounts").read_text().splitlines()
        if line.split()[1].startswith(prefix)
    ]


def remove_tree(path: Path) -> None:
    """Unmount what is mounted inside ``path`` (debootstrap's /proc if it was cut
    short, dockerd's network namespaces), then delete it; never across a mount."""
    for mount in sorted(_mounts_under(path), key=len, reverse=True):
        subprocess.run(["umount", "-l", mount], capture_output=True, timeout=30, check=False)
    if not _mounts_under(path):
        shutil.rmtree(path, ignore_errors=True)


_remove_rootfs = remove_tree


DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
KVDEPOT_IMAGE = "kvdepot-test/kvdepot:latest"
REDIS_IMAGE = "kvdepot-test/redis:latest"
VLLM_CPU_IMAGE = "kvdepot-test/vllm-cpu:latest"


def free_subnet() -> str:
    """First three octets of a /24 the host has no route into (e.g. ``172.31.240``)."""
    routes = subprocess.run(
        ["ip", "-4", "route"], capture_output=True, text=True, timeout=10, check=False
    ).stdout
    for third in range(240, 255):
        prefix = f"172.31.{third}"
        if f"{prefix}." not in routes:
            return prefix
    raise RuntimeError("no free 172.31.240-254.0/24 subnet on this host")


@dataclass
class Project:
    """One ``docker-compose -p NAME`` project of deploy/docker-compose.yml."""

    eng: Engine
    name: str
    env: dict[str, str]
    log_dir: Path

    def compose(
        self, *args: str, timeout: float = 180, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(
            ["docker-compose", "-f", str(DEPLOY / "docker-compose.yml"), "-p", self.name, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            cwd=DEPLOY,
        )
        if check and r.returncode != 0:
            raise RuntimeError(
                f"docker-compose {' '.join(args)} failed ({r.returncode}): {r.stderr[-3000:]}"
            )
        return r

    def up(self, *profile: str, timeout_s: float = 180) -> None:
        """``up -d``, again if it gave up on a dependency's health check (a busy host)."""
        for attempt in range(3):
            try:
                r = self.compose(*profile, "up", "-d", "--no-build", timeout=timeout_s, check=False)
            except subprocess.TimeoutExpired:
                continue
            if r.returncode == 0:
                return
            print(f"docker-compose up, attempt {attempt + 1}: {r.stderr[-500:]}")
            time.sleep(5)

    def container(self, service: str) -> str:
        cid = self.compose("ps", "-q", service).stdout.strip()
        if not cid:
            raise RuntimeError(f"no container for {service}")
        return cid

    def health(self, service: str) -> str:
        cid = self.compose("ps", "-q", service).stdout.strip()
        if not cid:
            return "absent"
        return self.eng.docker(
            "inspect",
            "--format",
            "{{.State.Status}}/{{if .State.Health}}{{.State.Health.Status}}{{end}}",
            cid,
        ).strip()

    def wait_healthy(self, services: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            states = {s: self.health(s) for s in services}
            if all(v in ("running/healthy", "running/") for v in states.values()):
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"not healthy within {timeout_s:.0f} s: {states}\n{self.logs_tail()}"
                )
            time.sleep(1)

    def logs_tail(self, lines: int = 30) -> str:
        r = self.compose("logs", "--no-color", "--tail", str(lines), check=False, timeout=60)
        return r.stdout[-12000:]

    def save_logs(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        r = self.compose("logs", "--no-color", "--timestamps", check=False, timeout=60)
        (self.log_dir / f"{self.name}.log").write_text(r.stdout + r.stderr)

    def down(self) -> None:
        self.save_logs()
        self.compose("--profile", "cpu", "down", "-v", "--timeout", "10", check=False, timeout=180)
