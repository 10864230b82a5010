"""The Docker engine and images of the compose tests (tests/deploy), made once per session."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from tests.deploy import dockerhost
from tests.deploy.dockerhost import DEPLOY, Engine, Project


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[Engine]:
    missing = dockerhost.missing_tools()
    if missing:
        pytest.skip(
            f"{', '.join(missing)} not installed (`make system-deps` installs docker.io, "
            "docker-compose and debootstrap with apt-get)"
        )
    if os.geteuid() != 0:
        pytest.skip("starting a Docker engine needs root")
    with dockerhost.engine() as eng:
        yield eng


@pytest.fixture(scope="session")
def base_image(docker_engine: Engine) -> str:
    """The debootstrap-made Debian base (cached in the engine's data root)."""
    started = time.monotonic()
    tag = dockerhost.base_image(docker_engine)
    print(f"base image {tag} ready in {time.monotonic() - started:.0f} s")
    return tag


@pytest.fixture(scope="session")
def kvdepot_images(docker_engine: Engine, base_image: str) -> dict[str, str]:
    """The kvdepot and Redis images, built from deploy/ on the local base."""
    started = time.monotonic()
    images = {
        "BASE_IMAGE": base_image,
        "KVDEPOT_IMAGE": dockerhost.KVDEPOT_IMAGE,
        "REDIS_IMAGE": dockerhost.REDIS_IMAGE,
    }
    # kvdepot through the compose file's own build section (host network, BASE
    # argument); Redis as docs/deployment.md says to where no registry is.
    builder = Project(docker_engine, "kvdepot-build", {**docker_engine.env, **images}, DEPLOY)
    builder.compose("build", "metadata-0", timeout=900)
    docker_engine.docker(
        "build",
        "--network",
        "host",
        "--build-arg",
        f"BASE={base_image}",
        "-f",
        str(DEPLOY / "redis.Dockerfile"),
        "-t",
        dockerhost.REDIS_IMAGE,
        str(DEPLOY.parent),
        timeout=600,
    )
    print(f"images built in {time.monotonic() - started:.0f} s")
    return images
