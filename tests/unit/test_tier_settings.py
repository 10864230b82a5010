"""Each tier is built from its own slice of the store's settings."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvdepot.store.config import StoreConfig
from kvdepot.store.tiers.factory import build_tiers, tier_settings
from kvdepot.store.tiers.gpu import GpuTier, GpuTierConfig
from kvdepot.store.tiers.ssd import SsdTier, SsdTierConfig

MiB = 1 << 20
TIERS = Path(__file__).resolve().parents[2] / "store" / "tiers"


def test_a_tiers_slice_holds_its_prefixed_settings(tmp_path: Path) -> None:
    config = StoreConfig(
        ssd_dir=str(tmp_path),
        ssd_capacity_bytes=8 * MiB,
        ssd_fsync="never",
        ssd_io_threads=2,
        gpu_capacity_bytes=MiB,
        gpu_device="cpu",
        gpu_promote_hits=5,  # the tiering's setting, not the GPU tier's
    )
    assert tier_settings(config, "ssd", SsdTierConfig) == SsdTierConfig(
        dir=str(tmp_path),
        capacity_bytes=8 * MiB,
        watermarks=config.ssd_watermarks,
        segment_bytes=0,
        fsync="never",
        io_threads=2,
        verify_on_open=True,
        compact_ratio=config.ssd_compact_ratio,
    )
    assert tier_settings(config, "gpu", GpuTierConfig) == GpuTierConfig(
        capacity_bytes=MiB, device="cpu", watermarks=config.gpu_watermarks
    )


def test_the_store_builds_its_tiers_from_their_slices(tmp_path: Path) -> None:
    config = StoreConfig(
        ssd_dir=str(tmp_path), ssd_capacity_bytes=8 * MiB, gpu_capacity_bytes=MiB, gpu_device="cpu"
    )
    tiers = build_tiers(config)
    try:
        gpu, ssd = tiers
        assert isinstance(gpu, GpuTier) and gpu.device == "cpu" and gpu.capacity == MiB
        assert isinstance(ssd, SsdTier) and ssd.capacity == 8 * MiB
    finally:
        for tier in tiers:
            tier.close()


@pytest.mark.parametrize("module", ["base.py", "cpu.py", "gpu.py", "ssd.py", "policy.py"])
def test_tiers_never_see_the_whole_store_config(module: str) -> None:
    tree = ast.parse((TIERS / module).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert "StoreConfig" not in imported | names
