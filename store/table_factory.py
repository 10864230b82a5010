"""Building a store node's chunk table, with its tiers, from its :class:`StoreConfig`.

Above :mod:`kvdepot.store.tiers`, which builds the tiers alone: the table
holds them, so nothing below it may build it.
"""

from __future__ import annotations

from kvdepot.store.chunks import ChunkStore, MovedListener, RemovedListener
from kvdepot.store.config import StoreConfig
from kvdepot.store.tiers.base import TierLimits
from kvdepot.store.tiers.factory import build_tiers
from kvdepot.store.tiers.policy import TieringOptions


def pin_arena(config: StoreConfig) -> bool:
    """Whether to page-lock the DRAM arena for CUDA."""
    if config.pin_memory == "auto":
        return bool(config.gpu_capacity_bytes) and config.gpu_device.startswith("cuda")
    return config.pin_memory == "on"


def build_chunk_store(
    config: StoreConfig,
    *,
    arena_path: str | None,
    on_removed: RemovedListener | None = None,
    on_moved: MovedListener | None = None,
) -> ChunkStore:
    """The chunk table of a store node, with every tier ``config`` asks for.

    Chunks of an SSD directory used before are in the table on return.
    """
    tiers = build_tiers(config)
    try:
        return ChunkStore(
            config.capacity_bytes,
            arena_path=arena_path,
            on_removed=on_removed,
            on_moved=on_moved,
            max_chunk_bytes=config.max_chunk_bytes or None,
            cpu_limits=TierLimits.parse(config.cpu_watermarks),
            pin_memory=pin_arena(config),
            tiers=tiers,
            options=TieringOptions(
                policy=config.eviction_policy,
                promote_hits=config.promote_hits,
                gpu_promote_hits=config.gpu_promote_hits,
                demotion_buffer_bytes=config.demotion_buffer_bytes,
            ),
        )
    except BaseException:
        # A table refused before it took the tiers over leaves them open
        # (closing one twice does nothing).
        for tier in tiers:
            tier.close()
        raise
