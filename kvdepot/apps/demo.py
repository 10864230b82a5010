"""``kvdepot demo``: prefill publishes, decode pulls, in separate OS processes.

The workload is a set of prompts that share a few system prompts. A prefill
process publishes the KV chunks of every prompt (the shared prefixes are sent
once and deduplicated after that); a decode process then looks up and pulls
the prompts, plus new prompts that share only the system prompt, and checks
every byte against what the prefill process published. Chunk bytes are a
pure function of the chunk key, so both sides derive them independently.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvdepot.config import parse_size
from kvdepot.errors import InvalidArgument, KVDepotError
from kvdepot.rpc.security_config import NO_SECURITY, SecurityConfig, child_args, load_security

CHUNK_TOKENS = 256
NAMESPACE_MODEL = "kvdepot-demo/tiny-llama"


@dataclass(frozen=True, slots=True)
class DemoOptions:
    """Shape of the demo workload and where it runs."""

    prompts: int = 16
    shared_prefixes: int = 4
    prefix_chunks: int = 4
    suffix_chunks: int = 2
    chunk_bytes: str = "1MiB"
    nodes: int = 2
    metadata: str = ""
    progress: bool = False

    def __post_init__(self) -> None:
        if min(self.prompts, self.shared_prefixes, self.prefix_chunks, self.nodes) < 1:
            raise InvalidArgument("prompts, shared prefixes, prefix chunks and nodes must be >= 1")
        if self.suffix_chunks < 0:
            raise InvalidArgument("suffix chunks must not be negative")
        if not 1 <= parse_size(self.chunk_bytes) <= 256 << 20:
            raise InvalidArgument("chunk bytes must be between 1 B and 256 MiB")


def _tokens(seed: int, chunks: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 32000, size=chunks * CHUNK_TOKENS, dtype=np.uint32)


def workload(o: DemoOptions, novel: bool) -> list[np.ndarray]:
    """Prompts as token arrays: published ones, or new ones (``novel``)."""
    systems = [_tokens(10_000 + j, o.prefix_chunks) for j in range(o.shared_prefixes)]
    count = o.shared_prefixes if novel else o.prompts
    base = 50_000 if novel else 20_000
    return [
        np.concatenate([systems[i % o.shared_prefixes], _tokens(base + i, o.suffix_chunks)])
        for i in range(count)
    ]


def chunk_payload(key: bytes, size: int) -> np.ndarray:
    """The demo's stand-in for a chunk's KV bytes: a function of the key only."""
    rng = np.random.default_rng(int.from_bytes(key, "little"))
    return np.frombuffer(rng.bytes(size), dtype=np.uint8)


def _progress(enabled: bool, role: str, done: int, total: int) -> None:
    if enabled:
        end = "\n" if done == total else ""
        sys.stderr.write(f"\r[{role}] {done}/{total} prompts{end}")
        sys.stderr.flush()


def _client(metadata: str, node_id: str, security: SecurityConfig | None) -> Any:
    from kvdepot.connector.client import ClientConfig, KVDepotClient

    return KVDepotClient(
        ClientConfig(
            metadata=metadata,
            node_id=node_id,
            tokens_per_chunk=CHUNK_TOKENS,
            security=security or NO_SECURITY,
        )
    )


def run_prefill(
    o: DemoOptions, metadata: str, node_id: str, security: SecurityConfig | None = None
) -> dict[str, Any]:
    """Publish every prompt's chunks; returns counts and timings."""
    from kvdepot.keys import Namespace, chunk_keys

    ns = Namespace(NAMESPACE_MODEL, chunk_tokens=CHUNK_TOKENS)
    size = parse_size(o.chunk_bytes)
    stored = skipped = failed = sent = saved = 0
    busy = 0.0
    prompts = workload(o, novel=False)
    with _client(metadata, node_id, security) as client:
        for i, tokens in enumerate(prompts):
            keys = chunk_keys(ns, tokens)
            buffers = [chunk_payload(k, size) for k in keys]
            t0 = time.perf_counter()
            r = client.put(keys, buffers)
            busy += time.perf_counter() - t0
            stored += r.stored
            skipped += r.skipped
            failed += r.failed
            sent += r.bytes_sent
            saved += r.bytes_skipped
            _progress(o.progress, "prefill", i + 1, len(prompts))
    return {
        "stored": stored,
        "skipped": skipped,
        "failed": failed,
        "bytes_sent": sent,
        "bytes_saved": saved,
        "put_gbps": sent / busy / 1e9 if busy else 0.0,
    }


