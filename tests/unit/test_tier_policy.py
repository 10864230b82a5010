"""Tests of the tier interface's small parts: policies, limits, the registry."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvdepot.errors import InvalidArgument
from kvdepot.keys import ChunkKey
from kvdepot.store.tiers import (
    LruPolicy,
    Tier,
    TieringOptions,
    TierLimits,
    create_policy,
    register_policy,
    register_tier,
    tier_class,
)
from kvdepot.store.tiers import base as base_module
from kvdepot.store.tiers import policy as policy_module
from kvdepot.store.tiers.cpu import CpuTier
from kvdepot.store.tiers.policy import FifoPolicy, policy_names


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def test_lru_gives_up_the_least_recently_used_first() -> None:
    p = LruPolicy()
    for i in range(4):
        p.insert(key(i))
    p.touch(key(0))
    p.remove(key(2))
    p.touch(key(99))  # unknown: ignored
    assert list(p.coldest()) == [key(1), key(3), key(0)]
    assert len(p) == 3


def test_fifo_ignores_reads() -> None:
    p = create_policy("fifo")
    assert isinstance(p, FifoPolicy)
    for i in range(3):
        p.insert(key(i))
    p.touch(key(0))
    assert list(p.coldest()) == [key(0), key(1), key(2)]


def test_policies_plug_in_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    class Newest(LruPolicy):
        def coldest(self):  # type: ignore[no-untyped-def]
            return reversed(list(super().coldest()))

    monkeypatch.setattr(policy_module, "POLICIES", policy_module.POLICIES.copy())
    register_policy("newest-first", Newest)
    assert "newest-first" in policy_names()
    assert isinstance(create_policy("newest-first"), Newest)
    TieringOptions(policy="newest-first")
    with pytest.raises(InvalidArgument, match="unknown eviction policy"):
        create_policy("mru-ish")
    with pytest.raises(InvalidArgument):
        TieringOptions(policy="nope")
    with pytest.raises(InvalidArgument):
        TieringOptions(promote_hits=-1)


def test_watermarks_are_validated_and_parsed() -> None:
    assert TierLimits.parse("0.9:0.5") == TierLimits(0.9, 0.5)
    for bad in ("0.5", "0.5:0.9", "1.5:0.5", "0.9:0", "x:y"):
        with pytest.raises(InvalidArgument):
            TierLimits.parse(bad)


def test_registry_imports_tiers_on_first_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base_module, "TIERS", base_module.TIERS.copy())
    assert tier_class("cpu") is CpuTier
    assert tier_class("ssd").name == "ssd"
    with pytest.raises(InvalidArgument, match="unknown tier"):
        tier_class("tape")
    register_tier("tape", "kvdepot.store.tiers.cpu:CpuTier")
    assert issubclass(tier_class("tape"), Tier)
    register_tier("bad", "kvdepot.store.tiers.base:TierLimits")
    with pytest.raises(InvalidArgument, match="not a Tier"):
        tier_class("bad")


NO_TORCH = r"""
import sys, tempfile
from kvdepot.store.config import StoreConfig
from kvdepot.store.daemon import StoreDaemon
from kvdepot.store.table_factory import build_chunk_store
from kvdepot.store.tiers import gpu  # the module itself does not import torch
d = tempfile.mkdtemp()
cs = build_chunk_store(StoreConfig(ssd_dir=d, ssd_capacity_bytes=1 << 20, capacity_bytes=1 << 20),
                       arena_path=None)
assert cs.tiers == ("cpu", "ssd"), cs.tiers
cs.close()
assert "torch" not in sys.modules, "torch was imported"
print("ok")
"""


def test_a_store_without_a_gpu_tier_never_imports_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-c", NO_TORCH], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_store_flags_configure_the_tiers(capsys: pytest.CaptureFixture[str]) -> None:
    from kvdepot.apps.cli import main

    argv = ["store", "--ssd-dir", "/tmp/kvdepot-ssd", "--ssd-capacity", "2GiB", "--gpu-capacity",
            "1GiB", "--gpu-device", "cuda:1", "--watermarks", "cpu=0.9:0.7", "--watermarks",
            "ssd=0.99:0.95", "--promote-hits", "2", "--ssd-fsync", "always", "--no-ssd-verify",
            "--check"]  # fmt: skip
    assert main(argv) == 0
    cfg = json.loads(capsys.readouterr().out)["store"]
    assert (cfg["ssd_dir"], cfg["ssd_capacity_bytes"]) == ("/tmp/kvdepot-ssd", 2 << 30)
    assert (cfg["gpu_capacity_bytes"], cfg["gpu_device"]) == (1 << 30, "cuda:1")
    assert (cfg["cpu_watermarks"], cfg["ssd_watermarks"]) == ("0.9:0.7", "0.99:0.95")
    assert (cfg["promote_hits"], cfg["ssd_fsync"]) == (2, "always")
    assert cfg["ssd_verify_on_open"] is False
    assert main(["store", "--watermarks", "tape=0.9:0.8", "--check"]) == 1
    assert main(["store", "--watermarks", "cpu=0.5:0.9", "--check"]) == 1


def test_store_config_validates_the_tiers() -> None:
    from kvdepot.store.config import StoreConfig

    for bad in (
        {"ssd_fsync": "sometimes"},
        {"pin_memory": "maybe"},
        {"ssd_compact_ratio": 1.0},
        {"eviction_policy": "random"},
        {"gpu_watermarks": "1"},
        {"ssd_io_threads": 0},
    ):
        with pytest.raises(InvalidArgument):
            StoreConfig(**bad)  # type: ignore[arg-type]
