"""The one host:port parser."""

from __future__ import annotations

import pytest

from kvdepot.endpoints import check_endpoint, parse_endpoint, parse_endpoints, split_endpoint
from kvdepot.errors import InvalidArgument


def test_an_address_splits_into_host_and_port() -> None:
    assert parse_endpoint("127.0.0.1:7700") == ("127.0.0.1", 7700)
    assert parse_endpoint("[::1]:80") == ("::1", 80)
    assert parse_endpoint("store-a.example:65535") == ("store-a.example", 65535)
    assert parse_endpoint("redis-1", default_port=6379) == ("redis-1", 6379)
    assert check_endpoint("[::1]:80") == "[::1]:80"


@pytest.mark.parametrize("bad", ["nohost", "h:0", "h:x", ":80", "h:", "h:65536", "[]:80", "h:²"])
def test_a_bad_address_is_one_clear_error(bad: str) -> None:
    with pytest.raises(InvalidArgument, match=r"^data plane address must be host:port, got "):
        parse_endpoint(bad, "data plane address")
    with pytest.raises(InvalidArgument):
        parse_endpoint(42, "x")  # type: ignore[arg-type]


def test_replica_lists() -> None:
    assert parse_endpoints(" a:1, [::1]:2 ,") == ["a:1", "[::1]:2"]
    with pytest.raises(InvalidArgument, match="no metadata address given"):
        parse_endpoints(" , ")
    with pytest.raises(InvalidArgument, match="metadata address must be host:port, got 'b'"):
        parse_endpoints("a:1,b")
    with pytest.raises(InvalidArgument, match="not list"):
        parse_endpoints(["a:1"])  # type: ignore[arg-type]


def test_the_tolerant_split_checks_nothing_but_the_port() -> None:
    assert split_endpoint("[::1]:0") == ("::1", 0)
    assert split_endpoint("0.0.0.0:7800") == ("0.0.0.0", 7800)
    for text in ("unix:/tmp/sock", "nohost", "h:x"):
        assert split_endpoint(text) == (text, None)
