"""TLS, and optionally client certificates (mutual TLS), for the SITS gRPC APIs.

With `SITS_GRPC_TLS=true` every SITS gRPC server serves TLS only, with this
process's certificate (`SITS_GRPC_TLS_CERT_FILE` / `_KEY_FILE`), and every SITS
client (services, the admission processor, tools) checks the server against
`SITS_GRPC_TLS_CA_FILE` (or the system's CAs). With
`SITS_GRPC_TLS_REQUIRE_CLIENT_CERT=true` servers also require a client
certificate from that CA, and clients present their own certificate.

Under Istio leave all of this off: the sidecars' mTLS encrypts and
authenticates every call, and the kubelet's gRPC probes cannot speak TLS.
The bearer token still guards the mutating calls either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from sits.runtime.settings import Settings


class GrpcTlsError(ValueError):
    """A TLS file is missing or unreadable; the message names the setting and file."""


def _read(path: Path, setting: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as err:
        raise GrpcTlsError(f"{setting}: cannot read {path}: {err.strerror or err}") from None
    if not data.strip():
        raise GrpcTlsError(f"{setting}: {path} is empty")
    return data


def server_credentials(settings: Settings) -> grpc.ServerCredentials | None:
    """TLS credentials for a SITS gRPC server, or None when SITS_GRPC_TLS is off."""
    if not settings.grpc_tls:
        return None
    if settings.grpc_tls_cert_file is None or settings.grpc_tls_key_file is None:
        raise GrpcTlsError("SITS_GRPC_TLS=true: a server needs SITS_GRPC_TLS_CERT_FILE and SITS_GRPC_TLS_KEY_FILE")
    key = _read(settings.grpc_tls_key_file, "SITS_GRPC_TLS_KEY_FILE")
    chain = _read(settings.grpc_tls_cert_file, "SITS_GRPC_TLS_CERT_FILE")
    client_ca = None
    if settings.grpc_tls_require_client_cert:
        assert settings.grpc_tls_ca_file is not None  # the settings' own check guarantees it
        client_ca = _read(settings.grpc_tls_ca_file, "SITS_GRPC_TLS_CA_FILE")
    return grpc.ssl_server_credentials(
        [(key, chain)], root_certificates=client_ca, require_client_auth=settings.grpc_tls_require_client_cert
    )


def channel_credentials(settings: Settings) -> grpc.ChannelCredentials | None:
    """TLS credentials for a channel to a SITS gRPC server, or None when SITS_GRPC_TLS is off."""
    if not settings.grpc_tls:
        return None
    ca = _read(settings.grpc_tls_ca_file, "SITS_GRPC_TLS_CA_FILE") if settings.grpc_tls_ca_file else None
    key = chain = None
    if settings.grpc_tls_cert_file is not None and settings.grpc_tls_key_file is not None:
        key = _read(settings.grpc_tls_key_file, "SITS_GRPC_TLS_KEY_FILE")
        chain = _read(settings.grpc_tls_cert_file, "SITS_GRPC_TLS_CERT_FILE")
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=chain)


def aio_channel(
    address: str,
    credentials: grpc.ChannelCredentials | None,
    options: Sequence[tuple[str, Any]] | None = None,
) -> grpc.aio.Channel:
    """A grpc.aio channel: TLS with `credentials`, plaintext without."""
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, credentials, options=options)


def sits_channel(settings: Settings, address: str) -> grpc.aio.Channel:
    """A channel to a SITS gRPC server, as `settings` say (TLS or not)."""
    return aio_channel(address, channel_credentials(settings))
