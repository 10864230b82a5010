"""The shared tier and throughput records cross protobuf field for field."""

from __future__ import annotations

from dataclasses import fields

from kvdepot.proto.gen import common_pb2
from kvdepot.records import TierStats, TransferRate
from kvdepot.wire.records import (
    tier_stats_from_proto,
    tier_stats_to_proto,
    transfer_from_proto,
    transfer_to_proto,
)


def test_tier_stats_keep_every_field_both_ways() -> None:
    # A distinct value per field: a field dropped or swapped shows.
    tier = TierStats("ssd", *range(1, len(fields(TierStats))))
    (message,) = tier_stats_to_proto([tier])
    assert [f.name for f in common_pb2.TierStats.DESCRIPTOR.fields] == [
        f.name for f in fields(TierStats)
    ]
    assert message.name == "ssd" and message.demotions == len(fields(TierStats)) - 1
    back = tier_stats_from_proto([message, common_pb2.TierStats(name="cpu")])
    assert back == (tier, TierStats("cpu"))


def test_transfer_rate_keeps_every_field_both_ways() -> None:
    rate = TransferRate(1.5e9, 2.5e8, 10.0)
    message = transfer_to_proto(rate)
    assert (message.bytes_in_per_s, message.bytes_out_per_s, message.window_s) == (
        1.5e9,
        2.5e8,
        10.0,
    )
    assert transfer_from_proto(message) == rate
    assert transfer_from_proto(common_pb2.TransferRate()) == TransferRate()
