"""W3C trace context across gRPC and Kafka, seen with an in-memory span exporter.

A client calls capture's ReportOom with a traceparent; capture publishes the
OomEvent to Kafka; a consumer on the bus handles it. The server span continues
the client's trace, the producer span is its child, and the consumer span's
parent is the producer span.
"""

from __future__ import annotations

import asyncio
import secrets

import grpc
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from services.capture.grpc_api import MUTATING_METHODS, binding
from services.capture.publisher import CapturePublisher, TopicEnsuringProducer
from services.capture.service import CaptureService
from services.capture.spool import Spool
from sits.runtime.bus import EventConsumer, EventProducer, ReceivedEvent, ensure_topics
from sits.runtime.clock import SystemClock
from sits.runtime.events import Topics
from sits.runtime.grpcserver import GrpcServer, bearer_metadata
from sits.runtime.settings import Settings
from sits.runtime.tracing import setup_tracing
from sits.v1 import capture_pb2_grpc, common_pb2, events_pb2
from tests.waiting import eventually

GIB = 1 << 30
EXPORTER = InMemorySpanExporter()
setup_tracing("sits-tests", extra_processors=[SimpleSpanProcessor(EXPORTER)])


def oom() -> events_pb2.OomEvent:
    event = events_pb2.OomEvent(
        requested_bytes=2 * GIB, device_free_bytes=GIB // 4, device_total_bytes=80 * GIB, pid=7, message="OOM"
    )
    event.meta.source = "test/hook"
    event.meta.target.CopyFrom(common_pb2.Target(host="h", gpu_uuid="GPU-0", engine="vllm-0"))
    return event


async def test_grpc_call_to_kafka_record_to_consumer_is_one_trace(settings: Settings, topics: Topics, tmp_path) -> None:
    await ensure_topics(settings)
    publisher = CapturePublisher(lambda: TopicEnsuringProducer(settings), Spool(tmp_path / "spool"), topics)
    service = CaptureService(publisher, SystemClock())
    handled: list[ReceivedEvent] = []
    stop = asyncio.Event()
    trace_id, client_span_id = secrets.token_hex(16), secrets.token_hex(8)

    async def handle(event: ReceivedEvent) -> None:
        handled.append(event)

    server = GrpcServer([binding(service)], token="s3cret", mutating_methods=MUTATING_METHODS)
    async with server, EventProducer(settings) as dlq:
        consumer = EventConsumer(
            settings, group_id=f"{topics.prefix}trace", topics=[topics.oom], handler=handle, dead_letters=dlq
        )
        async with grpc.aio.insecure_channel(server.address) as channel, consumer:
            publishing = asyncio.create_task(publisher.run(stop))
            consuming = asyncio.create_task(consumer.run(stop))
            stub = capture_pb2_grpc.CaptureStub(channel)
            reply = await stub.ReportOom(
                oom(),
                metadata=(*bearer_metadata("s3cret"), ("traceparent", f"00-{trace_id}-{client_span_id}-01")),
                timeout=5,
            )
            assert await eventually(lambda: len(handled) == 1, timeout_s=20)
            stop.set()
            await asyncio.gather(publishing, consuming)

    assert handled[0].message.meta.event_id == reply.event_id
    spans = [s for s in EXPORTER.get_finished_spans() if format(s.context.trace_id, "032x") == trace_id]
    by_kind = {s.kind: s for s in spans}
    server_span, producer, consumer_span = (
        by_kind[SpanKind.SERVER],
        by_kind[SpanKind.PRODUCER],
        by_kind[SpanKind.CONSUMER],
    )
    assert server_span.parent is not None and format(server_span.parent.span_id, "016x") == client_span_id
    assert producer.parent is not None and producer.parent.span_id == server_span.context.span_id
    assert producer.name == f"{topics.oom} publish"
    assert consumer_span.name == f"{topics.oom} process"
    assert consumer_span.parent is not None and consumer_span.parent.span_id == producer.context.span_id
    assert consumer_span.context.trace_id == producer.context.trace_id
