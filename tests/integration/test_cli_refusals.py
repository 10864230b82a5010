"""What the ``kvdepot`` command says when it refuses: which command's usage, which
side of a TLS connection refused and why, and a mistyped SSD directory."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdepot.apps import cli
from kvdepot.apps.certs import CertPaths, make_certs
from kvdepot.apps.cluster import wait_ready
from tests.conftest import free_port

pytestmark = pytest.mark.integration

KVDEPOT = [sys.executable, "-m", "kvdepot.apps.cli"]


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVDEPOT_")}
    return subprocess.run(
        [*KVDEPOT, *args], capture_output=True, text=True, timeout=timeout, check=False, env=env
    )


def one_line(out: subprocess.CompletedProcess[str]) -> str:
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


def test_an_unknown_flag_is_reported_by_its_command(tmp_path: Path) -> None:
    required = {
        "proxy": ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"],
        "certs": [str(tmp_path / "certs")],
    }
    for command in build_commands():
        out = run(command, *required.get(command, []), "--bogus")
        assert out.returncode == 2, (command, out.stderr)
        line = one_line(out)
        assert line.startswith(f"kvdepot {command}: error: unrecognized arguments: --bogus")
        assert f"kvdepot {command} --help" in line
    assert not (tmp_path / "certs").exists()
    out = run("store", "--port")
    assert out.returncode == 2
    assert one_line(out).startswith("kvdepot store: error: argument --port: expected one argument")


def build_commands() -> list[str]:
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    assert sub.choices
    return list(sub.choices)


# -- TLS -------------------------------------------------------------------------------
def _daemon(*args: str) -> Iterator[str]:
    port = free_port()
    with tempfile.TemporaryFile() as stderr:
        proc = subprocess.Popen(
            [*KVDEPOT, "metadata", "--port", str(port), "--stop-timeout", "20", *args],
            stdout=subprocess.PIPE,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
        )
        try:
            wait_ready(proc, "metadata", 60)
            yield f"127.0.0.1:{port}"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                pytest.fail(f"metadata {' '.join(args)} ignored SIGTERM for 60 s")
            if proc.returncode != 0:
                # Its stop outran --stop-timeout: stderr holds every thread's
                # stack. Not what these tests are about (the refusals are),
                # so it is reported, not failed on.
                stderr.seek(0)
                tail = stderr.read().decode(errors="replace")[-6000:]
                warnings.warn(
                    f"metadata {' '.join(args)} exited {proc.returncode} on SIGTERM:\n{tail}",
                    stacklevel=1,
                )


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[CertPaths, CertPaths]:
    tmp = tmp_path_factory.mktemp("certs")
    return make_certs(tmp / "ours"), make_certs(tmp / "other")


@pytest.fixture(scope="module")
def mtls(certs: tuple[CertPaths, CertPaths]) -> Iterator[str]:
    c = certs[0]
    yield from _daemon("--tls-cert", str(c.server_cert), "--tls-key", str(c.server_key),
                       "--tls-ca", str(c.ca), "--tls-client-auth")


@pytest.fixture(scope="module")
def plaintext() -> Iterator[str]:
    yield from _daemon()


def _client(c: CertPaths, *, ca: Path | None = None, cert: CertPaths | None = None) -> list[str]:
    args = ["--tls-ca", str(ca or c.ca)]
    if cert is not None:
        args += ["--tls-cert", str(cert.client_cert), "--tls-key", str(cert.client_key)]
    return args


def test_a_tls_mismatch_says_which_side_refused_and_why(
    mtls: str, plaintext: str, certs: tuple[CertPaths, CertPaths]
) -> None:
    ours, other = certs
    cases = [
        ([], mtls, "speaks TLS and this client plaintext: pass --tls-ca"),
        (_client(ours), mtls, "requires a client certificate (pass --tls-cert and --tls-key)"),
        (_client(ours, cert=other), mtls, "does not accept this client's certificate"),
        (_client(ours, ca=other.ca, cert=ours), mtls, f"does not trust {mtls}'s certificate"),
        (_client(ours, cert=ours), plaintext, "speaks plaintext gRPC and this client TLS"),
    ]
    for flags, target, says in cases:
        for command in (["stats", "--metadata", target], ["health", "--target", target]):
            out = run(*command, "--timeout", "3", *flags)
            assert out.returncode == 1, out.stderr
            line = one_line(out)  # no raw gRPC (absl) lines beside it
            assert line.startswith("kvdepot: error: ") and says in line, (command, flags, line)
            assert "Socket closed" not in line
    ok = run("stats", "--metadata", mtls, "--timeout", "3", *_client(ours, cert=ours))
    assert ok.returncode == 0, ok.stderr


# -- the SSD directory --------------------------------------------------------------------
def test_a_mistyped_ssd_dir_is_refused_and_nothing_is_created(tmp_path: Path) -> None:
    typo = tmp_path / "nvme-typo" / "kvdepot" / "ssd"
    args = ["store", "--port", "0", "--metadata", f"127.0.0.1:{free_port()}",
            "--capacity", "16MiB", "--ssd-dir", str(typo), "--ssd-capacity", "64MiB"]
    for extra in (["--check"], []):
        out = run(*args, *extra)
        assert out.returncode == 1, out.stderr
        line = one_line(out)
        assert line.startswith(f"kvdepot: error: --ssd-dir {typo}: cannot be created"), line
        assert "is not a directory" in line
    assert not (tmp_path / "nvme-typo").exists()


def test_the_ssd_dir_itself_is_created_and_the_default_capacity_is_logged(
    tmp_path: Path,
) -> None:
    ssd = tmp_path / "ssd"
    meta = subprocess.Popen(
        [*KVDEPOT, "metadata", "--port", "0"], stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
    )
    try:
        port = wait_ready(meta, "metadata", 60)["port"]
        store = subprocess.Popen(
            [*KVDEPOT, "store", "--port", "0", "--metadata", f"127.0.0.1:{port}",
             "--capacity", "16MiB", "--ssd-dir", str(ssd), "--no-shm"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
        )
        try:
            info = wait_ready(store, "store", 60)
            assert ssd.is_dir() and info["ssd_dir"] == str(ssd)
            stats = run("stats", "--json", "--metadata", f"127.0.0.1:{port}")
            assert stats.returncode == 0, stats.stderr
        finally:
            store.terminate()
            _, err = store.communicate(timeout=30)
        logged = [ln for ln in err.decode().splitlines() if "ssd tier on" in ln]
        assert len(logged) == 1 and "90% of the space free there" in logged[0], err
        assert "--ssd-capacity" in logged[0]
    finally:
        meta.terminate()
        meta.wait(timeout=30)
