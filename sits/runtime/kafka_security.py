"""How every SITS Kafka client (producer, consumer, admin, tap) connects: TLS, SASL, or neither.

`kafka_client_options(settings)` gives the keyword arguments aiokafka's
`AIOKafkaProducer`, `AIOKafkaConsumer` and `AIOKafkaAdminClient` take:
the bootstrap servers, the security protocol, an `ssl.SSLContext` (CA file,
optional client certificate) and the SASL mechanism with its user name and
password (read from a file, never logged).
"""

from __future__ import annotations

import ssl
from typing import Any

from aiokafka.helpers import create_ssl_context

from sits.runtime.secret_files import read_secret
from sits.runtime.settings import Settings


class KafkaSecurityError(ValueError):
    """A TLS or SASL file cannot be used; the message names the setting and file."""


def kafka_ssl_context(settings: Settings) -> ssl.SSLContext:
    try:
        context: ssl.SSLContext = create_ssl_context(
            cafile=settings.kafka_ssl_ca_file,
            certfile=settings.kafka_ssl_cert_file,
            keyfile=settings.kafka_ssl_key_file,
        )
    except (OSError, ssl.SSLError) as err:
        files = ", ".join(
            f"{name}={path}"
            for name, path in (
                ("SITS_KAFKA_SSL_CA_FILE", settings.kafka_ssl_ca_file),
                ("SITS_KAFKA_SSL_CERT_FILE", settings.kafka_ssl_cert_file),
                ("SITS_KAFKA_SSL_KEY_FILE", settings.kafka_ssl_key_file),
            )
            if path is not None
        )
        raise KafkaSecurityError(f"cannot build the Kafka TLS context from {files or 'the system CAs'}: {err}") from err
    context.check_hostname = settings.kafka_ssl_check_hostname
    return context


def kafka_client_options(settings: Settings) -> dict[str, Any]:
    """bootstrap_servers and the security keyword arguments for an aiokafka client."""
    protocol = settings.kafka_security_protocol
    options: dict[str, Any] = {"bootstrap_servers": settings.kafka_bootstrap, "security_protocol": protocol}
    if protocol in ("SSL", "SASL_SSL"):
        options["ssl_context"] = kafka_ssl_context(settings)
    if protocol.startswith("SASL_"):
        assert settings.kafka_sasl_password_file is not None  # the settings' own check guarantees it
        options["sasl_mechanism"] = settings.kafka_sasl_mechanism
        options["sasl_plain_username"] = settings.kafka_sasl_username
        options["sasl_plain_password"] = read_secret(settings.kafka_sasl_password_file, "Kafka SASL password")
    return options


def kafka_options_for(target: str | Settings) -> dict[str, Any]:
    """Client options for a tool given either SITS settings (TLS, SASL as configured) or a bare bootstrap
    address (a broker the tool started itself, such as the embedded Tansu: plaintext)."""
    return kafka_client_options(target) if isinstance(target, Settings) else {"bootstrap_servers": target}
