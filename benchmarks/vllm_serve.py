"""kvdepot behind a real ``vllm serve``, measured with vLLM's own client.

Every engine is a real ``vllm serve`` (the CPU build here) started as a
process group on 127.0.0.1 with the kvdepot connector configured by
``--kv-transfer-config``; kvdepot is a real local cluster (a metadata service
and two store daemons, :class:`kvdepot.cluster.LocalCluster`); the load comes
from ``vllm bench serve`` run through the venv's ``vllm`` command. The model is
a random-weight Llama built here, saved with a word-level tokenizer trained on
nothing (token ``i`` is the word ``t<i>``, so text and token ids map one to one
and ``vllm bench serve``'s random datasets keep their exact lengths); the hub
is never asked (``HF_HUB_OFFLINE=1``).

Comparisons, each alternating its A and B within this run:

1. Connector overhead with nothing reused: random prompts (a fresh seed per
   round, the same seed for A and B), request throughput and TPOT p99 of a
   ``kv_both`` engine against plain vLLM.
2. Reuse beyond vLLM's own cache: a ``prefix_repetition`` workload sent to a
   ``kv_both`` engine, the engine restarted, the same workload again: TTFT of
   the second run over the first.
3. Multi-turn conversations (each turn's prompt is the history, answers
   included, plus a new question) with vLLM's own prefix cache emptied before
   every request (``/reset_prefix_cache``, so each turn meets a fresh engine):
   prompt tokens vLLM reports as loaded by the connector
   (``usage.prompt_tokens_details.cached_tokens`` and the engine's
   ``vllm:prompt_tokens_by_source{source="external_kv_transfer"}``) over the
   tokens available in principle (the history's KV in whole engine blocks,
   never the prompt's last token).
4. Disaggregated prefill/decode (a ``kv_producer`` and a ``kv_consumer``
   engine, one core each, behind ``kvdepot proxy``) against one colocated
   engine on both cores, long prompts arriving while others decode: TPOT
   p50/p99 and TTFT of both.
5. Prompt tokens the P/D decode engine recomputes per request (prompt tokens
   minus those it loaded: ``usage`` of requests through the proxy, and the
   decode engine's ``vllm:prompt_tokens_by_source{source="local_compute"}``
   over the benchmark's requests).

    python benchmarks/vllm_serve.py [--quick] [--json] [--plot FILE.png]

Needs vLLM (the CPU build works), ``aiohttp`` (the proxy) and ``tokenizers``;
matplotlib for ``--plot``. The float32 model runs eagerly (``--enforce-eager``):
bfloat16 matmuls fall back to a slow path on CPUs without AVX-512 BF16, and
``torch.compile`` adds minutes to every engine start.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

log = sys.stderr
VOCAB = 1024


@dataclass(frozen=True, slots=True)
class Plan:
    """Sizes of one run (``--quick`` or full)."""

    layers: int
    hidden: int
    rounds: int  # alternating A/B rounds of comparisons 1 and 4
    restart_pairs: int  # first run / restart / second run, comparison 2
    # 1: random prompts, nothing reused
    random_prompts: int
    random_input: int
    random_output: int
    concurrency: int
    # 2: prefix repetition
    prefix_prompts: int
    prefix_len: int
    suffix_len: int
    num_prefixes: int
    prefix_output: int
    # 3: multi-turn
    conversations: int
    turns: int
    first_turn: int
    question: int
    answer: int
    # 4: P/D vs colocated
    pd_prompts: int
    pd_input: int
    pd_output: int
    pd_rate: float
    # 5: direct requests through the proxy, prompt lengths
    pd_probe_lengths: tuple[int, ...]


QUICK = Plan(
    layers=4,
    hidden=512,
    rounds=1,
    restart_pairs=1,
    random_prompts=8,
    random_input=512,
    random_output=32,
    concurrency=4,
    prefix_prompts=6,
    prefix_len=1024,
    suffix_len=128,
    num_prefixes=2,
    prefix_output=4,
    conversations=2,
    turns=3,
    first_turn=300,
    question=60,
    answer=48,
    pd_prompts=6,
    pd_input=1024,
    pd_output=48,
    pd_rate=0.5,
    pd_probe_lengths=(700, 1001),
)

# The full run: a model large enough that prefill dominates, more rounds.
FULL = replace(
    QUICK,
    layers=8,
    hidden=1024,
    rounds=2,
    restart_pairs=2,
    turns=4,
    first_turn=400,
    question=80,
    answer=64,
    pd_output=64,
    pd_rate=0.125,
    pd_probe_lengths=(700, 1001, 1500),
)


# --------------------------------------------------------------------------- model


def build_model(path: Path, layers: int, hidden: int) -> Path:
    """A random Llama with a word-level tokenizer (``t<i>`` is token ``i``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.integration.vllm.engine import build_tiny_llama

    build_tiny_llama(path, layers=layers, hidden=hidden, heads=16, kv_heads=4)
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
    """The venv's ``vllm`` command (``python -m kvdepot.vllm_cli`` where the
    venv's script is missing)."""
    script = Path(sys.executable).parent / "vllm"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "kvdepot.vllm_cli"]


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
) -> Server:
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
        "uni",
        "--enable-prompt-tokens-details",
        "--seed",
        "0",
        "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
    ]
    if kv is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv)]
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            env=engine_env(work, cores),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
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


