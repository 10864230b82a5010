"""The engines, proxy and load generator of ``benchmarks/vllm_serve.py``.

Real ``vllm serve`` processes (each in its own process group on 127.0.0.1),
``kvdepot proxy``, ``vllm bench serve`` through the venv's ``vllm``, their
HTTP and ``/metrics``, and the kvdepot cluster's counters. Every process
started here ends with the benchmark (``benchmarks/procs.py``; the engines
and the proxy get SIGTERM, so that vLLM stops its own engine processes).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.procs import popen  # noqa: E402
from benchmarks.procs import run as run_child  # noqa: E402

log = sys.stderr
VOCAB = 1024


# --------------------------------------------------------------------------- model


def build_model(path: Path, layers: int, hidden: int) -> Path:
    """A random Llama with a word-level tokenizer (``t<i>`` is token ``i``)."""
    from tests.integration.vllm.engine import build_tiny_llama

    build_tiny_llama(path, layers=layers, hidden=hidden, heads=16, kv_heads=4)
    return save_word_tokenizer(path)


def save_word_tokenizer(path: Path) -> Path:
    """Save beside a model the word-level tokenizer of ``build_model``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"t{i}": i for i in range(3, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(str(path))
    return path


# --------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def vllm_command() -> list[str]:
    """The venv's ``vllm`` command (``python -m kvdepot.apps.vllm_cli`` where the
    venv's script is missing)."""
    script = Path(sys.executable).parent / "vllm"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "kvdepot.apps.vllm_cli"]


def engine_env(work: Path, cores: str) -> dict[str, str]:
    from tests.integration.vllm.engine import engine_env as base

    env = base(work / "engine-tmp")
    # One compile/kernel cache for every engine of the run; cores by role.
    env.update(
        VLLM_CPU_OMP_THREADS_BIND=cores,
        VLLM_SERVER_DEV_MODE="1",  # /reset_prefix_cache
        VLLM_LOGGING_LEVEL="INFO",
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    return env


@dataclass
class Server:
    """A ``vllm serve`` (or the proxy) in its own process group."""

    name: str
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    started: float = field(default_factory=time.monotonic)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        # Children left in the group (engine core, workers).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def tail(self, n: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


class Processes:
    """Everything this run starts; all stopped at exit, also on failure."""

    def __init__(self) -> None:
        self.servers: list[Server] = []

    def add(self, s: Server) -> Server:
        self.servers.append(s)
        return s

    def stop(self, s: Server) -> None:
        s.stop()
        with contextlib.suppress(ValueError):
            self.servers.remove(s)

    def stop_all(self) -> None:
        for s in list(reversed(self.servers)):
            s.stop()
        self.servers.clear()


def kv_config(role: str, meta: str, node: str, chunk: int) -> dict[str, Any]:
    return {
        "kv_connector": "KVDepotConnector",
        "kv_connector_module_path": "kvdepot.connector.vllm",
        "kv_role": role,
        "kv_connector_extra_config": {"metadata": meta, "chunk_tokens": chunk, "node_id": node},
    }


def start_engine(
    procs: Processes,
    work: Path,
    name: str,
    model: Path,
    *,
    cores: str,
    kv: dict[str, Any] | None,
    prefix_caching: bool = True,
    max_model_len: int = 4096,
    tp: int = 1,
    block_size: int | None = None,
) -> Server:
    """A ``vllm serve`` of ``model``; ``cores`` as ``VLLM_CPU_OMP_THREADS_BIND``
    takes them (with ``tp`` ranks: one list per rank, ``"0|1"``)."""
    port = free_port()
    log_path = work / f"{name}.log"
    cmd = [
        *vllm_command(),
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        "model",
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        "16",
        "--distributed-executor-backend",
        "uni" if tp == 1 else "mp",
        "--tensor-parallel-size",
        str(tp),
        "--enable-prompt-tokens-details",
        "--seed",
        "0",
        "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
    ]
    if block_size is not None:
        cmd += ["--block-size", str(block_size)]
    if kv is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv)]
    with open(log_path, "wb") as out:
        proc = popen(
            cmd,
            env=engine_env(work, cores),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            death_signal=signal.SIGTERM,
        )
    server = procs.add(Server(name, proc, port, log_path))
    wait_http(server, 900)
    print(f"  {name} up in {time.monotonic() - server.started:.0f} s", file=log)
    return server


