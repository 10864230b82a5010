"""The import rules of pyproject.toml's ``[tool.importlinter]``, checked with lint-imports.

Held now: the shared layer (errors, grpc_errors, registry, endpoints, records,
record_wire, config, security, auth, health, request_guard, metrics, logs,
shutdown, repeat_log: every module directly in kvdepot/) imports nothing of
metadata, store or connector, nor of the applications (kvdepot.apps: the
command, local cluster, demo, certs, stats; kvdepot.proxy: the proxy and its
router); store, metadata, connector and proto import no application; the
store imports no connector; the metadata service imports neither the store nor
the connector; kvdepot.errors imports no gRPC.

Still to be moved before the rest of issue 18's rules can be contracts (they
are not claimed, and nothing is ignored to make the ones above pass):

- the connector imports the store's wire modules (store/protocol.py,
  sockets.py, handshake.py, xxh3.py, host.py, nixl_agent.py) and
  connector/vllm imports store/chunks.py: the data-plane wire package both
  ends import is not there yet, so "connector -> shared layer only" and "a
  vLLM worker loads no kvdepot.store module" do not hold;
- metadata/keys.py, the types and the lookup packing are imported by store
  and connector: they are the shared vocabulary but still live in metadata/,
  so "store and connector never import metadata" does not hold.
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
    assert top == set(shared["source_modules"])