def start_proxy(procs: Processes, work: Path, prefill: Server, decode: Server) -> Server:
    from kvdepot.cluster import wait_ready

    log_path = work / "proxy.log"
    with open(log_path, "wb") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvdepot.cli",
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
        )
    server = procs.add(Server("proxy", proc, 0, log_path))
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
        rc = subprocess.run(
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


# --------------------------------------------------------------------------- comparisons


def ms(result: dict[str, Any], key: str) -> float:
    return float(result.get(key, 0.0)) / 1000.0


def compare_no_reuse(
    work: Path, model: Path, plan: Plan, plain: Server, kv: Server
) -> dict[str, Any]:
    print("1. connector overhead, nothing reused (random prompts)", file=log)
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "kv_both": []}
    for r in range(plan.rounds):
        order = [("plain", plain), ("kv_both", kv)]
        if r % 2:
            order.reverse()
        for name, server in order:
            args = random_args(
                plan.random_prompts,
                plan.random_input,
                plan.random_output,
                1000 + r,
                plan.concurrency,
            )
            runs[name].append(bench(work, server, model, f"noreuse-{name}-{r}", args))

    def agg(name: str, key: str) -> float:
        return statistics.median(float(x.get(key, 0.0)) for x in runs[name])

    thr = agg("kv_both", "request_throughput") / agg("plain", "request_throughput")
    tpot = agg("kv_both", "p99_tpot_ms") / agg("plain", "p99_tpot_ms")
    per_round = [
        {
            "round": i,
            "throughput_ratio": round(k["request_throughput"] / p["request_throughput"], 4),
            "tpot_p99_ratio": round(k["p99_tpot_ms"] / p["p99_tpot_ms"], 4),
        }
        for i, (p, k) in enumerate(zip(runs["plain"], runs["kv_both"], strict=True))
    ]
    return {
        "throughput_ratio_no_reuse": round(thr, 4),
        "tpot_p99_ratio_no_reuse": round(tpot, 4),
        "no_reuse_rounds": per_round,
        "no_reuse_plain_req_s": round(agg("plain", "request_throughput"), 4),
        "no_reuse_kv_both_req_s": round(agg("kv_both", "request_throughput"), 4),
        "no_reuse_plain_tpot_p99_s": round(agg("plain", "p99_tpot_ms") / 1000, 4),
        "no_reuse_kv_both_tpot_p99_s": round(agg("kv_both", "p99_tpot_ms") / 1000, 4),
        "no_reuse_plain_ttft_mean_s": round(agg("plain", "mean_ttft_ms") / 1000, 4),
        "no_reuse_kv_both_ttft_mean_s": round(agg("kv_both", "mean_ttft_ms") / 1000, 4),
    }


def prefix_args(plan: Plan, seed: int) -> list[str]:
    return [
        "--dataset-name",
        "prefix_repetition",
        "--prefix-repetition-prefix-len",
        str(plan.prefix_len),
        "--prefix-repetition-suffix-len",
        str(plan.suffix_len),
        "--prefix-repetition-num-prefixes",
        str(plan.num_prefixes),
        "--prefix-repetition-output-len",
        str(plan.prefix_output),
        "--num-prompts",
        str(plan.prefix_prompts),
        "--max-concurrency",
        "1",
        "--request-rate",
        "inf",
        "--seed",
        str(seed),
    ]