def run_decode(
    o: DemoOptions, metadata: str, node_id: str, security: SecurityConfig | None = None
) -> dict[str, Any]:
    """Look up and pull every prompt (and new ones); verify every byte."""
    from kvdepot.keys import Namespace, chunk_keys

    ns = Namespace(NAMESPACE_MODEL, chunk_tokens=CHUNK_TOKENS)
    size = parse_size(o.chunk_bytes)
    requests = [(p, True) for p in workload(o, novel=False)]
    requests += [(p, False) for p in workload(o, novel=True)]
    total_chunks = hit_chunks = received = mismatched = 0
    full_hits_expected = full_hits = 0
    busy = 0.0
    with _client(metadata, node_id, security) as client:
        for i, (tokens, published) in enumerate(requests):
            keys = chunk_keys(ns, tokens)
            buffers = [np.empty(size, dtype=np.uint8) for _ in keys]
            t0 = time.perf_counter()
            r = client.get_into(keys, buffers)
            busy += time.perf_counter() - t0
            hits = r.leading
            for k, buf in zip(keys[:hits], buffers[:hits], strict=True):
                if not np.array_equal(buf, chunk_payload(k, size)):
                    mismatched += 1
            total_chunks += len(keys)
            hit_chunks += hits
            received += r.bytes_received
            if published:
                full_hits_expected += 1
                full_hits += hits == len(keys)
            _progress(o.progress, "decode", i + 1, len(requests))
    return {
        "requests": len(requests),
        "total_chunks": total_chunks,
        "hit_chunks": hit_chunks,
        "bytes_received": received,
        "mismatched_chunks": mismatched,
        "published_prompts_fully_hit": full_hits,
        "published_prompts": full_hits_expected,
        "get_gbps": received / busy / 1e9 if busy else 0.0,
    }


def _worker(
    role: str, o: DemoOptions, metadata: str, node_id: str, security_args: list[str]
) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "kvdepot.apps.demo",
        role,
        "--options",
        json.dumps(asdict(o)),
        "--metadata",
        metadata,
        "--node-id",
        node_id,
        *security_args,
    ]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, check=False, timeout=600)
    if proc.returncode != 0:
        raise KVDepotError(f"demo {role} process failed with status {proc.returncode}")
    result: dict[str, Any] = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    return result


def _node_ids(metadata: str, security: SecurityConfig) -> list[str]:
    with _client(metadata, "", security) as client:
        return [n.node_id for n in client.stats().nodes]


