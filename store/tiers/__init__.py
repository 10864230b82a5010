"""Storage tiers of a store node (GPU, DRAM, SSD) and the policy that orders chunks in them."""

from kvdepot.records import TierStats
from kvdepot.store.tiers.base import (
    RecoveredChunk,
    Tier,
    TierLimits,
    register_tier,
    tier_class,
)
from kvdepot.store.tiers.policy import (
    EvictionPolicy,
    LruPolicy,
    TieringOptions,
    create_policy,
    register_policy,
)

__all__ = [
    "EvictionPolicy",
    "LruPolicy",
    "RecoveredChunk",
    "Tier",
    "TierLimits",
    "TierStats",
    "TieringOptions",
    "create_policy",
    "register_policy",
    "register_tier",
    "tier_class",
]
