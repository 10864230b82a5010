"""``host:port`` addresses: the one parser every process uses.

An address is ``host:port``, or ``[v6]:port`` for an IPv6 host; the host is
returned without its brackets. A list of replicas is comma-separated
(``host:port,host:port``), as the metadata service's address is given.
"""

from __future__ import annotations

from kvdepot.errors import InvalidArgument


def split_endpoint(address: str) -> tuple[str, int | None]:
    """The host (without IPv6 brackets) and the port of ``address``, checking nothing else.

    For callers that must tolerate any text (a listen address gRPC reports
    on itself, a peer string): the port is None where there is no colon or
    what follows the last one is not a number, and the host is then
    ``address`` itself.
    """
    host, sep, port = address.rpartition(":")
    if not (sep and port.isascii() and port.isdigit()):
        return address, None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def parse_endpoint(
    address: str, what: str = "address", *, default_port: int | None = None
) -> tuple[str, int]:
    """Split ``address`` into host and port, checking both.

    Args:
        address: ``host:port`` or ``[v6]:port``.
        what: What the address is, for the error (``"data plane address"``).
        default_port: The port of an address without one; without a default
            such an address is an error.

    Raises:
        InvalidArgument: No host, no port where one is needed, or a port
            outside 1..65535.
    """
    if not isinstance(address, str):
        raise InvalidArgument(f"{what} must be host:port, not {type(address).__name__}")
    host, port = split_endpoint(address)
    if ":" not in address and default_port is not None:
        port = default_port
    if not host or port is None or not 0 < port < 65536:
        raise InvalidArgument(f"{what} must be host:port, got {address!r}")
    return host, port


def check_endpoint(address: str, what: str = "address") -> str:
    """``address`` itself, once :func:`parse_endpoint` accepts it."""
    parse_endpoint(address, what)
    return address


def parse_endpoints(spec: str, what: str = "metadata address") -> list[str]:
    """Split ``"host:port[,host:port…]"`` into addresses, checking each.

    Raises:
        InvalidArgument: Not text, no address at all, or one that is not ``host:port``.
    """
    if not isinstance(spec, str):
        raise InvalidArgument(f"{what} must be host:port[,host:port...], not {type(spec).__name__}")
    endpoints = [e.strip() for e in spec.split(",") if e.strip()]
    if not endpoints:
        raise InvalidArgument(f"no {what} given")
    return [check_endpoint(e, what) for e in endpoints]


__all__ = ["check_endpoint", "parse_endpoint", "parse_endpoints", "split_endpoint"]
