"""PutStart's per-key decision, shared by every index backend.

For each key of a put the answer is one of: the chunk already exists
(``SKIP_EXISTS``); this very put allocated it before and its reply was lost,
so it gets the same node again (``WRITE``); another put is writing it
(``SKIP_PENDING``); or it is placed on a node (``WRITE``, once the backend
has recorded the allocation). The rule is pure: a backend reads the state of
the keys and the nodes, calls :func:`admit`, and applies what it returns, in
its own way and with its own atomicity (a Redis backend wins each placement
with a script, and settles the keys it lost with :func:`settle_lost`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvdepot.errors import CapacityExceeded, Unavailable
from kvdepot.keys import ChunkKey
from kvdepot.metadata.placement import Placement
from kvdepot.types import Action, Allocation, NodeId, NodeInfo, Replica


@dataclass(frozen=True, slots=True)
class KeyState:
    """What the index holds for one key when a put starts.

    Attributes:
        exists: A live replica of the chunk is registered.
        pending: A live (unexpired) allocation of the key exists.
        retried: The node of a live allocation of the key made by this same
            put (same request id), else None.
    """

    exists: bool = False
    pending: bool = False
    retried: NodeId | None = None


ABSENT = KeyState()


@dataclass(slots=True)
class Admission:
    """The decision for a put's keys.

    Attributes:
        allocations: One per key, in order; None where the key is to be placed
            (see ``placements``), to be filled in by the backend.
        placements: (index of the key, node chosen) for every key to allocate.
        revoked: This put's own earlier allocations on nodes that are gone, by
            node: the backend drops them before placing those keys anew.
        deduplicated: Keys answered ``SKIP_EXISTS`` or ``SKIP_PENDING``.
        bytes_saved: Their sizes, summed.
    """

    allocations: list[Allocation | None] = field(default_factory=list)
    placements: list[tuple[int, NodeInfo]] = field(default_factory=list)
    revoked: dict[NodeId, list[ChunkKey]] = field(default_factory=dict)
    deduplicated: int = 0
    bytes_saved: int = 0


_EXISTS = Allocation(Action.SKIP_EXISTS)
_PENDING = Allocation(Action.SKIP_PENDING)


def retry_target(node_id: NodeId | None, nodes: Mapping[NodeId, NodeInfo]) -> Replica | None:
    """Where a retry of a put writes again: the same node, if it is still there."""
    if node_id is None:
        return None
    info = nodes.get(node_id)
    return None if info is None else Replica(node_id, info.address, "cpu")


def admit(
    keys: Sequence[ChunkKey],
    sizes: Sequence[int],
    states: Sequence[KeyState],
    nodes: Mapping[NodeId, NodeInfo],
    writer_node_id: NodeId,
    placement: Placement | None = None,
) -> Admission:
    """Decide every key of a put.

    Args:
        keys: The put's keys (a key may repeat: its later copies are pending).
        sizes: Their sizes in bytes.
        states: ``states[i]`` is the index's state of ``keys[i]``.
        nodes: The nodes that may take writes, by id (placement order).
        writer_node_id: The writer's own node, preferred for placement.
        placement: Chooses the node of each key to place, and is told of each
            choice; without one, free space alone decides.

    Raises:
        Unavailable: A key is to be placed and no node is registered.
        CapacityExceeded: A key is larger than every node's capacity.
    """
    out = Admission()
    placement = placement or Placement()
    infos = list(nodes.values())
    batch: set[ChunkKey] = set()
    for i, (key, size, state) in enumerate(zip(keys, sizes, states, strict=True)):
        if state.exists:
            out.allocations.append(_EXISTS)
            out.deduplicated, out.bytes_saved = out.deduplicated + 1, out.bytes_saved + size
            continue
        mine = None if key in batch else state.retried
        if (same := retry_target(mine, nodes)) is not None:
            # A retry of the put whose reply was lost (the replica that made
            # the allocation died or timed out): the same answer.
            placement.placed(same.node_id, size)
            batch.add(key)
            out.allocations.append(Allocation(Action.WRITE, same))
            continue
        if mine is not None:
            out.revoked.setdefault(mine, []).append(key)  # revoked, then placed anew
        elif key in batch or state.pending:
            out.allocations.append(_PENDING)
            out.deduplicated, out.bytes_saved = out.deduplicated + 1, out.bytes_saved + size
            continue
        node = placement.choose(infos, writer_node_id, size)
        if node is None:
            if not infos:
                raise Unavailable("no store node is registered to place chunks on")
            raise CapacityExceeded(
                f"a chunk of {size} bytes is larger than any store node's capacity"
            )
        placement.placed(node.node_id, size)
        batch.add(key)
        out.allocations.append(None)
        out.placements.append((i, node))
    return out


def settle_lost(retried: NodeId | None, nodes: Mapping[NodeId, NodeInfo]) -> Allocation:
    """The answer for a key whose placement another put won meanwhile.

    ``retried`` is the node of the key's allocation if this same put made it
    (a first attempt, slow rather than dead), else None.
    """
    same = retry_target(retried, nodes)
    return _PENDING if same is None else Allocation(Action.WRITE, same)