def wait_http(server: Server, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited:\n{server.tail()}")
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{server.name} not up within {timeout_s:.0f} s:\n{server.tail()}")


def start_proxy(
    procs: Processes, work: Path, prefill: Server, decode: Server, name: str = "proxy"
) -> Server:
    from kvdepot.apps.cluster import wait_ready

    log_path = work / f"{name}.log"
    with open(log_path, "wb") as err:
        proc = popen(
            [
                sys.executable,
                "-m",
                "kvdepot.apps.cli",
                "proxy",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--prefill",
                prefill.url,
                "--decode",
                decode.url,
            ],
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            death_signal=signal.SIGTERM,
        )
    server = procs.add(Server(name, proc, 0, log_path))
    server.port = int(wait_ready(proc, "proxy", 60)["port"])
    return server


# --------------------------------------------------------------------------- HTTP


def post(url: str, body: dict[str, Any], timeout_s: float = 600) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        raw = r.read()
    out: dict[str, Any] = json.loads(raw) if raw.strip() else {}
    return out


def complete(server: Server, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One greedy completion of token ids; the answer's ids and usage."""
    out = post(
        server.url + "/v1/completions",
        {
            "model": "model",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    return out


def reset_prefix_cache(server: Server) -> None:
    req = urllib.request.Request(server.url + "/reset_prefix_cache", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()


_METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([0-9.eE+-]+|NaN)$")


def metrics(server: Server) -> dict[str, float]:
    """The engine's Prometheus counters, summed over labels except ``source``."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        src = re.search(r'source="([^"]*)"', labels)
        le = re.search(r'le="([^"]*)"', labels)
        key = name + (f"[{src.group(1)}]" if src else "") + (f"[le={le.group(1)}]" if le else "")
        with contextlib.suppress(ValueError):
            out[key] = out.get(key, 0.0) + float(value)
    return out


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


# --------------------------------------------------------------------------- cluster


def cluster_stats(meta: str) -> dict[str, float]:
    from kvdepot.connector.client import ClientConfig, KVDepotClient

    with KVDepotClient(ClientConfig(metadata=meta)) as client:
        s = client.stats()
    return {"hit_tokens": s.hit_tokens, "puts_committed": s.puts_committed}


def wait_saves_settled(meta: str, quiet_s: float = 1.5, timeout_s: float = 60) -> None:
    """Until the cluster's committed puts stop growing (saves run behind the engine)."""
    deadline = time.monotonic() + timeout_s
    last = cluster_stats(meta)["puts_committed"]
    since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = cluster_stats(meta)["puts_committed"]
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return


# --------------------------------------------------------------------------- vllm bench serve


def bench(
    work: Path,
    server: Server,
    model: Path,
    name: str,
    args: list[str],
) -> dict[str, Any]:
    """One ``vllm bench serve`` run; its saved result."""
    out_dir = work / "bench"
    out_dir.mkdir(exist_ok=True)
    cmd = [
        *vllm_command(),
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        server.url,
        "--endpoint",
        "/v1/completions",
        "--model",
        "model",
        "--tokenizer",
        str(model),
        "--served-model-name",
        "model",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--ignore-eos",
        "--temperature",
        "0",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(out_dir),
        "--result-filename",
        f"{name}.json",
        *args,
    ]
    env = engine_env(work, "0-1")
    t0 = time.monotonic()
    with open(work / f"bench-{name}.log", "wb") as out:
        rc = run_child(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=1800, check=False
        ).returncode
    text = (work / f"bench-{name}.log").read_text(errors="replace")
    if rc != 0:
        raise RuntimeError(f"vllm bench serve {name} failed ({rc}):\n{text[-3000:]}")
    result: dict[str, Any] = json.loads((out_dir / f"{name}.json").read_text())
    failed = result.get("failed", 0)
    if failed:
        raise RuntimeError(f"vllm bench serve {name}: {failed} requests failed:\n{text[-3000:]}")
    print(
        f"  bench {name}: {result.get('completed')} requests, "
        f"{result.get('request_throughput', 0):.3f} req/s, "
        f"TTFT mean {result.get('mean_ttft_ms', 0):.0f} ms, "
        f"TPOT p99 {result.get('p99_tpot_ms', 0):.1f} ms ({time.monotonic() - t0:.0f} s)",
        file=log,
    )
    return result


def random_args(prompts: int, inp: int, out: int, seed: int, concurrency: int) -> list[str]:
    return [
        "--dataset-name",
        "random",
        "--random-input-len",
        str(inp),
        "--random-output-len",
        str(out),
        "--random-range-ratio",
        "0",
        "--num-prompts",
        str(prompts),
        "--max-concurrency",
        str(concurrency),
        "--request-rate",
        "inf",
        "--seed",
        str(seed),
    ]


def warm(server: Server, seed: int) -> None:
    """First requests pay for allocation and kernel selection: not measured."""
    import random

    rng = random.Random(seed)
    for n in (300, 40):
        complete(server, [rng.randrange(3, VOCAB) for _ in range(n)], 4)
