"""OpenTelemetry for SITS: one tracer provider per process, W3C trace context
on Kafka headers and gRPC metadata.

Kafka headers and gRPC metadata are both lists of (key, value) pairs; one typed
getter/setter pair carries the W3C `traceparent`/`tracestate` across either.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, MutableSequence, Sequence

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.propagators.textmap import Getter, Setter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

Header = tuple[str, bytes]

# W3C trace context, version 00: anything else in a record is malformed input.
_TRACEPARENT = re.compile(r"^00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}$")

PROPAGATOR = TraceContextTextMapPropagator()


class HeaderGetter(Getter[Sequence[Header]]):
    def get(self, carrier: Sequence[Header], key: str) -> list[str] | None:
        values = [v.decode("latin-1") for k, v in carrier if k.lower() == key]
        return values or None

    def keys(self, carrier: Sequence[Header]) -> list[str]:
        return [k for k, _ in carrier]


class HeaderSetter(Setter[MutableSequence[Header]]):
    def set(self, carrier: MutableSequence[Header], key: str, value: str) -> None:
        carrier.append((key, value.encode("latin-1")))


HEADER_GETTER = HeaderGetter()
HEADER_SETTER = HeaderSetter()


def is_valid_traceparent(value: str) -> bool:
    return _TRACEPARENT.match(value) is not None


def inject_headers(headers: MutableSequence[Header], ctx: otel_context.Context | None = None) -> None:
    PROPAGATOR.inject(headers, context=ctx, setter=HEADER_SETTER)


def extract_headers(headers: Sequence[Header]) -> otel_context.Context:
    return PROPAGATOR.extract(headers, getter=HEADER_GETTER)


def metadata_with_trace(metadata: Iterable[tuple[str, str]] = ()) -> list[tuple[str, str]]:
    """gRPC call metadata carrying the current trace context."""
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier)
    return [*metadata, *carrier.items()]


def setup_tracing(
    service_name: str,
    otlp_endpoint: str | None = None,
    extra_processors: Sequence[SpanProcessor] = (),
) -> TracerProvider:
    """Install the process's tracer provider (once) and the W3C propagator.

    With an OTLP endpoint, spans are batched to it over gRPC; tests pass their
    own processors (an in-memory exporter) instead.
    """
    propagate.set_global_textmap(PROPAGATOR)
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):
        provider = current
    else:
        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        trace.set_tracer_provider(provider)
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint, insecure=True)))
    for processor in extra_processors:
        provider.add_span_processor(processor)
    return provider


def current_trace_id() -> str:
    """The current trace id as 32 hex digits, or "" outside a trace."""
    span_context = trace.get_current_span().get_span_context()
    return format(span_context.trace_id, "032x") if span_context.is_valid else ""
