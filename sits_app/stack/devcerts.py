"""Certificates for trying TLS on one machine: a CA, and server/client certificates it signs.

For development, tests and the docker-compose TLS set-up (`sits tls dev-certs DIR`);
production certificates come from the organisation's CA (cert-manager, Vault...).
Keys are ECDSA P-256, written readable by the owner only, except the compose set's: compose
bind-mounts them into containers that run as other users (redis, kafka, sits), so those are
readable by all, which is fine for a throw-away development CA and nothing else.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import pkcs12
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Issued:
    """A certificate (PEM) and its private key (PEM, unencrypted)."""

    cert_pem: bytes
    key_pem: bytes


class DevCa:
    """A throw-away certificate authority."""

    def __init__(self, name: str = "SITS development CA", days: int = 30) -> None:
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        self._days = days
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(self._name)
            .issuer_name(self._name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._key, hashes.SHA256())
        )

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, common_name: str, hosts: Sequence[str] = (), *, server: bool = True, client: bool = True) -> Issued:
        """A certificate for `common_name`, valid for `hosts` (DNS names or IP addresses)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        usages = [ExtendedKeyUsageOID.SERVER_AUTH] if server else []
        usages += [ExtendedKeyUsageOID.CLIENT_AUTH] if client else []
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self._name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=self._days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        )
        names: list[x509.GeneralName] = []
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        return Issued(
            cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ),
        )


def pkcs12_bytes(issued: Issued, password: bytes, name: str) -> bytes:
    """`issued` as a password-protected PKCS#12 keystore (for Java servers such as Kafka)."""
    key = serialization.load_pem_private_key(issued.key_pem, password=None)
    cert = x509.load_pem_x509_certificate(issued.cert_pem)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return pkcs12.serialize_key_and_certificates(
        name.encode(), key, cert, None, serialization.BestAvailableEncryption(password)
    )


def write_private(path: Path, data: bytes, mode: int = 0o600) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(data)
    os.chmod(path, mode)


def write_issued(directory: Path, name: str, issued: Issued, key_mode: int = 0o600) -> tuple[Path, Path]:
    """`<name>.crt` and `<name>.key` in `directory`; returns their paths."""
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    directory.mkdir(parents=True, exist_ok=True)
    cert.write_bytes(issued.cert_pem)
    write_private(key, issued.key_pem, key_mode)
    return cert, key


# What docker-compose.yml's TLS set-up mounts (deploy/tls/README.md): hosts are the compose service names.
COMPOSE_CERTS: dict[str, tuple[str, ...]] = {
    "kafka": ("kafka", "localhost", "127.0.0.1"),
    "redis": ("redis", "localhost", "127.0.0.1"),
    "sits": ("capture", "decision", "validator", "envoy", "executor", "admission", "localhost", "127.0.0.1"),
}
KAFKA_KEYSTORE_PASSWORD_BYTES = 24


def write_compose_certs(directory: Path) -> list[Path]:
    """The files docker-compose.yml's TLS set-up mounts; returns what was written."""
    import hashlib
    import secrets

    shared = 0o644  # read by containers running as other users (see the module's note)
    ca = DevCa("SITS compose CA", days=365)
    written = [directory / "ca.crt"]
    directory.mkdir(parents=True, exist_ok=True)
    written[0].write_bytes(ca.cert_pem)
    for name, hosts in COMPOSE_CERTS.items():
        issued = ca.issue(name, hosts)
        written.extend(write_issued(directory, name, issued, shared))
        if name == "kafka":
            password = secrets.token_urlsafe(KAFKA_KEYSTORE_PASSWORD_BYTES)
            write_private(directory / "kafka.p12", pkcs12_bytes(issued, password.encode(), "kafka"), shared)
            # The apache/kafka image reads the keystore and key passwords from files beside the keystore.
            write_private(directory / "kafka_keystore_password", password.encode(), shared)
            written += [directory / "kafka.p12", directory / "kafka_keystore_password"]
    # Redis: ACL user "sits" (the default user off), its password for SITS_REDIS_PASSWORD_FILE and,
    # hashed, in the ACL file redis-server loads.
    redis_password = secrets.token_urlsafe(24)
    write_private(directory / "redis_password", redis_password.encode(), shared)
    digest = hashlib.sha256(redis_password.encode()).hexdigest()
    acl = f"user default off\nuser sits on #{digest} ~* &* +@all\n"
    write_private(directory / "redis_users.acl", acl.encode(), shared)
    written += [directory / "redis_password", directory / "redis_users.acl"]
    return written


def configure_parser(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    dev = sub.add_parser("dev-certs", help="a CA and certificates for docker-compose.yml's TLS set-up")
    dev.add_argument("directory", type=Path, help="where to write them (docker-compose.yml mounts .secrets/tls)")


def run(args: argparse.Namespace) -> int:
    for path in write_compose_certs(args.directory):
        print(path)
    return 0
