"""Placement of new chunks on store nodes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvdepot.types import NodeId, NodeInfo


def choose_node(
    nodes: Sequence[NodeInfo],
    writer_node_id: NodeId,
    size: int,
    planned: Mapping[NodeId, int],
) -> NodeInfo | None:
    """Pick the node a new chunk of ``size`` bytes is written to.

    The writer's own node comes first (publishing locally is the cheapest
    path, and its store makes room by LRU eviction); otherwise the node with
    the most free bytes, counting what this batch already placed there.
    Nodes whose total capacity is below ``size`` can never hold the chunk.
    """
    fitting = [n for n in nodes if n.capacity_bytes == 0 or n.capacity_bytes >= size]
    for n in fitting:
        if n.node_id == writer_node_id:
            return n
    if not fitting:
        return None
    return max(fitting, key=lambda n: (n.free_bytes - planned.get(n.node_id, 0), n.node_id))
