"""The import rules of pyproject.toml's ``[tool.importlinter]``, checked with lint-imports.

Held now: the shared layer (every module and package directly in kvdepot/ but
the applications: errors, registry, endpoints, records, config, keys, types,
validation, metadata_client, retry, metrics, logs, shutdown, repeat_log;
kvdepot/rpc, the gRPC plumbing; kvdepot/wire, the data plane's wire both ends
import) imports nothing of metadata, store or
connector, nor of the applications (kvdepot.apps: the command, local cluster,
demo, certs, stats; kvdepot.proxy: the proxy and its router); store, metadata,
connector and proto import no application; the store, the connector and the
metadata service import nothing of each other; kvdepot.errors and
kvdepot.rpc.security_config import no gRPC; the store is layered, bottom up:
its tiers, the tier placement, the mover, the chunk table, the data plane's
sessions and handlers, its server and the table's factory, the daemon.
A vLLM worker that loads the connector loads no kvdepot.store module (checked
by importing it). Nothing is ignored to make these pass.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import typecheck  # noqa: E402


def test_the_import_contracts_hold(tmp_path: Path) -> None:
    lint_imports = Path(sys.executable).with_name("lint-imports")
    assert lint_imports.exists(), "lint-imports is missing: pip install -e '.[dev]'"
    # The folders map onto kvdepot.* only through package-dir, which
    # lint-imports cannot follow: check the installed layout instead.
    typecheck.build_tree(tmp_path)
    result = subprocess.run(
        [str(lint_imports), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    kept = re.search(r"Contracts: (\d+) kept, 0 broken", result.stdout)
    assert kept and int(kept[1]) >= 5, result.stdout


def test_every_module_beside_the_shared_layer_is_in_its_contract() -> None:
    # A module dropped into kvdepot/ would otherwise escape the shared layer's
    # rules: an application belongs in kvdepot/apps/ (or kvdepot/proxy/).
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    shared = next(c for c in contracts if c["name"].startswith("the shared layer"))
    assert {"kvdepot.apps", "kvdepot.proxy"} <= set(shared["forbidden_modules"])
    top = {f"kvdepot.{p.stem}" for p in (ROOT / "kvdepot").glob("*.py") if p.stem != "__init__"}
    packages = {
        f"kvdepot.{p.parent.name}"
        for p in (ROOT / "kvdepot").glob("*/__init__.py")
        if p.parent.name not in ("apps", "proxy")
    }
    assert top | packages == set(shared["source_modules"])


def test_a_vllm_worker_loading_the_connector_loads_no_store_module() -> None:
    code = (
        "import sys\n"
        "import kvdepot.connector.vllm, kvdepot.connector.client\n"
        "from kvdepot.connector.transport import create_transport\n"
        "print(sorted(m for m in sys.modules if m.startswith('kvdepot.store')))\n"
    )
    try:
        import vllm  # noqa: F401
    except ImportError:
        code = code.replace("kvdepot.connector.vllm, ", "")  # the client and transports still
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
