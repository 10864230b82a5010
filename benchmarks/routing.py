"""KV-aware routing vs round-robin on a simulated disaggregated fleet.

The fleet is 4 prefill and 4 decode engines, each tied to its own store node
(8 nodes) of kvdepot's real index (the embedded ``memory://`` backend, driven
directly: ``put_end`` commits, ``remove_replicas`` evictions, ``lookup``) and
scored by the real routing code (:mod:`kvdepot.metadata.routing`, the same
functions the ``Route`` RPC runs). Nothing is computed on a GPU: engine time
is modelled with the constants below.

Workload: multi-turn chats. Each conversation starts with one of a few shared
system prompts; each turn appends a user message; the engine's reply is
appended before the next turn (its KV is not published: only prefill
publishes). Turns of a conversation are ``think`` seconds apart and
conversations start at random times, so requests of many chats interleave.

Per request, for both policies:

1. the prefill engine is chosen (round-robin, or the best ``Route`` score with
   its in-flight requests as load); of the prompt's chunks it finds the
   leading cached run on its own node (local), on other nodes (pulled over the
   network, then replicated to its node as the connector does) and computes
   the rest, which it publishes to its own node;
2. the decode engine is chosen the same way (after the prefill's commit) and
   loads the whole prompt KV: pulled from other nodes, replicated locally.

Each node keeps at most ``--node-chunks`` chunks (LRU); evictions are
reported to the index. Recomputed prefix tokens are tokens of full chunks that
some prefill had already computed and published but that the chosen engine
did not find (evicted everywhere): exactly what caching is supposed to save.

Estimated TTFT = queueing at the prefill engine + prefill compute of the
uncached tokens + pulls by the prefill + the decode's pull of the prompt KV:

    compute  = tokens / PREFILL_TOKENS_PER_S
    pull     = bytes / LINK_BYTES_PER_S         (another node)
    load     = bytes / LOCAL_BYTES_PER_S        (own node)

Usage::

    python benchmarks/routing.py [--quick] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvdepot.keys import ChunkKey, Namespace, chunk_keys
from kvdepot.metadata.index import IndexBackend, IndexConfig, create_backend
from kvdepot.metadata.routing import Candidate, RoutingWeights, best, score_candidates
from kvdepot.records import TierStats
from kvdepot.types import NodeInfo

# -- model constants (an 8B-class model in bf16 on one accelerator each) -------
CHUNK_TOKENS = 256
KV_BYTES_PER_TOKEN = 128 << 10  # 32 layers x 8 KV heads x 128 dims x 2 (K,V) x 2 B
CHUNK_BYTES = CHUNK_TOKENS * KV_BYTES_PER_TOKEN  # 32 MiB
PREFILL_TOKENS_PER_S = 10_000.0
LINK_BYTES_PER_S = 12.5e9  # 100 Gb/s between nodes
LOCAL_BYTES_PER_S = 50e9  # own node: shared memory / PCIe
LOAD_PENALTY_S = 0.1  # routing: seconds per in-flight request at an engine
ENGINES = 4  # of each role

WEIGHTS = RoutingWeights(
    link_bytes_per_s=LINK_BYTES_PER_S,
    local_bytes_per_s=LOCAL_BYTES_PER_S,
    prefill_tokens_per_s=PREFILL_TOKENS_PER_S,
    load_penalty_s=LOAD_PENALTY_S,
)
NS = Namespace("bench/routing-8b", chunk_tokens=CHUNK_TOKENS)


@dataclass(frozen=True, slots=True)
class Workload:
    conversations: int
    turns: int
    system_prompts: int
    system_tokens: tuple[int, int]
    user_tokens: tuple[int, int]
    reply_tokens: tuple[int, int]
    start_window_s: float
    think_s: tuple[float, float]
    node_chunks: int
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Request:
    arrival: float
    conversation: int
    turn: int
    tokens: tuple[int, ...]


def make_requests(w: Workload) -> list[Request]:
    rng = random.Random(w.seed)
    vocab = 32_000
    systems = [
        [rng.randrange(vocab) for _ in range(rng.randint(*w.system_tokens))]
        for _ in range(w.system_prompts)
    ]
    out: list[Request] = []
    for c in range(w.conversations):
        tokens = list(systems[rng.randrange(w.system_prompts)])
        t = rng.uniform(0, w.start_window_s)
        for turn in range(w.turns):
            tokens += [rng.randrange(vocab) for _ in range(rng.randint(*w.user_tokens))]
            out.append(Request(t, c, turn, tuple(tokens)))
            tokens += [rng.randrange(vocab) for _ in range(rng.randint(*w.reply_tokens))]
            t += rng.uniform(*w.think_s)
    out.sort(key=lambda r: r.arrival)
    return out


@dataclass(slots=True)
class Engine:
    url: str
    node: str
    busy_until: float = 0.0
    finishes: list[float] = field(default_factory=list)
    requests: int = 0

    def load(self, now: float) -> int:
        self.finishes = [f for f in self.finishes if f > now]
        return len(self.finishes)


@dataclass(slots=True)
class Totals:
    requests: int = 0
    prompt_tokens: int = 0
    computed_tokens: int = 0
    recomputed_tokens: int = 0
    local_tokens: int = 0
    remote_tokens: int = 0
    bytes_moved: int = 0
    evictions: int = 0
    ttft: list[float] = field(default_factory=list)


class Fleet:
    """The engines, their nodes' LRU contents and the index."""

    def __init__(self, index: IndexBackend, node_chunks: int) -> None:
        self.index = index
        self.node_chunks = node_chunks
        self.prefill = [Engine(f"prefill-{i}", f"p{i}") for i in range(ENGINES)]
        self.decode = [Engine(f"decode-{i}", f"d{i}") for i in range(ENGINES)]
        self.lru: dict[str, OrderedDict[ChunkKey, None]] = {}
        self.published: set[ChunkKey] = set()
        self._rr = {"prefill": 0, "decode": 0}

    async def start(self) -> None:
        for e in (*self.prefill, *self.decode):
            self.lru[e.node] = OrderedDict()
            info = NodeInfo(e.node, f"{e.node}:1", "", (TierStats("cpu", 1 << 40),))
            await self.index.register_node(info, [], 0.0)

    async def store(self, node: str, keys: list[ChunkKey], totals: Totals) -> None:
        """Commit ``keys`` on ``node`` and evict its least recently used beyond capacity."""
        lru = self.lru[node]
        new = [k for k in keys if k not in lru]
        for k in keys:
            lru[k] = None
            lru.move_to_end(k)
        if new:
            await self.index.put_end(node, new, [CHUNK_BYTES] * len(new))
        victims: list[ChunkKey] = []
        while len(lru) > self.node_chunks:
            victims.append(lru.popitem(last=False)[0])
        if victims:
            await self.index.remove_replicas(node, victims)
            totals.evictions += len(victims)

    async def choose(
        self, role: str, engines: list[Engine], keys: list[ChunkKey], now: float, policy: str
    ) -> Engine:
        turn = self._rr[role]
        self._rr[role] = turn + 1
        if policy == "round_robin" or not keys:
            return engines[turn % len(engines)]
        order = [*engines[turn % len(engines) :], *engines[: turn % len(engines)]]
        lookup = await self.index.lookup(keys, "", 0)
        scores = score_candidates(
            lookup,
            len(keys),
            CHUNK_TOKENS,
            [Candidate(e.url, e.node, e.load(now)) for e in order],
            WEIGHTS,
        )
        return order[best(scores)]

    async def load_prefix(
        self, node: str, keys: list[ChunkKey], totals: Totals
    ) -> tuple[int, float]:
        """Fetch the leading cached run of ``keys`` onto ``node``; (chunks, seconds)."""
        lookup = await self.index.lookup(keys, node, CHUNK_TOKENS)
        seconds = 0.0
        got: list[ChunkKey] = []
        for key, loc in zip(keys, lookup.locations[: lookup.hits], strict=False):
            if any(r.node_id == node for r in loc.replicas):
                totals.local_tokens += CHUNK_TOKENS
                seconds += loc.size / LOCAL_BYTES_PER_S
            else:
                totals.remote_tokens += CHUNK_TOKENS
                totals.bytes_moved += loc.size
                seconds += loc.size / LINK_BYTES_PER_S
            got.append(key)
        await self.store(node, got, totals)  # replicate on read, refresh LRU
        return lookup.hits, seconds

    async def serve(self, req: Request, policy: str, totals: Totals) -> None:
        keys = chunk_keys(NS, list(req.tokens))
        now = req.arrival
        totals.requests += 1
        totals.prompt_tokens += len(req.tokens)
        # 1. prefill
        p = await self.choose("prefill", self.prefill, keys, now, policy)
        hits, pull_s = await self.load_prefix(p.node, keys, totals)
        missing = keys[hits:]
        totals.recomputed_tokens += CHUNK_TOKENS * sum(k in self.published for k in missing)
        computed = len(req.tokens) - hits * CHUNK_TOKENS
        totals.computed_tokens += computed
        service = pull_s + computed / PREFILL_TOKENS_PER_S
        start = max(now, p.busy_until)
        p.busy_until = start + service
        p.finishes.append(p.busy_until)
        p.requests += 1
        await self.store(p.node, missing, totals)
        self.published.update(missing)
        # 2. decode loads the prompt's KV
        d = await self.choose("decode", self.decode, keys, p.busy_until, policy)
        d.requests += 1
        _, decode_pull_s = await self.load_prefix(d.node, keys, totals)
        totals.ttft.append(p.busy_until - now + decode_pull_s)


