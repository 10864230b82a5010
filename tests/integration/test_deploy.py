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
    assert {"prefill", "decode", "proxy"} <= {
        n for n, s in services.items() if "gpu" in s.get("profiles", [])
    }
    for name, svc in services.items():
        if name != "redis" and "gpu" not in svc.get("profiles", []):
            assert "healthcheck" in svc, name
    assert set(data["volumes"]) >= {"store-0-ssd", "store-1-ssd", "store-2-ssd"}
    tool = shutil.which("docker-compose")
    if tool is None:
        pytest.skip("docker-compose is not installed; parsed as YAML only")
    for profile in ([], ["--profile", "gpu"]):
        r = subprocess.run(
            [tool, "-f", str(DEPLOY / "docker-compose.yml"), *profile, "config", "-q"],
            capture_output=True,
            text=True,
            cwd=DEPLOY,
            check=False,
        )
        assert r.returncode == 0, r.stderr


def test_every_kvdepot_service_command_is_accepted_by_the_cli() -> None:
    checked = 0
    for name, svc in compose()["services"].items():
        image = str(svc.get("image", ""))
        if not image.startswith("kvdepot"):
            continue
        cmd = [str(c) for c in svc["command"]]
        env = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
        r = subprocess.run(
            [sys.executable, "-m", "kvdepot.cli", *cmd, "--check"],
            capture_output=True,
            text=True,
            env={**env, "PATH": "/usr/bin:/bin"},
            check=False,
        )
        assert r.returncode == 0, f"{name}: {r.stderr}"
        json.loads(r.stdout)
        checked += 1
    assert checked >= 6


def test_image_installs_kvdepot_as_the_readme_says() -> None:
    runs = [ln for ln in (DEPLOY / "Dockerfile").read_text().splitlines() if "pip install" in ln]
    assert runs
    readme = (ROOT / "README.md").read_text()
    for line in runs:
        command = line.split("RUN", 1)[1].strip().replace("--no-cache-dir ", "")
        assert command in readme, f"README does not document: {command}"
