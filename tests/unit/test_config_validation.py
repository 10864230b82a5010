"""One set of rules for every setting, whatever its source (flag, environment, file, code)."""

from __future__ import annotations

import dataclasses
import math
import typing
from pathlib import Path
from typing import Any

import pytest

from kvdepot.config import (
    RULE,
    InvalidSetting,
    Number,
    Port,
    check_environment,
    load_config,
    parse_size,
    settings_of,
)
from kvdepot.connector.client import ClientConfig
from kvdepot.errors import InvalidArgument
from kvdepot.metadata.config import MetadataConfig
from kvdepot.proxy.config import ENV_PREFIX, ProxyConfig, UpstreamConfig
from kvdepot.rpc.security_config import SecurityConfig
from kvdepot.store.config import StoreConfig

CONFIGS = (MetadataConfig, StoreConfig, ClientConfig, SecurityConfig)
SCOPES = {
    "KVDEPOT_METADATA_": MetadataConfig,
    "KVDEPOT_STORE_": StoreConfig,
    "KVDEPOT_CLIENT_": ClientConfig,
    "KVDEPOT_": SecurityConfig,
}


@pytest.mark.parametrize("cls", [*CONFIGS, ProxyConfig, UpstreamConfig], ids=lambda c: c.__name__)
def test_every_number_declares_what_it_accepts(cls: type) -> None:
    # A new numeric setting without a rule would take NaN, -1 or 70000 silently.
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        typ = hints[f.name]
        args = [a for a in typing.get_args(typ) if a is not type(None)] or [typ]
        if args[0] in (int, float):
            assert isinstance(f.metadata.get(RULE), (Number, Port)), f"{cls.__name__}.{f.name}"


@pytest.mark.parametrize(
    "cls", [MetadataConfig, StoreConfig, ClientConfig, UpstreamConfig], ids=lambda c: c.__name__
)
def test_non_finite_and_negative_numbers_are_refused_by_name(cls: type) -> None:
    for name, (typ, _) in settings_of(cls).items():
        if typ is not float:
            continue
        for bad in (math.nan, math.inf, -math.inf, -1.0):
            with pytest.raises(InvalidSetting) as info:
                cls(**{name: bad})
            assert info.value.settings[0] == name and str(info.value).startswith(name)


def test_ports_and_types() -> None:
    for bad in (-1, 65536, 70000):
        with pytest.raises(InvalidSetting, match="port"):
            MetadataConfig(port=bad)
        with pytest.raises(InvalidSetting, match="metrics_port"):
            StoreConfig(metrics_port=bad)
    with pytest.raises(InvalidSetting, match="must be an integer"):
        StoreConfig(port="7800")  # type: ignore[arg-type]
    with pytest.raises(InvalidSetting, match="must be an integer"):
        StoreConfig(port=True)
    with pytest.raises(InvalidSetting, match="must be true or false"):
        StoreConfig(shm="no")  # type: ignore[arg-type]
    with pytest.raises(InvalidSetting, match="metadata None: must be a string"):
        ClientConfig(metadata=None)  # type: ignore[arg-type]
    with pytest.raises(InvalidSetting, match="ssd_fsync"):
        StoreConfig(ssd_fsync="sometimes")
    with pytest.raises(InvalidSetting, match="at least twice heartbeat_interval_s"):
        MetadataConfig(lease_ttl_s=1.0, heartbeat_interval_s=1.0)
    assert MetadataConfig(metrics_port=0).metrics_port == 0


def test_the_same_value_is_refused_the_same_way_from_each_source(tmp_path: Path) -> None:
    f = tmp_path / "kvdepot.toml"
    f.write_text("[metadata]\nlease_ttl_s = nan\n")
    from_file = _refusal(lambda: load_config(
        MetadataConfig, prefix="KVDEPOT_METADATA_", file=f, section="metadata"))
    from_env = _refusal(lambda: load_config(
        MetadataConfig, prefix="KVDEPOT_METADATA_", env={"KVDEPOT_METADATA_LEASE_TTL_S": "nan"}))
    from_flag = _refusal(lambda: load_config(
        MetadataConfig, prefix="KVDEPOT_METADATA_", overrides={"lease_ttl_s": "nan"},
        flags={"lease_ttl_s": "--lease-ttl"}))
    assert {e.problem for e in (from_file, from_env, from_flag)} == {"must be a finite number > 0"}
    assert str(from_file).startswith("lease_ttl_s = nan in [metadata] of ")
    assert str(from_env).startswith("KVDEPOT_METADATA_LEASE_TTL_S=nan: ")
    assert str(from_flag).startswith("--lease-ttl nan: ")


def _refusal(call: Any) -> InvalidSetting:
    with pytest.raises(InvalidSetting) as info:
        call()
    return info.value


def test_file_values_of_the_wrong_kind_are_refused(tmp_path: Path) -> None:
    f = tmp_path / "kvdepot.toml"
    for text, says in (
        ("[store]\nport = 7800.5\n", "port = 7800.5 in [store]"),
        ("[store]\nport = true\n", "must be a number, not true or false"),
        ("[store]\nhost = [1, 2]\n", "must be a single value"),
        ("[store]\ncapacity_bytes = inf\n", "capacity_bytes"),
        ("[store]\nshm = 3\n", "shm = 3"),
    ):
        f.write_text(text)
        with pytest.raises(InvalidArgument, match=says.replace("[", r"\[")):
            load_config(StoreConfig, prefix="KVDEPOT_STORE_", file=f, section="store")
    f.write_text("[store]\nport = 7801.0\ncapacity_bytes = 8388608.0\n")
    cfg = load_config(StoreConfig, prefix="KVDEPOT_STORE_", file=f, section="store")
    assert (cfg.port, cfg.capacity_bytes) == (7801, 8 << 20)