async def simulate(w: Workload, policy: str) -> dict[str, Any]:
    index = create_backend(IndexConfig(url="memory://", lease_ttl_s=1e9))
    fleet = Fleet(index, w.node_chunks)
    await fleet.start()
    totals = Totals()
    t0 = time.perf_counter()
    for req in make_requests(w):
        await fleet.serve(req, policy, totals)
    await index.close()
    ttft = sorted(totals.ttft)
    return {
        "requests": totals.requests,
        "prompt_tokens": totals.prompt_tokens,
        "computed_tokens": totals.computed_tokens,
        "recomputed_tokens": totals.recomputed_tokens,
        "local_tokens": totals.local_tokens,
        "remote_tokens": totals.remote_tokens,
        "bytes_moved": totals.bytes_moved,
        "evictions": totals.evictions,
        "ttft_est_s": statistics.fmean(ttft),
        "ttft_p50_s": ttft[len(ttft) // 2],
        "ttft_p90_s": ttft[int(len(ttft) * 0.9)],
        "prefill_requests": [e.requests for e in fleet.prefill],
        "decode_requests": [e.requests for e in fleet.decode],
        "sim_wall_s": time.perf_counter() - t0,
    }


def workload(quick: bool, seed: int, node_chunks: int | None) -> Workload:
    if quick:
        return Workload(
            conversations=96,
            turns=5,
            system_prompts=6,
            system_tokens=(1024, 3072),
            user_tokens=(64, 512),
            reply_tokens=(64, 384),
            start_window_s=60.0,
            think_s=(5.0, 20.0),
            node_chunks=node_chunks or 96,
            seed=seed,
        )
    return Workload(
        conversations=400,
        turns=8,
        system_prompts=12,
        system_tokens=(1024, 4096),
        user_tokens=(64, 768),
        reply_tokens=(64, 512),
        start_window_s=240.0,
        think_s=(5.0, 30.0),
        node_chunks=node_chunks or 256,
        seed=seed,
    )


def render(result: dict[str, Any]) -> str:
    rows = [
        ("requests", "requests", "{:d}"),
        ("recomputed prefix tokens", "recomputed_tokens", "{:,d}"),
        ("computed tokens", "computed_tokens", "{:,d}"),
        ("local-hit tokens", "local_tokens", "{:,d}"),
        ("remote-pull tokens", "remote_tokens", "{:,d}"),
        ("bytes moved (GiB)", "bytes_moved", "gib"),
        ("evictions (chunks)", "evictions", "{:,d}"),
        ("TTFT est. mean (s)", "ttft_est_s", "{:.3f}"),
        ("TTFT est. p50 (s)", "ttft_p50_s", "{:.3f}"),
        ("TTFT est. p90 (s)", "ttft_p90_s", "{:.3f}"),
        ("prefill requests/engine", "prefill_requests", "list"),
    ]
    lines = [f"{'':26s} {'kv_aware':>22s} {'round_robin':>22s}"]
    for label, key, fmt in rows:
        cells = []
        for policy in ("kv_aware", "round_robin"):
            v = result[policy][key]
            if fmt == "gib":
                cells.append(f"{v / (1 << 30):,.1f}")
            elif fmt == "list":
                cells.append(",".join(map(str, v)))
            else:
                cells.append(fmt.format(v))
        lines.append(f"{label:26s} {cells[0]:>22s} {cells[1]:>22s}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smaller workload (< 60 s)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--node-chunks", type=int, help="chunks each store node keeps (LRU)")
    args = ap.parse_args(argv)
    w = workload(args.quick, args.seed, args.node_chunks)
    result: dict[str, Any] = {
        policy: asyncio.run(simulate(w, policy)) for policy in ("kv_aware", "round_robin")
    }
    result["config"] = {
        "engines": {"prefill": ENGINES, "decode": ENGINES},
        "conversations": w.conversations,
        "turns": w.turns,
        "system_prompts": w.system_prompts,
        "node_chunks": w.node_chunks,
        "chunk_tokens": CHUNK_TOKENS,
        "chunk_bytes": CHUNK_BYTES,
        "prefill_tokens_per_s": PREFILL_TOKENS_PER_S,
        "link_bytes_per_s": LINK_BYTES_PER_S,
        "local_bytes_per_s": LOCAL_BYTES_PER_S,
        "load_penalty_s": LOAD_PENALTY_S,
        "quick": args.quick,
        "seed": args.seed,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
