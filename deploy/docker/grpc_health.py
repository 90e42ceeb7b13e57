"""Container health check: exit 0 when a gRPC server reports SERVING on grpc.health.v1.

python grpc_health.py 127.0.0.1:50061 sits.v1.Capture

With SITS_GRPC_TLS=true it speaks TLS as the services do: the server is checked against
SITS_GRPC_TLS_CA_FILE, and SITS_GRPC_TLS_CERT_FILE/KEY_FILE are presented when set (servers
that require client certificates). Hostname checks use "localhost" (the probe dials 127.0.0.1).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str]) -> int:
    address, service = argv[1], (argv[2] if len(argv) > 2 else "")
    with _channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2.0
            )
        except grpc.RpcError as err:
            print(f"{address} {service}: {err.code().name}", file=sys.stderr)
            return 1
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    print(f"{address} {service}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
    return 0 if serving else 1


def _channel(address: str) -> grpc.Channel:
    if os.environ.get("SITS_GRPC_TLS", "").lower() not in ("1", "true", "yes", "on"):
        return grpc.insecure_channel(address)

    def read(variable: str) -> bytes | None:
        path = os.environ.get(variable)
        return Path(path).read_bytes() if path else None

    credentials = grpc.ssl_channel_credentials(
        read("SITS_GRPC_TLS_CA_FILE"), read("SITS_GRPC_TLS_KEY_FILE"), read("SITS_GRPC_TLS_CERT_FILE")
    )
    return grpc.secure_channel(address, credentials, options=[("grpc.ssl_target_name_override", "localhost")])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
