"""Container health check: exit 0 when a gRPC server reports SERVING on grpc.health.v1.

python grpc_health.py 127.0.0.1:50061 sits.v1.Capture
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str]) -> int:
    address, service = argv[1], (argv[2] if len(argv) > 2 else "")
    with grpc.insecure_channel(address) as channel:
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


if __name__ == "__main__":
    sys.exit(main(sys.argv))
