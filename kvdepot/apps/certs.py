"""``kvdepot certs``: a local CA and certificates to try TLS with.

Makes, in one directory, a CA (``ca.pem``, ``ca.key``), a daemon certificate
for the given hosts (``server.pem``, ``server.key``; usable as a client
certificate too, since a store daemon also calls the metadata service) and a
client certificate (``client.pem``, ``client.key``). Keys are ECDSA P-256 and
written mode 0600. For testing and small deployments: a production cluster
should get its certificates from its own PKI.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvdepot.errors import InvalidArgument

if TYPE_CHECKING:
    # Imported where used: the rest of the command line starts without cryptography.
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
FILES = ("ca.pem", "ca.key", "server.pem", "server.key", "client.pem", "client.key")


@dataclass(frozen=True, slots=True)
class CertPaths:
    """Where :func:`make_certs` wrote each file."""

    ca: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_certs(
    directory: str | Path,
    hosts: Sequence[str] = DEFAULT_HOSTS,
    *,
    days: int = 365,
    force: bool = False,
) -> CertPaths:
    """Write a CA, a daemon certificate for ``hosts`` and a client certificate.

    Raises:
        InvalidArgument: No hosts, a bad validity, files that exist (without
            ``force``), or ``cryptography`` missing.
    """
    try:
        from cryptography.x509.oid import ExtendedKeyUsageOID
    except ImportError:  # pragma: no cover - a dependency of kvdepot
        raise InvalidArgument("kvdepot certs needs the `cryptography` package") from None
    if not hosts:
        raise InvalidArgument("give at least one host name or address")
    if days < 1:
        raise InvalidArgument("certificates must be valid for at least a day")
    out = Path(directory)
    paths = CertPaths(*(out / name for name in FILES))
    existing = [p.name for p in (out / n for n in FILES) if p.exists()]
    if existing and not force:
        raise InvalidArgument(f"{out} already holds {', '.join(existing)} (use --force)")
    out.mkdir(parents=True, exist_ok=True)

    now = datetime.datetime.now(datetime.UTC)
    validity = _Validity(now - datetime.timedelta(hours=1), now + datetime.timedelta(days=days))
    ca = _make_ca(validity)
    server_key, server_cert = _issue(
        ca,
        validity,
        hosts[0],
        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
        _subject_alt_names(hosts),
    )
    client_key, client_cert = _issue(
        ca, validity, "kvdepot-client", [ExtendedKeyUsageOID.CLIENT_AUTH], []
    )

    _write_key(paths.ca_key, ca.key)
    _write_cert(paths.ca, ca.cert)
    _write_key(paths.server_key, server_key)
    _write_cert(paths.server_cert, server_cert)
    _write_key(paths.client_key, client_key)
    _write_cert(paths.client_cert, client_cert)
    return paths


@dataclass(frozen=True, slots=True)
class _Validity:
    """The period every certificate of one run is valid for."""

    start: datetime.datetime
    end: datetime.datetime


@dataclass(frozen=True, slots=True)
class _Authority:
    """The CA's key and certificate, which sign the other two."""

    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate


def _name(cn: str) -> x509.Name:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvdepot test CA"),
            x509.NameAttribute(NameOID.COMMON_NAME, cn),
        ]
    )


def _make_ca(validity: _Validity) -> _Authority:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("kvdepot CA"))
        .issuer_name(_name("kvdepot CA"))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(validity.start)
        .not_valid_after(validity.end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return _Authority(key, cert)


def _issue(
    ca: _Authority,
    validity: _Validity,
    cn: str,
    usages: list[x509.ObjectIdentifier],
    san: list[x509.GeneralName],
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(validity.start)
        .not_valid_after(validity.end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()),
            critical=False,
        )
    )
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return key, builder.sign(ca.key, hashes.SHA256())


def _subject_alt_names(hosts: Sequence[str]) -> list[x509.GeneralName]:
    from cryptography import x509

    san: list[x509.GeneralName] = []
    for host in hosts:
        try:
            san.append(x509.IPAddress(ipaddress.ip_address(host.strip("[]"))))
        except ValueError:
            san.append(x509.DNSName(host))
    return san


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    from cryptography.hazmat.primitives import serialization

    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)  # an existing file keeps its mode through O_CREAT


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
