"""The model's identity on real vLLM engines (CPU build): engines that load
one model by different paths share its KV (connector/vllm/model_identity.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvdepot.apps.cluster import LocalCluster

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvdepot[vllm]')")

from .engine import build_tiny_llama, engine_env
from .test_connector import CHUNK, PROMPT_A, PROMPT_B, ROOT, kv, same, spec

pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.timeout(600)]

NAMESPACE = re.compile(
    r"KVDepotConnector \((\w+), (\w+)\).*; namespace ([0-9a-f]{32}) = model (\S+) "
)


def start(workdir: Path, spec: dict[str, Any], name: str) -> subprocess.Popen[str]:
    """One engine process over ``spec``, at INFO (the connector's start-up lines)."""
    spec_path = workdir / f"{name}.json"
    spec_path.write_text(json.dumps(spec))
    env = engine_env(workdir / f"{name}-tmp")
    env["VLLM_LOGGING_LEVEL"] = "INFO"
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integration.vllm.engine", str(spec_path)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def result(workdir: Path, proc: subprocess.Popen[str], name: str) -> tuple[dict[str, Any], str]:
    """The engine's result and its log."""
    try:
        out, err = proc.communicate(timeout=400)
    finally:
        proc.kill()
    (workdir / f"{name}.log").write_text(out + err)  # vLLM logs to stdout
    for line in out.splitlines():
        if line.startswith("KVDEPOT RESULT "):
            return json.loads(line[len("KVDEPOT RESULT ") :]), out + err
    raise AssertionError(f"engine {name} failed ({proc.returncode}):\n{err[-3000:]}")


def test_engines_given_a_relative_and_an_absolute_path_share_the_kv(
    tmp_path: Path, cluster: LocalCluster
) -> None:
    model = build_tiny_llama(tmp_path / "models" / "tiny-llama")
    relative = os.path.relpath(model, ROOT)  # the engines run in ROOT
    assert not Path(relative).is_absolute()
    link = tmp_path / "link-to-tiny-llama"
    link.symlink_to(model, target_is_directory=True)
    meta = cluster.metadata_address
    prompts = [PROMPT_A, PROMPT_B]

    # The reference beside the producer: the 2-core host starts two engines
    # in about the time of one.
    plain_proc = start(tmp_path, spec(str(link), prompts, None), "plain")
    prod_proc = start(
        tmp_path, spec(relative, prompts, kv("kv_producer", meta, "store-0")), "producer"
    )
    prod, prod_log = result(tmp_path, prod_proc, "producer")
    plain = result(tmp_path, plain_proc, "plain")[0]["outputs"]
    # 3 chunks and 3 tail units of 32 tokens (A's 1, B's 2)
    assert prod["connector"]["chunks_saved"] == 3 + 3, prod["connector"]
    cons, cons_log = result(
        tmp_path,
        start(tmp_path, spec(str(model), prompts, kv("kv_consumer", meta, "store-1")), "consumer"),
        "consumer",
    )
    c = cons["connector"]
    # Everything the producer stored is found under the other path.
    assert c["chunks_loaded"] == 2 + 3 and c["tokens_hit"] == 5 * CHUNK, c
    assert c["load_errors"] == 0, c
    for got, want in zip(cons["outputs"], plain, strict=True):
        assert same(got, want), (got, want)

    # Each side logs its namespace in one line; both sides' lines agree.
    lines = [m.groups() for m in NAMESPACE.finditer(prod_log + cons_log)]
    roles = {(role, kv_role) for role, kv_role, _, _ in lines}
    assert {("SCHEDULER", "kv_producer"), ("SCHEDULER", "kv_consumer")} <= roles, lines
    assert {("WORKER", "kv_producer"), ("WORKER", "kv_consumer")} <= roles, lines
    assert len({(ns, m) for _, _, ns, m in lines}) == 1, lines
    assert lines[0][3].startswith("model-v1:"), lines
    assert relative not in cons_log and str(model) not in lines[0][3]
