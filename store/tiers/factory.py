"""Building a store node's chunk table and tiers from its :class:`StoreConfig`."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from kvdepot.store.chunks import ChunkStore, MovedListener, RemovedListener
from kvdepot.store.config import StoreConfig
from kvdepot.store.tiers.base import Tier, TierLimits, tier_class
from kvdepot.store.tiers.policy import TieringOptions

logger = logging.getLogger(__name__)


def build_tiers(config: StoreConfig) -> list[Tier]:
    """The configured tiers besides DRAM (``gpu``, ``ssd``), fastest first.

    Each is built by its registered class (:func:`tier_class`), so the GPU
    tier's module, and torch, are imported only when it is configured.
    """
    wanted = [
        name
        for name, on in (("gpu", config.gpu_capacity_bytes > 0), ("ssd", bool(config.ssd_dir)))
        if on
    ]
    tiers: list[Tier] = []
    try:
        for name in wanted:
            cls = tier_class(name)
            tiers.append(cls.from_config(tier_settings(config, name, cls.config_type)))
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    return tiers


def tier_settings(config: StoreConfig, name: str, kind: type[Any] | None) -> Any:
    """The tier ``name``'s slice of ``config``: its ``<name>_<field>`` settings
    as a ``kind`` (the tier's :attr:`~Tier.config_type`)."""
    if kind is None:
        return None
    values = {f.name: getattr(config, f"{name}_{f.name}") for f in dataclasses.fields(kind)}
    return kind(**values)


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
        for tier in tiers:
            tier.close()
        raise
