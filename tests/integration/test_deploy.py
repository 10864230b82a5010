"""The compose deployment, checked without a Docker engine.

The file must parse (with docker-compose where installed, else as YAML), every
kvdepot service's command line must be accepted by the CLI (``--check``), and
the image must install kvdepot the way the README says.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.integration

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
ROOT = DEPLOY.parent


def env_defaults() -> dict[str, str]:
    out = {}
    for line in (DEPLOY / ".env").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            k, _, v = line.partition("=")
            out[k.strip()] = v.strip()
    return out


def expand(text: str, env: dict[str, str]) -> str:
    def sub(m: re.Match[str]) -> str:
        name, default = m.group(1), m.group(3) or ""
        return env.get(name, default)

    return re.sub(r"\$\{(\w+)(:-([^}]*))?\}", sub, text)


def compose() -> dict[str, Any]:
    text = expand((DEPLOY / "docker-compose.yml").read_text(), env_defaults())
    data: dict[str, Any] = yaml.safe_load(text)
    return data


def test_compose_file_parses() -> None:
    data = compose()
    services = data["services"]
    assert {"redis", "metadata-0", "metadata-1", "store-0", "store-1", "store-2"} <= set(services)
    for profile, names in (
        ("gpu", {"prefill", "decode", "proxy"}),
        ("cpu", {"cpu-prefill", "cpu-decode", "cpu-proxy"}),
        ("monitoring", {"prometheus"}),
    ):
        assert names == {n for n, s in services.items() if profile in s.get("profiles", [])}
    for name, svc in services.items():
        if "gpu" not in svc.get("profiles", []):
            assert "healthcheck" in svc, name
            assert svc.get("restart") == "unless-stopped", name
            assert svc.get("init") is True, name
    assert set(data["volumes"]) >= {"store-0-ssd", "store-1-ssd", "store-2-ssd"}
    tool = shutil.which("docker-compose")
    if tool is None:
        pytest.skip("docker-compose is not installed; parsed as YAML only")
    for profile in ([], ["--profile", "gpu"], ["--profile", "cpu"], ["--profile", "monitoring"]):
        r = subprocess.run(
            [tool, "-f", str(DEPLOY / "docker-compose.yml"), *profile, "config", "-q"],
            capture_output=True,
            text=True,
            cwd=DEPLOY,
            check=False,
        )
        assert r.returncode == 0, r.stderr


def test_published_ports_are_on_loopback_only() -> None:
    published = 0
    for name, svc in compose()["services"].items():
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
            published += 1
    assert published >= 3


def test_each_store_keeps_its_ssd_tier_on_its_own_volume() -> None:
    services = compose()["services"]
    volumes = set()
    for i in range(3):
        svc = services[f"store-{i}"]
        cmd = [str(c) for c in svc["command"]]
        assert "--ssd-dir=/var/lib/kvdepot/ssd" in cmd
        assert any(c.startswith("--ssd-capacity=") for c in cmd)
        assert any(c.startswith("--capacity=") for c in cmd)
        (volume,) = svc["volumes"]
        assert volume == f"store-{i}-ssd:/var/lib/kvdepot"
        volumes.add(volume)
        # The DRAM arena lives in /dev/shm: it must be at least the arena.
        from kvdepot.config import parse_size

        arena = parse_size(next(c for c in cmd if c.startswith("--capacity=")).split("=", 1)[1])
        assert parse_size(str(svc["shm_size"]).replace("m", "MiB")) >= arena
    assert len(volumes) == 3


def test_the_token_is_a_secret_file_not_a_variable() -> None:
    data = compose()
    assert "kvdepot_token" in data["secrets"]
    for name, svc in data["services"].items():
        if name in ("redis", "prometheus"):  # they speak no kvdepot protocol
            continue
        assert "kvdepot_token" in svc.get("secrets", []), name
        assert "KVDEPOT_AUTH_TOKEN" not in (svc.get("environment") or {}), name
    assert (DEPLOY / "no-token").exists()


def test_every_kvdepot_service_command_is_accepted_by_the_cli(tmp_path: Path) -> None:
    # --check refuses an SSD directory whose parent is missing; the image has
    # /var/lib/kvdepot (the Dockerfile makes it), this host a stand-in.
    assert "mkdir -p /var/lib/kvdepot/ssd" in (DEPLOY / "Dockerfile").read_text()
    checked = 0
    for name, svc in compose()["services"].items():
        image = str(svc.get("image", ""))
        if not image.startswith("kvdepot:"):
            continue
        cmd = [str(c).replace("/var/lib/kvdepot", str(tmp_path)) for c in svc["command"]]
        env = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
        r = subprocess.run(
            [sys.executable, "-m", "kvdepot.apps.cli", *cmd, "--check"],
            capture_output=True,
            text=True,
            env={**env, "PATH": "/usr/bin:/bin"},
            check=False,
        )
        assert r.returncode == 0, f"{name}: {r.stderr}"
        json.loads(r.stdout)
        checked += 1
    assert checked >= 7


def test_image_installs_kvdepot_as_the_readme_says() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert "ARG BASE=python:3.11-slim" in dockerfile
    assert "USER kvdepot" in dockerfile
    runs = [ln for ln in dockerfile.splitlines() if ln.startswith("RUN pip install")]
    assert len(runs) == 1
    readme = (ROOT / "README.md").read_text()
    # The README's install line, with the dependencies already in the venv.
    assert "'.[redis]'" in runs[0] and "--no-deps" not in runs[0]
    assert "pip install '.[redis]'" in readme
    assert "--build-arg BASE=" in readme
