"""Building a store node's tiers besides DRAM from its :class:`StoreConfig`.

Tiers only: the chunk table that holds them is built above this package
(:mod:`kvdepot.store.table_factory`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from kvdepot.store.config import StoreConfig
from kvdepot.store.tiers.base import Tier, tier_class

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
