"""The shared records (:mod:`kvdepot.records`) to and from their protobuf messages.

The messages (``kvdepot.v1.TierStats``, ``kvdepot.v1.TransferRate``) have the
records' fields, by name; the field lists are taken from the records, so that
neither end copies fields by hand.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import fields

from kvdepot.proto.gen import common_pb2
from kvdepot.records import TierStats, TransferRate

_TIER_FIELDS = tuple(f.name for f in fields(TierStats))
_TRANSFER_FIELDS = tuple(f.name for f in fields(TransferRate))


def tier_stats_to_proto(tiers: Iterable[TierStats]) -> list[common_pb2.TierStats]:
    """One message per tier, in order."""
    return [common_pb2.TierStats(**{f: getattr(t, f) for f in _TIER_FIELDS}) for t in tiers]


def tier_stats_from_proto(tiers: Iterable[common_pb2.TierStats]) -> tuple[TierStats, ...]:
    """One record per message, in order."""
    return tuple(TierStats(**{f: getattr(t, f) for f in _TIER_FIELDS}) for t in tiers)


def transfer_to_proto(rate: TransferRate) -> common_pb2.TransferRate:
    return common_pb2.TransferRate(**{f: getattr(rate, f) for f in _TRANSFER_FIELDS})


def transfer_from_proto(message: common_pb2.TransferRate) -> TransferRate:
    return TransferRate(**{f: getattr(message, f) for f in _TRANSFER_FIELDS})


__all__ = [
    "tier_stats_from_proto",
    "tier_stats_to_proto",
    "transfer_from_proto",
    "transfer_to_proto",
]