def test_an_unknown_table_is_refused_like_an_unknown_key(tmp_path: Path) -> None:
    f = tmp_path / "kvdepot.toml"
    f.write_text("[stroe]\nport = 1\n")
    with pytest.raises(InvalidArgument, match=r"unknown table \[stroe\]"):
        load_config(StoreConfig, prefix="KVDEPOT_STORE_", file=f, section="store")
    f.write_text("[store]\nprot = 1\n")
    with pytest.raises(InvalidArgument, match=r"unknown keys in \[store\].*prot"):
        load_config(StoreConfig, prefix="KVDEPOT_STORE_", file=f, section="store")
    f.write_text('store = "x"\n')
    with pytest.raises(InvalidArgument, match="must be a table"):
        load_config(StoreConfig, prefix="KVDEPOT_STORE_", file=f, section="store")


def test_an_environment_variable_that_names_no_setting_is_refused() -> None:
    with pytest.raises(InvalidSetting, match=r"STORE_PROT.*did you mean KVDEPOT_STORE_PORT"):
        check_environment({"KVDEPOT_STORE_PROT": "1"}, SCOPES)
    with pytest.raises(InvalidSetting, match="KVDEPOT_METADATA_LEASE_TTL"):
        check_environment({"KVDEPOT_METADATA_LEASE_TTL": "5"}, SCOPES)
    # A nested config is not a variable.
    with pytest.raises(InvalidSetting, match="KVDEPOT_CLIENT_SECURITY"):
        check_environment({"KVDEPOT_CLIENT_SECURITY": "x"}, SCOPES)
    check_environment(
        {
            "KVDEPOT_STORE_PORT": "1",
            "KVDEPOT_METADATA_LEASE_TTL_S": "5",
            "KVDEPOT_CLIENT_RPC_TIMEOUT_S": "1",
            "KVDEPOT_AUTH_TOKEN": "t",
            "KVDEPOT_TLS_CA": "ca.pem",
            # Read elsewhere: the log format, the compose file, the test suite.
            "KVDEPOT_LOG_FORMAT": "json",
            "KVDEPOT_IMAGE": "kvdepot:latest",
            "KVDEPOT_TOKEN_FILE": "./secrets/t",
            "KVDEPOT_TEST_COMPOSE_CPU": "1",
            "KVDEPOT_FUZZ_EXAMPLES": "10",
            "OTHER": "x",
        },
        SCOPES,
    )


def test_sizes() -> None:
    assert parse_size(8388608.0) == 8 << 20
    for bad in ("inf", "nan", "1e400", 1.5, True, "-"):
        with pytest.raises(InvalidArgument, match="bad size"):
            parse_size(bad)  # type: ignore[arg-type]


def test_paths_a_daemon_creates_need_their_parent(tmp_path: Path) -> None:
    missing = tmp_path / "typo" / "ssd"
    with pytest.raises(InvalidSetting, match=r"ssd_dir.*its parent .*typo is not a directory"):
        StoreConfig(ssd_dir=str(missing))
    with pytest.raises(InvalidSetting, match="arena_path"):
        StoreConfig(arena_path=str(missing))
    (tmp_path / "file").write_text("")
    with pytest.raises(InvalidSetting, match="is not a directory"):
        StoreConfig(ssd_dir=str(tmp_path / "file"))
    assert StoreConfig(ssd_dir=str(tmp_path / "ssd")).ssd_dir.endswith("ssd")
    assert not (tmp_path / "ssd").exists()  # checking creates nothing


def test_a_token_file_others_can_read_is_refused(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("c" * 32 + "\n")
    for mode in (0o644, 0o640, 0o604, 0o660):
        token.chmod(mode)
        with pytest.raises(InvalidSetting, match=f"mode {mode:04o}.*chmod 600 {token}"):
            SecurityConfig(auth_token_file=str(token))
    token.chmod(0o600)
    assert SecurityConfig(auth_token_file=str(token)).tokens().token == "c" * 32
    token.chmod(0o400)
    assert SecurityConfig(auth_token_file=str(token)).auth


def test_the_ssd_tier_knows_the_configs_fsync_policies() -> None:
    from kvdepot.store.tiers import ssd

    assert ssd.FSYNC_POLICIES == ("always", "segment", "never")


def test_the_proxys_engine_timeouts() -> None:
    env = {ENV_PREFIX + "TOTAL_TIMEOUT_S": "30", ENV_PREFIX + "CONNECT_TIMEOUT_S": "2"}
    loaded = load_config(UpstreamConfig, prefix=ENV_PREFIX, env=env)
    assert (loaded.total_timeout_s, loaded.connect_timeout_s) == (30.0, 2.0)
    with pytest.raises(InvalidSetting, match="KVDEPOT_PROXY_TOTAL_TIMEOUT_S=0"):
        load_config(UpstreamConfig, prefix=ENV_PREFIX, env={ENV_PREFIX + "TOTAL_TIMEOUT_S": "0"})
    engines = {"prefill": ("http://p:1",), "decode": ("http://d:2",)}
    with pytest.raises(InvalidSetting, match="upstream"):
        ProxyConfig(**engines, upstream=30.0)  # type: ignore[arg-type]
