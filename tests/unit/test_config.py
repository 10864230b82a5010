"""Config loading: flags > env > file, validated per component."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdepot.config import load_config, parse_size
from kvdepot.errors import InvalidArgument
from kvdepot.metadata.config import MetadataConfig
from kvdepot.store.config import StoreConfig


def test_parse_size() -> None:
    assert parse_size("1MiB") == 1 << 20
    assert parse_size("2g") == 2 << 30
    assert parse_size("4096") == 4096
    assert parse_size("1.5KiB") == 1536
    for bad in ("", "MiB", "12 parsecs", "1..2M"):
        with pytest.raises(InvalidArgument):
            parse_size(bad)


def test_precedence_flags_over_env_over_file(tmp_path: Path) -> None:
    f = tmp_path / "kvdepot.toml"
    f.write_text('[store]\ncapacity_bytes = "64MiB"\nport = 9000\nnode_id = "file"\n')
    env = {"KVDEPOT_STORE_PORT": "9100", "KVDEPOT_STORE_NODE_ID": "env"}
    cfg = load_config(
        StoreConfig, prefix="KVDEPOT_STORE_", env=env, file=f, section="store",
        overrides={"node_id": "flag", "port": None},
    )
    assert cfg.capacity_bytes == 64 << 20
    assert cfg.port == 9100
    assert cfg.node_id == "flag"


def test_unknown_keys_and_bad_values_are_refused(tmp_path: Path) -> None:
    f = tmp_path / "m.toml"
    f.write_text("[metadata]\nprot = 1\n")
    with pytest.raises(InvalidArgument, match="prot"):
        load_config(MetadataConfig, prefix="X_", file=f, section="metadata")
    with pytest.raises(InvalidArgument):
        load_config(MetadataConfig, prefix="X_", env={"X_PORT": "seventy"})
    with pytest.raises(InvalidArgument):
        MetadataConfig(lease_ttl_s=1.0, heartbeat_interval_s=1.0)
    with pytest.raises(InvalidArgument):
        StoreConfig(capacity_bytes=10)
