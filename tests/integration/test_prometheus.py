"""kvdepot in Prometheus: the rules under promtool, and a real Prometheus server
scraping a local cluster and a ``vllm serve`` engine running the connector.

The connector's counters reach Prometheus through vLLM's own ``/metrics``
(vLLM's KV-connector metrics hook), not its log lines; they must agree with
what vLLM says it loaded (``vllm:prompt_tokens_by_source``, source
``external_kv_transfer``) and with the stores' own reads.
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvdepot.apps.cluster import LocalCluster

pytestmark = pytest.mark.integration

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (`make system-deps` installs Debian's prometheus)")
    return path


def test_alerting_rules_pass_their_unit_tests() -> None:
    promtool = _tool("promtool")
    for args in (
        ["check", "config", "prometheus.yml"],
        ["test", "rules", "rules_test.yml"],
    ):
        r = subprocess.run(
            [promtool, *args], cwd=RULES, capture_output=True, text=True, check=False
        )
        assert r.returncode == 0, r.stdout + r.stderr


# --------------------------------------------------------- a real server
class Prometheus:
    """A Prometheus server on a free loopback port, its TSDB in a temp dir."""

    def __init__(self, tmp: Path, jobs: dict[str, list[str]]) -> None:
        from tests.conftest import free_port

        self.port = free_port()
        scrape = [
            {"job_name": job, "static_configs": [{"targets": targets}]}
            for job, targets in jobs.items()
        ]
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES / "kvdepot-rules.yml")],
            "scrape_configs": scrape,
        }
        # JSON is YAML: no YAML writer needed.
        (tmp / "prometheus.yml").write_text(json.dumps(config))
        self.log = tmp / "prometheus.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    _tool("prometheus"),
                    f"--config.file={tmp / 'prometheus.yml'}",
                    f"--storage.tsdb.path={tmp / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        self.wait(lambda: self._get("/-/ready") is not None, "Prometheus is not ready")

    def _get(self, path: str) -> Any:
        assert self.proc.poll() is None, f"prometheus exited: {self.log.read_text()[-2000:]}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                body = r.read()
        except OSError:
            return None
        return json.loads(body) if path.startswith("/api/") else body

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query's vector: [{"metric": labels, "value": float}]."""
        reply = self._get("/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
        assert reply is not None and reply["status"] == "success", (promql, reply)
        return [
            {"metric": r["metric"], "value": float(r["value"][1])} for r in reply["data"]["result"]
        ]

    def value(self, promql: str) -> float | None:
        """The single value of a query, or None when it has none (yet)."""
        rows = self.query(promql)
        assert len(rows) <= 1, (promql, rows)
        return rows[0]["value"] if rows else None

    def rules(self) -> list[dict[str, Any]]:
        reply = self._get("/api/v1/rules")
        return [r for g in reply["data"]["groups"] for r in g["rules"]]

    def wait(self, ok: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not ok():
            assert time.monotonic() < deadline, what
            time.sleep(0.25)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A cluster with /metrics, a ``vllm serve`` engine with the connector, and
    Prometheus scraping all of them."""
    _tool("prometheus")
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvdepot[vllm]')")
    from tests.integration.vllm.engine import build_tiny_llama
    from tests.integration.vllm.test_connector import kv
    from tests.integration.vllm.test_proxy import free_port, serve, wait_http

    tmp = tmp_path_factory.mktemp("prometheus")
    model = str(build_tiny_llama(tmp / "model"))
    cluster = LocalCluster(
        nodes=1,
        capacity="128MiB",
        log_dir=tmp / "logs",
        lease_ttl_s=60,
        heartbeat_interval_s=1,
        metrics=True,
    )
    cluster.start()
    port = free_port()
    # Only this test's requests reach the engine: CI once saw it count 40
    # requests' worth of loaded tokens for the 2 this test sends.
    key = secrets.token_hex(16)
    proc = serve(
        model,
        port,
        kv(
            "kv_both", cluster.metadata_address, cluster.stores[0].info["node_id"], chunk_tokens=256
        ),
        tmp,
        "engine",
        "--enforce-eager",
        "--api-key",
        key,
    )
    prom: Prometheus | None = None
    try:
        assert cluster.metadata is not None
        jobs = {
            "kvdepot-metadata": [f"127.0.0.1:{cluster.metadata.info['metrics_port']}"],
            "kvdepot-store": [f"127.0.0.1:{s.info['metrics_port']}" for s in cluster.stores],
            "vllm": [f"127.0.0.1:{port}"],
        }
        prom = Prometheus(tmp, jobs)
        wait_http(f"http://127.0.0.1:{port}/health", proc, 600)
        yield {
            "url": f"http://127.0.0.1:{port}",
            "model": model,
            "key": key,
            "log": tmp / "engine.out",
            "cluster": cluster,
            "prom": prom,
        }
    finally:
        if prom is not None:
            prom.stop()
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        cluster.stop()


def _complete(served: dict[str, Any], ids: list[int]) -> None:
    body = {"model": served["model"], "prompt": ids, "max_tokens": 4, "temperature": 0.0}
    req = urllib.request.Request(
        served["url"] + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {served['key']}"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        assert r.status == 200


def _requests_logged(served: dict[str, Any]) -> list[str]:
    """The completion requests the engine's access log shows, client and status."""
    text = Path(served["log"]).read_text(errors="replace")
    return [ln.split("INFO:", 1)[-1].strip() for ln in text.splitlines() if "POST /v1/" in ln]


def _engine_metric(served: dict[str, Any], name: str) -> float:
    """A sample of the engine's own /metrics, read directly."""
    with urllib.request.urlopen(served["url"] + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_prometheus_reads_the_connectors_and_the_daemons_series(served: dict[str, Any]) -> None:
    prom: Prometheus = served["prom"]
    cluster: LocalCluster = served["cluster"]
    ids = np.random.default_rng(5).integers(1, 1000, 700).tolist()
    # A request without the engine's key is refused, so no other client counts here.
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(urllib.request.Request(served["url"] + "/v1/models"), timeout=10)
    assert refused.value.code == 401
    _complete(served, ids)  # computed, then published
    from tests.integration.vllm.test_serving import wait_published

    wait_published(cluster, 2)
    _complete(served, ids)  # loaded from kvdepot (vLLM's own prefix cache is off)

    loaded = "vllm:kvdepot_loaded_tokens_total"
    direct = _engine_metric(served, loaded)
    assert direct > 0, "the engine's /metrics shows no loaded tokens"
    prom.wait(lambda: prom.value(f"sum({loaded})") == direct, "Prometheus never scraped them")

    # Every target up; the daemons serving.
    assert {r["metric"]["job"]: r["value"] for r in prom.query("up")} == {
        "kvdepot-metadata": 1.0,
        "kvdepot-store": 1.0,
        "vllm": 1.0,
    }
    assert [r["value"] for r in prom.query("kvdepot_serving")] == [1.0, 1.0]

    # Served tokens are what vLLM itself counts as loaded from outside.
    external = prom.value('sum(vllm:prompt_tokens_by_source_total{source="external_kv_transfer"})')
    assert external == direct, (external, direct, _requests_logged(served))
    # Held when asked is at least what was served.
    held_q = 'kvdepot_cluster_lookup_tokens_total{result="hit"}'
    prom.wait(lambda: (prom.value(held_q) or 0) >= direct, "held tokens never reached served")
    # The stores served the load from what the engine had saved, each object
    # read once: no more hits than chunks put, no misses.
    # (The stores are scraped apart from the engine: a scrape may lag it.)
    prom.wait(
        lambda: (prom.value("sum(kvdepot_store_tier_hits_total)") or 0) > 0,
        "Prometheus never scraped the stores' hits",
    )
    hits = prom.value("sum(kvdepot_store_tier_hits_total)")
    puts = prom.value("sum(kvdepot_store_puts_total)")
    assert hits is not None and puts is not None and 0 < hits <= puts, (hits, puts)
    assert prom.value("sum(kvdepot_store_get_misses_total)") == 0
    assert prom.value("sum(vllm:kvdepot_saved_objects_total)")
    committed = "kvdepot_cluster_puts_committed_total"
    prom.wait(
        lambda: prom.value(committed) == prom.value("sum(kvdepot_store_puts_total)"),
        "the index did not commit every chunk the store took",
    )
    assert prom.value("sum(vllm:kvdepot_loads_total)") == 1
    assert prom.value("sum(vllm:kvdepot_lookups_total)") == 2
    assert prom.value('sum(vllm:kvdepot_lookup_failures_total{reason="deadline"})') == 0

    # The deployment's rules load and evaluate against these series; nothing fires.
    prom.wait(
        lambda: all(r["health"] == "ok" for r in prom.rules()),
        "the rules did not all evaluate cleanly",
    )
    firing = [r["name"] for r in prom.rules() if r.get("state") == "firing"]
    assert firing == [], firing
