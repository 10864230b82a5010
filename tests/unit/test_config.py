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


def test_command_line_options_come_from_the_fields() -> None:
    """Each daemon's options are generated from its config's field metadata:
    every flagged setting has its option, a boolean's option sets the opposite
    of its default, and an option not given leaves the setting to the
    environment and the file (None)."""
    from kvdepot.apps.cli import build_parser
    from kvdepot.apps.cli_settings import flag_names, setting_overrides
    from kvdepot.rpc.security_config import SecurityConfig

    parser = build_parser()
    store_flags = flag_names(StoreConfig)
    assert store_flags["capacity_bytes"] == "--capacity"
    assert store_flags["shm"] == "--no-shm"
    assert store_flags["cpu_watermarks"] == "--watermarks cpu="
    args = parser.parse_args(["store", "--capacity", "64MiB", "--no-shm", "--tls"])
    store = setting_overrides(args, StoreConfig)
    assert store["capacity_bytes"] == "64MiB"
    assert store["shm"] is False
    assert store["ssd_verify_on_open"] is None and store["force_node_id"] is None
    assert "cpu_watermarks" not in store  # the shared --watermarks is parsed apart
    security = setting_overrides(args, SecurityConfig)
    assert security["tls"] is True and security["tls_ca"] is None
    cfg = load_config(StoreConfig, prefix="KVDEPOT_STORE_", env={}, overrides=store)
    assert cfg.capacity_bytes == 64 << 20 and cfg.shm is False and cfg.ssd_verify_on_open
    args = parser.parse_args(["metadata", "--lease-ttl", "9"])
    assert setting_overrides(args, MetadataConfig)["lease_ttl_s"] == "9"
    with pytest.raises(SystemExit):
        parser.parse_args(["store", "--nixl", "sometimes"])  # a Choice lists its words
