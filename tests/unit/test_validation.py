"""Field checks of metadata requests."""

from __future__ import annotations

import math

import pytest

from kvdepot import validation as v
from kvdepot.errors import InvalidArgument


@pytest.mark.parametrize("address", ["127.0.0.1:7800", "[::1]:7800", "store-a.example:1"])
def test_addresses_that_connect(address: str) -> None:
    assert v.check_address(address, "address") == address


@pytest.mark.parametrize(
    "address", ["", "host", ":80", "host:0", "host:65536", "host:x", "a b:1", "h\x00:1", "h" * 300]
)
def test_addresses_that_do_not(address: str) -> None:
    with pytest.raises(InvalidArgument, match="address"):
        v.check_address(address, "address")
    assert v.check_address("", "grpc_address", required=False) == ""


def test_sizes_are_positive_and_fit_a_signed_64_bit_integer() -> None:
    assert v.check_sizes([1, v.MAX_SIZE], 2) == [1, v.MAX_SIZE]
    for bad in ([0], [-1], [v.MAX_SIZE + 1]):
        with pytest.raises(InvalidArgument, match="between 1 and"):
            v.check_sizes(bad, 1)
    with pytest.raises(InvalidArgument, match="2 keys but 1 sizes"):
        v.check_sizes([1], 2)


def test_rates_are_finite_and_not_negative() -> None:
    assert v.check_rate(0.0, "r") == 0.0
    for bad in (math.nan, math.inf, -math.inf, -1e-9):
        with pytest.raises(InvalidArgument, match="finite"):
            v.check_rate(bad, "r")


def test_tiers_are_known_and_unique() -> None:
    from kvdepot.proto.gen import common_pb2

    v.check_tier_stats([common_pb2.TierStats(name="cpu"), common_pb2.TierStats(name="ssd")])
    with pytest.raises(InvalidArgument, match="unknown tier"):
        v.check_tier_stats([common_pb2.TierStats(name="tape")])
    with pytest.raises(InvalidArgument, match="repeat"):
        v.check_tier_stats([common_pb2.TierStats(name="cpu")] * 2)


def test_names_are_short_printable_and_without_spaces() -> None:
    assert v.check_text("store-0", "node_id") == "store-0"
    assert v.check_text("", "node_id", required=False) == ""
    for bad in ("", "a b", "a\tb", "a\x00", "n" * 257):
        with pytest.raises(InvalidArgument, match="node_id"):
            v.check_text(bad, "node_id")