def run_demo(o: DemoOptions, security: SecurityConfig | None = None) -> dict[str, Any]:
    """Run the demo (starting a local cluster unless ``o.metadata`` is set).

    ``security`` is the cluster's token and TLS (a cluster the demo starts
    requires them too); the worker processes get it without a secret on
    their command lines.
    """
    from kvdepot.apps.cluster import LocalCluster

    security = security or NO_SECURITY
    started = time.perf_counter()
    cluster: LocalCluster | None = None
    private = Path(tempfile.mkdtemp(prefix="kvdepot-demo-secrets-"))
    try:
        if o.metadata:
            metadata = o.metadata
        else:
            logs = Path(tempfile.mkdtemp(prefix="kvdepot-demo-"))
            per_node = max(
                64 << 20,
                2
                * parse_size(o.chunk_bytes)
                * o.prompts
                * (o.prefix_chunks + o.suffix_chunks)
                // o.nodes,
            )
            cluster = LocalCluster(
                nodes=o.nodes, capacity=str(per_node), log_dir=logs, security=security
            ).start()
            metadata = cluster.metadata_address
        nodes = _node_ids(metadata, security)
        if not nodes:
            raise KVDepotError(f"no store nodes registered at {metadata}")
        flags = child_args(security, private)
        prefill = _worker("prefill", o, metadata, nodes[0], flags)
        decode = _worker("decode", o, metadata, nodes[-1], flags)
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(private, ignore_errors=True)
    verified = (
        decode["mismatched_chunks"] == 0
        and prefill["failed"] == 0
        and decode["published_prompts_fully_hit"] == decode["published_prompts"]
    )
    return {
        "chunks_published": prefill["stored"],
        "chunks_deduplicated": prefill["skipped"],
        "bytes_transferred": prefill["bytes_sent"] + decode["bytes_received"],
        "bytes_saved": prefill["bytes_saved"],
        "prefix_hit_rate": decode["hit_chunks"] / max(1, decode["total_chunks"]),
        "verified": verified,
        "prompts_published": o.prompts,
        "decode_requests": decode["requests"],
        "chunks_pulled": decode["hit_chunks"],
        "chunks_looked_up": decode["total_chunks"],
        "mismatched_chunks": decode["mismatched_chunks"],
        "chunk_bytes": parse_size(o.chunk_bytes),
        "chunk_tokens": CHUNK_TOKENS,
        "nodes": len(nodes),
        "metadata": metadata,
        "put_gbps": round(prefill["put_gbps"], 3),
        "get_gbps": round(decode["get_gbps"], 3),
        "elapsed_s": round(time.perf_counter() - started, 2),
    }


def render_summary(s: dict[str, Any]) -> str:
    """Human-readable demo summary."""
    from kvdepot.apps.stats import human_bytes

    lines = [
        f"kvdepot demo on {s['nodes']} store nodes (metadata {s['metadata']})",
        f"  prefill published {s['prompts_published']} prompts: "
        f"{s['chunks_published']} chunks stored, {s['chunks_deduplicated']} deduplicated "
        f"({human_bytes(s['bytes_saved'])} never sent), put {s['put_gbps']:.2f} GB/s",
        f"  decode pulled {s['chunks_pulled']}/{s['chunks_looked_up']} chunks for "
        f"{s['decode_requests']} prompts: prefix hit rate {100 * s['prefix_hit_rate']:.1f}%, "
        f"get {s['get_gbps']:.2f} GB/s",
        f"  bytes transferred {human_bytes(s['bytes_transferred'])}, "
        f"every pulled byte verified: {'yes' if s['verified'] else 'NO'}",
        f"  done in {s['elapsed_s']:.1f} s",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvdepot.apps.demo")
    p.add_argument("role", choices=["prefill", "decode"])
    p.add_argument("--options", required=True)
    p.add_argument("--metadata", required=True)
    p.add_argument("--node-id", default="")
    p.add_argument("--auth-token-file", default=None)
    for flag in ("--tls-cert", "--tls-key", "--tls-ca", "--tls-server-name"):
        p.add_argument(flag, default=None)
    p.add_argument("--tls", action="store_true")
    p.add_argument("--tls-client-auth", action="store_true")
    args = p.parse_args(argv)
    o = DemoOptions(**json.loads(args.options))
    run = run_prefill if args.role == "prefill" else run_decode
    try:
        security = load_security(
            os.environ,
            None,
            {
                "auth_token_file": args.auth_token_file,
                "tls": args.tls or None,
                "tls_cert": args.tls_cert,
                "tls_key": args.tls_key,
                "tls_ca": args.tls_ca,
                "tls_client_auth": args.tls_client_auth or None,
                "tls_server_name": args.tls_server_name,
            },
        )
        result = run(o, args.metadata, args.node_id, security)
    except KVDepotError as exc:
        print(f"kvdepot demo {args.role}: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
