"""Prometheus metrics shared by all services, and the /metrics endpoint.

Names are part of the contract with the alert rules and the Grafana dashboard
in deploy/; a service adds its own metrics beside these, prefixed `sits_`.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram, start_http_server

EVENTS_IN = Counter("sits_events_in_total", "Events handled, by topic and type.", ["topic", "type"])
EVENTS_OUT = Counter("sits_events_out_total", "Events published, by topic.", ["topic"])
EVENTS_COALESCED = Counter(
    "sits_events_coalesced_total", "Metric samples folded into a newer one for the same target.", ["topic"]
)
DEAD_LETTERS = Counter("sits_dead_letters_total", "Records sent to the dead-letter topic.", ["topic", "reason"])
HANDLER_RETRIES = Counter("sits_handler_retries_total", "Handler failures that will be retried.", ["topic"])
HANDLER_SECONDS = Histogram(
    "sits_handler_seconds",
    "Time to handle one event.",
    ["topic"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
CONSUMER_LAG = Gauge("sits_consumer_lag", "Records not yet consumed, by topic and group.", ["topic", "group"])
CONSUMER_LAG_SECONDS = Gauge(
    "sits_consumer_lag_seconds",
    "Age of the oldest record not yet handled (0 when caught up), by topic and group.",
    ["topic", "group"],
)
GRPC_REJECTED = Counter("sits_grpc_rejected_total", "gRPC calls refused before the handler ran.", ["method", "code"])


def serve_metrics(port: int, addr: str = "127.0.0.1") -> int:
    """Start the /metrics endpoint in a background thread; returns the bound port."""
    return start_metrics(port, addr)[0]


def start_metrics(port: int, addr: str = "127.0.0.1") -> tuple[int, Callable[[], None]]:
    """Start the /metrics endpoint in a background thread; returns the bound port and what stops it
    (and frees the port), for processes that stop without exiting (tests, embedded stacks)."""
    server, thread = start_http_server(port, addr=addr)

    def shutdown() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return int(server.server_address[1]), shutdown
