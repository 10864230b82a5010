"""Fixtures of the vLLM connector tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdepot.apps.cluster import LocalCluster


@pytest.fixture()
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    """A metadata service and two stores whose leases outlive an engine run."""
    c = LocalCluster(
        nodes=2, capacity="64MiB", log_dir=tmp_path / "logs", lease_ttl_s=60, heartbeat_interval_s=1
    )
    c.start()
    try:
        yield c
    finally:
        c.stop()