def multiturn(server: Server, meta: str, plan: Plan, block: int, seed: int) -> dict[str, Any]:
    """Conversations against an engine whose own cache is emptied before each turn."""
    import random

    print("3. multi-turn conversations, vLLM's cache emptied before every turn", file=log)
    rng = random.Random(seed)
    turns: list[dict[str, Any]] = []
    for c in range(plan.conversations):
        history: list[int] = []
        computed = 0  # tokens of the history whose KV the engine computed
        for t in range(plan.turns):
            new = plan.first_turn if t == 0 else plan.question
            prompt = history + [rng.randrange(3, VOCAB) for _ in range(new)]
            wait_saves_settled(meta)
            reset_prefix_cache(server)
            before = metrics(server)
            out = complete(server, prompt, plan.answer)
            after = metrics(server)
            choice = out["choices"][0]
            answer = list(choice.get("token_ids") or [])
            usage = out.get("usage") or {}
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            external = delta(
                after, before, "vllm:prompt_tokens_by_source_total[external_kv_transfer]"
            )
            # In principle: the history's KV (never the prompt's last token,
            # which the engine always computes), in whole engine blocks.
            avail_tokens = min(computed, len(prompt) - 1)
            avail_blocks = (avail_tokens // block) * block
            if t > 0:
                turns.append(
                    {
                        "conversation": c,
                        "turn": t + 1,
                        "prompt_tokens": len(prompt),
                        "available_tokens": avail_tokens,
                        "available_block_tokens": avail_blocks,
                        "cached_tokens": cached,
                        "external_tokens": int(external),
                    }
                )
                print(
                    f"  conversation {c} turn {t + 1}: prompt {len(prompt)}, "
                    f"from kvdepot {int(external)} (usage {cached}) of {avail_blocks} "
                    f"({avail_tokens} before block rounding)",
                    file=log,
                )
            history = prompt + answer
            # The last generated token was sampled, never fed back: no KV.
            computed = len(prompt) + len(answer) - 1
    got = sum(t["external_tokens"] for t in turns)
    avail = sum(t["available_block_tokens"] for t in turns)
    avail_all = sum(t["available_tokens"] for t in turns)
    return {
        "multiturn_hit_fraction": round(got / avail, 4) if avail else None,
        "multiturn_hit_fraction_of_all_history_tokens": round(got / avail_all, 4)
        if avail_all
        else None,
        "multiturn_tokens_from_kvdepot": got,
        "multiturn_tokens_available": avail,
        "multiturn_turns": turns,
    }


def pd_probe(
    proxy: Server, decode: Server, plain: Server, lengths: tuple[int, ...], seed: int
) -> list[dict[str, Any]]:
    """Requests through the proxy, one at a time: what the decode engine
    recomputed, and whether its greedy tokens are the plain engine's."""
    import random

    rng = random.Random(seed)
    rows = []
    for n in lengths:
        prompt = [rng.randrange(3, VOCAB) for _ in range(n)]
        before = metrics(decode)
        out = complete(proxy, prompt, 8)
        after = metrics(decode)
        reference = complete(plain, prompt, 8)["choices"][0].get("token_ids")
        usage = out.get("usage") or {}
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        local = delta(after, before, "vllm:prompt_tokens_by_source_total[local_compute]")
        external = delta(after, before, "vllm:prompt_tokens_by_source_total[external_kv_transfer]")
        rows.append(
            {
                "prompt_tokens": n,
                "decode_cached_tokens": cached,
                "decode_recomputed_tokens": n - cached,
                "decode_metrics_local_compute": int(local),
                "decode_metrics_external": int(external),
                "tokens_equal_plain": out["choices"][0].get("token_ids") == reference,
            }
        )
        print(
            f"  probe {n} tokens: decode loaded {cached} (metrics: external {int(external)}, "
            f"computed {int(local)}), recomputed {n - cached}; "
            f"tokens = plain engine's: {rows[-1]['tokens_equal_plain']}",
            file=log,
        )
    return rows


# --------------------------------------------------------------------------- main


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from kvdepot.cluster import LocalCluster

    plan = QUICK if args.quick else FULL
    chunk = args.chunk_tokens
    block = 128  # the CPU backend's default block size
    t_start = time.monotonic()
    model = build_model(work / "model", plan.layers, plan.hidden)
    print(
        f"model: {plan.layers} layers, hidden {plan.hidden}, float32; chunk {chunk} tokens; "
        f"vllm command: {' '.join(vllm_command())}",
        file=log,
    )
    result: dict[str, Any] = {
        "quick": bool(args.quick),
        "model": {
            "layers": plan.layers,
            "hidden": plan.hidden,
            "heads": 16,
            "kv_heads": 4,
            "vocab": VOCAB,
            "dtype": "float32",
        },
        "block_size": block,
        "chunk_tokens": chunk,
        "plan": {k: getattr(plan, k) for k in plan.__dataclass_fields__},
    }
    procs = Processes()
    try:
        with LocalCluster(
            nodes=2, capacity="3GiB", log_dir=work / "cluster", lease_ttl_s=120
        ) as cluster:
            meta = cluster.metadata_address
            both = "0-1"
            # 1. Plain and kv_both engines, both cores each, alternating.
            plain = start_engine(procs, work, "plain", model, cores=both, kv=None)
            warm(plain, 1)
            kv_first = start_engine(
                procs,
                work,
                "kv_both-0",
                model,
                cores=both,
                kv=kv_config("kv_both", meta, "store-0", chunk),
            )
            warm(kv_first, 2)
            result.update(compare_no_reuse(work, model, plan, plain, kv_first))
            # 2. Restart: first run, restart, second run.
            print("2. prefix repetition, engine restarted between the runs", file=log)
            pairs = []
            current = kv_first
            for i in range(plan.restart_pairs):
                seed = 2000 + i
                first = bench(work, current, model, f"restart-first-{i}", prefix_args(plan, seed))
                wait_saves_settled(meta)
                procs.stop(current)
                current = start_engine(
                    procs,
                    work,
                    f"kv_both-{i + 1}",
                    model,
                    cores=both,
                    kv=kv_config("kv_both", meta, "store-0", chunk),
                )
                warm(current, 10 + i)
                second = bench(work, current, model, f"restart-second-{i}", prefix_args(plan, seed))
                pairs.append(
                    {
                        "ttft_first_mean_s": round(ms(first, "mean_ttft_ms"), 4),
                        "ttft_second_mean_s": round(ms(second, "mean_ttft_ms"), 4),
                        "ttft_first_p50_s": round(ms(first, "median_ttft_ms"), 4),
                        "ttft_second_p50_s": round(ms(second, "median_ttft_ms"), 4),
                        "ratio_mean": round(second["mean_ttft_ms"] / first["mean_ttft_ms"], 4),
                    }
                )
            result["ttft_ratio_after_restart"] = round(
                statistics.median(p["ratio_mean"] for p in pairs), 4
            )
            result["restart_pairs"] = pairs
            # 3. Multi-turn on the last kv_both engine.
            result.update(multiturn(current, meta, plan, block, 3000))
            procs.stop(current)
            # 4. P/D behind the proxy against the colocated plain engine.
            print("4. P/D behind kvdepot proxy vs one colocated engine", file=log)
            prefill = start_engine(
                procs,
                work,
                "prefill",
                model,
                cores="0",
                kv=kv_config("kv_producer", meta, "store-0", chunk),
            )
            decode = start_engine(
                procs,
                work,
                "decode",
                model,
                cores="1",
                kv=kv_config("kv_consumer", meta, "store-1", chunk),
                prefix_caching=False,
            )
            proxy = start_proxy(procs, work, prefill, decode)
            warm(proxy, 4)
            runs: dict[str, list[dict[str, Any]]] = {"colocated": [], "pd": []}
            dec_before = metrics(decode)
            pd_requests = 0
            for r in range(plan.rounds):
                order = [("colocated", plain), ("pd", proxy)]
                if r % 2:
                    order.reverse()
                for name, server in order:
                    a = random_args(plan.pd_prompts, plan.pd_input, plan.pd_output, 4000 + r, 64)
                    a[a.index("--request-rate") + 1] = str(plan.pd_rate)
                    a += ["--burstiness", "1.0"]
                    runs[name].append(bench(work, server, model, f"{name}-{r}", a))
                    if name == "pd":
                        pd_requests += plan.pd_prompts
            dec_after = metrics(decode)

            def agg(name: str, key: str) -> float:
                return statistics.median(float(x.get(key, 0.0)) for x in runs[name]) / 1000

            for name in ("pd", "colocated"):
                result[f"{name}_tpot_p50_s"] = round(agg(name, "p50_tpot_ms"), 4)
                result[f"{name}_tpot_p99_s"] = round(agg(name, "p99_tpot_ms"), 4)
                result[f"{name}_ttft_mean_s"] = round(agg(name, "mean_ttft_ms"), 4)
                result[f"{name}_ttft_p50_s"] = round(agg(name, "p50_ttft_ms"), 4)
                result[f"{name}_ttft_p99_s"] = round(agg(name, "p99_ttft_ms"), 4)
                result[f"{name}_itl_p99_s"] = round(agg(name, "p99_itl_ms"), 4)
            # 5. Decode-side recompute.
            local = delta(
                dec_after, dec_before, "vllm:prompt_tokens_by_source_total[local_compute]"
            )
            ext = delta(
                dec_after, dec_before, "vllm:prompt_tokens_by_source_total[external_kv_transfer]"
            )
            result["pd_bench_decode_prompt_tokens_computed"] = int(local)
            result["pd_bench_decode_prompt_tokens_loaded"] = int(ext)
            result["pd_bench_decode_recomputed_tokens_mean"] = (
                round(local / pd_requests, 1) if pd_requests else None
            )
            probes = pd_probe(proxy, decode, plain, plan.pd_probe_lengths, 5000)
            result["pd_probes"] = probes
            result["pd_decode_recomputed_tokens_max"] = max(
                p["decode_recomputed_tokens"] for p in probes
            )
            result["kvdepot_cluster"] = cluster_stats(meta)
    finally:
        procs.stop_all()
    result["targets"] = {
        "throughput_ratio_no_reuse >= 0.97": result.get("throughput_ratio_no_reuse", 0) >= 0.97,
        "tpot_p99_ratio_no_reuse <= 1.05": result.get("tpot_p99_ratio_no_reuse", 9) <= 1.05,
        "ttft_ratio_after_restart <= 0.5": result.get("ttft_ratio_after_restart", 9) <= 0.5,
        "multiturn_hit_fraction >= 0.95": (result.get("multiturn_hit_fraction") or 0) >= 0.95,
        "pd_decode_recomputed_tokens_max < block_size": result.get(
            "pd_decode_recomputed_tokens_max", 1 << 30
        )
        < block,
    }
    result["wall_s"] = round(time.monotonic() - t_start, 1)
    return result


def plot(result: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=log)
        return False
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    ax = axes[0]
    names = [
        "throughput\n(kv_both/plain)",
        "TPOT p99\n(kv_both/plain)",
        "TTFT after\nrestart / first",
        "multi-turn\nhit fraction",
    ]
    vals = [
        result.get("throughput_ratio_no_reuse", 0),
        result.get("tpot_p99_ratio_no_reuse", 0),
        result.get("ttft_ratio_after_restart", 0),
        result.get("multiturn_hit_fraction") or 0,
    ]
    targets = [0.97, 1.05, 0.5, 0.95]
    ax.bar(range(len(vals)), vals, color=["#4c72b0", "#4c72b0", "#55a868", "#c44e52"])
    for i, t in enumerate(targets):
        ax.hlines(t, i - 0.4, i + 0.4, colors="black", linestyles="dashed")
    ax.set_xticks(range(len(vals)), names, fontsize=8)
    ax.set_title("ratios (dashed: targets)")
    ax = axes[1]
    keys = ["tpot_p50_s", "tpot_p99_s", "ttft_p50_s", "ttft_p99_s"]
    x = range(len(keys))
    ax.bar(
        [i - 0.2 for i in x],
        [result.get(f"colocated_{k}", 0) for k in keys],
        0.4,
        label="colocated (2 cores)",
    )
    ax.bar(
        [i + 0.2 for i in x],
        [result.get(f"pd_{k}", 0) for k in keys],
        0.4,
        label="P/D via kvdepot (1+1 cores)",
    )
    ax.set_xticks(list(x), [k.replace("_s", "") for k in keys], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("seconds")
    ax.set_title("P/D vs colocated")
    ax.legend(fontsize=8)
    ax = axes[2]
    probes = result.get("pd_probes", [])
    ax.bar(
        [str(p["prompt_tokens"]) for p in probes], [p["decode_recomputed_tokens"] for p in probes]
    )
    ax.axhline(result.get("block_size", 128), color="black", linestyle="dashed")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("tokens recomputed by decode")
    ax.set_title("P/D decode recompute (dashed: one block)")
    fig.suptitle(
        f"kvdepot + vllm serve (CPU), {result['model']['layers']} layers, "
        f"hidden {result['model']['hidden']}{' (quick)' if result.get('quick') else ''}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller model and workloads")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--plot", type=Path, default=None, metavar="FILE.png", help="write a plot")
    p.add_argument("--chunk-tokens", type=int, default=256, help="connector chunk (x128)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument(
        "--replot",
        type=Path,
        default=None,
        metavar="RESULT.json",
        help="only draw --plot from a saved --json result",
    )
    args = p.parse_args(argv)
    if args.replot is not None:
        if args.plot is None:
            p.error("--replot needs --plot")
        return 0 if plot(json.loads(args.replot.read_text()), args.plot) else 1
    work = Path(tempfile.mkdtemp(prefix="kvdepot-vllm-serve-"))
    try:
        result = run(args, work)
    except BaseException:
        print(f"failed; logs in {work}", file=log)
        raise
    if args.plot is not None:
        plot(result, args.plot)
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            if not isinstance(v, list | dict):
                print(f"{k:>44}: {v}")
        for k, ok in result["targets"].items():
            print(f"{k:>44}: {'met' if ok else 'NOT met'}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
