"""The compose file's cpu profile: vLLM (CPU build) prefill and decode engines with
the kvdepot connector behind ``kvdepot proxy``, on the cluster of the default profile.

Opt-in (``KVDEPOT_TEST_COMPOSE_CPU=1``): building the vLLM image installs
about 3.5 GB of wheels, well over the six minutes the rest of the compose test
takes. One completion through the proxy must equal a plain engine's, and the
decode engine must have loaded the prefill's KV from the stores.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import free_port
from tests.deploy import dockerhost
from tests.deploy.dockerhost import Engine, Project, free_subnet

pytestmark = [
    pytest.mark.docker,
    pytest.mark.integration,
    pytest.mark.timeout(3600),
    pytest.mark.skipif(
        os.environ.get("KVDEPOT_TEST_COMPOSE_CPU") != "1",
        reason="opt-in: KVDEPOT_TEST_COMPOSE_CPU=1 (builds a 3.5 GB vLLM image)",
    ),
]

CHUNK = 128
PROMPT = np.random.default_rng(1234).integers(1, 1000, 300).tolist()  # 2 full chunks
ENGINES = ["cpu-prefill", "cpu-decode", "cpu-proxy"]
HOST_WHEELS = Path("/opt/wheels")
WHEELS_PORT = 47861


@contextlib.contextmanager
def wheel_server() -> Iterator[str]:
    """Serve the host's local wheels (the torch +cpu build) to the image build, if any."""
    if not HOST_WHEELS.is_dir():
        yield ""
        return
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(HOST_WHEELS))
    # A fixed port where it is free: the URL is a build argument, and a new one
    # would rebuild the 3.5 GB layer each run.
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", WHEELS_PORT), handler)
    except OSError:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def post_inside(project: Project, container: str, port: int, body: dict[str, object]) -> dict:
    """POST /v1/completions from inside a container (engines publish no ports)."""
    code = (
        "import json, sys, urllib.request as u; "
        f"r = u.Request('http://127.0.0.1:{port}/v1/completions', data=sys.stdin.buffer.read(), "
        "headers={'Content-Type': 'application/json'}); "
        "print(u.urlopen(r, timeout=300).read().decode())"
    )
    out = project.eng.docker_input(
        json.dumps(body), "exec", "-i", container, "python3", "-c", code, timeout=400
    )
    result: dict = json.loads(out)
    return result


@pytest.fixture(scope="module")
def cpu_project(
    docker_engine: Engine, kvdepot_images: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Project, int]]:
    tmp = tmp_path_factory.mktemp("compose-cpu")
    proxy_port = free_port()
    env = {
        **docker_engine.env,
        **kvdepot_images,
        "VLLM_CPU_IMAGE": dockerhost.VLLM_CPU_IMAGE,
        "METADATA_PORT": str(free_port()),
        "METADATA_1_PORT": str(free_port()),
        "PROXY_PORT": str(proxy_port),
        "SUBNET": free_subnet(),
        "STORE_CAPACITY": "64MiB",
        "STORE_SHM_SIZE": "80m",
        "STORE_SSD_CAPACITY": "256MiB",
        "HEALTH_INTERVAL": "5s",
        # A busy 2-core host takes seconds to start a Python process.
        "HEALTH_TIMEOUT": "30s",
        "LOG_FORMAT": "text",
        # PyTorch's CPU index is not reachable here: the torch wheel comes from WHEELS.
        "TORCH_INDEX": os.environ.get("KVDEPOT_TEST_TORCH_INDEX", "https://pypi.org/simple"),
    }
    project = Project(docker_engine, f"kvdc{os.getpid()}", env, Path(tmp))
    with wheel_server() as wheels:
        started = time.monotonic()
        project.env["WHEELS"] = wheels
        project.compose("--profile", "cpu", "build", "cpu-prefill", timeout=3000)
        print(f"vLLM CPU image built in {time.monotonic() - started:.0f} s")
    try:
        core = ["metadata-0", "metadata-1", "store-0", "store-1", "store-2"]
        project.up("--profile", "cpu", timeout_s=900)
        project.wait_healthy([*core, "cpu-prefill", "cpu-decode"], 1200)
        # The proxy is created once the engines are healthy: docker-compose may
        # have given up on them before (vLLM loads for minutes on a busy host).
        project.up("--profile", "cpu", timeout_s=300)
        project.wait_healthy([*core, *ENGINES], 300)
        yield project, proxy_port
    finally:
        project.down()


def test_a_completion_through_the_proxy_equals_a_plain_engines(
    cpu_project: tuple[Project, int],
) -> None:
    project, _ = cpu_project
    body = {
        "model": "/opt/models/tiny-llama",
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": 0.0,
        "return_token_ids": True,
    }
    proxy = project.container("cpu-proxy")
    through = post_inside(project, proxy, 8000, body)
    tokens = through["choices"][0]["token_ids"]
    assert len(tokens) == 8

    # A plain engine (no connector) on the same model and settings.
    name = f"{project.name}-plain-{uuid.uuid4().hex[:6]}"
    project.compose(
        "--profile",
        "cpu",
        "run",
        "-d",
        "--no-deps",
        "--name",
        name,
        "-e",
        "KV_ROLE=none",
        "cpu-decode",
    )
    try:
        deadline = time.monotonic() + 600
        while True:
            state = project.eng.docker(
                "inspect", "--format", "{{.State.Status}}/{{.State.Health.Status}}", name
            ).strip()
            if state == "running/healthy":
                break
            assert state.startswith("running") and time.monotonic() < deadline, state
            time.sleep(2)
        plain = post_inside(project, name, 8100, body)
    finally:
        project.eng.docker("rm", "-f", name, check=False)
    assert tokens == plain["choices"][0]["token_ids"]

    # The decode engine loaded the prefill's chunks from the stores.
    stats = json.loads(
        project.compose(
            "exec",
            "-T",
            "metadata-0",
            "kvdepot-entrypoint",
            "kvdepot",
            "stats",
            "--metadata",
            "127.0.0.1:7700",
            "--json",
        ).stdout
    )
    assert stats["puts_committed"] >= 2, stats
    assert stats["hit_tokens"] >= 2 * CHUNK, stats
