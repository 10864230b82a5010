"""What the scheduler side tells the workers to load and save in one step.

The unit moved is a *KV object*: a whole chunk (``chunk_tokens`` tokens
under its chained chunk key) or one tail unit of a prompt (``TAIL_TOKENS``
tokens after its last whole chunk, each under a key chained from that
chunk's key, see :func:`kvdepot.keys.block_keys`), each stored as one object
per KV head (:mod:`kvdepot.connector.vllm.chunk_format`). Neither depends
on the engine's block size; an engine loads whole blocks of them.

Blocks are named per KV cache group (see
:class:`kvdepot.connector.vllm.layout.CacheGroups`): the same positions of
the request, each group's own block ids there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvdepot.connector.vllm.chunk_format import FULL_PART
from kvdepot.keys import ChunkKey, Namespace, block_keys, chunk_keys

# vLLM's placeholder for a block a sliding-window group does not keep
# (outside its window): nothing is read from or written to it.
NULL_BLOCK = 0


@dataclass(frozen=True, slots=True)
class KVObject:
    """One stored object: its key and the engine blocks it fills, in order.

    Attributes:
        key: Its key (its KV head 0's; see ``head_key``).
        position: The request's block index of its first block.
        blocks: Per KV cache group, the block ids of its positions.
        start: The request's index of its first token (-1: ``position``'s first).
        tokens: Its tokens (0: its blocks, whole).
        part: ``FULL_PART`` or ``WINDOW_PART`` (``key`` is the chunk's key
            either way; a part's heads have keys of their own).
    """

    key: ChunkKey
    position: int
    blocks: tuple[tuple[int, ...], ...]
    start: int = -1
    tokens: int = 0
    part: int = FULL_PART

    @property
    def num_blocks(self) -> int:
        return len(self.blocks[0])

    def span(self, block_size: int) -> tuple[int, int]:
        """``(first token, tokens)`` of the request it holds."""
        start = self.start if self.start >= 0 else self.position * block_size
        return start, (self.tokens or self.num_blocks * block_size)

    def whole(self, groups: Sequence[int] | None = None) -> bool:
        """Every group of ``groups`` (None: all) still holds every block of
        it (a save needs them all)."""
        held = self.blocks if groups is None else [self.blocks[g] for g in groups]
        return all(b != NULL_BLOCK for group in held for b in group)

    def touches(self, groups: Sequence[int]) -> bool:
        """Some group of ``groups`` holds a block of it (a load writes there)."""
        return any(b != NULL_BLOCK for g in groups for b in self.blocks[g])

    def positioned(self, group: int) -> list[tuple[int, int]]:
        """``(position, block id)`` of each of its blocks in ``group``."""
        return [(self.position + j, b) for j, b in enumerate(self.blocks[group])]


@dataclass(frozen=True, slots=True)
class Source:
    """Where a load is read from: the store a lookup named first for its
    chunks (the lookup lists this node's replicas first) and the tier there.

    Attributes:
        node: The store's node ("" unknown: no lookup named one).
        address: Its data-plane address, read first.
        tier: The tier the lookup named.
    """

    node: str = ""
    address: str = ""
    tier: str = ""

    @property
    def label(self) -> str:
        """The cost gate's name of it: loads from one are timed together."""
        return f"{self.node}/{self.tier}" if self.node else ""


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """One request's load.

    Attributes:
        req_id: The request.
        objects: What to load, in prompt order.
        first_block: Blocks at earlier positions the engine computed
            already (its own prefix cache): loads leave them untouched.
        asynchronous: Loaded between steps (the request waits in
            ``WAITING_FOR_REMOTE_KVS``) instead of inside the step.
        wait_for_commit: The objects may still be being published (a
            prefill's ``kv_transfer_params`` announced them): poll the
            lookup until they are all there, within the load's deadline.
        deadline_s: An in-step load's deadline from the start of its step
            (given up and recomputed after it); 0: ``load_timeout_s``.
        end: The token the load ends before (its objects may hold more).
        probe: Only fetched and timed, never written into blocks: the
            request computes (see ``LoadPacer``).
        source: Where most of its objects live, as the lookup named it: read
            from there first, and its time is reported under its label.
    """

    req_id: str
    objects: tuple[KVObject, ...]
    first_block: int = 0
    asynchronous: bool = True
    wait_for_commit: bool = False
    deadline_s: float = 0.0
    end: int = 1 << 62
    probe: bool = False
    source: Source = Source()

    def loaded_positions(
        self, objects: Sequence[KVObject], block_size: int
    ) -> list[tuple[int, int]]:
        """``(position, group-0 block)`` of the blocks this load writes into
        from ``objects``, each once."""
        seen: dict[int, int] = {}
        for o in objects:
            if o.part != FULL_PART:
                continue  # within a full part's blocks
            start, n = o.span(block_size)
            lo = max(start, self.first_block * block_size)
            hi = min(start + n, self.end)
            for p in range(lo // block_size, -(-hi // block_size) if hi > lo else lo // block_size):
                seen.setdefault(p, o.blocks[0][p - o.position])
        return sorted(seen.items())

    def loaded_tokens(self, objects: Sequence[KVObject], block_size: int) -> int:
        """Tokens this load writes from ``objects`` (each once: a window
        part holds tokens of its full part)."""
        total = 0
        for o in objects:
            if o.part != FULL_PART:
                continue
            start, n = o.span(block_size)
            total += max(0, min(start + n, self.end) - max(start, self.first_block * block_size))
        return total


@dataclass(frozen=True, slots=True)
class SavePlan:
    """Objects of one request that became complete in this step."""

    req_id: str
    objects: tuple[KVObject, ...]


@dataclass
class KVDepotConnectorMetadata(KVConnectorMetadata):
    """What the workers do in one step."""

    loads: list[LoadPlan] = field(default_factory=list)
    saves: list[SavePlan] = field(default_factory=list)
    skipped: int = 0  # objects not published because they are stored already


@dataclass(frozen=True, slots=True)
class PrefixKeys:
    """The keys of a token sequence: its whole chunks, then its tail blocks.

    Attributes:
        chunks: One key per whole chunk.
        tail: One key per whole block after the last whole chunk.
        chunk_tokens: Tokens per chunk.
        block_tokens: Tokens per tail key (``TAIL_TOKENS``, or a test's).
    """

    chunks: tuple[ChunkKey, ...]
    tail: tuple[ChunkKey, ...]
    chunk_tokens: int
    block_tokens: int

    @property
    def keys(self) -> list[ChunkKey]:
        return [*self.chunks, *self.tail]

    @property
    def key_tokens(self) -> list[int]:
        return [self.chunk_tokens] * len(self.chunks) + [self.block_tokens] * len(self.tail)

    def tokens_of(self, hits: int) -> int:
        """Tokens covered by the first ``hits`` keys."""
        full = min(hits, len(self.chunks))
        return full * self.chunk_tokens + (hits - full) * self.block_tokens


def prefix_keys(
    ns: Namespace,
    tokens: Sequence[int],
    block_tokens: int,
    *,
    with_tail: bool = True,
    chunks: Sequence[ChunkKey] | None = None,
) -> PrefixKeys:
    """Keys of ``tokens``: chunk keys, and block keys of the tail.

    Args:
        ns: The engine's namespace.
        tokens: The token sequence.
        block_tokens: Tokens per tail key.
        with_tail: Also key the tail blocks.
        chunks: Chunk keys of a prefix of ``tokens`` computed before; only
            the chunks after them are hashed again.
    """
    c = ns.chunk_tokens
    n = len(tokens) // c
    if chunks is not None and len(chunks) >= n:
        full = tuple(chunks[:n])
    else:
        full = tuple(chunk_keys(ns, list(tokens[: n * c])))
    tail: tuple[ChunkKey, ...] = ()
    if with_tail and c > block_tokens:
        tail = tuple(tail_keys(ns, tokens, block_tokens, n, full))
    return PrefixKeys(full, tail, c, block_tokens)


def tail_keys(
    ns: Namespace,
    tokens: Sequence[int],
    block_tokens: int,
    region: int,
    chunks: Sequence[ChunkKey],
) -> list[ChunkKey]:
    """Block keys of the whole blocks of chunk ``region`` that ``tokens`` hold,
    at most ``blocks_per_chunk - 1`` (a whole chunk has a chunk key)."""
    c = ns.chunk_tokens
    seed = chunks[region - 1] if region > 0 else ns.digest()
    per_chunk = c // block_tokens
    end = min(len(tokens), region * c + (per_chunk - 1) * block_tokens)
    return block_keys(seed, list(tokens[region * c : end]), block_tokens)
