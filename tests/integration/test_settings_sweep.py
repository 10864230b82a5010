"""Every command, fed each invalid value of each setting, refuses it in one line.

The cases are built from the config dataclasses' fields and the rules they
declare (:func:`kvdepot.config.settings_of`), so a new setting is swept
without touching this file: a float gets NaN, infinity and -1, an integer a
word and a value below its range, a port -1 and 70000, a word among choices
an unknown one, a path a missing parent. Each value arrives by a flag where
the command has one, else (and in turn) by the environment and a config
file. Every run must exit 1 or 2 with exactly one line on stderr that names
the setting as it was given, no traceback, no arena left in /dev/shm and no
process left in its session. Most runs use ``--check`` (nothing starts); a
few start the daemon for real.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvdepot.apps.cli_settings import flag_names
from kvdepot.config import (
    Choice,
    Directory,
    FilePath,
    Number,
    Parsed,
    Port,
    Rule,
    settings_of,
)
from kvdepot.connector.client import ClientConfig
from kvdepot.metadata.config import MetadataConfig
from kvdepot.rpc.security_config import SecurityConfig
from kvdepot.store.config import StoreConfig
from tests.conftest import free_port

pytestmark = pytest.mark.integration

KVDEPOT = [sys.executable, "-m", "kvdepot.apps.cli"]
MISSING_PARENT = "/nonexistent-kvdepot-sweep/typo/dir"


def bad_values(typ: Any, rule: Rule | None) -> list[str]:
    """Values of a setting of type ``typ`` that ``rule`` must refuse, as text."""
    if isinstance(rule, Port):
        return ["-1", "70000", "x"]
    if typ is float:
        out = ["nan", "inf", "-1"]
        if isinstance(rule, Number) and rule.high is not None:
            out.append(f"{rule.high + 1:g}")
        return out
    if typ is int:
        out = ["x"]
        if isinstance(rule, Number) and rule.low is not None:
            out.append(str(int(rule.low) - 1))
        if isinstance(rule, Number) and rule.high is not None:
            out.append(str(int(rule.high) + 1))
        return out
    if typ is bool:
        return ["maybe"]
    if isinstance(rule, (Directory, FilePath)):
        return [MISSING_PARENT]
    if isinstance(rule, (Choice, Parsed)):
        return ["not valid"]  # a space: no word, name or address of any parser
    return []  # free text (a host, a node id): nothing is invalid by itself


@dataclass(frozen=True)
class Component:
    """A command and the config it builds from flags, environment and file."""

    name: str
    command: tuple[str, ...]
    cls: type
    prefix: str
    section: str | None  # table of a --config file; None: the command reads none
    flags: dict[str, str]
    # Settings the command sets itself whatever the environment says.
    fixed: frozenset[str] = frozenset()


@dataclass
class Case:
    component: str
    args: list[str]
    names: tuple[str, ...]  # the line must name the setting one of these ways
    env: dict[str, str] = field(default_factory=dict)
    file: str = ""  # text of a --config file
    setting: str = ""  # the config field swept, if any
    timeout_s: float = 60.0

    @property
    def label(self) -> str:
        return f"{self.component}: {' '.join(self.args)} {self.env or ''} {self.file!r}"


def _toml(raw: str, typ: Any) -> str:
    if typ in (int, float) and (raw in ("nan", "inf") or raw.lstrip("-").isdigit()):
        return raw
    return json.dumps(raw)


def _flag_args(flag: str, raw: str) -> list[str]:
    if flag.endswith("="):  # --watermarks cpu=HIGH:LOW
        head, _, tier = flag.partition(" ")
        return [head, tier + raw]
    return [flag, raw]


def setting_cases(c: Component, first_only: bool = False) -> Iterator[Case]:
    """Each bad value of each setting of ``c``, by flag, environment and file in turn."""
    for name, (typ, rule) in settings_of(c.cls).items():
        if name in c.fixed:
            continue
        values = bad_values(typ, rule)
        for i, raw in enumerate(values[:1] if first_only else values):
            key = c.prefix + name.upper()
            sources = ["env"]
            if name in c.flags and typ is not bool:
                sources.insert(0, "flag")
            if c.section is not None:
                sources.append("file")
            source = sources[i % len(sources)]
            if source == "flag":
                yield Case(c.name, [*c.command, *_flag_args(c.flags[name], raw)],
                           (c.flags[name].rstrip("="),), setting=name)
            elif source == "env":
                yield Case(c.name, list(c.command), (key,), env={key: raw}, setting=name)
            else:
                yield Case(c.name, list(c.command), (f"{name} = ",), setting=name,
                           file=f"[{c.section}]\n{name} = {_toml(raw, typ)}\n")


def common_cases(c: Component, token_0644: Path, not_pem: Path) -> Iterator[Case]:
    """What every command refuses the same way: a variable or a table that names
    no setting, and bad security settings (the token file, TLS files)."""
    typo = c.prefix + "PROT" if c.prefix != "KVDEPOT_" else "KVDEPOT_TLS_CAA"
    yield Case(c.name, list(c.command), (typo,), env={typo: "1"})
    if c.section is not None:
        yield Case(c.name, list(c.command), ("[stroe]",), file="[stroe]\nport = 1\n")
    yield Case(c.name, [*c.command, "--auth-token-file", str(token_0644)], ("--auth-token-file",))
    yield Case(c.name, list(c.command), ("KVDEPOT_AUTH_TOKEN_FILE",),
               env={"KVDEPOT_AUTH_TOKEN_FILE": str(token_0644)})
    yield Case(c.name, [*c.command, "--tls-ca", str(not_pem)], ("tls_ca",))
    for name, (typ, rule) in settings_of(SecurityConfig).items():
        for raw in bad_values(typ, rule):
            key = "KVDEPOT_" + name.upper()
            yield Case(c.name, list(c.command), (key,), env={key: raw})


def components() -> dict[str, Component]:
    metadata = Component("metadata", ("metadata", "--check"), MetadataConfig,
                         "KVDEPOT_METADATA_", "metadata", flag_names(MetadataConfig))
    store = Component("store", ("store", "--check"), StoreConfig, "KVDEPOT_STORE_", "store",
                      flag_names(StoreConfig))
    # A client command reads no file; a value that passed would make it call a
    # daemon that is not there (one line too, but not naming the setting).
    stats = Component("stats", ("stats", "--metadata", f"127.0.0.1:{free_port()}"),
                      ClientConfig, "KVDEPOT_CLIENT_", None,
                      {"metadata": "--metadata", "rpc_timeout_s": "--timeout"},
                      fixed=frozenset({"security"}))
    return {c.name: c for c in (metadata, store, stats)}


def up_cases() -> Iterator[Case]:
    """``up`` checks what its daemons inherit before starting any (one value each)."""
    port = ["--metadata-port", str(free_port())]
    for c in (
        Component("up", ("up", *port), MetadataConfig, "KVDEPOT_METADATA_", None, {},
                  fixed=frozenset({"host", "port", "index"})),
        Component("up", ("up", *port), StoreConfig, "KVDEPOT_STORE_", None, {},
                  fixed=frozenset({"host", "port", "capacity_bytes"})),
    ):
        yield from setting_cases(c, first_only=True)
    for raw in ("-1", "70000", "x"):
        yield Case("up", ["up", "--metadata-port", raw], ("--metadata-port",))
    yield Case("up", ["up", *port, "--capacity", "x"], ("--capacity",))
    yield Case("up", ["up", *port, "--nodes", "x"], ("--nodes",))


def proxy_cases() -> Iterator[Case]:
    engines = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    for raw in ("-1", "70000", "x"):
        yield Case("proxy", ["proxy", *engines, "--port", raw, "--check"], ("port",))
    yield Case("proxy", ["proxy", *engines, "--routing", "bogus", "--check"], ("--routing",))
    yield Case("proxy", ["proxy", *engines, "--check", "--bogus"], ("--bogus",))


def real_cases() -> Iterator[Case]:
    """Daemons started for real (no --check), one bad setting each."""
    meta = ["--metadata", f"127.0.0.1:{free_port()}", "--port", "0", "--capacity", "16MiB"]
    yield Case("real", ["metadata", "--port", "0", "--lease-ttl", "nan"], ("--lease-ttl",))
    yield Case("real", ["store", *meta, "--ssd-dir", MISSING_PARENT], ("--ssd-dir",))
    yield Case("real", ["store", *meta, "--watermarks", "cpu=0.5:0.9"], ("--watermarks cpu=",))
    yield Case("real", ["store", *meta], ("KVDEPOT_STORE_HOLD_TIMEOUT_S",),
               env={"KVDEPOT_STORE_HOLD_TIMEOUT_S": "inf"})
    # Past the config: the arena exists when the SSD directory cannot be made.
    yield Case("real", ["store", *meta, "--ssd-dir", "/proc/kvdepot-sweep",
                        "--ssd-capacity", "1GiB"], ("ssd_dir",))
    yield Case("real", ["up", "--metadata-port", str(free_port())],
               ("KVDEPOT_STORE_IDLE_TIMEOUT_S",), env={"KVDEPOT_STORE_IDLE_TIMEOUT_S": "nan"})


# -- running a case -----------------------------------------------------------------
def _session_members(sid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        if int(fields[3]) == sid:
            members.append(int(entry.name))
    return members


def _arenas_of(pid: int) -> list[str]:
    return [p.name for p in Path("/dev/shm").glob("kvdepot*") if p.name.endswith(f"-{pid}")]


def run_case(case: Case, tmp: Path) -> str:
    """What is wrong with how ``case`` was refused, or ``""``."""
    args = list(case.args)
    if case.file:
        path = tmp / f"case-{uuid.uuid4().hex}.toml"
        path.write_text(case.file)
        args.append(f"--config={path}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVDEPOT_")}
    env.update(case.env)
    proc = subprocess.Popen([*KVDEPOT, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=case.timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return f"still running after {case.timeout_s:.0f} s (the value was accepted)"
    deadline = time.monotonic() + 10
    while _session_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    problems = []
    left = _session_members(proc.pid)
    if left:
        problems.append(f"processes left behind: {left}")
        os.killpg(proc.pid, signal.SIGKILL)
    if _arenas_of(proc.pid):
        problems.append(f"arena left in /dev/shm: {_arenas_of(proc.pid)}")
    lines = stderr.strip().splitlines()
    if proc.returncode not in (1, 2):
        problems.append(f"exit status {proc.returncode}")
    if "Traceback" in stderr:
        problems.append("a traceback")
    if len(lines) != 1:
        problems.append(f"{len(lines)} lines on stderr")
    elif not any(n in lines[0] for n in case.names):
        problems.append(f"the line names none of {case.names}")
    return f"{'; '.join(problems)}\n    stderr: {stderr.strip()[:600]!r}" if problems else ""


def run_all(cases: list[Case], tmp: Path, workers: int = 4) -> None:
    assert cases
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(lambda c: run_case(c, tmp), cases))
    failures = [f"{c.label}\n  -> {r}" for c, r in zip(cases, results, strict=True) if r]
    assert not failures, f"{len(failures)} of {len(cases)} cases:\n" + "\n".join(failures)


@pytest.fixture(scope="module")
def security_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("sweep-security")
    token = tmp / "token"
    token.write_text("s" * 32 + "\n")
    token.chmod(0o644)
    not_pem = tmp / "ca.pem"
    not_pem.write_text("not a certificate\n")
    return token, not_pem


@pytest.mark.parametrize("name", ["metadata", "store", "stats"])
def test_each_setting_of_each_command(
    name: str, tmp_path: Path, security_files: tuple[Path, Path]
) -> None:
    c = components()[name]
    cases = [*setting_cases(c), *common_cases(c, *security_files)]
    # Built from the dataclasses: every number, flag and choice of the config is in.
    swept = {n for n, (t, r) in settings_of(c.cls).items() if t in (int, float, bool) or r}
    assert swept - c.fixed <= {x.setting for x in cases}
    run_all(cases, tmp_path)


def test_up_refuses_before_starting_anything(tmp_path: Path) -> None:
    run_all(list(up_cases()), tmp_path)


def test_proxy(tmp_path: Path) -> None:
    run_all(list(proxy_cases()), tmp_path)


def test_daemons_started_for_real(tmp_path: Path) -> None:
    run_all(list(real_cases()), tmp_path, workers=2)
